"""Keeping a saved array in one layout on XLA's GPU pipeline."""

import math

import jax
from jax import lax


def barrier_rows(*arrays: jax.Array) -> tuple[jax.Array, ...]:
  """``arrays`` through one ``optimization_barrier``, each as ``[rows, last axis]``.

  The values are unchanged. The barrier keeps XLA from recomputing an array
  in the backward from what made it (which keeps those inputs alive too).
  Flattened to two axes, the array takes the row-major layout the next
  matmul reads: XLA's layout assignment otherwise gives it the layout of its
  producer (for instance batch-minor, chosen for a sum over the batch in the
  backward) and makes a row-major copy for the matmul, and both live until
  the backward. Arrays of rank 0 or 1 pass as they are.

  Under SPMD, merging the leading axes keeps a sharding of the first axis
  (data parallelism, FSDP); an array sharded along a later leading axis
  (sequence or heads) would be gathered under automatic mesh axes, and passes
  unflattened under explicit ones, whose types show that sharding.
  """
  flat = lax.optimization_barrier(tuple(_rows(x) for x in arrays))
  return tuple(f.reshape(x.shape) for f, x in zip(flat, arrays))


def _rows(x):
  """``x`` as ``[rows, last axis]``, or as it is where that merges no axes or would merge an
  axis after the first that its type says is sharded (no sharding of the rows says that)."""
  if x.ndim < 2 or any(jax.typeof(x).sharding.spec[1:x.ndim - 1]):
    return x
  return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
