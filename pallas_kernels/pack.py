"""Pallas kernels that pack small integer codes along the last axis, and unpack them.

The layout and the pure-JAX twins the kernels are tested against,
`pack_reference` and `unpack_reference`, are the library's
(`lowmem_jax.ops._packing`, re-exported here). The kernels view a row of ``n``
codes as ``[n / P, P]`` (a free reshape), so a program reads whole bytes' worth
of codes and reduces over the minor axis; `codes_to_bytes` and
`bytes_to_codes` are the in-kernel steps the fused activation kernels share.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lowmem_jax.ops import _packing
from lowmem_jax.ops._packing import (SUPPORTED_BITS, bytes_to_codes, check_packed, codes_per_byte,
                                 codes_to_bytes, pack_reference, packed_size, unpack_reference)
from pallas_kernels import _blocks

__all__ = ["SUPPORTED_BITS", "byte_grid", "bytes_to_codes", "check_packed", "codes_per_byte",
           "codes_to_bytes", "grouped", "pack", "pack_reference", "packed_size", "ungrouped",
           "unpack", "unpack_reference"]


def grouped(x: jax.Array, bits: int, fill=0) -> jax.Array:
  """``[..., n]`` as ``[rows, ceil(n / P), P]``, padding the last axis with ``fill``.

  A reshape when ``P`` divides ``n``; otherwise the padding copies ``x``.
  """
  return _packing.grouped(_blocks.as_rows(x), bits, fill)


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
    options: interpret mode and tuning (`pallas_kernels.Options`).

  Returns:
    ``uint8[..., ceil(n * bits / 8)]``, equal to `pack_reference`.
  """
  view, out_shape = _codes_view(codes, bits)
  if view is None:
    return jnp.zeros(out_shape, jnp.uint8)
  grid, grouped_spec, bytes_spec = byte_grid(view.shape[0], out_shape[-1], bits, options)
  packed = _blocks.pallas_call(
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
  codes = _blocks.pallas_call(
      functools.partial(_unpack_kernel, bits=bits, shape=view.shape + (8 // bits,)),
      out_shape=jax.ShapeDtypeStruct(view.shape + (8 // bits,), jnp.uint8),
      grid=grid, in_specs=[bytes_spec], out_specs=grouped_spec,
      interpret=options.interpret, compiler_params=options.compiler_params(),
      name="lowmem_unpack")(view)
  return ungrouped(codes, out_shape)


def _codes_view(codes, bits):
  """Checked ``codes`` as `grouped` uint8 ``[rows, m, P]`` (``None`` when empty), and
  the packed shape ``[..., m]``."""
  codes = _packing.checked_codes(codes, bits)
  out_shape = codes.shape[:-1] + (packed_size(codes.shape[-1], bits),)
  if 0 in out_shape:
    return None, out_shape
  return grouped(codes, bits), out_shape
