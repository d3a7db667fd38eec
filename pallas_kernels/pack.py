"""Bit-packing of small integer codes along the last axis: kernels and reference.

The layout (DESIGN.md): with ``b`` bits a code and ``P = 8 // b`` codes a
byte, element ``j`` of a row goes to byte ``j // P`` at bit ``b * (j % P)``,
low bits first; the last axis is zero-padded to a multiple of ``P``. Packing
along the last axis keeps a packed residual sharded like the array it came from.

The kernels view a row of ``n`` codes as ``[n / P, P]`` (a free reshape), so a
program reads whole bytes' worth of codes and reduces over the minor axis.
`pack_reference` and `unpack_reference` are the pure-JAX twins the kernels are
tested against; `codes_to_bytes` and `bytes_to_codes` are the in-kernel steps
the fused activation kernels share.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _blocks

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
  """``[..., n]`` as ``[rows, ceil(n / P), P]``, padding the last axis with ``fill``.

  A reshape when ``P`` divides ``n``; otherwise the padding copies ``x``.
  """
  per_byte = codes_per_byte(bits)
  x = _blocks.as_rows(x)
  pad = -x.shape[-1] % per_byte
  if pad:
    x = jnp.pad(x, [(0, 0), (0, pad)], constant_values=fill)
  return x.reshape(x.shape[0], x.shape[1] // per_byte, per_byte)


def ungrouped(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Inverse of `grouped`: ``[rows, m, P]`` back to ``shape`` (``[..., n]``)."""
  x = x.reshape(x.shape[0], x.shape[1] * x.shape[2])
  if x.shape[-1] != shape[-1]:
    x = x[:, :shape[-1]]
  return x.reshape(shape)


def byte_grid(rows: int, m: int, bits: int, options: _blocks.Options):
  """Grid and block specs for ``[rows, m, P]`` code views and ``[rows, m]`` bytes."""
  per_byte = 8 // bits
  block_rows, block_bytes = _blocks.block_shape(rows, m, options, per_byte)
  grid = (pl.cdiv(rows, block_rows), pl.cdiv(m, block_bytes))
  grouped_spec = pl.BlockSpec((block_rows, block_bytes, per_byte), lambda i, j: (i, j, 0))
  bytes_spec = pl.BlockSpec((block_rows, block_bytes), lambda i, j: (i, j))
  return grid, grouped_spec, bytes_spec


def _pack_kernel(codes_ref, packed_ref, *, bits, shape):
  """``shape``: the ``[rows, m, P]`` code view; blocks outside it are masked."""
  at = (pl.program_id(0), pl.program_id(1), 0)
  packed = codes_to_bytes(_blocks.load(codes_ref, shape, at), bits)
  _blocks.store(packed_ref, packed, shape[:2], at[:2])


def _unpack_kernel(packed_ref, codes_ref, *, bits, shape):
  """``shape``: the ``[rows, m, P]`` code view; blocks outside it are masked."""
  at = (pl.program_id(0), pl.program_id(1), 0)
  codes = bytes_to_codes(_blocks.load(packed_ref, shape[:2], at[:2]), bits)
  _blocks.store(codes_ref, codes.astype(codes_ref.dtype), shape, at)


@functools.partial(jax.jit, static_argnames=("bits", "options"))
def pack(codes: jax.Array, bits: int, *, options: _blocks.Options = _blocks.Options()) -> jax.Array:
  """Packs codes along the last axis with a Pallas kernel.

  Args:
    codes: integer array ``[..., n]`` with values in ``[0, 2**bits)``; other
      values are masked to their low ``bits`` bits.
    bits: 1, 2, 4 or 8.
    options: interpret mode and tuning (`pallas_kernels._blocks.Options`).

  Returns:
    ``uint8[..., ceil(n * bits / 8)]``, equal to `pack_reference`.
  """
  view, out_shape = _codes_view(codes, bits)
  if view is None:
    return jnp.zeros(out_shape, jnp.uint8)
  grid, grouped_spec, bytes_spec = byte_grid(view.shape[0], out_shape[-1], bits, options)
  packed = pl.pallas_call(
      functools.partial(_pack_kernel, bits=bits, shape=view.shape),
      out_shape=jax.ShapeDtypeStruct(view.shape[:2], jnp.uint8),
      grid=grid, in_specs=[grouped_spec], out_specs=bytes_spec,
      interpret=options.interpret, compiler_params=options.compiler_params(),
      name="lowmem_pack")(view)
  return packed.reshape(out_shape)


@functools.partial(jax.jit, static_argnames=("bits", "n", "options"))
def unpack(packed: jax.Array, bits: int, n: int, *,
           options: _blocks.Options = _blocks.Options()) -> jax.Array:
  """Inverse of `pack`: ``uint8[..., ceil(n * bits / 8)]`` to ``uint8[..., n]``."""
  check_packed(packed, bits, n)
  out_shape = packed.shape[:-1] + (n,)
  if 0 in out_shape:
    return jnp.zeros(out_shape, jnp.uint8)
  view = _blocks.as_rows(packed)
  grid, grouped_spec, bytes_spec = byte_grid(view.shape[0], view.shape[1], bits, options)
  codes = pl.pallas_call(
      functools.partial(_unpack_kernel, bits=bits, shape=view.shape + (8 // bits,)),
      out_shape=jax.ShapeDtypeStruct(view.shape + (8 // bits,), jnp.uint8),
      grid=grid, in_specs=[bytes_spec], out_specs=grouped_spec,
      interpret=options.interpret, compiler_params=options.compiler_params(),
      name="lowmem_unpack")(view)
  return ungrouped(codes, out_shape)


def pack_reference(codes: jax.Array, bits: int) -> jax.Array:
  """Pure-JAX `pack`: integer ``[..., n]`` to ``uint8[..., ceil(n * bits / 8)]``.

  Codes must lie in ``[0, 2**bits)``; other values are masked to their low
  ``bits`` bits, as in the kernel.
  """
  view, out_shape = _codes_view(codes, bits)
  if view is None:
    return jnp.zeros(out_shape, jnp.uint8)
  return codes_to_bytes(view, bits).reshape(out_shape)


def unpack_reference(packed: jax.Array, bits: int, n: int) -> jax.Array:
  """Pure-JAX `unpack`: ``uint8[..., ceil(n * bits / 8)]`` to ``uint8[..., n]``."""
  check_packed(packed, bits, n)
  codes = bytes_to_codes(packed, bits).astype(jnp.uint8)
  return codes.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))[..., :n]


def _codes_view(codes, bits):
  """Checked ``codes`` as `grouped` uint8 ``[rows, m, P]`` (``None`` when empty), and
  the packed shape ``[..., m]``."""
  if not jnp.issubdtype(codes.dtype, jnp.integer) or codes.ndim < 1:
    raise TypeError(
        f"codes must be an integer array of rank >= 1, got {codes.dtype}{list(codes.shape)}.")
  out_shape = codes.shape[:-1] + (packed_size(codes.shape[-1], bits),)
  if 0 in out_shape:
    return None, out_shape
  return grouped(codes.astype(jnp.uint8) & jnp.uint8(2**bits - 1), bits), out_shape


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
