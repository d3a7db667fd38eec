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

import functools
import math
from typing import Callable, Sequence

import jax
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax import names
from lowmem_jax._checks import check_float_array
from lowmem_jax.ops import _activation_reference as reference, dispatch
from lowmem_jax.ops._activation_reference import Fit  # an activation's fit, public here

# Published fits (LowMemoryBP): sum(a) = 1 and sum(a * c) = 0.
REGELU2_A = (-0.04922261145617846, 1.0979632065417297, -0.048740595085551286)
REGELU2_C = (-3.1858810036855245, -0.001178821281161997, 3.190832613414926)
RESILU2_A = (-0.04060357190528599, 1.080925428529668, -0.040321856624382146)
RESILU2_C = (-6.3050461001646445, -0.0008684942046214787, 6.325815242089708)


def _kernels():
  """The Pallas kernels, imported where one runs: ``import lowmem_jax`` loads no Pallas."""
  from pallas_kernels import activations
  return activations


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _approx(fit: Fit, options, x: jax.Array) -> jax.Array:
  if options is None:
    return reference.forward_reference(fit, x)[0]  # XLA drops the unused code
  return _kernels().forward(fit, x, options)[0]


def _approx_fwd(fit, options, x):
  if options is None:
    y, packed = reference.forward_reference(fit, x)
  else:
    y, packed = _kernels().forward(fit, x, options)
  # Tied to y, the code is made before y's next use; alone, XLA may schedule it
  # at the end of the forward (only the backward reads it) and keep x alive.
  y, packed = jax.lax.optimization_barrier((y, packed))
  return y, checkpoint_name(packed, names.ACT_CODE)


def _approx_bwd(fit, options, packed, dy):
  if options is None:
    return (reference.backward_reference(fit, packed, dy),)
  return (_kernels().backward(fit, packed, dy, options),)


_approx.defvjp(_approx_fwd, _approx_bwd)


def approx_activation(
    fn: Callable[[jax.Array], jax.Array],
    a: Sequence[float],
    c: Sequence[float],
    *,
    kernel_fn: Callable[[jax.Array], jax.Array] | None = None,
) -> Callable[..., jax.Array]:
  """Builds an activation with exact forward ``fn`` and a step-function backward.

  Args:
    fn: the exact activation, applied in float32.
    a: slope increments ``a_1..a_K`` of the fit, ``1 <= K <= 3``.
    c: the kinks ``c_1 < .. < c_K`` of the fit.
    kernel_fn: ``fn`` written with ops Pallas' Triton lowering has, where
      ``fn`` uses one it lacks (``erfc``); ``None``: the kernel runs ``fn``.

  Returns:
    A function ``(x, *, impl=None) -> y`` on float16/bfloat16/float32 arrays
    of rank >= 1, ``y`` of x's shape and dtype, whose only residual for
    backward is a ``uint8[..., ceil(n * bits / 8)]`` code (``n = x.shape[-1]``;
    1 bit for one kink, 2 bits for two or three), tagged ``act_code``. ``impl``
    picks XLA or the fused Pallas kernel (`lowmem_jax.ops.dispatch`); both save
    the same code and return the same ``dx`` for the same ``dy``. The
    function's ``fit`` attribute is its `Fit`.
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
  if kernel_fn is not None and not callable(kernel_fn):
    raise TypeError(f"kernel_fn must be callable or None, got {type(kernel_fn).__name__}.")
  fit = Fit(fn, a, c, kernel_fn)

  def activation(x: jax.Array, *, impl: str | None = None) -> jax.Array:
    check_float_array(x, "x")
    return _approx(fit, dispatch.kernel_options(impl, "approx_activation"), x)

  activation.fit = fit
  return activation


def _gelu(x):
  return jax.nn.gelu(x, approximate=False)


regelu2 = approx_activation(_gelu, REGELU2_A, REGELU2_C, kernel_fn=reference.gelu)
regelu2.__name__ = regelu2.__qualname__ = "regelu2"
regelu2.__doc__ = """ReGELU2: exact (erf) GELU forward, 2-bit residual, step backward.

Args:
  x: float16/bfloat16/float32 array ``[..., n]``.
  impl: "xla", "pallas", "pallas_interpret" or "auto" (`lowmem_jax.ops.dispatch`);
    ``None`` reads ``$LOWMEM_JAX_IMPL``, else "auto".

Returns:
  ``gelu(x)`` of x's shape and dtype, computed in float32. Backward keeps only
  ``uint8[..., ceil(n / 4)]`` and returns ``dy * s[code]`` (LowMemoryBP's fit).
"""

resilu2 = approx_activation(jax.nn.silu, RESILU2_A, RESILU2_C)
resilu2.__name__ = resilu2.__qualname__ = "resilu2"
resilu2.__doc__ = """ReSiLU2: exact SiLU forward, 2-bit residual, step backward.

Args:
  x: float16/bfloat16/float32 array ``[..., n]``.
  impl: "xla", "pallas", "pallas_interpret" or "auto" (`lowmem_jax.ops.dispatch`);
    ``None`` reads ``$LOWMEM_JAX_IMPL``, else "auto".

Returns:
  ``silu(x)`` of x's shape and dtype, computed in float32. Backward keeps only
  ``uint8[..., ceil(n / 4)]`` and returns ``dy * s[code]`` (LowMemoryBP's fit).
"""

relu = approx_activation(jax.nn.relu, (1.0,), (0.0,))
relu.__name__ = relu.__qualname__ = "relu"
relu.__doc__ = """Exact ReLU whose only residual is a 1-bit mask, 8 a byte.

Args:
  x: float16/bfloat16/float32 array ``[..., n]``.
  impl: "xla", "pallas", "pallas_interpret" or "auto" (`lowmem_jax.ops.dispatch`);
    ``None`` reads ``$LOWMEM_JAX_IMPL``, else "auto".

Returns:
  ``relu(x)`` of x's shape and dtype. Backward keeps ``uint8[..., ceil(n / 8)]``
  and returns ``dy * (x > 0)``, which is ReLU's exact derivative.
"""


def _tanh_gelu(x):
  return jax.nn.gelu(x, approximate=True)


regelu2_tanh = approx_activation(_tanh_gelu, REGELU2_A, REGELU2_C)
regelu2_tanh.__name__ = regelu2_tanh.__qualname__ = "regelu2_tanh"
regelu2_tanh.__doc__ = """The tanh GELU (`jax.nn.gelu`'s default) forward with ReGELU2's backward.

What `lowmem_jax.lowmem` puts in place of a tanh GELU: the forward stays the
model's own; the backward is ReGELU2's step function, fitted to the erf GELU,
whose derivative differs from the tanh GELU's by less than 0.001.

Args:
  x: float16/bfloat16/float32 array ``[..., n]``.
  impl: "xla", "pallas", "pallas_interpret" or "auto" (`lowmem_jax.ops.dispatch`).

Returns:
  ``gelu(x, approximate=True)`` of x's shape and dtype, computed in float32.
  Backward keeps only ``uint8[..., ceil(n / 4)]`` and returns ``dy * s[code]``.
"""

