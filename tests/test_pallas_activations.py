"""The fused activation kernels against their pure-JAX reference (interpret mode on CPU)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowmem_jax as lm
from pallas_kernels import _blocks, activations as kernels

FNS = {"regelu2": lm.regelu2, "resilu2": lm.resilu2, "relu": lm.relu}
FITS = {name: fn.fit for name, fn in FNS.items()}
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
INTERPRET = _blocks.Options(interpret=True)
SMALL_BLOCKS = _blocks.Options(interpret=True, block_rows=2, block_cols=2)
# Ranks 1 to 4, last axes that 4 and 8 do not divide, size 0, batch dims of 1.
SHAPES = [(0,), (1,), (7,), (3, 9), (4, 0), (2, 3, 16), (1, 5, 13), (1, 1, 2, 6), (2, 1, 1, 33)]
# The kernels are shape-generic in their dtype: every shape in float32, each 16-bit dtype on
# the last (interpret mode is slow on CPU: the full product was a sixth of the suite's items).
CASES = [(jnp.float32, shape) for shape in SHAPES] + [(dtype, SHAPES[-1]) for dtype in DTYPES[1:]]


def _x(shape, dtype, seed=0):
  return (4 * jax.random.normal(jax.random.key(seed), shape)).astype(dtype)


def _assert_y_close(y, y_ref):
  """Kernel and XLA round the same float32 activation: float32 to 1e-5, else 1 ulp."""
  assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
  rtol = 1e-5 if y.dtype == jnp.float32 else float(jnp.finfo(y.dtype).eps)
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32),
                             rtol=rtol, atol=1e-30)


@pytest.mark.slow
@pytest.mark.parametrize("options", [INTERPRET, SMALL_BLOCKS], ids=["default", "small_blocks"])
@pytest.mark.parametrize(("dtype", "shape"), CASES)
@pytest.mark.parametrize("name", FITS)
def test_kernels_match_reference(name, dtype, shape, options):
  fit = FITS[name]
  x, dy = _x(shape, dtype), _x(shape, dtype, seed=1)
  y, packed = kernels.forward(fit, x, options)
  y_ref, packed_ref = kernels.forward_reference(fit, x)
  _assert_y_close(y, y_ref)
  assert packed.dtype == jnp.uint8 and packed.shape == packed_ref.shape
  np.testing.assert_array_equal(packed, packed_ref)
  dx = kernels.backward(fit, packed, dy, options)
  assert dx.dtype == dtype
  np.testing.assert_array_equal(dx, kernels.backward_reference(fit, packed_ref, dy))


def test_kernel_spans_column_blocks_with_default_blocks():
  fit = FITS["regelu2"]
  x = _x((3, 4100), jnp.bfloat16)  # 1025 bytes of codes a row, over the 1024-byte block
  np.testing.assert_array_equal(kernels.forward(fit, x, INTERPRET)[1],
                                kernels.forward_reference(fit, x)[1])


def test_backward_checks_packed():
  fit, dy = FITS["regelu2"], _x((2, 8), jnp.float32)
  with pytest.raises(TypeError, match="packed must be uint8"):
    kernels.backward(fit, jnp.zeros((2, 2), jnp.int32), dy, INTERPRET)
  with pytest.raises(ValueError, match="packed's last axis"):
    kernels.backward(fit, jnp.zeros((2, 3), jnp.uint8), dy, INTERPRET)


def test_kernel_gelu_matches_erfc_gelu():
  x = jnp.linspace(-12, 12, 20001, dtype=jnp.float32)
  np.testing.assert_allclose(kernels.gelu(x), jax.nn.gelu(x, approximate=False),
                             rtol=2e-5, atol=1e-37)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FNS)
def test_public_function_same_code_and_gradient(name, dtype):
  fn = FNS[name]
  x, dy = _x((2, 3, 10), dtype), _x((2, 3, 10), dtype, seed=1)
  y, vjp = jax.vjp(lambda x: fn(x, impl="pallas_interpret"), x)
  y_ref, vjp_ref = jax.vjp(lambda x: fn(x, impl="xla"), x)
  _assert_y_close(y, y_ref)
  np.testing.assert_array_equal(vjp(dy)[0], vjp_ref(dy)[0])
  # The kernel path saves the one residual the XLA path saves: the packed code.
  saved = lm.memory.saved_residuals(
      lambda x: fn(x, impl="pallas_interpret").astype(jnp.float32).sum(), x)
  assert [(r.shape, r.dtype, r.name) for r in saved.rows] == [
      ((2, 3, (10 * FITS[name].bits + 7) // 8), np.uint8, lm.names.ACT_CODE)]


@pytest.mark.slow
@pytest.mark.parametrize("name", FNS)
def test_transformations(name):
  """jit, vmap, grad, checkpoint and scan over the kernel path give XLA's gradients."""
  fn = FNS[name]
  x = _x((3, 4, 12), jnp.float32)

  def loss(impl):
    def per_example(x):
      h = jax.checkpoint(lambda x: fn(x, impl=impl))(x)
      def body(carry, row):
        return jnp.tanh(fn(row + carry, impl=impl)), None
      return jnp.sum(jax.lax.scan(body, jnp.zeros(h.shape[-1]), h)[0])
    return lambda x: jnp.sum(jax.vmap(per_example)(x))

  grads = jax.jit(jax.grad(loss("pallas_interpret")))(x)
  chex.assert_trees_all_close(grads, jax.grad(loss("xla"))(x), rtol=1e-5)
  jaxpr = str(jax.make_jaxpr(jax.grad(loss("pallas_interpret")))(x))
  assert "lowmem_approx_activation_fwd" in jaxpr and "lowmem_approx_activation_bwd" in jaxpr


@pytest.mark.slow
@pytest.mark.parametrize("target", ["h100", "a100-80gb"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FITS)
def test_kernels_compile_for_gpu_targets(name, dtype, target):
  """Both kernels compile through Triton and ptxas for sm_90a and sm_80, here without a GPU."""
  fit, target = FITS[name], lm.targets.get(target)
  x = jax.ShapeDtypeStruct((64, 197, 3072), dtype)
  packed = jax.ShapeDtypeStruct((64, 197, 3072 * fit.bits // 8), jnp.uint8)
  for compiled in (target.compile(lambda x: kernels.forward(fit, x), x),
                   target.compile(lambda p, dy: kernels.backward(fit, p, dy), packed, x)):
    assert 'custom_call_target="__gpu$xla.gpu.triton"' in compiled.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8, 197, 3072 + 3), (3, 197, 1000)])  # blocks overhang
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FNS)
def test_on_gpu_same_code_and_gradient(name, dtype, shape):
  fn = FNS[name]
  x, dy = _x(shape, dtype), _x(shape, dtype, seed=1)
  y, vjp = jax.vjp(lambda x: fn(x, impl="pallas"), x)
  y_ref, vjp_ref = jax.vjp(lambda x: fn(x, impl="xla"), x)
  _assert_y_close(y, y_ref)
  np.testing.assert_array_equal(vjp(dy)[0], vjp_ref(dy)[0])


def test_no_recompilation():
  """A second call with the same shapes reuses the compiled kernels."""
  fn = jax.jit(jax.grad(lambda x: jnp.sum(lm.regelu2(x, impl="pallas_interpret"))))
  x = _x((4, 12), jnp.float32)
  fn(x)
  sizes = fn._cache_size(), kernels.forward._cache_size(), kernels.backward._cache_size()
  fn(x + 1)
  assert (fn._cache_size(), kernels.forward._cache_size(),
          kernels.backward._cache_size()) == sizes
