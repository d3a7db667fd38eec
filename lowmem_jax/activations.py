"""Activations with exact forward and a 1- or 2-bit residual for backward.

Approx-BP (Yang et al., "Reducing Fine-Tuning Memory Overhead by Approximate
and Memory-Sharing Backpropagation", ICML 2024, arXiv:2406.16282): the forward
is the exact activation; the backward uses the derivative of a piecewise-linear
fit ``h(x) = sum_i a_i * relu(x - c_i)``, a step function, so backward only
needs which interval each input fell into: a code in ``{0, .., K}`` for ``K``
kinks, packed along the last axis (2 bits for 2-3 kinks, 1 bit for one).

    y  = fn(x)                                   (float32, cast to x.dtype)
    code = [x > c_1] + ... + [x > c_K]
    dx = dy * s[code],  s = (0, a_1, a_1 + a_2, ..., a_1 + ... + a_K)
"""

import dataclasses
import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax import names
from lowmem_jax._checks import check_float_array
from pallas_kernels import pack

# Published fits (LowMemoryBP): sum(a) = 1 and sum(a * c) = 0.
REGELU2_A = (-0.04922261145617846, 1.0979632065417297, -0.048740595085551286)
REGELU2_C = (-3.1858810036855245, -0.001178821281161997, 3.190832613414926)
RESILU2_A = (-0.04060357190528599, 1.080925428529668, -0.040321856624382146)
RESILU2_C = (-6.3050461001646445, -0.0008684942046214787, 6.325815242089708)


@dataclasses.dataclass(frozen=True)
class _Fit:
  """A hashable piecewise-linear fit: slope increments ``a`` at kinks ``c``."""
  fn: Callable[[jax.Array], jax.Array]
  a: tuple[float, ...]
  c: tuple[float, ...]

  @property
  def bits(self) -> int:
    return 1 if len(self.c) == 1 else 2

  def code(self, x: jax.Array) -> jax.Array:
    """``uint8`` code of each element: how many kinks lie below it.

    Compared in float32, so the kinks are not rounded to x's dtype.
    """
    x = x.astype(jnp.float32)
    return sum((x > jnp.float32(ci)).astype(jnp.uint8) for ci in self.c)

  def slope(self, code: jax.Array) -> jax.Array:
    """``float32`` ``s[code] = a_1 + .. + a_code``, elementwise (no gather)."""
    return sum(jnp.where(code > i, jnp.float32(ai), jnp.float32(0)) for i, ai in enumerate(self.a))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _approx(fit: _Fit, x: jax.Array) -> jax.Array:
  return fit.fn(x.astype(jnp.float32)).astype(x.dtype)


def _approx_fwd(fit, x):
  packed = pack.pack(fit.code(x), fit.bits)
  return _approx(fit, x), checkpoint_name(packed, names.ACT_CODE)


def _approx_bwd(fit, packed, dy):
  slope = fit.slope(pack.unpack(packed, fit.bits, dy.shape[-1]))
  return ((dy.astype(jnp.float32) * slope).astype(dy.dtype),)


_approx.defvjp(_approx_fwd, _approx_bwd)


def approx_activation(
    fn: Callable[[jax.Array], jax.Array],
    a: Sequence[float],
    c: Sequence[float],
) -> Callable[[jax.Array], jax.Array]:
  """Builds an activation with exact forward ``fn`` and a step-function backward.

  Args:
    fn: the exact activation, applied in float32.
    a: slope increments ``a_1..a_K`` of the fit, ``1 <= K <= 3``.
    c: the kinks ``c_1 < .. < c_K`` of the fit.

  Returns:
    A function ``x -> y`` on float16/bfloat16/float32 arrays of rank >= 1,
    ``y`` of x's shape and dtype, whose only residual for backward is a
    ``uint8[..., ceil(n * bits / 8)]`` code (``n = x.shape[-1]``; 1 bit for
    one kink, 2 bits for two or three), tagged ``act_code``.
  """
  if not callable(fn):
    raise TypeError(f"fn must be callable, got {type(fn).__name__}.")
  try:
    a = tuple(float(v) for v in a)
    c = tuple(float(v) for v in c)
  except TypeError as e:
    raise TypeError(f"a and c must be sequences of numbers, got a={a!r}, c={c!r}.") from e
  if not all(math.isfinite(v) for v in a + c):
    raise ValueError(f"a and c must be finite, got a={a}, c={c}.")
  if not 1 <= len(a) <= 3 or len(a) != len(c):
    raise ValueError(
        f"a and c must have the same length, between 1 and 3 (kinks), got "
        f"len(a)={len(a)} and len(c)={len(c)}.")
  if any(c1 >= c2 for c1, c2 in zip(c, c[1:])):
    raise ValueError(f"c must be strictly increasing, got {c}.")
  fit = _Fit(fn, a, c)

  def activation(x: jax.Array) -> jax.Array:
    check_float_array(x, "x")
    return _approx(fit, x)

  return activation


def _gelu(x):
  return jax.nn.gelu(x, approximate=False)


regelu2 = approx_activation(_gelu, REGELU2_A, REGELU2_C)
regelu2.__name__ = "regelu2"
regelu2.__doc__ = """ReGELU2: exact (erf) GELU forward, 2-bit residual, step backward.

Args:
  x: float16/bfloat16/float32 array ``[..., n]``.

Returns:
  ``gelu(x)`` of x's shape and dtype, computed in float32. Backward keeps only
  ``uint8[..., ceil(n / 4)]`` and returns ``dy * s[code]`` (LowMemoryBP's fit).
"""

resilu2 = approx_activation(jax.nn.silu, RESILU2_A, RESILU2_C)
resilu2.__name__ = "resilu2"
resilu2.__doc__ = """ReSiLU2: exact SiLU forward, 2-bit residual, step backward.

Args:
  x: float16/bfloat16/float32 array ``[..., n]``.

Returns:
  ``silu(x)`` of x's shape and dtype, computed in float32. Backward keeps only
  ``uint8[..., ceil(n / 4)]`` and returns ``dy * s[code]`` (LowMemoryBP's fit).
"""

relu = approx_activation(jax.nn.relu, (1.0,), (0.0,))
relu.__name__ = "relu"
relu.__doc__ = """Exact ReLU whose only residual is a 1-bit mask, 8 a byte.

Args:
  x: float16/bfloat16/float32 array ``[..., n]``.

Returns:
  ``relu(x)`` of x's shape and dtype. Backward keeps ``uint8[..., ceil(n / 8)]``
  and returns ``dy * (x > 0)``, which is ReLU's exact derivative.
"""
