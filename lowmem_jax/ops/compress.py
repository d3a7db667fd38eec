"""Compressed residuals: exact forward, a reduced copy of the input saved for backward.

A layer linear in its input, ``y = f(x, w)`` (a matmul, a convolution), needs
x in its backward only for the weight gradient: the input gradient needs w
alone. So these functions compute the forward exactly, save a compressed x̃ in
place of x, and in backward evaluate the exact vjp of f at (x̃, w):

- the input gradient is exact (it does not read x̃);
- the weight gradient is linear in the saved input, so its error is the weight
  gradient of the compression error, bounded elementwise by

      |dw̃ - dw| <= vjp_w f(|x̃ - x|, |dy|)        (for a matmul: |x̃ - x|^T |dy|)

  because each entry of the weight gradient is a sum of products of one input
  entry and one output-gradient entry.

Two compressions:

- `quantized_residual` / `int8_dense` / `int8_dot_general` / `int8_conv`: x quantised per
  row (along its last axis) symmetrically to ``bits`` bits with a float32 scale
  ``s = max|x_row| / (2**(bits - 1) - 1)``, codes packed along the last axis.
  Rounding to nearest gives ``|x̃ - x| <= s / 2`` per entry; x̃ is rounded
  back to x's dtype, which adds at most ``u * (|x| + s / 2)`` (u: the unit
  roundoff, 2**-8 for bfloat16, 2**-11 for float16, 2**-24 for float32). (Per-group
  quantised residuals are the ActNN line: Chen et al., "ActNN: Reducing Training
  Memory Footprint via 2-Bit Activation Compressed Training", ICML 2021.)
- `pooled_conv`: channels-last convolution whose residual is x average-pooled
  over non-overlapping ``pool`` windows of every spatial axis (``pool**d`` times
  smaller); backward repeats each mean over its window. Then ``|x̃ - x|`` is at
  most the spread (max - min) of x in the entry's window. (Barley & Fröning,
  "Less Memory Means smaller GPUs: Backpropagation with Compressed Activations",
  2024, arXiv:2409.11902: 29% less peak memory on ResNet.)

For an ``f`` not linear in x, both gradients are evaluated at x̃ and the bound
above does not hold.
"""

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax import names
from lowmem_jax._checks import check_float_array
from lowmem_jax.ops._packing import pack_reference, unpack_reference

QUANT_BITS = (2, 4, 8)


def _check_bits(bits: Any) -> int:
  if not isinstance(bits, int) or isinstance(bits, bool) or bits not in QUANT_BITS:
    raise ValueError(f"bits must be one of {QUANT_BITS}, got {bits!r}.")
  return 2 ** (bits - 1) - 1


def quantize_rows(x: jax.Array, bits: int = 8) -> tuple[jax.Array, jax.Array]:
  """Symmetric per-row quantisation of ``x [..., n]`` along its last axis.

  Args:
    x: float16/bfloat16/float32 ``[..., n]``.
    bits: 2, 4 or 8: each entry becomes an integer q in ``[-Q, Q]``,
      ``Q = 2**(bits - 1) - 1``, stored as the code ``q + Q``.

  Returns:
    ``(packed, scale)``: ``uint8[..., ceil(n * bits / 8)]`` codes packed along the
    last axis as in `lowmem_jax.ops._packing`, and ``float32[..., 1]`` scales
    ``max|x_row| / Q`` (0 for an all-zero row). ``x ≈ q * scale`` with an error
    of at most ``scale / 2`` per entry.
  """
  q_max = _check_bits(bits)
  check_float_array(x)
  x32 = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / q_max
  q = jnp.round(x32 / jnp.where(scale > 0, scale, 1.0))
  codes = (jnp.clip(q, -q_max, q_max) + q_max).astype(jnp.uint8)
  return pack_reference(codes, bits), scale


def dequantize_rows(packed: jax.Array, scale: jax.Array, bits: int, n: int,
                    dtype: Any = jnp.float32) -> jax.Array:
  """The inverse of `quantize_rows`: ``[..., n]`` of ``dtype``, ``q * scale``."""
  q_max = _check_bits(bits)
  q = unpack_reference(packed, bits, n).astype(jnp.float32) - q_max
  return (q * scale).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _quantized(fn, saved_as, x, *params):
  return fn(x, *params)


def _quantized_fwd(fn, saved_as, x, *params):
  bits, _, _ = saved_as
  packed, scale = quantize_rows(x, bits)
  saved = (checkpoint_name(packed, names.COMPRESSED_IN),
           checkpoint_name(scale, names.COMPRESSED_SCALE))
  return fn(x, *params), (saved, params)


def _quantized_bwd(fn, saved_as, residuals, dy):
  # Tied to dy, the dequantised copy is made when the backward reaches it, not hoisted.
  residuals, dy = jax.lax.optimization_barrier((residuals, dy))
  (packed, scale), params = residuals
  x_tilde = dequantize_rows(packed, scale, *saved_as)
  _, vjp = jax.vjp(fn, x_tilde, *params)
  return vjp(dy)


_quantized.defvjp(_quantized_fwd, _quantized_bwd)


def quantized_residual(fn: Callable[..., jax.Array], bits: int = 8) -> Callable[..., jax.Array]:
  """``fn(x, *params)`` with the same forward, saving x quantised to ``bits`` bits.

  Args:
    fn: a function linear in its first argument ``x [..., n]`` (float16,
      bfloat16 or float32), such as a matmul or a convolution with channels last.
    bits: 2, 4 or 8 bits per entry of the saved x, plus a float32 scale per row.

  Returns:
    A function of the same arguments. Its backward evaluates the vjp of ``fn``
    at the dequantised x (see the module docstring for the error bound). It
    saves ``uint8[..., ceil(n * bits / 8)]`` (named ``compressed_in``), the
    ``float32[..., 1]`` scales (``compressed_scale``) and ``params``.
  """
  _check_bits(bits)
  if not callable(fn):
    raise TypeError(f"fn must be callable, got {type(fn).__name__}.")

  def quantized(x: jax.Array, *params: jax.Array) -> jax.Array:
    check_float_array(x)
    return _quantized(fn, (bits, x.shape[-1], x.dtype), x, *params)
  return quantized


def int8_dense(x: jax.Array, w: jax.Array) -> jax.Array:
  """``x @ w`` that saves x as int8 with a float32 scale per row.

  Args:
    x: ``[..., n]`` float16/bfloat16/float32.
    w: ``[n, m]``.

  Returns:
    ``x @ w``, exactly as `jnp.matmul` computes it. Backward: ``dx`` exact,
    ``dw = x̃^T dy`` with ``|x̃ - x| <= max|x_row| / 254`` per entry in float32
    (plus the rounding to x's dtype, see the module docstring).
  """
  return quantized_residual(jnp.matmul, 8)(x, w)


def int8_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision=None,
                     preferred_element_type=None) -> jax.Array:
  """`jax.lax.dot_general` that saves ``lhs`` as int8 rows with a float32 scale.

  A drop-in for Flax: ``nn.Dense(features, dot_general=int8_dot_general)``.
  The rows quantised are along ``lhs``'s last axis.
  """
  fn = functools.partial(lax.dot_general, dimension_numbers=dimension_numbers,
                         precision=precision, preferred_element_type=preferred_element_type)
  return quantized_residual(fn, 8)(lhs, rhs)


def int8_conv(lhs: jax.Array, rhs: jax.Array, window_strides, padding, *,
              dimension_numbers=None, **conv_kwargs) -> jax.Array:
  """`jax.lax.conv_general_dilated`, channels last, saving ``lhs`` as int8 with a
  float32 scale per pixel (the rows along the channel axis).

  A drop-in for Flax: ``nn.Conv(..., conv_general_dilated=int8_conv)``.
  """
  check_float_array(lhs, "lhs")
  layout = _checked_layout(lhs, rhs, dimension_numbers)
  conv = functools.partial(lax.conv_general_dilated, window_strides=window_strides,
                           padding=padding, dimension_numbers=layout, **conv_kwargs)
  return quantized_residual(conv, 8)(lhs, rhs)


def _checked_layout(x, w, dimension_numbers) -> lax.ConvDimensionNumbers:
  layout = _channels_last(x.ndim)
  if dimension_numbers is not None and (
      lax.conv_dimension_numbers(x.shape, w.shape, dimension_numbers) != layout):
    raise ValueError(f"dimension_numbers must be channels-last ({layout}), "
                     f"got {dimension_numbers}.")
  return layout


def _channels_last(ndim: int) -> lax.ConvDimensionNumbers:
  spatial = tuple(range(1, ndim - 1))
  return lax.ConvDimensionNumbers(lhs_spec=(0, ndim - 1, *spatial),
                                  rhs_spec=(ndim - 1, ndim - 2, *range(ndim - 2)),
                                  out_spec=(0, ndim - 1, *spatial))


def avg_pool(x: jax.Array, pool: int) -> jax.Array:
  """Mean of ``x [N, *spatial, C]`` over non-overlapping ``pool`` windows of each
  spatial axis: ``[N, *(s // pool), C]``, computed in float32, in x's dtype."""
  # Not Flax's nn.avg_pool: it divides the float32 sums by an int32 count, which
  # strict dtype promotion refuses. The same sum, divided by the same count in float32.
  window = (1,) + (pool,) * (x.ndim - 2) + (1,)
  total = lax.reduce_window(x.astype(jnp.float32), 0.0, lax.add, window, window, "VALID")
  return (total / jnp.float32(pool ** (x.ndim - 2))).astype(x.dtype)


def upsample(x: jax.Array, pool: int) -> jax.Array:
  """Each entry of ``x [N, *spatial, C]`` repeated ``pool`` times along each spatial axis."""
  for axis in range(1, x.ndim - 1):
    x = jnp.repeat(x, pool, axis=axis)
  return x


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _pooled(conv, pool, x, w):
  return conv(x, w)


def _pooled_fwd(conv, pool, x, w):
  return conv(x, w), (checkpoint_name(avg_pool(x, pool), names.COMPRESSED_IN), w)


def _pooled_bwd(conv, pool, residuals, dy):
  # Tied to dy, the repeated copy is made when the backward reaches it, not hoisted.
  residuals, dy = jax.lax.optimization_barrier((residuals, dy))
  pooled, w = residuals
  _, vjp = jax.vjp(conv, upsample(pooled, pool), w)
  return vjp(dy)


_pooled.defvjp(_pooled_fwd, _pooled_bwd)


def pooled_conv(x: jax.Array, w: jax.Array, window_strides=None, padding: Any = "SAME", *,
                pool: int = 2, dimension_numbers=None, **conv_kwargs) -> jax.Array:
  """`jax.lax.conv_general_dilated`, channels last, saving x average-pooled.

  A drop-in for Flax:
  ``nn.Conv(..., conv_general_dilated=functools.partial(pooled_conv, pool=2))``.

  Args:
    x: ``[N, *spatial, C_in]`` float16/bfloat16/float32; each spatial size a
      multiple of ``pool``.
    w: ``[*window, C_in, C_out]``.
    window_strides: strides per spatial axis; default 1.
    padding: as in `jax.lax.conv_general_dilated`.
    pool: the pooling window per spatial axis, >= 1 (1 saves x unchanged).
    dimension_numbers: None or channels-last (``("NHWC", "HWIO", "NHWC")`` in 2-D).
    **conv_kwargs: the other arguments of `jax.lax.conv_general_dilated`.

  Returns:
    The exact convolution ``[N, *spatial_out, C_out]``. Backward: the input
    gradient is exact; the weight gradient is taken at the pooled-then-repeated
    x (see the module docstring for the bound). Saves ``[N, *(s // pool), C_in]``
    in x's dtype (named ``compressed_in``) and w.
  """
  check_float_array(x)
  if not isinstance(pool, int) or isinstance(pool, bool) or pool < 1:
    raise ValueError(f"pool must be an int >= 1, got {pool!r}.")
  if x.ndim < 3 or any(s % pool for s in x.shape[1:-1]):
    raise ValueError(f"x must be [N, *spatial, C] with each spatial size a multiple of "
                     f"pool={pool}, got shape {x.shape}.")
  layout = _checked_layout(x, w, dimension_numbers)
  strides = (1,) * (x.ndim - 2) if window_strides is None else tuple(window_strides)
  padding = padding if isinstance(padding, str) else tuple(map(tuple, padding))
  conv = functools.partial(lax.conv_general_dilated, window_strides=strides, padding=padding,
                           dimension_numbers=layout, **conv_kwargs)
  return _pooled(conv, pool, x, w)
