"""The piecewise-linear fit of an approximate activation, and its pure-JAX forward and backward.

Approx-BP (Yang et al., ICML 2024, arXiv:2406.16282). For a fit with kinks
``c_1 < .. < c_K`` and slope increments ``a_1..a_K``:

    forward:  y = fn(x) (float32, cast to x.dtype),
              code = [x > c_1] + .. + [x > c_K], packed ``8 // bits`` a byte
    backward: dx = dy * s[code],  s = (0, a_1, a_1 + a_2, ..)   (float32)

`forward_reference` and `backward_reference` are what `lowmem_jax.ops.activations`
runs under ``impl="xla"``, and what the fused kernels of
`pallas_kernels.activations` are tested against. This module imports no kernel.
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from lowmem_jax.ops._packing import pack_reference, unpack_reference


@dataclasses.dataclass(frozen=True)
class Fit:
  """A piecewise-linear fit of an activation: slope increments ``a`` at kinks ``c``.

  Hashable (a static argument of kernels and ``custom_vjp``).

  Attributes:
    fn: the exact activation, applied in float32.
    a: slope increments ``a_1..a_K``, ``1 <= K <= 3``.
    c: kinks ``c_1 < .. < c_K``.
    kernel_fn: ``fn`` as the kernel computes it, where ``fn`` uses an op
      Pallas' Triton lowering lacks (GELU's ``erfc``); ``None``: ``fn``.
  """
  fn: Callable[[jax.Array], jax.Array]
  a: tuple[float, ...]
  c: tuple[float, ...]
  kernel_fn: Callable[[jax.Array], jax.Array] | None = None

  @property
  def bits(self) -> int:
    """Bits a code: 1 for one kink, 2 for two or three."""
    return 1 if len(self.c) == 1 else 2

  def code(self, x: jax.Array) -> jax.Array:
    """int32 code of each element: how many kinks lie below it (compared in float32)."""
    x = x.astype(jnp.float32)
    return sum((x > jnp.float32(ci)).astype(jnp.int32) for ci in self.c)

  def slope(self, code: jax.Array) -> jax.Array:
    """float32 ``s[code] = a_1 + .. + a_code``, elementwise (no gather)."""
    return sum(jnp.where(code > i, jnp.float32(ai), jnp.float32(0)) for i, ai in enumerate(self.a))


def gelu(x: jax.Array) -> jax.Array:
  """Exact (erf) GELU of float32 ``x`` from ``exp`` alone, for kernels.

  ``gelu(x) = x / 2 * erfc(-x / sqrt(2))``, with ``erfc`` from Press et al.'s
  Chebyshev fit (Numerical Recipes, 2nd ed., section 6.2, ``erfcc``), whose
  relative error is below 1.2e-7 in exact arithmetic. In float32 the rounding
  of ``exp``'s argument dominates for large ``|x|``, as in XLA's GELU; the
  tests hold it within 2e-5 relative of `jax.nn.gelu` on [-12, 12].
  """
  z = -x * jnp.float32(0.7071067811865476)
  t = 1 / (1 + 0.5 * jnp.abs(z))
  poly = jnp.float32(0.17087277)
  for coef in (-0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806, 0.09678418,
               0.37409196, 1.00002368, -1.26551223):
    poly = poly * t + jnp.float32(coef)
  tail = t * jnp.exp(poly - z * z)
  return 0.5 * x * jnp.where(z >= 0, tail, 2 - tail)


def forward_reference(fit: Fit, x: jax.Array):
  """The forward in pure JAX: ``(fn(x) in x's dtype, uint8 packed code)``."""
  y = fit.fn(x.astype(jnp.float32)).astype(x.dtype)
  return y, pack_reference(fit.code(x), fit.bits)


def backward_reference(fit: Fit, packed: jax.Array, dy: jax.Array) -> jax.Array:
  """The backward in pure JAX: ``dy * s[code]`` in float32, cast to dy's dtype."""
  slope = fit.slope(unpack_reference(packed, fit.bits, dy.shape[-1]))
  return (dy.astype(jnp.float32) * slope).astype(dy.dtype)
