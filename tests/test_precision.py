import chex
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

from lowmem_jax import models, names
from lowmem_jax.compile import memory
from lowmem_jax.optim import precision
from third_party_promotion import FLAX_NORM, JMP_LOSS_SCALE, OPTAX_BIAS_CORRECTION


def loss_fn(params, batch, dtype=jnp.float32):
  """Mean squared error of a two-layer net computed in ``dtype``; float32 loss."""
  x, y = batch
  w, v = (params[k].astype(dtype) for k in "wv")
  return jnp.mean(((jnp.tanh(x.astype(dtype) @ w) @ v).astype(jnp.float32) - y) ** 2)


def loss_fn16(params, batch):
  return loss_fn(params, batch, jnp.float16)


def setup():
  kw, kv, kx, ky = jax.random.split(jax.random.key(0), 4)
  params = {"w": jax.random.normal(kw, (8, 16)), "v": jax.random.normal(kv, (16, 2))}
  batch = (jax.random.normal(kx, (32, 8)), jax.random.normal(ky, (32, 2)))
  return params, batch


def plain_step(tx, loss=loss_fn):
  def step(params, opt_state, batch):
    grads = jax.grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return step


def test_get_policy():
  p = precision.get_policy("bfloat16")
  assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (jnp.float32, jnp.bfloat16,
                                                              jnp.float32)
  assert precision.get_policy("params=float32,compute=float16,output=float32").compute_dtype \
      == jnp.float16
  assert precision.flax_dtypes("float16") == dict(dtype=jnp.float16, param_dtype=jnp.float32)
  with pytest.raises(ValueError, match="spec must be one of"):
    precision.get_policy("float8")
  with pytest.raises(TypeError, match="spec"):
    precision.get_policy(16)


@FLAX_NORM
def test_policy_halves_the_matmul_residuals_of_a_reference_model():
  def saved(policy):  # batch 16: the half-precision weight copies it also saves are small
    w = models.workload("vit-tiny", batch=16, image=224, **precision.flax_dtypes(policy))
    params = w.abstract_params()
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))  # master weights
    return memory.saved_residuals(w.loss, params, w.inputs, w.labels)
  full, half = saved("float32"), saved("bfloat16")
  assert half.by_name()[names.MLP_ACT] * 2 == full.by_name()[names.MLP_ACT]
  # Not all of it halves: the plain attention keeps float32 probabilities and
  # Flax's LayerNorm float32 statistics (0.73 of the float32 total here).
  assert 0.5 * full.activation_bytes < half.activation_bytes < 0.8 * full.activation_bytes


@JMP_LOSS_SCALE
@OPTAX_BIAS_CORRECTION
def test_finite_step_equals_the_unscaled_step_exactly():
  params, batch = setup()
  tx = optax.adam(1e-2)
  step = jax.jit(precision.loss_scaled_step(loss_fn, tx))
  new_params, new_opt, scale, metrics = step(params, tx.init(params),
                                             precision.dynamic_loss_scale(), batch)
  want_params, want_opt = jax.jit(plain_step(tx))(params, tx.init(params), batch)
  chex.assert_trees_all_equal(new_params, want_params)
  chex.assert_trees_all_equal(new_opt, want_opt)
  assert bool(metrics["grads_finite"]) and float(metrics["loss_scale"]) == 2.0 ** 15
  assert int(scale.counter) == 1


@JMP_LOSS_SCALE
@OPTAX_BIAS_CORRECTION
def test_overflow_skips_the_step_and_keeps_its_state():
  params, batch = setup()
  tx = optax.adam(1e-2)
  step = jax.jit(precision.loss_scaled_step(loss_fn16, tx))
  opt_state = tx.init(params)
  params, opt_state = plain_step(tx)(params, opt_state, batch)  # a state with history
  scale = precision.dynamic_loss_scale(2.0 ** 10, period=3)
  overflowing = (batch[0], batch[1] * 1e4)  # scaled gradient > 65504: inf in float16
  p1, o1, s1, m1 = step(params, opt_state, scale, overflowing)
  assert not bool(m1["grads_finite"])
  chex.assert_trees_all_equal(p1, params)
  chex.assert_trees_all_equal(o1, opt_state)
  assert float(s1.loss_scale) == 2.0 ** 9 and int(s1.counter) == 0
  p2, o2, s2, m2 = step(p1, o1, s1, batch)  # recovers: the step it would have taken
  want_params, want_opt = plain_step(tx, loss_fn16)(params, opt_state, batch)
  # float16 compute: the jitted and the op-by-op step round their dots differently, a few
  # float16 ulps (2**-10) in the gradient (seen with jax 0.10.2's CPU dots).
  chex.assert_trees_all_close(p2, want_params, rtol=1e-4, atol=1e-4)
  chex.assert_trees_all_close(o2, want_opt, rtol=1e-2, atol=1e-4)
  assert bool(m2["grads_finite"]) and float(s2.loss_scale) == 2.0 ** 9


@JMP_LOSS_SCALE
def test_scale_recovers_float16_gradients_that_underflow():
  w = jnp.ones((4,))
  x = jnp.full((4,), 1e-4)

  def loss(params, batch):  # float16 compute: d loss / dw = 1e-8, below float16's range
    small = params.astype(jnp.float16) * batch.astype(jnp.float16) * jnp.float16(1e-4)
    return small.sum().astype(jnp.float32)

  def grads_under(scale):
    tx = optax.sgd(1e8)  # the update then shows the gradient in float32 parameters
    new_w, _, _, metrics = precision.loss_scaled_step(loss, tx)(w, tx.init(w), scale, x)
    assert bool(metrics["grads_finite"])
    return (w - new_w) / 1e8
  np.testing.assert_array_equal(grads_under(jmp.NoOpLossScale()), 0.0)  # lost
  np.testing.assert_allclose(grads_under(precision.dynamic_loss_scale()), 1e-8, rtol=1e-2)


@JMP_LOSS_SCALE
def test_scan_matches_the_python_loop():
  params, batch = setup()
  tx = optax.sgd(0.1)
  step = precision.loss_scaled_step(loss_fn16, tx)
  factors = jnp.array([1.0, 1.0, 1e6, 1.0, 1.0, 1.0])  # one float16 overflow in the middle
  batches = (jnp.stack([batch[0]] * 6), batch[1][None] * factors[:, None, None])

  def body(carry, b):
    p, o, s = carry
    p, o, s, m = step(p, o, s, b)
    return (p, o, s), m

  init = (params, tx.init(params), precision.dynamic_loss_scale(2.0 ** 4, period=2))
  (p_scan, _, s_scan), m_scan = jax.jit(lambda c, b: jax.lax.scan(body, c, b))(init, batches)
  carry = init
  for i in range(6):
    carry, _ = body(carry, jax.tree.map(lambda a: a[i], batches))
  chex.assert_trees_all_close(p_scan, carry[0], rtol=1e-3, atol=1e-4)  # float16 compute, as above
  np.testing.assert_array_equal(m_scan["grads_finite"], [1, 1, 0, 1, 1, 1])
  # doubles after two finite steps, halves on the overflow, doubles again after two more
  np.testing.assert_array_equal(m_scan["loss_scale"], [16, 16, 32, 16, 16, 32])
  assert float(s_scan.loss_scale) == float(carry[2].loss_scale) == 32


def test_bad_arguments():
  with pytest.raises(ValueError, match="initial"):
    precision.dynamic_loss_scale(0.0)
  with pytest.raises(ValueError, match="period"):
    precision.dynamic_loss_scale(period=0)
  with pytest.raises(ValueError, match="factor"):
    precision.dynamic_loss_scale(factor=1)
