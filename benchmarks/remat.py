"""Remat policies and the planner on ViT-B/16 and the LLaMA-style model: the Pareto table.

For each model, with exact activations and plain norms and again with
ReGELU2/ReSiLU2 and MS norms, it prints one row per policy: the compiled peak
of the gradient step (XLA's buffer assignment on abstract shapes, float32
compute; on CPU a proxy, see lowmem_jax.compile.memory), the saved-activation bytes
(autodiff's residuals, backend-free) and the recompute FLOPs as a share of the
step without remat (XLA's cost analysis of the compiled step). Rows: no remat
(`everything`), `full`, `minimal`, `dots`, `compressed`, and the planner's
choice at three budgets between `full` and no remat.

With --exhaustive it also compiles every subset of a small name vocabulary and
compares the planner's pick, searching name sets only (``names=`` the same
vocabulary, ``candidates=()``), with the best subset at each budget.

    python benchmarks/remat.py                      # both models, both variants
    python benchmarks/remat.py --exhaustive         # + planner against exhaustive search
    python benchmarks/remat.py --quick              # a two-layer model, one variant, one plan
"""

import argparse
import functools
import itertools
import time

import jax
import jax.numpy as jnp

import lowmem_jax as lm
from lowmem_jax import app, names
from lowmem_jax.compile import policies

SIZES = {"vit-b16": dict(batch=64), "llama-100m": dict(batch=4, seq=1024)}
QUICK_SIZES = {"vit-tiny": dict(batch=2), "llama-tiny": dict(batch=2, seq=64)}
QUICK = dict(models=["llama-tiny"], variants=["exact, plain norms"], budget_fractions=(0.5,))
CPU = lm.targets.get("cpu")  # a proxy (lowmem_jax.compile.memory): the table's header says so
VARIANTS = {"exact, plain norms": "baseline",  # technique sets (lowmem_jax.app.techniques)
            "approx, MS norms": "approx+ms-norm"}
BUDGET_FRACTIONS = (0.25, 0.5, 0.75)  # of the way from full remat's peak to no remat's
SMALL_VOCABULARY = (names.QKV, names.ATTN_PROBS, names.MLP_HIDDEN, names.MLP_ACT)


def workload(model, text, sizes):
  wl = app.parse(text).workload(app.Job(model, target="cpu", **sizes[model]))

  def step(params, inputs, labels, *, policy):
    return jax.grad(wl.with_policy(policy).loss)(params, inputs, labels)

  return wl, step, (wl.abstract_params(), wl.inputs, wl.labels)


def activation_bytes(wl, policy, args):
  labels = jnp.zeros(wl.labels.shape, jnp.int32)
  loss = lambda p, x: wl.with_policy(policy).loss(p, x, labels)
  return lm.memory.saved_residuals(loss, *args[:2]).activation_bytes


@functools.cache
def _compiled(step, policy, shapes):
  lowered = CPU.lower(functools.partial(step, policy=policy), *jax.tree.unflatten(*shapes))
  compiled = CPU.compile_lowered(lowered)
  return lm.memory.stats_of(compiled).peak_bytes, lm.memory.step_flops(lowered, compiled)


def measure(step, args, policy):
  """(peak bytes, FLOPs) of the step compiled for the CPU proxy, each policy compiled once."""
  leaves, treedef = jax.tree.flatten(args)
  return _compiled(step, policy, (treedef, tuple(leaves)))


def pareto(model, variant, text, exhaustive, sizes, budget_fractions=BUDGET_FRACTIONS):
  wl, step, args = workload(model, text, sizes)
  top, base_flops = measure(step, args, policies.everything)
  floor, _ = measure(step, args, policies.full)
  rows = [(name, policy) for name, policy in policies.READY_MADE.items()]
  budgets = [int(floor + f * (top - floor)) for f in budget_fractions]
  plans = []
  for f, budget in zip(budget_fractions, budgets):
    plan = lm.plan(step, *args, budget=budget, target=CPU)
    plans.append(plan)
    rows.append((f"plan at {budget / 2**20:.1f} MiB ({f:.0%}): {policies.describe(plan.policy)} "
                 f"[{len(plan.tried)} compiled, {plan.seconds:.0f} s]", plan.policy))
  print(f"\n### {model} ({sizes[model]}), {variant}, float32 compute, compiled for the CPU "
        "(a proxy)\n")
  print("| policy | compiled peak MiB | saved activations MiB | recompute % of step |")
  print("|---|---:|---:|---:|")
  saved = {}
  for label, policy in rows:
    peak, flops = measure(step, args, policy)
    saved[label] = activation_bytes(wl, policy, args)
    print(f"| {label} | {peak / 2**20:.1f} | {saved[label] / 2**20:.1f} | "
          f"{100 * (flops - base_flops) / base_flops:.1f} |", flush=True)
  print(f"\nsaved activations, no remat / full: {saved['everything'] / saved['full']:.1f}x; "
        f"compiled peak: {top / floor:.2f}x")
  if exhaustive:
    compare_exhaustive(step, args, budgets, base_flops)


def compare_exhaustive(step, args, budgets, base_flops):
  """The planner's name-set search over SMALL_VOCABULARY against every subset of it."""
  subsets = [policies.save_only(*s) for r in range(len(SMALL_VOCABULARY) + 1)
             for s in itertools.combinations(SMALL_VOCABULARY, r)]
  start = time.perf_counter()
  results = {p: measure(step, args, p) for p in subsets}
  print(f"\nexhaustive over the {len(subsets)} subsets of {SMALL_VOCABULARY} "
        f"({time.perf_counter() - start:.0f} s):\n")
  print("| budget MiB | planner's pick (names only) | its recompute % | best subset | its recompute % | gap |")
  print("|---:|---|---:|---|---:|---:|")
  for budget in budgets:
    plan = lm.plan(step, *args, budget=budget, names=SMALL_VOCABULARY, candidates=(), target=CPU)
    fitting = [(flops, p) for p, (peak, flops) in results.items() if peak <= budget]
    best_flops, best = min(fitting, key=lambda fp: fp[0])
    best_recompute = best_flops - base_flops
    excess = plan.recompute_flops - best_recompute
    gap = excess / best_recompute if best_recompute else (float("inf") if excess > 0 else 0.0)
    print(f"| {budget / 2**20:.1f} | {policies.describe(plan.policy)} | "
          f"{100 * plan.recompute_fraction:.2f} | {policies.describe(best)} | "
          f"{100 * best_recompute / base_flops:.2f} | {100 * gap:+.1f}% |", flush=True)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", nargs="+", choices=[*SIZES, *QUICK_SIZES],
                      help="default: both full-size models (--quick: llama-tiny)")
  parser.add_argument("--exhaustive", action="store_true")
  parser.add_argument("--quick", action="store_true",
                      help="a two-layer model, one variant, one plan: that it runs")
  args = parser.parse_args(argv)
  sizes = {**SIZES, **QUICK_SIZES}
  models = args.models or (QUICK["models"] if args.quick else list(SIZES))
  variants = QUICK["variants"] if args.quick else list(VARIANTS)
  fractions = QUICK["budget_fractions"] if args.quick else BUDGET_FRACTIONS
  for model in models:
    for variant in variants:
      pareto(model, variant, VARIANTS[variant], args.exhaustive, sizes, fractions)


if __name__ == "__main__":
  main()
