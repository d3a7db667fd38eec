"""Fused activation kernels: one pass writes ``y`` and the packed residual code.

Approx-BP (Yang et al., ICML 2024, arXiv:2406.16282). The fit (`Fit`, and
`gelu` as kernels compute it) and the pure-JAX twins the kernels are tested
against, `forward_reference` and `backward_reference`, are the library's
(`lowmem_jax.ops._activation_reference`, which gives the formulas; re-exported
here).

The forward kernel reads ``x`` once and writes ``y`` and the packed code; the
backward kernel reads ``dy`` and the packed code and writes ``dx``. Both see
rows as ``[n / P, P]`` groups (`pack.grouped`), so packing is a reduction over
the minor axis inside the program.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lowmem_jax.ops._activation_reference import Fit, backward_reference, forward_reference, gelu
from pallas_kernels import _blocks, pack

__all__ = ["Fit", "backward", "backward_reference", "forward", "forward_reference", "gelu"]


def _forward_kernel(x_ref, y_ref, packed_ref, *, fit, shape):
  at = (pl.program_id(0), pl.program_id(1), 0)
  x = _blocks.load(x_ref, shape, at).astype(jnp.float32)
  _blocks.store(y_ref, (fit.kernel_fn or fit.fn)(x).astype(y_ref.dtype), shape, at)
  _blocks.store(packed_ref, pack.codes_to_bytes(fit.code(x), fit.bits), shape[:2], at[:2])


def _backward_kernel(packed_ref, dy_ref, dx_ref, *, fit, shape):
  at = (pl.program_id(0), pl.program_id(1), 0)
  slope = fit.slope(pack.bytes_to_codes(_blocks.load(packed_ref, shape[:2], at[:2]), fit.bits))
  dy = _blocks.load(dy_ref, shape, at).astype(jnp.float32)
  _blocks.store(dx_ref, (dy * slope).astype(dx_ref.dtype), shape, at)


@functools.partial(jax.jit, static_argnames=("fit", "options"))
def forward(fit: Fit, x: jax.Array, options: _blocks.Options = _blocks.Options()):
  """Fused forward: ``y = fn(x)`` and its packed code in one kernel.

  Args:
    fit: the activation and its fit.
    x: float16/bfloat16/float32 ``[..., n]``. Where ``8 // fit.bits`` divides
      ``n`` the kernel reads ``x`` once; otherwise it works on a copy padded
      with ``-inf`` and ``y`` is sliced back, two more passes.
    options: interpret mode and tuning.

  Returns:
    ``(y, packed)``: ``y`` of x's shape and dtype, ``packed`` of
    ``uint8[..., ceil(n * bits / 8)]``; equal to `forward_reference`.
  """
  size = pack.packed_size(x.shape[-1], fit.bits)
  if x.size == 0:
    return forward_reference(fit, x)
  # -inf pads: no kink lies below it, so padding codes are 0, as the layout says.
  view = pack.grouped(x, fit.bits, fill=-jnp.inf)
  grid, grouped_spec, bytes_spec = pack.byte_grid(view.shape[0], size, fit.bits, options)
  y, packed = _blocks.pallas_call(
      functools.partial(_forward_kernel, fit=fit, shape=view.shape),
      out_shape=(jax.ShapeDtypeStruct(view.shape, x.dtype),
                 jax.ShapeDtypeStruct(view.shape[:2], jnp.uint8)),
      grid=grid, in_specs=[grouped_spec], out_specs=(grouped_spec, bytes_spec),
      interpret=options.interpret, compiler_params=options.compiler_params(),
      name="lowmem_approx_activation_fwd")(view)
  return pack.ungrouped(y, x.shape), packed.reshape(x.shape[:-1] + (size,))


@functools.partial(jax.jit, static_argnames=("fit", "options"))
def backward(fit: Fit, packed: jax.Array, dy: jax.Array,
             options: _blocks.Options = _blocks.Options()) -> jax.Array:
  """Fused backward: ``dx = dy * s[code]`` from the packed code, in dy's dtype.

  Args:
    fit: the activation and its fit.
    packed: ``uint8[..., ceil(n * bits / 8)]`` from `forward`.
    dy: float16/bfloat16/float32 ``[..., n]``.
    options: interpret mode and tuning.

  Returns:
    ``dx`` of dy's shape and dtype; equal to `backward_reference`.
  """
  pack.check_packed(packed, fit.bits, dy.shape[-1])
  if dy.size == 0:
    return backward_reference(fit, packed, dy)
  view = pack.grouped(dy, fit.bits)
  rows, size = view.shape[:2]
  grid, grouped_spec, bytes_spec = pack.byte_grid(rows, size, fit.bits, options)
  dx = _blocks.pallas_call(
      functools.partial(_backward_kernel, fit=fit, shape=view.shape),
      out_shape=jax.ShapeDtypeStruct(view.shape, dy.dtype),
      grid=grid, in_specs=[bytes_spec, grouped_spec], out_specs=grouped_spec,
      interpret=options.interpret, compiler_params=options.compiler_params(),
      name="lowmem_approx_activation_bwd")(packed.reshape(rows, size), view)
  return pack.ungrouped(dx, dy.shape)
