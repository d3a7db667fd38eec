"""Shardings: where a mesh's explicit axes make them part of an array's type, whether a
mesh of Auto axes is set for tracing (`jax.set_mesh`), under which the layer-streamed step
gathers parameters and token blocks are taken position-major, and the mesh a tree of arrays
lies on (`mesh_of`), on which the layer-streamed state is made, each leaf split as its
parameter (`split_as`)."""

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


def split_as(x: jax.Array, param: jax.Array) -> jax.Array:
  """``x``, a state leaf of ``param`` (on its mesh, a `jax.sharding.NamedSharding`), split over
  the mesh as ``param`` is on each trailing axis the two have of one size, whole along the
  others, in ``x``'s memory kind: ZeRO's optimizer state, each device's share beside its
  parameters' (Rajbhandari et al., 2020). Adam's moments ``[n, len / n, ...]`` of a leaf
  ``[len, ...]`` split along ``...`` as the leaf; 8-bit codes as their leaf, their block
  scales ``[..., 1]`` whole. As the step's update writes them, so its second call does not
  compile again."""
  spec = tuple(param.sharding.spec) + (None,) * (param.ndim - len(param.sharding.spec))
  axes = [None] * x.ndim
  for k in range(1, min(x.ndim, param.ndim) + 1):
    if x.shape[-k] == param.shape[-k]:
      axes[-k] = spec[-k]
  while axes and axes[-1] is None:  # P() as the step's outputs have it, not P(None): one key
    axes.pop()
  sharding = jax.sharding.NamedSharding(param.sharding.mesh, jax.sharding.PartitionSpec(*axes),
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
