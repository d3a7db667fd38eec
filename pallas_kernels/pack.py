"""Bit-packing of small integer codes along the last axis.

The layout (DESIGN.md): with ``b`` bits a code and ``8 // b`` codes a byte,
element ``j`` of a row goes to byte ``j // (8 // b)`` at bit
``b * (j % (8 // b))``, low bits first; the last axis is zero-padded to a
multiple of ``8 // b``. Packing along the last axis keeps a packed residual
sharded like the array it came from.

This file holds the pure-JAX reference, which is what runs on every backend.
"""

import math

import jax.numpy as jnp

SUPPORTED_BITS = (1, 2, 4, 8)


def _codes_per_byte(bits: int) -> int:
  if bits not in SUPPORTED_BITS:
    raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}.")
  return 8 // bits


def packed_size(n: int, bits: int) -> int:
  """Bytes a row of ``n`` codes of ``bits`` bits takes: ``ceil(n * bits / 8)``."""
  return math.ceil(n / _codes_per_byte(bits))


def pack(codes: jnp.ndarray, bits: int) -> jnp.ndarray:
  """Packs codes along the last axis.

  Args:
    codes: integer array ``[..., n]`` with values in ``[0, 2**bits)``.
    bits: 1, 2, 4 or 8.

  Returns:
    ``uint8[..., ceil(n * bits / 8)]``.
  """
  per_byte = _codes_per_byte(bits)
  codes = codes.astype(jnp.uint8)
  n = codes.shape[-1]
  size = packed_size(n, bits)
  if size * per_byte > n:
    codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, size * per_byte - n)])
  groups = codes.reshape(*codes.shape[:-1], size, per_byte)
  shifts = jnp.arange(0, 8, bits, dtype=jnp.uint8)
  return jnp.sum(groups << shifts, axis=-1, dtype=jnp.uint8)


def unpack(packed: jnp.ndarray, bits: int, n: int) -> jnp.ndarray:
  """Inverse of `pack`: ``uint8[..., ceil(n * bits / 8)]`` to ``uint8[..., n]``."""
  per_byte = _codes_per_byte(bits)
  shifts = jnp.arange(0, 8, bits, dtype=jnp.uint8)
  mask = jnp.uint8(2**bits - 1)
  codes = (packed[..., None] >> shifts) & mask
  return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)[..., :n]
