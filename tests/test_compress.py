import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from lowmem_jax import names
from lowmem_jax.compile import memory
from lowmem_jax.ops import compress

CONV_DN = ("NHWC", "HWIO", "NHWC")


def conv(x, w, strides=(1, 1)):
  return lax.conv_general_dilated(x, w, strides, "SAME", dimension_numbers=CONV_DN)


def smooth_images(key, shape):
  """Spatially smooth inputs (images are), so pooling loses little."""
  coarse = jax.random.normal(key, (shape[0], shape[1] // 4, shape[2] // 4, shape[3]))
  return jax.image.resize(coarse, shape, "linear")


def weight_grad_bound(fn, x, x_tilde, w, dy):
  """vjp_w fn(|x̃ - x|, |dy|): the elementwise bound on the weight-gradient error."""
  _, vjp = jax.vjp(lambda w: fn(jnp.abs(x_tilde - x), w), w)
  return vjp(jnp.abs(dy))[0]


def check_gradients(compressed, exact, x, x_tilde, w, dy):
  """Forward equal, input gradient exact, weight gradient within the bound."""
  y, vjp = jax.jit(lambda x, w: jax.vjp(compressed, x, w))(x, w)
  y0, vjp0 = jax.vjp(exact, x, w)
  (dx, dw), (dx0, dw0) = vjp(dy), vjp0(dy)
  np.testing.assert_array_equal(y, y0)
  np.testing.assert_allclose(dx, dx0, rtol=1e-6, atol=1e-6)
  bound = weight_grad_bound(exact, x, x_tilde, w, dy)
  assert np.all(np.abs(dw - dw0) <= bound * (1 + 1e-4) + 1e-5)
  assert np.abs(dw - dw0).max() > 0  # the weight gradient does see the compression
  return np.abs(dw - dw0).max() / np.abs(dw0).max()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_rows_error_and_size(bits):
  x = jax.random.normal(jax.random.key(0), (3, 5, 37)) * jnp.arange(1.0, 4.0)[:, None, None]
  x = x.at[1, 2].set(0.0)  # an all-zero row
  packed, scale = compress.quantize_rows(x, bits)
  assert packed.dtype == jnp.uint8 and packed.shape == (3, 5, math.ceil(37 * bits / 8))
  assert scale.dtype == jnp.float32 and scale.shape == (3, 5, 1)
  x_tilde = compress.dequantize_rows(packed, scale, bits, 37)
  assert np.all(np.abs(x_tilde - x) <= scale / 2 * (1 + 1e-6))
  np.testing.assert_array_equal(x_tilde[1, 2], 0.0)
  q_max = 2 ** (bits - 1) - 1
  np.testing.assert_allclose(scale[..., 0], np.abs(x).max(-1) / q_max, rtol=1e-6)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantized_dense_gradients_within_bound(bits):
  kx, kw, kd = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(kx, (4, 16, 64))
  w = jax.random.normal(kw, (64, 32))
  dy = jax.random.normal(kd, (4, 16, 32))
  packed, scale = compress.quantize_rows(x, bits)
  x_tilde = compress.dequantize_rows(packed, scale, bits, 64)
  rel = check_gradients(compress.quantized_residual(jnp.matmul, bits), jnp.matmul,
                        x, x_tilde, w, dy)
  assert rel < {2: 1.0, 4: 0.15, 8: 0.01}[bits]  # 2 bits: ternary, coarse


def test_int8_dense_saves_int8_and_a_scale_per_row():
  x = jax.ShapeDtypeStruct((8, 128, 96), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((96, 64), jnp.bfloat16)
  saved = memory.saved_residuals(compress.int8_dense, x, w)
  assert saved.by_name() == {names.COMPRESSED_IN: 8 * 128 * 96,  # 1 byte an entry
                             names.COMPRESSED_SCALE: 8 * 128 * 4}
  plain = memory.saved_residuals(jnp.matmul, x, w)
  assert [r.nbytes for r in plain.rows if r.shape == x.shape] == [8 * 128 * 96 * 2]  # x itself


@pytest.mark.parametrize("dtype, unit_roundoff", [(jnp.bfloat16, 2.0 ** -8),
                                                  (jnp.float16, 2.0 ** -11)])
def test_quantize_rows_half_precision_bound(dtype, unit_roundoff):
  x = (jax.random.normal(jax.random.key(12), (256, 64)) * 3).astype(dtype)
  packed, scale = compress.quantize_rows(x)
  x_tilde = compress.dequantize_rows(packed, scale, 8, 64, dtype)
  x32, err = x.astype(jnp.float32), jnp.abs(x_tilde.astype(jnp.float32) - x.astype(jnp.float32))
  assert np.all(err <= scale / 2 + unit_roundoff * (jnp.abs(x32) + scale / 2))
  assert np.any(err > scale / 2)  # the rounding to the dtype does add to s / 2


def test_int8_dense_bfloat16():
  kx, kw = jax.random.split(jax.random.key(2))
  x = jax.random.normal(kx, (32, 48), jnp.bfloat16)
  w = jax.random.normal(kw, (48, 16), jnp.bfloat16)
  y, vjp = jax.vjp(compress.int8_dense, x, w)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(y, x @ w)
  dx, dw = vjp(jnp.ones_like(y))
  assert dx.dtype == dw.dtype == jnp.bfloat16


def test_int8_dot_general_in_flax_dense():
  x = jax.random.normal(jax.random.key(3), (6, 40))
  plain, compressed = nn.Dense(24), nn.Dense(24, dot_general=compress.int8_dot_general)
  params = plain.init(jax.random.key(4), x)
  np.testing.assert_array_equal(compressed.apply(params, x), plain.apply(params, x))
  g = jax.grad(lambda p: compressed.apply(p, x).sum())(params)["params"]["kernel"]
  g0 = jax.grad(lambda p: plain.apply(p, x).sum())(params)["params"]["kernel"]
  scale = np.abs(x).max(-1) / 127
  bound = (scale[:, None] / 2).sum(0)  # |x̃ - x|^T |dy| with dy = 1
  assert np.all(np.abs(g - g0) <= bound[None, :] * (1 + 1e-4) + 1e-6)


@pytest.mark.parametrize("strides", [(1, 1), (2, 2)])
def test_pooled_conv_gradients_within_bound(strides):
  kx, kw, kd = jax.random.split(jax.random.key(5), 3)
  x = smooth_images(kx, (2, 16, 16, 8))
  w = jax.random.normal(kw, (3, 3, 8, 4))
  exact = functools.partial(conv, strides=strides)
  compressed = functools.partial(compress.pooled_conv, window_strides=strides, pool=2)
  dy = jax.random.normal(kd, exact(x, w).shape)
  x_tilde = compress.upsample(compress.avg_pool(x, 2), 2)
  rel = check_gradients(compressed, exact, x, x_tilde, w, dy)
  assert rel < 0.5


def test_pooled_conv_spread_bound():
  """|x̃ - x| is at most the spread of x in its pooling window."""
  x = jax.random.normal(jax.random.key(6), (1, 8, 8, 3))
  x_tilde = compress.upsample(compress.avg_pool(x, 2), 2)
  windows = x.reshape(1, 4, 2, 4, 2, 3)
  spread = windows.max((2, 4)) - windows.min((2, 4))
  assert np.all(np.abs(x_tilde - x) <= compress.upsample(spread, 2) + 1e-6)


@pytest.mark.parametrize("pool", [1, 2, 4])
def test_pooled_conv_saves_the_pooled_input(pool):
  x = jax.ShapeDtypeStruct((4, 32, 32, 16), jnp.float32)
  w = jax.ShapeDtypeStruct((3, 3, 16, 32), jnp.float32)
  saved = memory.saved_residuals(functools.partial(compress.pooled_conv, pool=pool), x, w)
  assert saved.by_name() == {names.COMPRESSED_IN: 4 * 32 * 32 * 16 * 4 // pool ** 2}
  if pool == 1:  # nothing lost
    y = jax.random.normal(jax.random.key(7), (2, 4, 4, 3))
    wk = jax.random.normal(jax.random.key(8), (3, 3, 3, 2))
    g = jax.grad(lambda w: compress.pooled_conv(y, w, pool=1).sum())(wk)
    np.testing.assert_allclose(g, jax.grad(lambda w: conv(y, w).sum())(wk), rtol=1e-6)


def test_pooled_conv_in_flax_conv():
  x = smooth_images(jax.random.key(9), (2, 8, 8, 4))
  pooled = functools.partial(compress.pooled_conv, pool=2)
  plain, compressed = nn.Conv(6, (3, 3), strides=2), nn.Conv(6, (3, 3), strides=2,
                                                              conv_general_dilated=pooled)
  params = plain.init(jax.random.key(10), x)
  np.testing.assert_array_equal(compressed.apply(params, x), plain.apply(params, x))
  gx = jax.grad(lambda x: compressed.apply(params, x).sum())(x)
  np.testing.assert_allclose(gx, jax.grad(lambda x: plain.apply(params, x).sum())(x), rtol=1e-6)


def test_int8_conv_in_flax_conv():
  x = smooth_images(jax.random.key(13), (2, 8, 8, 4))
  plain, compressed = nn.Conv(6, (3, 3)), nn.Conv(6, (3, 3), conv_general_dilated=compress.int8_conv)
  params = plain.init(jax.random.key(14), x)
  np.testing.assert_array_equal(compressed.apply(params, x), plain.apply(params, x))
  saved = memory.saved_residuals(lambda x: compressed.apply(params, x), x)
  assert saved.by_name() == {names.COMPRESSED_IN: 2 * 8 * 8 * 4,
                             names.COMPRESSED_SCALE: 2 * 8 * 8 * 4}  # a scale a pixel
  gx = jax.grad(lambda x: compressed.apply(params, x).sum())(x)
  np.testing.assert_allclose(gx, jax.grad(lambda x: plain.apply(params, x).sum())(x), rtol=1e-6)
  with pytest.raises(ValueError, match="dimension_numbers"):
    compress.int8_conv(x, jnp.ones((6, 4, 3, 3)), (1, 1), "SAME",
                       dimension_numbers=("NCHW", "OIHW", "NCHW"))


def test_pooled_conv_under_scan():
  """A scanned stack of pooled convs: forward and input gradient exact."""
  kx, kw = jax.random.split(jax.random.key(15))
  x0 = smooth_images(kx, (2, 8, 8, 4))
  ws = jax.random.normal(kw, (3, 3, 3, 4, 4)) / 6

  def stack(conv_fn, x, ws):
    return jax.lax.scan(lambda h, w: (conv_fn(h, w), None), x, ws)[0].sum()

  pooled = functools.partial(compress.pooled_conv, pool=2)
  value, (gx, gw) = jax.jit(jax.value_and_grad(functools.partial(stack, pooled), (0, 1)))(x0, ws)
  value0, (gx0, gw0) = jax.value_and_grad(functools.partial(stack, conv), (0, 1))(x0, ws)
  np.testing.assert_allclose(value, value0, rtol=1e-6)
  np.testing.assert_allclose(gx, gx0, rtol=1e-5, atol=1e-6)
  assert 0 < float(jnp.linalg.norm(gw - gw0) / jnp.linalg.norm(gw0)) < 0.5


def test_under_scan_input_gradient_exact_weight_gradients_bounded():
  """A scanned chain of int8 dense layers: dx exact, each layer's dw within its bound."""
  kx, kw = jax.random.split(jax.random.key(11))
  x0 = jax.random.normal(kx, (8, 32))
  ws = jax.random.normal(kw, (3, 32, 32)) / np.sqrt(32)

  def chain(dense, x, ws):
    return jax.lax.scan(lambda h, w: (dense(h, w), None), x, ws)[0].sum()

  gx, gw = jax.jit(jax.grad(functools.partial(chain, compress.int8_dense), (0, 1)))(x0, ws)
  gx0, gw0 = jax.grad(functools.partial(chain, jnp.matmul), (0, 1))(x0, ws)
  np.testing.assert_allclose(gx, gx0, rtol=1e-5, atol=1e-6)
  xs = [x0]
  for w in ws[:-1]:
    xs.append(xs[-1] @ w)
  dy = jnp.ones((8, 32))
  for layer in reversed(range(3)):
    x = xs[layer]
    packed, scale = compress.quantize_rows(x)
    x_tilde = compress.dequantize_rows(packed, scale, 8, 32)
    bound = weight_grad_bound(jnp.matmul, x, x_tilde, ws[layer], dy)
    assert np.all(np.abs(gw[layer] - gw0[layer]) <= bound * (1 + 1e-4) + 1e-5)
    dy = dy @ ws[layer].T


def test_bad_inputs_name_the_argument():
  x = jnp.ones((2, 4, 4, 3))
  w = jnp.ones((3, 3, 3, 2))
  with pytest.raises(ValueError, match="bits"):
    compress.quantized_residual(jnp.matmul, bits=3)
  with pytest.raises(ValueError, match="bits"):
    compress.quantize_rows(x, bits=1)
  with pytest.raises(TypeError, match="fn"):
    compress.quantized_residual("matmul")
  with pytest.raises(TypeError, match="x must be float16"):
    compress.int8_dense(jnp.ones((2, 3), jnp.int32), jnp.ones((3, 2)))
  with pytest.raises(ValueError, match="pool"):
    compress.pooled_conv(x, w, pool=0)
  with pytest.raises(ValueError, match="multiple of pool=3"):
    compress.pooled_conv(x, w, pool=3)
  with pytest.raises(ValueError, match="dimension_numbers"):
    compress.pooled_conv(x, w, dimension_numbers=("NCHW", "OIHW", "NCHW"))
