import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowmem_jax as lm


def layer_norm(x, eps=1e-6):
  # Times rsqrt, as flax.linen.LayerNorm: its VJP saves x - mu beside the output. Divided by
  # sqrt, jax >= 0.12.1's div VJP ((dx - q dy) / y, saving the quotient q) saves the output
  # alone, so the CPU target's temp of test_ms_norm_lowers_compiled_temp_bytes' plain block
  # falls to 1,051,648 bytes in float32 (ms: 1,049,616) and 1,313,792 in bfloat16 (ms:
  # 1,573,904); times rsqrt it is 1,575,936 in float32 on jax 0.10.2 to 0.12.1 and in
  # bfloat16 2,102,272 (0.10.2), 2,362,368 (0.12.0.1), 1,838,080 (0.12.1).
  x = x.astype(jnp.float32)
  mu = jnp.mean(x, -1, keepdims=True)
  return (x - mu) * jax.lax.rsqrt(jnp.mean(jnp.square(x - mu), -1, keepdims=True) + eps)


def rms_norm(x, eps=1e-6):
  x = x.astype(jnp.float32)
  return x / jnp.sqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + eps)


PAIRS = {"layer": (lm.ms_layer_norm, layer_norm), "rms": (lm.ms_rms_norm, rms_norm)}


@pytest.mark.parametrize("kind", list(PAIRS))
@pytest.mark.parametrize("shape", [(7,), (4, 33), (2, 3, 64)])
def test_forward_and_gradient_match_plain_norm(kind, shape):
  ms, plain = PAIRS[kind]
  x = 3 * jax.random.normal(jax.random.key(0), shape) + 1
  w = jax.random.normal(jax.random.key(1), shape)
  chex.assert_trees_all_close(ms(x), plain(x), atol=1e-5)
  loss = lambda f: (lambda x: jnp.sum(jnp.sin(f(x)) * w))
  chex.assert_trees_all_close(jax.grad(loss(ms))(x), jax.grad(loss(plain))(x), atol=1e-5)


@pytest.mark.parametrize("kind", list(PAIRS))
@pytest.mark.parametrize("dtype,out", [(jnp.bfloat16, None), (jnp.float16, None), (jnp.float32, jnp.bfloat16)])
def test_dtypes(kind, dtype, out):
  ms, plain = PAIRS[kind]
  x = jax.random.normal(jax.random.key(0), (4, 64)).astype(dtype)
  y, vjp = jax.vjp(lambda x: ms(x, dtype=out), x)
  assert y.dtype == (out or dtype)
  dy = jax.random.normal(jax.random.key(1), y.shape).astype(y.dtype)
  (dx,) = vjp(dy)
  assert dx.dtype == dtype
  chex.assert_trees_all_close(y.astype(jnp.float32), plain(x), atol=2e-2)
  # Exact up to the rounding of the saved y (and dy) to a 16-bit dtype.
  (dx_plain,) = jax.vjp(plain, x.astype(jnp.float32))[1](dy.astype(jnp.float32))
  chex.assert_trees_all_close(dx.astype(jnp.float32), dx_plain, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("kind", list(PAIRS))
def test_residuals_are_y_and_float32_rstd(kind):
  ms, _ = PAIRS[kind]
  x = jax.ShapeDtypeStruct((4, 5, 64), jnp.bfloat16)
  res = lm.memory.saved_residuals(lambda x: ms(x).astype(jnp.float32).sum(), x)
  got = sorted((r.name, r.shape, str(r.dtype)) for r in res.rows)
  assert got == [("norm_out", (4, 5, 64), "bfloat16"), ("norm_rstd", (4, 5), "float32")]


def _affine_args(kind, n):
  """Random ``scale`` (and, for LayerNorm, ``bias``) ``[n]``, away from 0."""
  scale = 1 + 0.5 * jax.random.normal(jax.random.key(3), (n,))
  return (scale, jax.random.normal(jax.random.key(4), (n,))) if kind == "layer" else (scale,)


@pytest.mark.parametrize("kind", list(PAIRS))
@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_affine_forward_and_gradients_match_plain_norm(kind, impl):
  """The norm's own scale (and bias) kept and trained: every gradient is the plain
  affine norm's (the exact twin), recovered from the saved output."""
  ms, plain = PAIRS[kind]
  x = 3 * jax.random.normal(jax.random.key(0), (2, 3, 64)) + 1
  w = jax.random.normal(jax.random.key(1), x.shape)
  affine = _affine_args(kind, 64)

  def twin(x, scale, bias=None):
    return plain(x) * scale[None, None] + (0.0 if bias is None else bias[None, None])

  loss = lambda f: (lambda x, *a: jnp.sum(jnp.sin(f(x, *a)) * w))
  ours = lambda x, *a: ms(x, *a, impl=impl)
  chex.assert_trees_all_close(ours(x, *affine), twin(x, *affine), atol=1e-5)
  argnums = tuple(range(1 + len(affine)))
  chex.assert_trees_all_close(jax.grad(loss(ours), argnums)(x, *affine),
                              jax.grad(loss(twin), argnums)(x, *affine), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_a_bias_without_a_scale_is_the_plain_norms(impl):
  x = 3 * jax.random.normal(jax.random.key(0), (2, 3, 64)) + 1
  w = jax.random.normal(jax.random.key(1), x.shape)
  bias = jax.random.normal(jax.random.key(4), (64,))
  loss = lambda f: (lambda x, b: jnp.sum(jnp.sin(f(x, b)) * w))
  ours = lambda x, b: lm.ms_layer_norm(x, None, b, impl=impl)
  twin = lambda x, b: layer_norm(x) + b[None, None]
  chex.assert_trees_all_close(jax.grad(loss(ours), (0, 1))(x, bias),
                              jax.grad(loss(twin), (0, 1))(x, bias), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind,bias", [("rms", False), ("layer", False), ("layer", True)])
def test_affine_residual_is_shared_with_the_next_matmul_but_with_a_16_bit_bias(kind, bias):
  """With its scale the norm saves its output (what the matmul saves) and rstd; with a bias
  in 16 bits it saves its output before the affine too (recovering it from the rounded
  output would lose |bias| / |scale| of its ulps)."""
  ms, _ = PAIRS[kind]
  x = jax.ShapeDtypeStruct((4, 5, 64), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((64, 8), jnp.bfloat16)
  affine = _affine_args(kind, 64)[:2 if bias else 1]
  res = lm.memory.saved_residuals(
      lambda x, w, *a: jnp.sum(jnp.dot(ms(x, *a, dtype=jnp.bfloat16), w).astype(jnp.float32)),
      x, w, *affine)
  got = sorted((r.shape, str(r.dtype)) for r in res.rows if r.shape[:2] == (4, 5))
  assert got == [((4, 5), "float32")] + [((4, 5, 64), "bfloat16")] * (2 if bias else 1)


@pytest.mark.parametrize("scale,bias", [(0.05, 2.0), (1.0, 0.0), (None, 3.0)])
def test_affine_in_bfloat16_is_the_plain_norms_up_to_its_rounding(scale, bias):
  """bfloat16 output, a bias large against the scale (or no scale): the gradients within
  bfloat16's rounding of the plain LayerNorm's (the output's own rounding)."""
  x = 3 * jax.random.normal(jax.random.key(0), (8, 64)) + 1
  w = jax.random.normal(jax.random.key(1), x.shape)
  s = None if scale is None else scale * (1 + 0.1 * jax.random.normal(jax.random.key(2), (64,)))
  b = bias * jnp.ones(64)

  def plain(x, s, b):
    return (layer_norm(x) * (1.0 if s is None else s[None]) + b[None]).astype(jnp.bfloat16)

  ours = lambda x, s, b: lm.ms_layer_norm(x, s, b, dtype=jnp.bfloat16)
  loss = lambda f: (lambda x, s, b: jnp.sum(jnp.sin(f(x, s, b).astype(jnp.float32)) * w))
  argnums = (0, 2) if s is None else (0, 1, 2)
  for got, want in zip(jax.grad(loss(ours), argnums)(x, s, b),
                       jax.grad(loss(plain), argnums)(x, s, b)):
    assert jnp.max(jnp.abs(got - want)) <= 2e-2 * jnp.max(jnp.abs(want))


def test_a_zero_scale_gives_nan_gradients_for_its_feature_alone():
  """A feature whose scale is exactly 0 is erased from the saved output: its input cannot be
  recovered, and its gradients (of x and of the scale) say so; every other stays exact."""
  x = jax.random.normal(jax.random.key(0), (3, 8))
  scale = 1 + 0.3 * jax.random.normal(jax.random.key(1), (8,))
  zero = scale.at[2].set(0.0)
  loss = lambda f: (lambda x, s: jnp.sum(jnp.sin(f(x, s)) * jnp.arange(8.0)[None]))
  ours = lambda x, s: lm.ms_rms_norm(x, s)
  twin = lambda x, s: rms_norm(x) * s[None]
  dx, dscale = jax.grad(loss(ours), (0, 1))(x, zero)
  want_dx, want_dscale = jax.grad(loss(twin), (0, 1))(x, zero)
  assert np.isnan(dscale[2]) and np.isnan(dx[:, 2]).all()
  keep = np.arange(8) != 2
  np.testing.assert_allclose(dx[:, keep], want_dx[:, keep], atol=1e-5)
  np.testing.assert_allclose(dscale[keep], want_dscale[keep], atol=1e-5)


def test_affine_of_the_wrong_shape_is_refused():
  with pytest.raises(ValueError, match=r"scale must have shape \(8,\)"):
    lm.ms_rms_norm(jnp.ones((3, 8)), jnp.ones(4))
  with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
    lm.ms_layer_norm(jnp.ones((3, 8)), jnp.ones(8), jnp.ones((1, 8)))
  with pytest.raises(TypeError, match="scale must be float16"):
    lm.ms_rms_norm(jnp.ones((3, 8)), jnp.ones(8, jnp.int32))


def _block(norm, dtype):
  def f(x, w):
    return jnp.sum(jnp.tanh(jnp.dot(norm(x, dtype=dtype), w.astype(dtype)).astype(jnp.float32)))
  return f


def _plain(x, dtype):
  return layer_norm(x).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ms_norm_and_matmul_save_y_once(dtype):
  """The norm's output is the matmul's saved input: one array, not two."""
  x = jax.ShapeDtypeStruct((256, 512), jnp.float32)
  w = jax.ShapeDtypeStruct((512, 128), jnp.float32)
  ms = lm.memory.saved_residuals(_block(lm.ms_layer_norm, dtype), x, w)
  y_like = [r for r in ms.rows if r.shape == (256, 512) and not r.is_argument]
  assert len(y_like) == 1 and y_like[0].name == lm.names.NORM_OUT
  plain = lm.memory.saved_residuals(_block(_plain, dtype), x, w)
  assert plain.activation_bytes > ms.activation_bytes


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ms_norm_lowers_compiled_temp_bytes(dtype):
  x = jax.ShapeDtypeStruct((256, 512), jnp.float32)
  w = jax.ShapeDtypeStruct((512, 512), jnp.float32)
  grad = lambda f: jax.grad(f, argnums=(0, 1))
  # On the CPU target (a proxy); on the H100 target the two are equal (docs/benchmarks.md).
  ms = lm.memory.analyze(grad(_block(lm.ms_layer_norm, dtype)), x, w, target="cpu")
  plain = lm.memory.analyze(grad(_block(_plain, dtype)), x, w, target="cpu")
  # The plain norm keeps at least one more array of y's size.
  assert plain.temp_bytes - ms.temp_bytes >= 256 * 512 * jnp.dtype(dtype).itemsize


@pytest.mark.parametrize("kind", list(PAIRS))
def test_transformations(kind):
  ms, plain = PAIRS[kind]
  x = jax.random.normal(jax.random.key(0), (3, 4, 16))
  loss = lambda f: (lambda x: jnp.sum(f(x) ** 3))
  g = jax.grad(loss(plain))(x)
  chex.assert_trees_all_close(jax.jit(jax.grad(loss(ms)))(x), g, atol=1e-5)
  chex.assert_trees_all_close(jax.vmap(jax.grad(loss(ms)))(x), g, atol=1e-5)
  chex.assert_trees_all_close(jax.grad(jax.checkpoint(loss(ms)))(x), g, atol=1e-5)
  scanned = jax.grad(lambda x: jax.lax.scan(lambda c, xi: (c + loss(ms)(xi), None), 0.0, x)[0])(x)
  chex.assert_trees_all_close(scanned, g, atol=1e-5)


def test_bad_input():
  with pytest.raises(TypeError, match=r"\bx\b"):
    lm.ms_layer_norm(jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match="eps"):
    lm.ms_rms_norm(jnp.zeros((3,)), eps=0.0)
  with pytest.raises(ValueError, match="eps must be a number > 0, got True"):
    lm.ms_rms_norm(jnp.zeros((3,)), eps=True)
  x = jax.random.normal(jax.random.key(0), (2, 8))
  assert (lm.ms_layer_norm(x, eps=np.float32(1e-5)) == lm.ms_layer_norm(x, eps=1e-5)).all()
  with pytest.raises(TypeError, match="dtype"):
    lm.ms_rms_norm(jnp.zeros((3,)), dtype=jnp.int8)


def test_public_functions_carry_their_own_names():
  """Built by shared code, each public op still reads as itself in tracebacks and profiles."""
  for fn in (lm.ms_layer_norm, lm.ms_rms_norm, lm.regelu2, lm.resilu2, lm.relu,
             lm.activations.regelu2_tanh):
    assert fn.__qualname__ == fn.__name__ and "<locals>" not in fn.__qualname__
