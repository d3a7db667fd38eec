"""An embedding lookup whose table-sized gradient buffer is made when it is needed.

The gradient of a row gather ``jnp.take(table, ids, axis=0)`` is a
scatter-add of the output's cotangent into a zero ``table``-sized buffer.
XLA makes that zero buffer as soon as it can, and a broadcast of a constant
has no inputs, so it is made at the start of the backward pass and stays
live through it. In AdamA's micro-batch loop that is the step's peak, where
the logits and their gradient are (GPT-2-small's 50,257 × 768 float32 table:
147 MiB; `docs/benchmarks.md`). `take` computes the same gradient, bit for
bit, from a zero that an ``optimization_barrier`` ties to the cotangent, so
the buffer exists only once the cotangent does. It helps where the peak
comes before the lookup's cotangent, as in that loop; a plain step, whose
buffers XLA orders otherwise, is not helped (measured a little worse), nor
is gradient accumulation. Reverse mode only (a ``custom_vjp``: ``jax.jvp``
raises; ``jax.grad`` of ``jax.grad`` works).

`lowmem_jax.flax.linen.Embed` and `lowmem_jax.flax.nnx.Embed` are Flax's ``Embed`` with
this lookup.
"""

import jax
import jax.numpy as jnp


def take(table: jax.Array, ids: jax.Array) -> jax.Array:
  """Rows of ``table``: ``jnp.take(table, ids, axis=0)``, its twin.

  Args:
    table: ``[num_embeddings, ...]``, any dtype; sharded or not.
    ids: integer ``[...]``; negative ids count from the end, ids out of range
      give ``jnp.take``'s fill rows (NaN for a float table) and no gradient.

  Returns:
    ``[*ids.shape, *table.shape[1:]]``, ``table``'s dtype. The gradient with
    respect to ``table`` equals ``jnp.take``'s; its zero buffer is made after
    the cotangent exists.
  """
  if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
    raise ValueError(f"`ids` must be integers, got {jnp.result_type(ids)}.")
  if jnp.ndim(table) < 1:
    raise ValueError(f"`table` must have a leading axis of rows, got shape {jnp.shape(table)}.")
  return _take(table, ids)


@jax.custom_vjp
def _take(table, ids):
  return jnp.take(table, ids, axis=0)


def _take_fwd(table, ids):
  aval = jax.typeof(table)
  return jnp.take(table, ids, axis=0), (ids, jax.ShapeDtypeStruct(aval.shape, aval.dtype,
                                                                   sharding=aval.sharding))


def _take_bwd(residuals, dy):
  ids, table = residuals
  # A zero the scheduler cannot make before ``dy``: the barrier is one op over both.
  zero, dy = jax.lax.optimization_barrier((jnp.zeros((), table.dtype), dy))
  dtable = jnp.broadcast_to(zero, table.shape, out_sharding=table.sharding).at[ids].add(dy)
  return dtable, None


_take.defvjp(_take_fwd, _take_bwd)
