"""Memory-sharing LayerNorm and RMSNorm, without affine parameters.

MS-BP (Yang et al., ICML 2024, arXiv:2406.16282): the exact backward of a
normalisation can be written with its output ``y`` and the per-row ``rstd``
instead of its input ``x``. When the next layer is a matmul, it saves ``y``
anyway, so the norm adds only one float32 per row. Any affine ``g, b`` of a
pretrained norm is folded into the next linear layer (`lowmem_jax.flax.affine_folding`).

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
def _ms_norm(spec, options, x):
  return _forward(spec, options, x)[0]


def _ms_norm_fwd(spec, options, x):
  y, rstd = _layout.barrier_rows(*_forward(spec, options, x))
  y = checkpoint_name(y, names.NORM_OUT)
  return y, (y, checkpoint_name(rstd, names.NORM_RSTD))


def _ms_norm_bwd(spec, options, res, dy):
  y, rstd = res
  if options is None:
    dx = reference.backward_reference(y, rstd, dy, centered=spec.centered, x_dtype=spec.x_dtype)
  else:
    dx = _kernels().backward(y, rstd, dy, centered=spec.centered, x_dtype=spec.x_dtype,
                          options=options)
  return (dx,)


_ms_norm.defvjp(_ms_norm_fwd, _ms_norm_bwd)


def _norm(centered: bool, x: jax.Array, eps: float, dtype, impl: str | None) -> jax.Array:
  check_float_array(x, "x")
  if not is_real(eps) or not eps > 0:
    raise ValueError(f"eps must be a number > 0, got {eps!r}.")
  x_dtype = jnp.dtype(x.dtype)
  spec = _Spec(centered, float(eps), x_dtype, check_out_dtype(dtype) or x_dtype)
  options = dispatch.kernel_options(impl, "ms_norm", lambda: _kernels().supports(x.shape[-1]))
  return _ms_norm(spec, options, x)


def ms_layer_norm(x: jax.Array, *, eps: float = 1e-6, dtype=None,
                  impl: str | None = None) -> jax.Array:
  """LayerNorm without affine whose backward needs only ``y`` and ``rstd``.

  Args:
    x: float16/bfloat16/float32 array ``[..., n]``, normalised over the last axis.
    eps: added to the (biased) variance.
    dtype: dtype of ``y``; defaults to x's. Give the dtype the next layer
      computes in, so that layer saves this very array.
    impl: "xla", "pallas", "pallas_interpret" or "auto" (`lowmem_jax.ops.dispatch`);
      ``None`` reads ``$LOWMEM_JAX_IMPL``, else "auto". The kernel takes rows
      of up to 16384 elements.

  Returns:
    ``y`` of x's shape. Saved for backward: ``y`` (``norm_out``) and
    ``float32[...]`` ``rstd`` (``norm_rstd``). The gradient is exact up to the
    rounding of the saved ``y`` to ``dtype`` (exact to float tolerance in float32).
  """
  return _norm(True, x, eps, dtype, impl)


def ms_rms_norm(x: jax.Array, *, eps: float = 1e-6, dtype=None,
                impl: str | None = None) -> jax.Array:
  """RMSNorm without affine whose backward needs only ``y`` and ``rstd``.

  Args:
    x: float16/bfloat16/float32 array ``[..., n]``, normalised over the last axis.
    eps: added to ``mean(x**2)``.
    dtype, impl: as `ms_layer_norm`'s.

  Returns:
    ``y`` of x's shape. Saved for backward: ``y`` (``norm_out``) and
    ``float32[...]`` ``rstd`` (``norm_rstd``), as `ms_layer_norm`.
  """
  return _norm(False, x, eps, dtype, impl)
