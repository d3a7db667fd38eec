"""The element arithmetic of 8-bit moments, bfloat16 stochastic rounding and Adam, in pure
JAX: what `lowmem_jax.optim.lowbit` and `lowmem_jax.optim.rounding` compute with XLA, and
what the fused update kernel (`pallas_kernels.adam8bit`) computes in a program, so the two
are one arithmetic. Codes are those `lowmem_jax.optim.lowbit`'s docstring describes. This
module imports no kernel.
"""

from typing import Any

import jax
import jax.numpy as jnp
from optax import tree_utils as otu

MANTISSA = 3
EXP_BITS = {True: 4, False: 5}  # signed, unsigned


def abs_max(blocks: jax.Array) -> jax.Array:
  """float32 ``blocks [..., block]``'s absolute maximum along the last axis, NaN where a block
  holds a NaN on every backend (XLA:CPU's float max may drop one). One integer max reduction
  over the bits with the sign cleared: they order as the magnitudes do, and NaN's above
  infinity's."""
  magnitudes = jax.lax.bitcast_convert_type(blocks, jnp.uint32) & jnp.uint32(0x7FFFFFFF)
  return jax.lax.bitcast_convert_type(jnp.max(magnitudes, axis=-1), jnp.float32)


def rounded(bits: jax.Array, dropped: int, noise: jax.Array | None) -> jax.Array:
  """float32 ``bits`` (uint32) plus the offset that makes dropping their low ``dropped`` bits
  round: half a unit of the kept last bit (to nearest, ties away from zero) or, with
  uniform ``noise`` (uint32, ``bits``' shape), uniform bits below it (stochastically). A
  carry bumps the exponent."""
  if noise is None:
    return bits + (1 << (dropped - 1))
  return bits + (noise >> (32 - dropped))


def codes(blocks: jax.Array, scales: jax.Array, noise: jax.Array | None, *,
          signed: bool) -> jax.Array:
  """uint8 codes of float32 ``blocks [..., block]`` in blocks of ``scales [...]`` (float32),
  rounded with ``noise`` (uint32, ``blocks``' shape; None: to nearest): `lowmem_jax.optim.lowbit.quantize`'s."""
  # Clipped: scales made in another pass of the same arithmetic may differ in the last bit.
  unit = jnp.clip(blocks / jnp.where(scales > 0, scales, 1.0)[..., None], -1.0, 1.0)
  magnitude = jax.lax.bitcast_convert_type(jnp.abs(unit), jnp.uint32)
  bits = rounded(magnitude, 23 - MANTISSA, noise)
  exp_bits = EXP_BITS[signed]
  exponent = (bits >> 23).astype(jnp.int32) - 127 + (2 ** exp_bits - 1)
  mantissa = ((bits >> (23 - MANTISSA)) & (2 ** MANTISSA - 1)).astype(jnp.int32)
  code = jnp.where(exponent >= 1, (exponent << MANTISSA) | mantissa, 0)
  if signed:
    code = code | jnp.where(unit < 0, 1 << 7, 0)
  else:
    code = jnp.where(unit > 0, jnp.maximum(code, 1 << MANTISSA), 0)
  return code.astype(jnp.uint8)


def decoded(code: jax.Array, *, signed: bool) -> jax.Array:
  """float32 values over their block's scale of uint32 ``code``:
  `lowmem_jax.optim.lowbit.dequantize`'s."""
  exponent = (code >> MANTISSA) & (2 ** EXP_BITS[signed] - 1)
  mantissa = code & (2 ** MANTISSA - 1)
  # (1 + f/8) 2^(e - bias) built as float32 bits: no exp2, which XLA will not compute twice.
  bits = ((exponent + (127 - (2 ** EXP_BITS[signed] - 1))) << 23) | (mantissa << (23 - MANTISSA))
  magnitude = jnp.where(exponent > 0, jax.lax.bitcast_convert_type(bits, jnp.float32), 0.0)
  return jnp.where(code >= 1 << 7, -magnitude, magnitude) if signed else magnitude


def bfloat16_of(x: jax.Array, noise: jax.Array) -> jax.Array:
  """float32 ``x`` in bfloat16, rounded stochastically with ``noise`` (uint32, ``x``'s
  shape): `lowmem_jax.optim.rounding.stochastic_round`'s."""
  bits = rounded(jax.lax.bitcast_convert_type(x, jnp.uint32), 16, noise)
  value = jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16)
  return jnp.where(jnp.isnan(x), jnp.asarray(jnp.nan, jnp.bfloat16), value)


def rounded_update(u: jax.Array, p: jax.Array, noise: jax.Array) -> jax.Array:
  """The float32 update that takes bfloat16 ``p`` to ``p + u`` (``u`` float) rounded
  stochastically with ``noise`` (uint32, ``p``'s shape) under ``optax.apply_updates``:
  `lowmem_jax.optim.rounding.stochastic_rounding`'s for each leaf."""
  p32 = p.astype(jnp.float32)
  new = bfloat16_of(p32 + u.astype(jnp.float32), noise).astype(jnp.float32)
  return jnp.where(new == p32, 0.0, new - p32)  # an infinite parameter stays


def adam_moments(mu: Any, nu: Any, grads: Any, *, b1: Any, b2: Any) -> tuple[Any, Any]:
  """Adam's new moments, ``b1 mu + (1 - b1) g`` and ``b2 nu + (1 - b2) g^2``, of float32
  moments and a gradient of any float dtype taken in float32 (trees alike): a bfloat16
  gradient's ``1 - b1`` would otherwise be rounded to bfloat16 (0.1001 for 0.1)."""
  grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
  return (otu.tree_update_moment(grads, mu, b1, 1),
          otu.tree_update_moment_per_elem_norm(grads, nu, b2, 2))


def adam_step(mu_hat: jax.Array, nu_hat: jax.Array, *, eps: Any, eps_root: Any) -> jax.Array:
  """Adam's direction of bias-corrected moments:
  ``mu_hat / (sqrt(nu_hat + eps_root) + eps)``."""
  return mu_hat / (jnp.sqrt(nu_hat + eps_root) + eps)
