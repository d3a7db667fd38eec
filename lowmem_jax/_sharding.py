"""Shardings where a mesh's explicit axes make them part of an array's type."""

import jax


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


def in_mesh() -> bool:
  """Whether a mesh is set for tracing (`jax.set_mesh`): `gathered` and `position_major` act
  only then."""
  return not jax.sharding.get_abstract_mesh().empty


def gathered(tree):
  """Each leaf of ``tree`` whole on every device of the mesh set for tracing, FSDP's
  all-gather of parameters before their use (their gradient is then reduced back to
  their sharding); ``tree`` itself without a mesh."""
  if not in_mesh():
    return tree
  whole = jax.sharding.PartitionSpec()
  return jax.tree.map(lambda x: jax.sharding.reshard(x, whole) if explicit(x) is not None
                      else jax.lax.with_sharding_constraint(x, whole), tree)


def position_major(x: jax.Array) -> jax.Array:
  """``x: [batch, length, ...]`` as ``[length, batch, ...]`` under a mesh set for tracing,
  else ``x`` (its own inverse). A block of the flattened tokens then holds every
  sequence's share, so it stays split over the devices the batch is split over, where a
  block of batch-major tokens lies on one device and is gathered to the others."""
  return jax.numpy.swapaxes(x, 0, 1) if in_mesh() else x
