"""The MS-norm kernels against their pure-JAX reference (interpret mode on CPU)."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowmem_jax as lm
from lowmem_jax.compile.memory import step_time
from pallas_kernels import _blocks, norms as kernels

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
INTERPRET = _blocks.Options(interpret=True)
SMALL_BLOCKS = _blocks.Options(interpret=True, block_rows=2)
# Ranks 1 to 4, rows that are no power of two, size 0, batch dims of 1.
SHAPES = [(0,), (1,), (7,), (3, 9), (4, 0), (0, 5), (2, 3, 16), (1, 5, 13), (1, 1, 3, 768)]
# The kernels are shape-generic in their dtype: every shape in float32, each 16-bit dtype on
# the last (interpret mode is slow on CPU).
CASES = [(jnp.float32, shape) for shape in SHAPES] + [(dtype, SHAPES[-1]) for dtype in DTYPES[1:]]
NORMS = {"layer": lm.ms_layer_norm, "rms": lm.ms_rms_norm}


def _x(shape, dtype, seed=0):
  return (3 * jax.random.normal(jax.random.key(seed), shape) + 1).astype(dtype)


def _assert_close(actual, expected):
  """Float32 to 1e-5 of the largest value; 16-bit results to two of their ulps."""
  assert actual.dtype == expected.dtype and actual.shape == expected.shape
  expected = np.asarray(expected, np.float32)
  tol = 1e-5 if actual.dtype == jnp.float32 else 2 * float(jnp.finfo(actual.dtype).eps)
  scale = float(np.max(np.abs(expected), initial=1.0))
  np.testing.assert_allclose(np.asarray(actual, np.float32), expected, rtol=0, atol=tol * scale)


@pytest.mark.slow
@pytest.mark.parametrize("options", [INTERPRET, SMALL_BLOCKS], ids=["default", "small_blocks"])
@pytest.mark.parametrize(("dtype", "shape"), CASES)
@pytest.mark.parametrize("centered", [True, False], ids=["layer", "rms"])
def test_kernels_match_reference(centered, dtype, shape, options):
  x, dy = _x(shape, dtype), _x(shape, dtype, seed=1)
  y, rstd = kernels.forward(x, centered=centered, eps=1e-6, options=options)
  y_ref, rstd_ref = kernels.forward_reference(x, centered=centered, eps=1e-6)
  _assert_close(y, y_ref)
  assert rstd.dtype == jnp.float32 and rstd.shape == shape[:-1]
  np.testing.assert_allclose(rstd, rstd_ref, rtol=1e-5)
  dx = kernels.backward(y_ref, rstd_ref, dy, centered=centered, options=options)
  _assert_close(dx, kernels.backward_reference(y_ref, rstd_ref, dy, centered=centered))


@pytest.mark.parametrize("out", [jnp.bfloat16, jnp.float32])
def test_output_dtype(out):
  x = _x((4, 96), jnp.float32)
  y, _ = kernels.forward(x, centered=True, eps=1e-6, y_dtype=out, options=INTERPRET)
  _assert_close(y, kernels.forward_reference(x, centered=True, eps=1e-6, y_dtype=out)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", NORMS)
def test_public_function_matches_xla(kind, dtype):
  norm = NORMS[kind]
  x, dy = _x((2, 3, 40), dtype), _x((2, 3, 40), dtype, seed=1)
  y, vjp = jax.vjp(lambda x: norm(x, impl="pallas_interpret"), x)
  y_ref, vjp_ref = jax.vjp(lambda x: norm(x, impl="xla"), x)
  _assert_close(y, y_ref)
  _assert_close(vjp(dy)[0], vjp_ref(dy)[0])
  saved = lm.memory.saved_residuals(
      lambda x: norm(x, impl="pallas_interpret").astype(jnp.float32).sum(), x)
  assert sorted((r.name, r.shape, np.dtype(r.dtype).name) for r in saved.rows) == [
      (lm.names.NORM_OUT, (2, 3, 40), np.dtype(dtype).name),
      (lm.names.NORM_RSTD, (2, 3), "float32")]


@pytest.mark.parametrize("kind", NORMS)
def test_transformations(kind):
  """jit, vmap, grad, checkpoint and scan over the kernel path give XLA's gradients."""
  norm = NORMS[kind]
  x = _x((3, 4, 24), jnp.float32)

  def loss(impl):
    def per_example(x):
      h = jax.checkpoint(lambda x: norm(x, impl=impl))(x)
      def body(carry, row):
        return jnp.tanh(norm(row + carry, impl=impl)), None
      return jnp.sum(jax.lax.scan(body, jnp.zeros(h.shape[-1]), h)[0] * jnp.arange(24.0))
    return lambda x: jnp.sum(jax.vmap(per_example)(x))

  grads = jax.jit(jax.grad(loss("pallas_interpret")))(x)
  chex.assert_trees_all_close(grads, jax.grad(loss("xla"))(x), rtol=1e-4, atol=1e-5)
  jaxpr = str(jax.make_jaxpr(jax.grad(loss("pallas_interpret")))(x))
  assert "lowmem_ms_norm_fwd" in jaxpr and "lowmem_ms_norm_bwd" in jaxpr


def test_rows_too_long():
  x = jnp.zeros((2, kernels.MAX_ROW + 1), jnp.float32)
  with pytest.raises(ValueError, match="too long"):
    kernels.forward(x, centered=True, eps=1e-6, options=INTERPRET)
  with pytest.raises(ValueError, match="cannot run the ms_norm kernel: rows of 16385"):
    lm.ms_layer_norm(x, impl="pallas_interpret")
  assert lm.ms_layer_norm(x, impl="auto").shape == x.shape  # auto takes XLA


@pytest.mark.parametrize("target", ["h100", "a100-80gb"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_compile_for_gpu_targets(dtype, target):
  """Both kernels compile through Triton and ptxas for sm_90a and sm_80, here without a GPU,
  each declaring its float work to the step-time estimate (at least a multiply and an add an
  element)."""
  target = lm.targets.get(target)
  for centered in (True, False):
    x = jax.ShapeDtypeStruct((8, 2048, 4096), dtype)
    rstd = jax.ShapeDtypeStruct((8, 2048), jnp.float32)
    for compiled in (
        target.compile(lambda x: kernels.forward(x, centered=centered, eps=1e-6), x),
        target.compile(lambda y, r, dy: kernels.backward(y, r, dy, centered=centered), x, rstd, x)):
      text = compiled.as_text()
      assert 'custom_call_target="__gpu$xla.gpu.triton"' in text
      assert step_time.estimate(text, target).lane_ops["fp"] >= 2 * math.prod(x.shape)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8, 197, 768), (3, 197, 1000)])  # blocks overhang cols, rows
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", NORMS)
def test_on_gpu_matches_xla(kind, dtype, shape):
  norm = NORMS[kind]
  x, dy = _x(shape, dtype), _x(shape, dtype, seed=1)
  y, vjp = jax.vjp(lambda x: norm(x, impl="pallas"), x)
  y_ref, vjp_ref = jax.vjp(lambda x: norm(x, impl="xla"), x)
  _assert_close(y, y_ref)
  _assert_close(vjp(dy)[0], vjp_ref(dy)[0])


def test_block_cols_is_refused():
  with pytest.raises(ValueError, match="block_cols must be None"):
    kernels.forward(jnp.ones((2, 8)), centered=True, eps=1e-6,
                    options=_blocks.Options(interpret=True, block_cols=4))
