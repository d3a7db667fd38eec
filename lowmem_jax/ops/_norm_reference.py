"""MS-LayerNorm and MS-RMSNorm without affine, forward and backward in pure JAX.

MS-BP (Yang et al., ICML 2024, arXiv:2406.16282). Per row of the last axis,
statistics in float32, biased variance:

    LayerNorm: y = (x - mean(x)) * rstd,  rstd = 1 / sqrt(var(x) + eps)
               dx = rstd * (dy - mean(dy) - y * mean(dy * y))
    RMSNorm:   y = x * rstd,              rstd = 1 / sqrt(mean(x^2) + eps)
               dx = rstd * (dy - y * mean(dy * y))

`forward_reference` and `backward_reference` are what `lowmem_jax.ops.norms` runs
under ``impl="xla"``, and what the kernels of `pallas_kernels.norms` are
tested against. This module imports no kernel.
"""

import jax
import jax.numpy as jnp


def forward_reference(x: jax.Array, *, centered: bool, eps: float, y_dtype=None):
  """The forward in pure JAX: ``(y in y_dtype, float32 rstd [...])``."""
  x32 = x.astype(jnp.float32)
  if centered:
    x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.maximum(jnp.mean(jnp.square(x32), axis=-1, keepdims=True), 0.0)
  rstd = jax.lax.rsqrt(var + eps)
  return (x32 * rstd).astype(y_dtype or x.dtype), rstd[..., 0]


def backward_reference(y: jax.Array, rstd: jax.Array, dy: jax.Array, *, centered: bool,
                       x_dtype=None) -> jax.Array:
  """The backward in pure JAX: ``rstd * (dy [- mean(dy)] - y * mean(dy * y))`` in float32."""
  dy32 = dy.astype(jnp.float32)
  y32 = y.astype(jnp.float32)
  g = dy32 - y32 * jnp.mean(dy32 * y32, axis=-1, keepdims=True)
  if centered:
    g = g - jnp.mean(dy32, axis=-1, keepdims=True)
  return (rstd[..., None] * g).astype(x_dtype or dy.dtype)
