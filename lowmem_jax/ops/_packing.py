"""Bit-packing of small integer codes along the last axis, in pure JAX.

The layout (DESIGN.md): with ``b`` bits a code and ``P = 8 // b`` codes a
byte, element ``j`` of a row goes to byte ``j // P`` at bit ``b * (j % P)``,
low bits first; the last axis is zero-padded to a multiple of ``P``. Packing
along the last axis keeps a packed residual sharded like the array it came from.

The library packs with `pack_reference` and unpacks with `unpack_reference`
(the approximate activations' codes, `lowmem_jax.ops.compress`'s quantised
residuals). The Pallas kernels of `pallas_kernels.pack` are tested against
them and share their steps: `grouped` views a row of ``n`` codes as ``[n / P,
P]`` (a free reshape), and `codes_to_bytes` / `bytes_to_codes` reduce over
the minor axis. This module imports no kernel.
"""

import math

import jax
import jax.numpy as jnp

SUPPORTED_BITS = (1, 2, 4, 8)


def codes_per_byte(bits: int) -> int:
  """``8 // bits``, after checking ``bits`` is one of `SUPPORTED_BITS`."""
  if not isinstance(bits, int) or bits not in SUPPORTED_BITS:
    raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}.")
  return 8 // bits


def packed_size(n: int, bits: int) -> int:
  """Bytes a row of ``n`` codes of ``bits`` bits takes: ``ceil(n * bits / 8)``."""
  return math.ceil(n / codes_per_byte(bits))


def _shifts(bits: int, ndim: int) -> jax.Array:
  """int32 ``bits * (0, 1, .., P - 1)`` along the last of ``ndim`` axes."""
  per_byte = 8 // bits
  return jax.lax.broadcasted_iota(jnp.int32, (1,) * (ndim - 1) + (per_byte,), ndim - 1) * bits


def codes_to_bytes(codes: jax.Array, bits: int) -> jax.Array:
  """``[..., m, P]`` integer codes to their ``uint8[..., m]`` bytes."""
  return jnp.sum(codes.astype(jnp.int32) << _shifts(bits, codes.ndim), axis=-1).astype(jnp.uint8)


def bytes_to_codes(packed: jax.Array, bits: int) -> jax.Array:
  """``uint8[..., m]`` bytes to their int32 codes ``[..., m, P]``."""
  packed = packed.astype(jnp.int32)[..., None]
  return (packed >> _shifts(bits, packed.ndim)) & (2**bits - 1)


def grouped(x: jax.Array, bits: int, fill=0) -> jax.Array:
  """``[..., n]`` as ``[..., ceil(n / P), P]``, padding the last axis with ``fill``.

  A reshape when ``P`` divides ``n``; otherwise the padding copies ``x``.
  """
  per_byte = codes_per_byte(bits)
  pad = -x.shape[-1] % per_byte
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=fill)
  return x.reshape(*x.shape[:-1], x.shape[-1] // per_byte, per_byte)


def checked_codes(codes: jax.Array, bits: int) -> jax.Array:
  """``codes`` as uint8, each masked to its low ``bits`` bits.

  Raises:
    TypeError: ``codes`` is not an integer array of rank >= 1.
    ValueError: ``bits`` is not one of `SUPPORTED_BITS`.
  """
  if not jnp.issubdtype(codes.dtype, jnp.integer) or codes.ndim < 1:
    raise TypeError(
        f"codes must be an integer array of rank >= 1, got {codes.dtype}{list(codes.shape)}.")
  codes_per_byte(bits)
  return codes.astype(jnp.uint8) & jnp.uint8(2**bits - 1)


def check_packed(packed: jax.Array, bits: int, n: int) -> None:
  """Raises unless ``packed`` is ``uint8[..., ceil(n * bits / 8)]``, ``n >= 0``."""
  if not isinstance(n, int) or n < 0:
    raise ValueError(f"n must be an int >= 0, got {n!r}.")
  if packed.dtype != jnp.uint8:
    raise TypeError(f"packed must be uint8, got {packed.dtype}.")
  if packed.ndim < 1 or packed.shape[-1] != packed_size(n, bits):
    raise ValueError(
        f"packed's last axis must be ceil(n * bits / 8) = {packed_size(n, bits)} for n={n}, "
        f"bits={bits}, got shape {packed.shape}.")


def pack_reference(codes: jax.Array, bits: int) -> jax.Array:
  """Packs integer codes ``[..., n]`` into ``uint8[..., ceil(n * bits / 8)]``.

  Codes must lie in ``[0, 2**bits)``; other values are masked to their low
  ``bits`` bits, as in the kernel.

  >>> pack_reference(jnp.array([1, 2, 3, 0, 1], jnp.uint8), 2)
  Array([57,  1], dtype=uint8)
  """
  codes = checked_codes(codes, bits)
  return codes_to_bytes(grouped(codes, bits), bits)


def unpack_reference(packed: jax.Array, bits: int, n: int) -> jax.Array:
  """`pack_reference` undone: ``uint8[..., ceil(n * bits / 8)]`` to ``uint8[..., n]``."""
  check_packed(packed, bits, n)
  codes = bytes_to_codes(packed, bits).astype(jnp.uint8)
  return codes.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))[..., :n]
