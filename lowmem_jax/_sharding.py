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
