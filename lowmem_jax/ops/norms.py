"""Memory-sharing LayerNorm and RMSNorm, with or without their affine parameters.

MS-BP (Yang et al., ICML 2024, arXiv:2406.16282): the exact backward of a
normalisation can be written with its output ``y`` and the per-row ``rstd``
instead of its input ``x``. When the next layer is a matmul, it saves ``y``
anyway, so the norm adds only one float32 per row.

The paper folds a norm's affine ``g, b`` into the next linear layer
(`lowmem_jax.flax.affine_folding`), which trains another parameterisation (the
norm's scale no longer trains on its own). Given ``scale`` (and ``bias``), the
norm keeps them as parameters instead: ``z = y * scale + bias`` is what it
outputs and saves, and the backward recovers ``y = (z - bias) / scale`` from it:

    dscale = sum_rows(dz * y),  dbias = sum_rows(dz),  dy = dz * scale

exact up to the rounding of the saved ``z``. With a bias and a 16-bit output the
norm saves ``y`` itself instead (recovered from ``z``, ``y`` would lose |bias| / |scale|
of its ulps): exact, and no array shared with the next matmul. A scale entry that is
exactly 0 erases its feature of ``y`` from ``z``: that feature's gradients (of ``x``
and of the scale) are NaN, not a silent 0; every other is exact.

Per row of the last axis, statistics in float32, biased variance:

    LayerNorm: y = (x - mean(x)) * rstd,  rstd = 1 / sqrt(var(x) + eps)
               dx = rstd * (dy - mean(dy) - y * mean(dy * y))
    RMSNorm:   y = x * rstd,              rstd = 1 / sqrt(mean(x^2) + eps)
               dx = rstd * (dy - y * mean(dy * y))

The sharing is real only when the next layer consumes ``y`` as it is: emit the
dtype the next matmul computes in (``dtype=``), or a cast makes a second array.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax import names
from lowmem_jax._checks import check_float_array, check_out_dtype, is_real
from lowmem_jax.ops import _layout, _norm_reference as reference, dispatch


@dataclasses.dataclass(frozen=True)
class _Spec:
  centered: bool  # LayerNorm (True) or RMSNorm (False)
  eps: float
  x_dtype: jnp.dtype
  y_dtype: jnp.dtype


def _kernels():
  """The Pallas kernels, imported where one runs: ``import lowmem_jax`` loads no Pallas."""
  from pallas_kernels import norms
  return norms


def _forward(spec, options, x):
  if options is None:
    return reference.forward_reference(x, centered=spec.centered, eps=spec.eps,
                                       y_dtype=spec.y_dtype)
  return _kernels().forward(x, centered=spec.centered, eps=spec.eps, y_dtype=spec.y_dtype,
                         options=options)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ms_norm(spec, options, x, scale, bias):
  return _ms_norm_fwd(spec, options, x, scale, bias)[0]


def _row(p, like):
  """``p: [n]`` as float32 of ``like``'s rank, to scale its rows."""
  return jax.lax.broadcast_to_rank(p.astype(jnp.float32), like.ndim)


def _rank(mask, like):
  """``mask: bool[n]`` broadcast to ``like``'s rank."""
  return jax.lax.broadcast_to_rank(mask, like.ndim)


def _affine(y, scale, bias):
  """``y * scale + bias`` in float32, either of them None for none."""
  y = y.astype(jnp.float32)
  y = y if scale is None else y * _row(scale, y)
  return y if bias is None else y + _row(bias, y)


def _saves_y(spec, bias) -> bool:
  """Whether the norm saves ``y`` itself: with a bias and a 16-bit output, where ``z``'s
  rounding would cost ``y`` |bias| / |scale| of its ulps."""
  return bias is not None and spec.y_dtype.itemsize < 4


def _ms_norm_fwd(spec, options, x, scale, bias):
  if scale is None and bias is None:
    z, rstd = _forward(spec, options, x)
    saved = z
  else:
    y, rstd = _forward(dataclasses.replace(spec, y_dtype=jnp.dtype(jnp.float32)), options, x)
    z = _affine(y, scale, bias).astype(spec.y_dtype)
    saved = y.astype(spec.y_dtype) if _saves_y(spec, bias) else z
  own = saved is not z
  z, rstd, *rest = _layout.barrier_rows(z, rstd, *([saved] if own else []))
  z = checkpoint_name(z, names.NORM_OUT)
  return z, (rest[0] if own else z, checkpoint_name(rstd, names.NORM_RSTD), scale, bias)


def _sum_rows(a, dtype):
  """``a: float32[..., n]`` summed over every axis but the last, in ``dtype``."""
  return a.reshape(-1, a.shape[-1]).sum(0).astype(dtype)


def _recovered(spec, saved, scale, bias):
  """``(y, lost)``: the norm's output before its affine, from the saved array, float32;
  ``lost``: bool ``[n]``, the features a zero scale erased from ``z`` (their ``y`` is 0
  here: ``z - bias`` is), or None."""
  y = saved.astype(jnp.float32)
  if _saves_y(spec, bias):
    return y, None
  y = y if bias is None else y - _row(bias, y)
  if scale is None:
    return y, None
  lost = scale == 0  # there z - bias is exactly 0 (saved in float32, or without a bias)
  return y / _row(jnp.where(lost, jnp.ones_like(scale), scale), y), lost


def _ms_norm_bwd(spec, options, res, dz):
  saved, rstd, scale, bias = res
  y, dy, lost = saved, dz, None
  if scale is not None or bias is not None:
    y, lost = _recovered(spec, saved, scale, bias)
    dy = dz.astype(jnp.float32) * (1.0 if scale is None else _row(scale, y))
  if options is None:
    dx = reference.backward_reference(y, rstd, dy, centered=spec.centered, x_dtype=spec.x_dtype)
  else:
    dx = _kernels().backward(y, rstd, dy, centered=spec.centered, x_dtype=spec.x_dtype,
                          options=options)
  dz32 = dz.astype(jnp.float32)
  dscale = None if scale is None else _sum_rows(dz32 * y, scale.dtype)
  if lost is not None:  # a zero scale's feature of x and of the scale's gradient: not known
    dx = jnp.where(_rank(lost, dx), jnp.nan, dx).astype(dx.dtype)
    dscale = jnp.where(lost, jnp.nan, dscale).astype(dscale.dtype)
  return dx, dscale, None if bias is None else _sum_rows(dz32, bias.dtype)


_ms_norm.defvjp(_ms_norm_fwd, _ms_norm_bwd)


def _check_affine(p, name: str, n: int) -> None:
  if p is None:
    return
  check_float_array(p, name)
  if p.shape != (n,):
    raise ValueError(f"{name} must have shape ({n},), x's last axis, got {p.shape}.")


def _norm(centered: bool, x: jax.Array, eps: float, dtype, impl: str | None, scale=None,
          bias=None) -> jax.Array:
  check_float_array(x, "x")
  if not is_real(eps) or not eps > 0:
    raise ValueError(f"eps must be a number > 0, got {eps!r}.")
  _check_affine(scale, "scale", x.shape[-1])
  _check_affine(bias, "bias", x.shape[-1])
  x_dtype = jnp.dtype(x.dtype)
  spec = _Spec(centered, float(eps), x_dtype, check_out_dtype(dtype) or x_dtype)
  options = dispatch.kernel_options(impl, "ms_norm", lambda: _kernels().supports(x.shape[-1]))
  return _ms_norm(spec, options, x, scale, bias)


def ms_layer_norm(x: jax.Array, scale: jax.Array | None = None, bias: jax.Array | None = None,
                  *, eps: float = 1e-6, dtype=None, impl: str | None = None) -> jax.Array:
  """LayerNorm, optionally with its affine, whose backward needs only its output and ``rstd``.

  Args:
    x: float16/bfloat16/float32 array ``[..., n]``, normalised over the last axis.
    scale, bias: optional float ``[n]``: ``z = y * scale + bias``, both trained (their
      gradients are returned); None for none.
    eps: added to the (biased) variance.
    dtype: dtype of the output; defaults to x's. Give the dtype the next layer
      computes in, so that layer saves this very array.
    impl: "xla", "pallas", "pallas_interpret" or "auto" (`lowmem_jax.ops.dispatch`);
      ``None`` reads ``$LOWMEM_JAX_IMPL``, else "auto". The kernel takes rows
      of up to 16384 elements.

  Returns:
    ``z`` (``y`` without affine) of x's shape. Saved for backward: ``z``
    (``norm_out``) and ``float32[...]`` ``rstd`` (``norm_rstd``). The gradients are
    exact up to the rounding of the saved ``z`` to ``dtype`` (exact to float
    tolerance in float32); NaN where a scale entry is exactly 0 (see the module).
  """
  return _norm(True, x, eps, dtype, impl, scale, bias)


def ms_rms_norm(x: jax.Array, scale: jax.Array | None = None, *, eps: float = 1e-6,
                dtype=None, impl: str | None = None) -> jax.Array:
  """RMSNorm, optionally with its scale, whose backward needs only its output and ``rstd``.

  Args:
    x: float16/bfloat16/float32 array ``[..., n]``, normalised over the last axis.
    scale: optional float ``[n]``, trained: ``z = y * scale``; None for none.
    eps: added to ``mean(x**2)``.
    dtype, impl: as `ms_layer_norm`'s.

  Returns:
    ``z`` of x's shape. Saved for backward: ``z`` (``norm_out``) and
    ``float32[...]`` ``rstd`` (``norm_rstd``), as `ms_layer_norm`.
  """
  return _norm(False, x, eps, dtype, impl, scale)
