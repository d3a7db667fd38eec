import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from jax.sharding import NamedSharding, PartitionSpec as P

import lowmem_jax as lm
from lowmem_jax.ops import activations
from pallas_kernels import pack

EXACT = {
    "regelu2": lambda x: jax.nn.gelu(x, approximate=False),
    "resilu2": jax.nn.silu,
    "relu": jax.nn.relu,
}
EXACT64 = {
    "regelu2": lambda x: 0.5 * x * (1 + scipy.special.erf(x / np.sqrt(2))),
    "resilu2": lambda x: x / (1 + np.exp(-x)),
    "relu": lambda x: np.maximum(x, 0),
}
FITS = {
    "regelu2": (activations.REGELU2_A, activations.REGELU2_C),
    "resilu2": (activations.RESILU2_A, activations.RESILU2_C),
    "relu": ((1.0,), (0.0,)),
}
FNS = {"regelu2": lm.regelu2, "resilu2": lm.resilu2, "relu": lm.relu}
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _x(shape, dtype, seed=0):
  return (4 * jax.random.normal(jax.random.key(seed), shape)).astype(dtype)


def _reference_grad(name, x, dy):
  """dy * s[code], with s = (0, a1, a1+a2, ...) and code = #kinks below x."""
  a, c = FITS[name]
  s = np.concatenate([[0.0], np.cumsum(np.asarray(a, np.float32), dtype=np.float32)]).astype(np.float32)
  x32 = np.asarray(x.astype(jnp.float32))
  code = sum((x32 > ci).astype(np.int32) for ci in c)
  return (np.asarray(dy.astype(jnp.float32)) * s[code]).astype(x.dtype)


@pytest.mark.parametrize("name", list(FNS))
def test_forward_matches_exact_float32(name):
  x = _x((8, 301), jnp.float32)
  y = FNS[name](x)
  assert y.dtype == jnp.float32 and y.shape == x.shape
  assert float(jnp.max(jnp.abs(y - EXACT[name](x)))) <= 1e-6


@pytest.mark.parametrize("name", list(FNS))
def test_forward_within_one_ulp_bfloat16(name):
  x = _x((8, 301), jnp.bfloat16)
  y = FNS[name](x)
  assert y.dtype == jnp.bfloat16
  # The float64 value rounded to bfloat16. (JAX's own bfloat16 gelu evaluates
  # in bfloat16 and lies up to ~100 ulps from it where gelu is tiny.)
  exact = jnp.asarray(EXACT64[name](np.asarray(x, np.float64))).astype(jnp.bfloat16)
  # Distance in units in the last place: adjacent bfloat16 values differ by 1
  # in their int16 bit patterns (same sign).
  ulps = np.abs(np.asarray(y).view(np.int16).astype(np.int32)
                - np.asarray(exact).view(np.int16).astype(np.int32))
  # Where gelu/silu underflow float32 (|y| < 1e-6) the float32 criterion holds instead.
  tiny = np.abs(np.asarray(exact, np.float32)) < 1e-6
  assert ulps[~tiny].max() <= 1
  assert np.abs(np.asarray(y, np.float32) - np.asarray(exact, np.float32))[tiny].max(initial=0) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FNS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5,), (3, 7), (2, 3, 8), (2, 1, 3, 13)])
def test_backward_is_dy_times_step(name, dtype, shape):
  x = _x(shape, dtype)
  dy = _x(shape, dtype, seed=1)
  y, vjp = jax.vjp(FNS[name], x)
  (dx,) = vjp(dy)
  assert dx.dtype == dtype and dx.shape == shape
  np.testing.assert_array_equal(np.asarray(dx), _reference_grad(name, x, dy))


@pytest.mark.parametrize("name,max_err,mean_err", [("regelu2", 0.55, 0.11), ("resilu2", 0.55, 0.15), ("relu", 0.0, 0.0)])
def test_gradient_distance_to_exact_twin(name, max_err, mean_err):
  """Distance of the step-function gradient to the exact one, x ~ N(0, 2^2).

  The fits' derivative is a 4-level step of a smooth curve: the largest gap is
  ~0.55 just beside the middle kink, and the mean gap is about 0.11 (ReGELU2)
  and 0.15 (ReSiLU2). ReLU's derivative is a step, so its gradient is exact.
  """
  x = 2 * jax.random.normal(jax.random.key(0), (100_000,))
  approx = jax.grad(lambda x: FNS[name](x).sum())(x)
  exact = jax.grad(lambda x: EXACT[name](x).sum())(x)
  err = jnp.abs(approx - exact)
  assert float(err.max()) <= max_err
  assert float(err.mean()) <= mean_err
  if name != "relu":
    assert float(err.mean()) > 0.5 * mean_err  # it is an approximation, and a good one


@pytest.mark.parametrize("name,bits", [("regelu2", 2), ("resilu2", 2), ("relu", 1)])
@pytest.mark.parametrize("n", [1, 4, 7, 3072])
def test_only_residual_is_the_packed_code(name, bits, n):
  x = jax.ShapeDtypeStruct((6, n), jnp.bfloat16)
  res = lm.memory.saved_residuals(lambda x: FNS[name](x).astype(jnp.float32).sum(), x)
  assert len(res.rows) == 1
  (row,) = res.rows
  assert row.dtype == np.uint8 and row.name == lm.names.ACT_CODE
  assert row.shape == (6, pack.packed_size(n, bits)) == (6, math.ceil(n * bits / 8))


@pytest.mark.parametrize("name", list(FNS))
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_backward_at_the_kinks_rounded_to_dtype(name, dtype):
  """Kinks compare in float32: a kink rounded up to x's dtype stays above it."""
  x = jnp.asarray(FITS[name][1], jnp.float32).astype(dtype)
  dy = jnp.ones_like(x)
  (dx,) = jax.vjp(FNS[name], x)[1](dy)
  np.testing.assert_array_equal(np.asarray(dx), _reference_grad(name, x, dy))


@pytest.mark.parametrize("name", list(FNS))
def test_size_zero(name):
  x = jnp.zeros((3, 0), jnp.float32)
  assert FNS[name](x).shape == (3, 0)
  assert jax.grad(lambda x: FNS[name](x).sum())(x).shape == (3, 0)


@pytest.mark.parametrize("bad,err", [
    (jnp.zeros((3,), jnp.int32), TypeError),
    (jnp.zeros((3,), jnp.float64) if jax.config.jax_enable_x64 else np.zeros((3,), np.float64), TypeError),
    (jnp.float32(1.0), ValueError),
    ([1.0, 2.0], TypeError),
])
def test_bad_input_names_x(bad, err):
  with pytest.raises(err, match=r"\bx\b"):
    lm.regelu2(bad)


def test_approx_activation_validates_fit():
  with pytest.raises(ValueError, match="same length"):
    lm.approx_activation(jnp.tanh, (1.0, 2.0), (0.0,))
  with pytest.raises(ValueError, match="between 1 and 3"):
    lm.approx_activation(jnp.tanh, (), ())
  with pytest.raises(ValueError, match="increasing"):
    lm.approx_activation(jnp.tanh, (0.5, 0.5), (1.0, -1.0))


def test_approx_activation_user_fit():
  """A 2-kink hard-tanh-like fit of tanh: slopes 0, 1, 0."""
  act = lm.approx_activation(jnp.tanh, (1.0, -1.0), (-1.0, 1.0))
  x = jnp.array([-2.0, -0.5, 0.5, 2.0])
  chex.assert_trees_all_close(act(x), jnp.tanh(x))
  chex.assert_trees_all_close(jax.grad(lambda x: act(x).sum())(x), jnp.array([0.0, 1.0, 1.0, 0.0]))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FNS))
def test_transformations(name):
  f = FNS[name]
  x = _x((4, 6, 10), jnp.float32)
  loss = lambda x: jnp.sum(f(x) ** 2)
  g = jax.grad(loss)(x)
  chex.assert_trees_all_close(jax.jit(jax.grad(loss))(x), g)
  chex.assert_trees_all_close(jax.grad(jax.checkpoint(loss))(x), g)
  chex.assert_trees_all_close(jax.vmap(jax.grad(loss))(x), jnp.stack([jax.grad(loss)(xi) for xi in x]))
  chex.assert_trees_all_close(jax.vmap(f, in_axes=-1, out_axes=-1)(x), f(x))

  def body(carry, xi):
    return carry + loss(xi), None
  scanned = jax.grad(lambda x: jax.lax.scan(body, 0.0, x)[0])(x)
  chex.assert_trees_all_close(scanned, g, rtol=1e-6)


def test_sharded_jit_on_8_devices():
  assert jax.device_count() == 8, "conftest forces 8 CPU devices"
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  x = _x((8, 6, 16), jnp.float32)
  xs = jax.device_put(x, NamedSharding(mesh, P("data", None, "model")))
  grad = jax.jit(jax.grad(lambda x: jnp.sum(lm.regelu2(x) ** 2)))
  g = grad(xs)
  chex.assert_trees_all_close(g, jax.grad(lambda x: jnp.sum(lm.regelu2(x) ** 2))(x))
  assert g.sharding.is_equivalent_to(xs.sharding, x.ndim)


def test_regelu2_tanh_gradient_distance_to_the_tanh_gelu():
  """ReGELU2's step backward under the tanh GELU's forward: the same distance
  as to the erf GELU (the two GELUs' derivatives differ by < 0.001)."""
  x = 2 * jax.random.normal(jax.random.key(0), (100_000,))
  approx = jax.grad(lambda x: lm.activations.regelu2_tanh(x).sum())(x)
  exact = jax.grad(lambda x: jax.nn.gelu(x, approximate=True).sum())(x)
  err = jnp.abs(approx - exact)
  assert float(err.max()) <= 0.55
  assert 0.055 < float(err.mean()) <= 0.11
  chex.assert_trees_all_close(lm.activations.regelu2_tanh(x), jax.nn.gelu(x), atol=1e-6)
