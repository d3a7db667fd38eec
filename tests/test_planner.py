import re

import jax
import jax.numpy as jnp
import pytest

import lowmem_jax as lm
from lowmem_jax import models, names
from lowmem_jax.compile import planner, policies

TINY_VIT = dict(patch_size=4, width=64, depth=1, mlp_dim=256, num_heads=2, num_classes=10)


@pytest.fixture(scope="module")
def workload():
  """A 1-block ViT on 32x32 images, batch 16: the planner's step and its abstract args."""
  model = models.ViT(**TINY_VIT, dtype=jnp.float32)
  inputs = jax.ShapeDtypeStruct((16, 32, 32, 3), jnp.float32)
  labels = jax.ShapeDtypeStruct((16,), jnp.int32)
  wl = models.Workload("tiny-vit", model, inputs, labels)

  def step(params, x, y, *, policy):
    return jax.grad(wl.with_policy(policy).loss)(params, x, y)

  return step, (wl.abstract_params(), inputs, labels)


def _peak(step, args, policy):
  return lm.memory.analyze(lambda *a: step(*a, policy=policy), *args).peak_bytes


@pytest.fixture(scope="module")
def peaks(workload):
  """The compiled peaks without remat and with full remat (``top``, ``floor``), compiled
  once for the module's tests."""
  step, args = workload
  return _peak(step, args, policies.everything), _peak(step, args, policies.full)


def test_a_budget_the_step_fits_needs_no_remat(workload, peaks):
  step, args = workload
  plan = lm.plan(step, *args, budget=peaks[0])
  assert plan.policy is policies.everything and plan.recompute_flops == 0


@pytest.mark.slow
@pytest.mark.heavy
def test_the_plan_fits_the_budget_at_the_least_recompute_tried(workload, peaks):
  step, args = workload
  top, floor = peaks
  assert floor < top  # remat shows in the compiled figure (see targets.CPU_KEEPS_REMAT)
  budget = (top + floor) // 2
  plan = lm.plan(step, *args, budget=budget)
  assert plan.peak_bytes <= budget
  assert _peak(step, args, plan.policy) == plan.peak_bytes  # the oracle, compiled afresh
  full = next(c for c in plan.tried if c.policy == policies.full)
  # A policy that recomputes only elementwise work can count a few FLOPs
  # fewer than the step without remat: XLA fuses the two programs differently.
  assert -0.01 * plan.step_flops < plan.recompute_flops < full.recompute_flops
  assert {c.fits for c in plan.tried} == {True, False}
  assert "save_only" in str(plan) and f"{budget:,}" in str(plan)


@pytest.mark.slow
def test_a_second_plan_reuses_the_compiled_candidates(workload, peaks):
  """Over the candidates of two names (the whole search compiles 11: the heavy test above)."""
  step, args = workload
  top, floor = peaks
  plan = lambda: lm.plan(step, *args, budget=(top + floor) // 2,
                         names=(names.QKV, names.ATTN_OUT))
  assert len(plan().tried) > 1
  before = planner._measure.cache_info().misses
  plan()
  assert planner._measure.cache_info().misses == before


@pytest.mark.slow
def test_an_impossible_budget_names_the_smallest_peak(workload, peaks):
  step, args = workload
  floor = peaks[1]
  with pytest.raises(planner.BudgetError, match="smallest peak reachable") as error:
    lm.plan(step, *args, budget=floor // 2)
  reached = int(re.search(r"reachable: ([\d,]+) bytes", str(error.value)).group(1).replace(",", ""))
  assert floor // 2 < reached <= floor


def test_names_restrict_the_search(workload, peaks):
  step, args = workload
  top, floor = peaks
  plan = lm.plan(step, *args, budget=(top + floor) // 2, names=(names.QKV, names.ATTN_OUT))
  for c in plan.tried:
    if (kept := policies.kept_names(c.policy)) is not None:
      assert kept <= {names.QKV, names.ATTN_OUT}


def test_candidates_may_keep_names_the_step_does_not_tag(workload, peaks):
  step, args = workload  # exact activations, plain norms: no act_code, no norm_rstd
  top, floor = peaks
  plan = lm.plan(step, *args, budget=(top + floor) // 2, candidates=(policies.compressed,))
  assert plan.peak_bytes <= (top + floor) // 2


def test_bad_arguments_are_named(workload, peaks):
  step, args = workload
  with pytest.raises(ValueError, match="budget"):
    lm.plan(step, *args, budget=0)
  with pytest.raises(ValueError, match="budget"):
    lm.plan(step, *args, budget=1.5e9)
  with pytest.raises(TypeError, match="step_fn"):
    lm.plan(None, *args, budget=10)
  with pytest.raises(ValueError, match="not tagged"):
    lm.plan(step, *args, budget=peaks[0], names=("no_such_name",))
  with pytest.raises(TypeError, match="candidates"):
    lm.plan(step, *args, budget=10, candidates=("dots",))


def test_the_steps_own_names_need_no_registering():
  """The planner's candidates keep names it finds tagged in the step, in the vocabulary or
  not."""
  def step(w, x, *, policy):
    def loss(w, x):
      return jnp.sum(jnp.sin(jax.ad_checkpoint.checkpoint_name(jnp.sin(x @ w), "planner_own")) @ w)
    return jax.grad(jax.checkpoint(loss, policy=policy))(w, x)
  args = (jax.ShapeDtypeStruct((32, 32), jnp.float32), jax.ShapeDtypeStruct((64, 32), jnp.float32))
  with pytest.raises(planner.BudgetError):  # after save_only({'planner_own'}) was compiled
    lm.plan(step, *args, budget=1)
  assert "planner_own" not in names.known()
