"""`lowmem_jax.optim.in_backward`: AdamA's moments folded in the backward (``fold_in_backward``),
bit for bit what folding after the backward gives, and never the whole gradient held."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowmem_jax as lm
from adama import dense_stack_loss  # benchmarks/, on sys.path in conftest.py
from lowmem_jax import optim
from optim_checks import (LinenMLP, exact, layer, mlp_batch, mlp_init, mlp_loss, scanned_init,
                          scanned_loss, three_steps)
from third_party_promotion import OPTAX_BIAS_CORRECTION


@pytest.mark.parametrize("where", [None, lambda path, leaf: path[-1].key == "kernel"],
                         ids=["every leaf", "kernels"])
@OPTAX_BIAS_CORRECTION
def test_fold_in_backward_of_any_pytree_equals_folding_after_the_backward(where):
  """A non-scanned Flax linen model: bit for bit in float32 (NNX: test_nnx.py)."""
  k = 4
  model = LinenMLP()
  params = model.init(jax.random.key(0), jnp.zeros((1, 8)))["params"]
  loss = lambda p, b: jnp.mean((model.apply({"params": p}, b[0]) - b[1]) ** 2)
  tx = lm.adamaw(1e-2, k)
  options = optim.FoldInBackward(key=None, where=where)
  runs = three_steps([lm.microbatch_step(loss, tx, k, fold_in_backward=f)
                       for f in (None, options)], params, tx)
  exact(runs[0], runs[1])


@OPTAX_BIAS_CORRECTION
def test_fold_in_backward_never_holds_the_whole_gradient():
  """On the H100 target, in the compiled buffers at the step's peak."""
  k = 4
  params = [jax.ShapeDtypeStruct((1024, 1024), jnp.float32)] * 8
  batch = (jax.ShapeDtypeStruct((4 * 256, 1024), jnp.float32),) * 2
  tx = lm.adamaw(1e-3, k)
  step = jax.jit(lm.microbatch_step(dense_stack_loss, tx, k, fold_in_backward=True),
                 donate_argnums=(0, 1))
  peak = lm.memory.report(step, params, jax.eval_shape(tx.init, params), batch, target="h100")
  assert peak.at_peak["gradients"] <= 0.25 * lm.memory.tree_bytes(params), peak.at_peak


def test_fold_in_backward_bad_options():
  with pytest.raises(ValueError, match="where"):
    optim.FoldInBackward(key=None, where=3)
  with pytest.raises(ValueError, match="where"):
    optim.FoldInBackward(where=lambda path, leaf: True)  # key="layers": the scanned path
  with pytest.raises(ValueError, match="fold_in_backward"):
    lm.microbatch_step(mlp_loss, lm.adama(2), 2, fold_in_backward="yes")
  step = lm.microbatch_step(mlp_loss, lm.adama(2), 2,
                            fold_in_backward=optim.FoldInBackward(None, where=lambda *_: False))
  with pytest.raises(ValueError, match="selects no leaf"):
    step(mlp_init(), lm.adama(2).init(mlp_init()), mlp_batch())


@pytest.mark.parametrize("nu_scale", optim.NU_SCALES)
@OPTAX_BIAS_CORRECTION
def test_fold_in_backward_equals_folding_after_backward(nu_scale):
  fold = lm.MomentFold(2, nu_scale=nu_scale)
  tx = optax.chain(lm.adama(fold), optax.scale_by_learning_rate(1e-2))
  params, batch = scanned_init(), mlp_batch()
  plain = jax.jit(lm.microbatch_step(scanned_loss, tx, fold))
  in_backward = jax.jit(lm.microbatch_step(scanned_loss, tx, fold,
                                           fold_in_backward=lm.optim.FoldInBackward("layers")))
  p1, s1 = p2, s2 = params, tx.init(params)
  for _ in range(3):
    p1, s1, m1 = plain(p1, s1, batch)
    p2, s2, m2 = in_backward(p2, s2, batch)
  chex.assert_trees_all_close((p1, s1, m1), (p2, s2, m2), rtol=1e-5, atol=1e-7)
  assert float(jnp.max(jnp.abs(s2[0].mu["layers"]["w1"]))) > 0


@OPTAX_BIAS_CORRECTION
def test_fold_in_backward_with_state_takes_moments_last():
  k = 2
  tx = optax.chain(lm.adama(k), optax.scale_by_learning_rate(1e-2))
  counting = lambda params, state, batch, moments: (scanned_loss(params, batch, moments), state + 1)
  params, batch = scanned_init(), mlp_batch()
  p1, calls, s1, _ = jax.jit(lm.microbatch_step(
      counting, tx, k, has_state=True, fold_in_backward=lm.optim.FoldInBackward()))(
          params, jnp.zeros([], jnp.int32), tx.init(params), batch)
  p2, s2, _ = jax.jit(lm.microbatch_step(scanned_loss, tx, k))(params, tx.init(params), batch)
  chex.assert_trees_all_close((p1, s1), (p2, s2), rtol=1e-5, atol=1e-7)
  assert int(calls) == k


@pytest.mark.parametrize("options", [optim.FoldInBackward(key=None), optim.FoldInBackward("layers")],
                         ids=["any pytree", "scan_layers"])
@OPTAX_BIAS_CORRECTION
def test_fold_in_backward_apply_if_finite_skips_a_non_finite_micro_batch(options):
  """As without fold_in_backward: the NaN micro-batch is skipped (moments and params kept)
  and counted in total_notfinite. Every leaf folds in backward, so no gradient that reaches
  ``tx.update`` is computed as usual."""
  k = 4
  tx = optax.apply_if_finite(lm.adamaw(1e-2, k), max_consecutive_errors=3)
  params = {"layers": scanned_init()["layers"]}
  loss = lambda p, b, moments=None: jnp.mean(
      (lm.optim.scan_layers(layer, b[0], p["layers"], moments) - b[1]) ** 2)
  x, y = mlp_batch()
  poisoned = (x.at[1].set(jnp.nan), y)  # row 1: micro-batch 1 (strided)
  runs = [(params, tx.init(params))] * 2
  for batch in (poisoned, mlp_batch(seed=2)):
    runs = [jax.jit(lm.microbatch_step(loss, tx, k, fold_in_backward=f))(p, s, batch)
            for f, (p, s, *_) in zip((None, options), runs)]
  chex.assert_trees_all_close(runs[0][:2], runs[1][:2], rtol=1e-5, atol=1e-7)
  assert int(runs[1][1].total_notfinite) == 1
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(runs[1][:2]))


def test_scan_layers_gradient_of_input_matches_plain_scan():
  params, (x, _) = scanned_init(), mlp_batch()
  moments = optim.LayerMoments(*(jax.tree.map(jnp.zeros_like, params["layers"]),) * 2,
                               jnp.asarray(True), optim.MomentFold(2))
  f = lambda m: lambda x: jnp.sum(jnp.sin(lm.optim.scan_layers(layer, x, params["layers"], m)))
  chex.assert_trees_all_close(f(moments)(x), f(None)(x), rtol=1e-6)
  chex.assert_trees_all_close(jax.grad(f(moments))(x), jax.grad(f(None))(x), rtol=1e-5, atol=1e-6)


@OPTAX_BIAS_CORRECTION
def test_adama_step_holds_no_accumulator_in_compiled_memory():
  """XLA's compiled peak on the H100 target (abstract shapes). A scanned model's backward makes
  the stacked layers' gradient whole, so AdamA alone saves little there (the unscanned stack
  above saves nearly all of it); folding in the layers' backward rule saves the gradient."""
  k = 4
  params = jax.eval_shape(lambda: scanned_init(layers=4, d=256, h=1024))
  batch = (jax.ShapeDtypeStruct((8, 256), jnp.float32), jax.ShapeDtypeStruct((8, 1), jnp.float32))
  grad_bytes = lm.memory.tree_bytes(params)
  peaks = {}
  for name, tx, options in [
      ("accumulate", optax.adam(1e-3), None),
      ("adama", lm.adama(k), None),
      ("fold-in-backward", lm.adama(k), lm.optim.FoldInBackward())]:
    step = jax.jit(lm.microbatch_step(scanned_loss, tx, k, fold_in_backward=options),
                   donate_argnums=(0, 1))
    peaks[name] = lm.memory.analyze(step, params, jax.eval_shape(tx.init, params), batch,
                                    target="h100").peak_bytes
  assert peaks["adama"] <= peaks["accumulate"], peaks
  assert peaks["fold-in-backward"] <= peaks["accumulate"] - 0.9 * grad_bytes, peaks


@OPTAX_BIAS_CORRECTION
def test_one_moment_fold_for_both_halves_of_adama():
  """One MomentFold given to adama and microbatch_step: the backward folds with its
  rates, bit for bit what folding after the backward with the same adama gives."""
  k = 4
  model = LinenMLP()
  params = model.init(jax.random.key(0), jnp.zeros((1, 8)))["params"]
  loss = lambda p, b: jnp.mean((model.apply({"params": p}, b[0]) - b[1]) ** 2)
  fold = lm.MomentFold(k, b1=0.8, b2=0.99, nu_scale="mean")
  tx = lm.adamaw(1e-2, fold)
  runs = three_steps([lm.microbatch_step(loss, tx, fold, fold_in_backward=f)
                       for f in (None, True)], params, tx)
  exact(runs[0], runs[1])
  default = three_steps([lm.microbatch_step(loss, lm.adamaw(1e-2, k), k)], params,
                         lm.adamaw(1e-2, k))
  assert not np.allclose(jax.tree.leaves(runs[0])[0], jax.tree.leaves(default[0])[0])


@OPTAX_BIAS_CORRECTION
def test_adama_refuses_a_fold_that_differs_from_the_backward():
  params = {"w": jnp.ones((8, 4))}
  loss = lambda p, x: jnp.sum((x @ p["w"]) ** 2)
  x = jnp.ones((4, 8))
  tx = optax.chain(lm.adama(2, b1=0.95), optax.scale_by_learning_rate(0.1))
  with pytest.raises(ValueError, match="give it to both"):  # an int k folds with MomentFold(2)
    lm.microbatch_step(loss, tx, 2, fold_in_backward=True)(params, tx.init(params), x)
  agreeing = lm.MomentFold(2, b1=0.95)
  lm.microbatch_step(loss, tx, agreeing, fold_in_backward=True)(params, tx.init(params), x)
  hyper = optax.inject_hyperparams(lm.adama, static_args=("k", "b1", "b2"))(k=2, b1=0.9)
  lm.microbatch_step(loss, hyper, 2, fold_in_backward=True)(params, hyper.init(params), x)
  with pytest.raises(ValueError, match="`nu_scale`='mean' differs"):
    lm.adama(lm.MomentFold(2), b1=0.9, nu_scale="mean")  # b1: the default, taken as the fold's
  assert lm.adama(lm.MomentFold(2, b1=0.8)).init(params).mu["w"].shape == (8, 4)
  # An injected b1 cannot reach the backward's fixed rule: refused (it was ignored under jit).
  traced = optax.inject_hyperparams(lm.adama, static_args=("k",))(k=2, b1=0.9)
  assert set(traced.init(params).hyperparams) >= {"b1", "b2", "eps"}
  with pytest.raises(ValueError, match="traced"):
    jax.jit(lm.microbatch_step(loss, traced, 2, fold_in_backward=True))(
        params, traced.init(params), x)
  with pytest.raises(ValueError, match="static_args"):
    optax.inject_hyperparams(lm.adama, static_args=("k",))(k=lm.MomentFold(2), b1=0.5).init(
        params)
  with pytest.raises(ValueError, match="`k` must be a positive"):
    lm.adamaw(0.1, 0)
