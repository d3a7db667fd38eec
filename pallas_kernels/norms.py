"""MS-LayerNorm / MS-RMSNorm kernels: one pass per row block, each way.

MS-BP (Yang et al., ICML 2024, arXiv:2406.16282). The kernels compute what
their pure-JAX twins, `forward_reference` and `backward_reference`, compute:
the library's (`lowmem_jax.ops._norm_reference`, which gives the formulas;
re-exported here), which the kernels are tested against.

A program holds whole rows (the row padded to a power of two and masked), so
the forward writes ``y`` and ``rstd`` in one pass and the backward takes both
row means of ``dy`` in one kernel. Rows longer than `MAX_ROW` do not fit a
program.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lowmem_jax.ops._norm_reference import backward_reference, forward_reference
from pallas_kernels import _blocks

__all__ = ["MAX_ROW", "backward", "backward_reference", "forward", "forward_reference",
           "supports"]

# Longest row a program holds: 16K float32 values, 64 KiB (JAX's own Triton
# layer norm loads rows in chunks of 64 KiB; ours holds the whole row).
MAX_ROW = 16384


def supports(n: int) -> str | None:
  """Why the kernels cannot take rows of ``n`` elements, or ``None`` if they can."""
  if pl.next_power_of_2(n) > MAX_ROW:
    return f"rows of {n} elements exceed the kernel's limit of {MAX_ROW}"
  return None


def _row_grid(rows: int, n: int, options: _blocks.Options):
  """Grid and specs: whole (padded) rows, ``[block_rows, N]`` and ``[block_rows]``."""
  reason = supports(n)
  if reason:
    raise ValueError(f"x's last axis is too long for the norm kernels: {reason}.")
  if options.block_cols is not None:
    raise ValueError(f"options.block_cols must be None for the norm kernels (a program holds "
                     f"whole rows), got {options.block_cols}.")
  cols = pl.next_power_of_2(n)
  block_rows, _ = _blocks.block_shape(rows, cols, _blocks.Options(block_rows=options.block_rows))
  grid = (pl.cdiv(rows, block_rows),)
  row_spec = pl.BlockSpec((block_rows, cols), lambda i: (i, 0))
  stat_spec = pl.BlockSpec((block_rows,), lambda i: (i,))
  return grid, row_spec, stat_spec


def _masked(ref, shape):
  """The block of ``[rows, n]`` as float32, zero beyond column ``n``, and the column mask."""
  value = _blocks.load(ref, shape, (pl.program_id(0), 0)).astype(jnp.float32)
  mask = jax.lax.broadcasted_iota(jnp.int32, value.shape, 1) < shape[1]
  return jnp.where(mask, value, 0.0), mask


def _forward_kernel(x_ref, y_ref, rstd_ref, *, centered, eps, shape):
  n = shape[1]
  x, mask = _masked(x_ref, shape)
  if centered:
    x = jnp.where(mask, x - jnp.sum(x, axis=1, keepdims=True) / n, 0.0)
  rstd = jax.lax.rsqrt(jnp.sum(x * x, axis=1) / n + eps)
  _blocks.store(y_ref, (x * rstd[:, None]).astype(y_ref.dtype), shape, (pl.program_id(0), 0))
  _blocks.store(rstd_ref, rstd, shape[:1], (pl.program_id(0),))


def _backward_kernel(y_ref, rstd_ref, dy_ref, dx_ref, *, centered, shape):
  n = shape[1]
  y, _ = _masked(y_ref, shape)
  dy, _ = _masked(dy_ref, shape)
  g = dy - y * (jnp.sum(dy * y, axis=1, keepdims=True) / n)
  if centered:
    g = g - jnp.sum(dy, axis=1, keepdims=True) / n
  rstd = _blocks.load(rstd_ref, shape[:1], (pl.program_id(0),))
  _blocks.store(dx_ref, (rstd[:, None] * g).astype(dx_ref.dtype), shape, (pl.program_id(0), 0))


@functools.partial(jax.jit, static_argnames=("centered", "eps", "y_dtype", "options"))
def forward(x: jax.Array, *, centered: bool, eps: float, y_dtype=None,
            options: _blocks.Options = _blocks.Options()):
  """Normalises the rows of ``x`` in one pass.

  Args:
    x: float16/bfloat16/float32 ``[..., n]``, ``next_power_of_2(n) <= MAX_ROW``.
    centered: LayerNorm (True) or RMSNorm (False).
    eps: added to the variance (mean square).
    y_dtype: dtype of ``y``; defaults to x's.
    options: interpret mode and tuning (``block_cols`` must be None: rows are whole).

  Returns:
    ``(y, rstd)``: ``y`` of x's shape in ``y_dtype``, ``rstd`` float32 ``[...]``.
  """
  y_dtype = jnp.dtype(y_dtype or x.dtype)
  if x.size == 0:
    return forward_reference(x, centered=centered, eps=eps, y_dtype=y_dtype)
  rows = _blocks.as_rows(x)
  grid, row_spec, stat_spec = _row_grid(*rows.shape, options)
  y, rstd = _blocks.pallas_call(
      functools.partial(_forward_kernel, centered=centered, eps=eps, shape=rows.shape),
      out_shape=(jax.ShapeDtypeStruct(rows.shape, y_dtype),
                 jax.ShapeDtypeStruct(rows.shape[:1], jnp.float32)),
      grid=grid, in_specs=[row_spec], out_specs=(row_spec, stat_spec),
      interpret=options.interpret, compiler_params=options.compiler_params(),
      name="lowmem_ms_norm_fwd")(rows)
  return y.reshape(x.shape), rstd.reshape(x.shape[:-1])


@functools.partial(jax.jit, static_argnames=("centered", "x_dtype", "options"))
def backward(y: jax.Array, rstd: jax.Array, dy: jax.Array, *, centered: bool, x_dtype=None,
             options: _blocks.Options = _blocks.Options()) -> jax.Array:
  """The exact input gradient from ``y`` and ``rstd``, both row means in one kernel.

  Args:
    y: the forward's output ``[..., n]``, any float dtype.
    rstd: float32 ``[...]`` from `forward`.
    dy: the output's cotangent, y's shape.
    centered: LayerNorm (True) or RMSNorm (False).
    x_dtype: dtype of ``dx``; defaults to dy's.
    options: interpret mode and tuning.

  Returns:
    ``dx`` of y's shape in ``x_dtype``.
  """
  x_dtype = jnp.dtype(x_dtype or dy.dtype)
  if y.size == 0:
    return backward_reference(y, rstd, dy, centered=centered, x_dtype=x_dtype)
  rows = _blocks.as_rows(y)
  grid, row_spec, stat_spec = _row_grid(*rows.shape, options)
  dx = _blocks.pallas_call(
      functools.partial(_backward_kernel, centered=centered, shape=rows.shape),
      out_shape=jax.ShapeDtypeStruct(rows.shape, x_dtype),
      grid=grid, in_specs=[row_spec, stat_spec, row_spec], out_specs=row_spec,
      interpret=options.interpret, compiler_params=options.compiler_params(),
      name="lowmem_ms_norm_bwd")(rows, rstd.reshape(rows.shape[:1]), _blocks.as_rows(dy))
  return dx.reshape(y.shape)
