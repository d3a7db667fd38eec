"""Shardings: where a mesh's explicit axes make them part of an array's type, whether a
mesh of Auto axes is set for tracing (`jax.set_mesh`), under which the layer-streamed step
gathers parameters and token blocks are taken position-major, and the mesh a tree of arrays
lies on (`mesh_of`), on which the layer-streamed state is made, each leaf split as its
parameter (`split_as`)."""

import math

import jax
import numpy as np

from lowmem_jax import _jax


def explicit(x: jax.Array) -> jax.sharding.NamedSharding | None:
  """``x``'s sharding where its mesh has explicit axes, else None: a matmul contracting a
  sharded axis must be told its output's sharding there."""
  sharding = jax.typeof(x).sharding
  types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
  return sharding if any(t == jax.sharding.AxisType.Explicit for t in types) else None


def like(x: jax.Array, ref: jax.Array) -> jax.Array:
  """``x`` resharded as ``ref`` where ``ref``'s mesh has explicit axes, else ``x``: a loop's
  carry keeps its type there, however the inputs a step reads are sharded."""
  sharding = explicit(ref)
  return x if sharding is None else jax.sharding.reshard(x, sharding)


def in_auto_mesh() -> bool:
  """Whether a mesh whose axes are all ``Auto`` is set for tracing (`jax.set_mesh`), where
  `gathered` constrains and XLA's propagation places the rest."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def mesh_of(tree) -> jax.sharding.Mesh | None:
  """The mesh of more than one device, its axes all ``Auto``, that ``tree``'s arrays lie on
  (each leaf a concrete `jax.Array` under a `jax.sharding.NamedSharding` of that mesh), where
  nothing is being traced and no mesh is set for tracing (`jax.set_mesh`); else None."""
  leaves = jax.tree.leaves(tree)
  if _jax.tracing() or not jax.sharding.get_abstract_mesh().empty or not leaves or any(
      not isinstance(x, jax.Array) or not isinstance(x.sharding, jax.sharding.NamedSharding)
      for x in leaves):  # a tracer leaf only while tracing, answered above
    return None
  meshes = {x.sharding.mesh for x in leaves}
  mesh = meshes.pop()
  auto = all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  return mesh if not meshes and mesh.size > 1 and auto else None


def split_as(x: jax.Array, param: jax.Array, lead: int = 0) -> jax.Array:
  """``x``, a state leaf of ``param`` (on its mesh, a `jax.sharding.NamedSharding`), split over
  the mesh as ``param`` is, in ``x``'s memory kind: ZeRO's optimizer state, each device's share
  beside its parameters' (Rajbhandari et al., 2020). ``x`` has ``param``'s axes (Adam's
  moments, 8-bit codes; an axis of another size, as block scales' ``[..., 1]``, whole), or
  ``param``'s axis ``lead`` in slices ``[n, len / n]`` (a leaf updated in slices; ``lead`` 1 in
  a stack of layers), split along ``n`` as ``param`` along ``len`` where it divides (each
  device's slices its rows'), else along ``len / n``, the axes after as above; any other
  ``x`` whole. As the step's
  update writes them, so its second call does not compile again."""
  spec = tuple(param.sharding.spec) + (None,) * (param.ndim - len(param.sharding.spec))
  mesh = param.sharding.mesh
  parts = lambda entry: math.prod(mesh.shape[a] for a in (
      () if entry is None else (entry,) if isinstance(entry, str) else entry))
  sliced = (x.ndim == param.ndim + 1 and lead < param.ndim and x.shape[:lead] == param.shape[:lead]
            and x.shape[lead] * x.shape[lead + 1] == param.shape[lead])
  axes = [None] * x.ndim if x.ndim == param.ndim or sliced else []
  for i, entry in enumerate(spec if axes else ()):
    if entry is None:
      continue
    if sliced and i == lead:  # the slices [n, len / n] of len: split n, else len / n
      at = next((a for a in (lead, lead + 1) if x.shape[a] % parts(entry) == 0), None)
    else:
      at = i + (sliced and i > lead)
      at = at if x.shape[at] == param.shape[i] else None
    if at is not None:
      axes[at] = entry
  while axes and axes[-1] is None:  # P() as the step's outputs have it, not P(None): one key
    axes.pop()
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes),
                                        memory_kind=x.sharding.memory_kind)
  return jax.device_put(x, sharding)


def gathered(tree):
  """Each leaf of ``tree`` whole on every device of the `in_auto_mesh` mesh: FSDP's
  all-gather of parameters before their use. The constraint's transpose constrains the
  cotangent alike, so the gradient is all-reduced whole where a reduce-scatter to the
  leaf's shard would move half as much (leaving the cotangent free, tried, let XLA move
  activations instead). ``tree`` itself without such a mesh."""
  if not in_auto_mesh():
    return tree
  whole = jax.sharding.PartitionSpec()
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, whole), tree)


def one_device(device: jax.Device, memory_kind: str | None = None) -> jax.sharding.NamedSharding:
  """``device`` alone as a mesh, in ``memory_kind``: an abstract array placed so is typed in
  its memory (``float32<host>``) when a step is traced on it, as an array put there is; under
  a `jax.sharding.SingleDeviceSharding` it is typed as device memory whatever its kind."""
  mesh = jax.sharding.Mesh(np.array([device]), ("_",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=memory_kind)
