"""`lowmem_jax.adama` (AdamA) against Adam and its spec, and `lowmem_jax.microbatch_step`: one
update over k micro-batches, with state, aux, sharding and non-finite micro-batches."""

import chex
import flax.linen
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import lowmem_jax as lm
from adama import dense_stack_loss  # benchmarks/, on sys.path in conftest.py
from lowmem_jax import optim
from lowmem_jax.optim import steps
from optim_checks import (PARAMS, exact, mlp_batch, mlp_init, mlp_loss, scanned_init,
                          scanned_loss, stateful_loss, three_steps)
from third_party_promotion import OPTAX_BIAS_CORRECTION, OPTAX_UPDATE_MOMENT


def random_grads(params, n, seed=0):
  keys = jax.random.split(jax.random.key(seed), n)
  return [jax.tree.map(lambda p: jax.random.normal(key, p.shape, p.dtype), params) for key in keys]


@pytest.mark.parametrize("mu_dtype", [
    None, pytest.param(jnp.bfloat16, marks=OPTAX_UPDATE_MOMENT)])
@OPTAX_BIAS_CORRECTION
def test_k1_is_adam_bit_for_bit(mu_dtype):
  ours = optax.chain(lm.adama(1, mu_dtype=mu_dtype), optax.scale_by_learning_rate(1e-2))
  theirs = optax.adam(1e-2, mu_dtype=mu_dtype)
  s1, s2 = ours.init(PARAMS), theirs.init(PARAMS)
  for g in random_grads(PARAMS, 20):
    u1, s1 = jax.jit(ours.update)(g, s1)
    u2, s2 = jax.jit(theirs.update)(g, s2)
    exact(u1, u2)
  exact((s1[0].mu, s1[0].nu), (s2[0].mu, s2[0].nu))


@OPTAX_BIAS_CORRECTION
def test_adamaw_k1_is_adamw_bit_for_bit():
  mask = {"w": True, "b": False}
  ours, theirs = lm.adamaw(1e-2, 1, weight_decay=0.1, mask=mask), optax.adamw(1e-2, weight_decay=0.1, mask=mask)
  s1, s2 = ours.init(PARAMS), theirs.init(PARAMS)
  params = PARAMS
  for g in random_grads(PARAMS, 20):
    u1, s1 = jax.jit(ours.update)(g, s1, params)
    u2, s2 = jax.jit(theirs.update)(g, s2, params)
    exact(u1, u2)
    params = optax.apply_updates(params, u1)


def numpy_adama(grads, k, nu_scale, b1=0.9, b2=0.999, eps=1e-8):
  """The spec of DESIGN.md in float64 NumPy: moments and direction after each micro-step."""
  w = 1 / k ** 2 if nu_scale == "mean_sq" else 1 / k
  m = v = 0.0
  t = 0
  out = []
  for i, g in enumerate(grads):
    g = np.asarray(g, np.float64)
    if i % k == 0:
      m, v = b1 * m, b2 * v
    m = m + (1 - b1) * g / k
    v = v + (1 - b2) * g ** 2 * w
    direction = np.zeros_like(g)
    if i % k == k - 1:
      t += 1
      direction = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    out.append((m, v, direction))
  return out


@pytest.mark.parametrize("nu_scale", optim.NU_SCALES)
@pytest.mark.parametrize("k", [2, 4])
@OPTAX_BIAS_CORRECTION
def test_moments_follow_the_spec(k, nu_scale):
  tx = lm.adama(k, nu_scale=nu_scale)
  grads = [g["w"] for g in random_grads(PARAMS, 3 * k)]
  state = tx.init({"w": PARAMS["w"]})
  for g, (m, v, direction) in zip(grads, numpy_adama(grads, k, nu_scale)):
    updates, state = jax.jit(tx.update)({"w": g}, state)
    np.testing.assert_allclose(state.mu["w"], m, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(state.nu["w"], v, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(updates["w"], direction, rtol=1e-4, atol=1e-6)
  assert int(state.count) == 3 and int(state.micro_step) == 0


@OPTAX_BIAS_CORRECTION
def test_mu_is_adams_on_the_mean_gradient_and_mean_nu_bounds_adams():
  k = 4
  grads = random_grads(PARAMS, 2 * k)
  adam, state = optax.scale_by_adam(), None
  results = {}
  for nu_scale in optim.NU_SCALES:
    tx = lm.adama(k, nu_scale=nu_scale)
    state = tx.init(PARAMS)
    for g in grads:
      _, state = tx.update(g, state)
    results[nu_scale] = state
  adam_state = adam.init(PARAMS)
  for step in range(2):
    mean = jax.tree.map(lambda *g: sum(g) / k, *grads[step * k:(step + 1) * k])
    _, adam_state = adam.update(mean, adam_state)
  chex.assert_trees_all_close(results["mean"].mu, adam_state.mu, rtol=1e-6)
  # The mean of squares is never below the square of the mean (Jensen).
  for ours, adams in zip(jax.tree.leaves(results["mean"].nu), jax.tree.leaves(adam_state.nu)):
    assert np.all(np.asarray(ours) >= np.asarray(adams) * (1 - 1e-6))


@OPTAX_BIAS_CORRECTION
def test_adamaw_decays_and_schedules_per_optimizer_step():
  k = 3
  schedule = lambda step: 0.1 * jnp.asarray(step + 1, jnp.float32)
  tx = lm.adamaw(schedule, k, weight_decay=0.5)
  params = {"w": jnp.full((2,), 2.0)}
  state = tx.init(params)
  zero = {"w": jnp.zeros(2)}
  for step in range(2):
    for micro in range(k):
      updates, state = tx.update(zero, state, params)
      expected = -schedule(step) * 0.5 * 2.0 if micro == k - 1 else 0.0
      np.testing.assert_allclose(updates["w"], expected, rtol=1e-6)


@OPTAX_BIAS_CORRECTION
def test_inject_hyperparams():
  k = 2
  grads = random_grads(PARAMS, 2 * k)
  injected = optax.inject_hyperparams(lm.adamaw, static_args=("k",))(learning_rate=1e-2, k=k)
  direct = lm.adamaw(1e-2, k)
  s1, s2 = injected.init(PARAMS), direct.init(PARAMS)
  for g in grads:
    u1, s1 = jax.jit(injected.update)(g, s1, PARAMS)
    u2, s2 = jax.jit(direct.update)(g, s2, PARAMS)
    # Injected hyperparameters are float32 arrays: (1 - b1) rounds differently.
    chex.assert_trees_all_close(u1, u2, rtol=1e-4)
  s1.hyperparams["learning_rate"] = jnp.asarray(0.0)
  for g in grads[:k]:
    u1, s1 = injected.update(g, s1, PARAMS)
  assert all(float(jnp.max(jnp.abs(u))) == 0.0 for u in jax.tree.leaves(u1))
  with pytest.raises(ValueError, match="static_args"):
    optax.inject_hyperparams(lm.adamaw)(learning_rate=1e-2, k=k).init(PARAMS)


@OPTAX_BIAS_CORRECTION
def test_microbatch_step_equals_k_updates_by_hand():
  k = 4
  tx = optax.chain(lm.adama(k), optax.scale_by_learning_rate(1e-2))
  step = jax.jit(lm.microbatch_step(mlp_loss, tx, k))
  params, batch = mlp_init(), mlp_batch()
  state = tx.init(params)
  p1, s1 = params, state
  p2, s2 = params, state
  for _ in range(3):
    p1, s1, metrics = step(p1, s1, batch)
    for i in range(k):
      micro = jax.tree.map(lambda x: x[i::k], batch)  # strided micro-batches
      updates, s2 = tx.update(jax.grad(mlp_loss)(p2, micro), s2, p2)
      p2 = optax.apply_updates(p2, updates)
  chex.assert_trees_all_close((p1, s1), (p2, s2), rtol=1e-6, atol=1e-7)
  assert int(s1[0].count) == 3 and metrics["loss"].shape == ()


def _applying_every_micro_step(loss, tx, k):
  """microbatch_step's AdamA path before issue 21: the params carried through the scan and
  every micro-batch's (zero) update applied to them."""
  def step(params, opt_state, batch):
    def body(carry, micro):
      params, opt_state = carry
      value, grads = jax.value_and_grad(loss)(params, micro)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), value
    (params, opt_state), losses = jax.lax.scan(
        body, (params, opt_state), jax.tree.map(lambda x: x.swapaxes(0, 1), steps._split(batch, k)))
    return params, opt_state, {"loss": losses.mean()}
  return step


@pytest.mark.parametrize("k", [1, 4])
@OPTAX_BIAS_CORRECTION
def test_microbatch_step_applies_one_update_bit_for_bit(k):
  tx = lm.adamaw(1e-2, k, weight_decay=0.1)
  params = mlp_init()
  runs = three_steps([lm.microbatch_step(mlp_loss, tx, k),
                       _applying_every_micro_step(mlp_loss, tx, k)], params, tx)
  exact(runs[0], runs[1])


@OPTAX_BIAS_CORRECTION
def test_train_step_is_one_update_or_microbatch_step():
  tx = optax.adamw(1e-2)
  params, batch = mlp_init(), mlp_batch()

  @jax.jit
  def by_hand(params, state, batch):
    loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, {"loss": loss}
  exact(jax.jit(optim.train_step(mlp_loss, tx))(params, tx.init(params), batch),
        by_hand(params, tx.init(params), batch))
  adama = lm.adamaw(1e-2, 4)
  exact(jax.jit(optim.train_step(mlp_loss, adama, 4, fold_in_backward=True))(
            params, adama.init(params), batch),
        jax.jit(lm.microbatch_step(mlp_loss, adama, 4, fold_in_backward=True))(
            params, adama.init(params), batch))
  with pytest.raises(ValueError, match="`fold_in_backward` folds AdamA's micro-batches"):
    optim.train_step(mlp_loss, tx, fold_in_backward=True)
  with pytest.raises(ValueError, match="positive Python int"):
    optim.train_step(mlp_loss, tx, 0)


@pytest.mark.parametrize("tx_k, step_k", [(4, 2), (2, 4), (1, 2), (2, 1)])
@OPTAX_BIAS_CORRECTION
def test_a_step_refuses_an_adama_over_another_k(tx_k, step_k):
  """adamaw(k=4) under a 2-micro-batch step left the params unchanged, k=2 under a
  4-micro-batch one dropped the first half-step's update, silently: the state holds its k,
  and microbatch_step and train_step refuse another, quoting both."""
  tx = lm.adamaw(1e-2, tx_k)
  params, batch = mlp_init(), mlp_batch()
  assert optim.find_adama_state(tx.init(params)).k == tx_k
  steps_ = [optim.train_step(mlp_loss, tx, step_k)]
  if step_k > 1:
    steps_.append(lm.microbatch_step(mlp_loss, tx, lm.MomentFold(step_k)))
  for step in steps_:
    with pytest.raises(ValueError, match=f"AdamA over k={tx_k}.*k={step_k}"):
      jax.jit(step)(params, tx.init(params), batch)


@OPTAX_BIAS_CORRECTION
def test_adama_state_keeps_its_k_through_serialisation_and_jit():
  """The k is static metadata of the state: no leaf, kept by flax.serialization's restore
  into a template and by jit."""
  tx = lm.adamaw(1e-2, 2)
  params = mlp_init()
  state = tx.init(params)
  assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(state))
  restored = flax.serialization.from_state_dict(
      tx.init(params), flax.serialization.to_state_dict(state))
  restored = flax.serialization.from_bytes(restored, flax.serialization.to_bytes(restored))
  params, state, _ = jax.jit(optim.train_step(mlp_loss, tx, 2))(params, restored, mlp_batch())
  assert optim.find_adama_state(state).k == 2 and int(optim.find_adama_state(state).count) == 1


@OPTAX_BIAS_CORRECTION
def test_on_kth_micro_step_is_conditionally_transform():
  """Its twin: the same updates and inner state to float tolerance (XLA fuses a select and a
  cond differently: about 1 ulp)."""
  k = 3
  inner = lambda: optax.chain(optax.add_decayed_weights(0.1),
                              optax.scale_by_learning_rate(optax.linear_schedule(1.0, 0.1, 4)))
  ours = optax.chain(lm.adama(k), optim.on_kth_micro_step(inner(), k))
  twin = optax.chain(lm.adama(k), optax.conditionally_transform(inner(), lambda n: n % k == k - 1))
  s1, s2 = ours.init(PARAMS), twin.init(PARAMS)
  for g in random_grads(PARAMS, 3 * k):
    u1, s1 = jax.jit(ours.update)(g, s1, PARAMS)
    u2, s2 = jax.jit(twin.update)(g, s2, PARAMS)
    chex.assert_trees_all_close(u1, u2, rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(s1[1].inner_state, s2[1].inner_state)
  assert int(s1[1].micro_step) == int(s2[1].step) == 3 * k


@OPTAX_BIAS_CORRECTION
def test_microbatch_step_applies_every_update_under_a_skipping_wrapper():
  """A wrapper that may skip AdamA (here its second micro-step) shifts its step across calls:
  the update then falls inside the loop, and is applied there, as before."""
  k = 4
  tx = optax.conditionally_mask(lm.adamaw(1e-2, k), lambda n: n != 1)
  params = mlp_init()
  runs = three_steps([lm.microbatch_step(mlp_loss, tx, k),
                       _applying_every_micro_step(mlp_loss, tx, k)], params, tx)
  exact(runs[0], runs[1])
  assert not np.array_equal(runs[0][0]["w1"], params["w1"])


@OPTAX_BIAS_CORRECTION
def test_microbatch_steps_one_update_holds_no_more_than_one_inside_the_loop():
  """On the H100 target: the update applied once after the loop holds no more than applying
  it at every micro-step (jax 0.10.2's XLA kept a parameter-sized buffer in the loop for the
  latter, 0.4 of the gradient more; jax 0.12's schedules both alike, within 10 KB of 32 MiB),
  and AdamA saves nearly the whole gradient against accumulation."""
  k = 4
  params = [jax.ShapeDtypeStruct((1024, 1024), jnp.float32)] * 8
  batch = (jax.ShapeDtypeStruct((4 * 256, 1024), jnp.float32),) * 2
  temps = {}
  for name, make, tx in (("once", lm.microbatch_step, lm.adamaw(1e-3, k)),
                         ("every", _applying_every_micro_step, lm.adamaw(1e-3, k)),
                         ("accumulate", lm.microbatch_step, optax.adamw(1e-3))):
    step = jax.jit(make(dense_stack_loss, tx, k), donate_argnums=(0, 1))
    temps[name] = lm.memory.analyze(step, params, jax.eval_shape(tx.init, params), batch,
                                    target="h100").temp_bytes
  grad_bytes = lm.memory.tree_bytes(params)
  assert temps["once"] <= temps["every"] + 0.001 * grad_bytes, temps
  # 0.875x measured since the micro-batches are sliced in the loop body (no batch copy): that
  # took 8.4 MB from accumulation and 6.3 MB from AdamA here (0.94x before).
  assert temps["once"] <= temps["accumulate"] - 0.85 * grad_bytes, temps


@OPTAX_BIAS_CORRECTION
def test_microbatch_step_accumulates_for_other_optimizers():
  k = 4
  tx = optax.adam(1e-2)
  params, batch = mlp_init(), mlp_batch()
  p1, s1, _ = jax.jit(lm.microbatch_step(mlp_loss, tx, k))(params, tx.init(params), batch)
  s2 = tx.init(params)
  updates, s2 = tx.update(jax.grad(mlp_loss)(params, batch), s2)
  chex.assert_trees_all_close((p1, s1), (optax.apply_updates(params, updates), s2), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("folded", [True, False], ids=["adama", "adam"])
@OPTAX_BIAS_CORRECTION
def test_has_state_threads_state_through_micro_batches(folded):
  k = 4
  tx = optax.chain(lm.adama(k), optax.scale_by_learning_rate(1e-2)) if folded else optax.adam(1e-2)
  params, batch = mlp_init(), mlp_batch()
  p1, c1, s1, _ = jax.jit(lm.microbatch_step(stateful_loss, tx, k, has_state=True))(
      params, jnp.zeros([]), tx.init(params), batch)
  p2, c2, s2, grads = params, jnp.zeros([]), tx.init(params), []
  for i in range(k):  # k sequential passes, the state threaded
    g, c2 = jax.grad(stateful_loss, has_aux=True)(p2, c2, jax.tree.map(lambda x: x[i::k], batch))
    if folded:
      updates, s2 = tx.update(g, s2, p2)
      p2 = optax.apply_updates(p2, updates)
    else:
      grads.append(g)
  if not folded:
    updates, s2 = tx.update(jax.tree.map(lambda *g: sum(g) / k, *grads), s2, p2)
    p2 = optax.apply_updates(p2, updates)
  chex.assert_trees_all_close((p1, c1, s1), (p2, c2, s2), rtol=1e-5, atol=1e-7)


@OPTAX_BIAS_CORRECTION
def test_has_aux_stacks_aux_per_micro_batch():
  loss = lambda p, b: (mlp_loss(p, b), {"n": b[0].shape[0]})
  tx = lm.adama(2)
  _, _, metrics = lm.microbatch_step(loss, tx, 2, has_aux=True)(mlp_init(), tx.init(mlp_init()), mlp_batch())
  np.testing.assert_array_equal(metrics["aux"]["n"], [8, 8])


@OPTAX_BIAS_CORRECTION
def test_state_saved_mid_step_continues_bit_identically():
  k = 4
  tx = lm.adamaw(1e-2, k)
  params = mlp_init()
  grads = [jax.grad(mlp_loss)(params, mlp_batch(seed=s)) for s in range(k)]
  update = jax.jit(tx.update)
  state = tx.init(params)
  for g in grads[:2]:
    _, state = update(g, state, params)
  restored = flax.serialization.from_bytes(tx.init(params), flax.serialization.to_bytes(state))
  assert int(restored[0].micro_step) == 2
  for g in grads[2:]:
    u1, state = update(g, state, params)
    u2, restored = update(g, restored, params)
  exact((u1, state), (u2, restored))


@OPTAX_BIAS_CORRECTION
def test_sharded_state_matches_one_device():
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(8), ("d",))
  k = 2
  params = {"w1": jax.random.normal(jax.random.key(0), (8, 32)), "w2": jax.random.normal(jax.random.key(1), (32, 1))}
  batch = mlp_batch(n=16)
  tx = optax.chain(lm.adama(k), optax.scale_by_learning_rate(1e-2))
  step = jax.jit(lm.microbatch_step(mlp_loss, tx, k))
  p1, s1, _ = step(params, tx.init(params), batch)
  shard = lambda tree: jax.tree.map(
      lambda x: jax.device_put(x, NamedSharding(mesh, P(*((None,) * (x.ndim - 1)), "d") if x.ndim and x.shape[-1] % 8 == 0 else P())), tree)
  sharded_params = shard(params)
  sharded_state = shard(tx.init(params))
  assert sharded_state[0].mu["w1"].sharding.spec == P(None, "d")
  p2, s2, _ = step(sharded_params, sharded_state, batch)
  assert len(p2["w1"].sharding.device_set) == 8
  chex.assert_trees_all_close((p1, s1), (p2, s2), rtol=1e-5, atol=1e-7)


@OPTAX_BIAS_CORRECTION
def test_apply_if_finite_skips_a_non_finite_micro_batch():
  k = 4
  tx = optax.apply_if_finite(lm.adama(k), max_consecutive_errors=3)
  grads = random_grads(PARAMS, k)
  nan = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads[0])
  state = tx.init(PARAMS)
  clean = lm.adama(k)
  clean_state = clean.init(PARAMS)
  for i, g in enumerate(grads):
    if i == 2:
      before = state
      updates, state = tx.update(nan, state)
      assert int(state.notfinite_count) == 1 and not bool(state.last_finite)
      exact(state.inner_state, before.inner_state)
      assert all(float(jnp.max(jnp.abs(u))) == 0.0 for u in jax.tree.leaves(updates))
    updates, state = tx.update(g, state)
    expected, clean_state = clean.update(g, clean_state)
    chex.assert_trees_all_close(updates, expected, rtol=1e-6)  # within 1 ulp: the cond fuses differently
  chex.assert_trees_all_close(state.inner_state, clean_state, rtol=1e-6)
  assert int(state.total_notfinite) == 1


@OPTAX_BIAS_CORRECTION
def test_apply_if_finite_with_k1_is_adams():
  ours, theirs = optax.apply_if_finite(lm.adama(1), 2), optax.apply_if_finite(optax.scale_by_adam(), 2)
  s1, s2 = ours.init(PARAMS), theirs.init(PARAMS)
  grads = random_grads(PARAMS, 5)
  grads[2] = jax.tree.map(lambda g: g * jnp.inf, grads[2])
  for g in grads:
    u1, s1 = ours.update(g, s1)
    u2, s2 = theirs.update(g, s2)
    exact(u1, u2)
  assert int(s1.total_notfinite) == int(s2.total_notfinite) == 1


@pytest.mark.parametrize("k", [0, -1, 2.0, True, "4"])
def test_bad_k(k):
  with pytest.raises(ValueError, match="`k`"):
    lm.adama(k)
  with pytest.raises(ValueError, match="`k`"):
    lm.microbatch_step(mlp_loss, optax.adam(1e-3), k)


def test_bad_arguments():
  with pytest.raises(ValueError, match="nu_scale"):
    lm.adama(2, nu_scale="sum")
  tx = lm.adama(2)
  with pytest.raises(ValueError, match="tree structures"):
    tx.update({"w": jnp.ones(3)}, tx.init({"v": jnp.ones(3)}))
  over_3 = lm.adama(3)
  step = lm.microbatch_step(mlp_loss, over_3, 3)
  with pytest.raises(ValueError, match="divisible by k=3"):
    step(mlp_init(), over_3.init(mlp_init()), mlp_batch(n=16))
  with pytest.raises(ValueError, match="tree structures"):
    step(mlp_init(), over_3.init({"w": jnp.ones(3)}), mlp_batch(n=15))
  with pytest.raises(ValueError, match="an AdamA over k=3, and this one folds over k=2"):
    tx.update(PARAMS, over_3.init(PARAMS))
  adam = optax.adam(1e-3)
  step = lm.microbatch_step(scanned_loss, adam, 2, fold_in_backward=lm.optim.FoldInBackward())
  with pytest.raises(ValueError, match="fold_in_backward"):
    step(scanned_init(), adam.init(scanned_init()), mlp_batch())
  ignores_moments = lambda params, batch, moments: scanned_loss(params, batch)
  step = lm.microbatch_step(ignores_moments, tx, 2, fold_in_backward=lm.optim.FoldInBackward())
  with pytest.raises(ValueError, match="made 0 such calls"):
    step(scanned_init(), tx.init(scanned_init()), mlp_batch())
  step = lm.microbatch_step(scanned_loss, tx, 2, fold_in_backward=lm.optim.FoldInBackward("blocks"))
  with pytest.raises(ValueError, match="'blocks'"):
    step(scanned_init(), tx.init(scanned_init()), mlp_batch())


