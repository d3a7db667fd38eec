"""A remat planner: a policy of least recompute whose compiled step fits a budget.

The oracle is XLA: each candidate policy is compiled on abstract shapes and
judged by its compiled peak (`lowmem_jax.compile.memory.MemoryStats.peak_bytes`) and
by the FLOPs of its compiled step (``cost_analysis()``). Recompute is the
FLOPs beyond the step with `policies.everything`, which keeps what a step
without remat keeps. The candidates are ``save_only(S)`` for sets ``S`` of
checkpoint names and a few given policies, searched in four stages:

1. `policies.everything`: if it fits, nothing need be recomputed.
2. `policies.full` and the ``candidates``: by default the ready-made
   `policies.minimal` and `policies.dots`, which keep matmul outputs whether
   or not they carry a name.
3. A greedy chain from ``save_only(all names)`` to ``full``, dropping names in
   order of bytes saved per recompute FLOP (bytes from the jaxpr's tagged
   values, FLOPs from one lowering per name), bisected for the first fit.
4. Refinement: a line fitted to the compiled peaks of the chain predicts the
   peak of every name set; the few sets predicted to fit at the least
   estimated recompute are compiled, and the best that fits wins.

If nothing compiled fits, `BudgetError` gives the smallest peak reached. The
choice is the least recompute among the candidates compiled, not a proof of
the least over every policy. Compiled results are cached per step function,
argument shapes, policy and target (policies must be hashable, as JAX's and
this library's are), so a second `plan` of the same step at another budget
compiles little; the cache holds the step functions: `clear_cache` drops it.
"""

import collections
import dataclasses
import functools
import itertools
import math
import sys
import time
from typing import Callable

import jax
import numpy as np

from lowmem_jax import _jaxpr
from lowmem_jax import names as _names
from lowmem_jax.compile import memory, policies, targets


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One compiled policy.

  Attributes:
    label: the policy, readably.
    policy: the policy itself.
    peak_bytes: compiled peak (`memory.MemoryStats.peak_bytes`).
    flops: FLOPs of the compiled step (XLA's cost analysis).
    recompute_flops: ``flops`` beyond the step with `policies.everything`;
      slightly negative where XLA fuses the two programs differently.
    fits: ``peak_bytes <= budget``.
  """
  label: str
  policy: Callable
  peak_bytes: int
  flops: float
  recompute_flops: float
  fits: bool


@dataclasses.dataclass(frozen=True)
class Plan:
  """What `plan` chose and what it tried.

  Attributes:
    policy: the chosen policy; pass it to the step as ``policy=``.
    peak_bytes: its compiled peak.
    recompute_flops: its FLOPs beyond the step with `policies.everything`.
    step_flops: FLOPs of the step with `policies.everything`.
    budget: the budget asked for, in bytes.
    tried: every compiled candidate, in the order tried.
    seconds: wall time of the search.
  """
  policy: Callable
  peak_bytes: int
  recompute_flops: float
  step_flops: float
  budget: int
  tried: tuple[Candidate, ...]
  seconds: float

  @property
  def recompute_fraction(self) -> float:
    """Recompute as a fraction of the step's FLOPs."""
    return self.recompute_flops / self.step_flops if self.step_flops else 0.0

  def __str__(self) -> str:
    lines = [f"budget {self.budget:,} bytes: {policies.describe(self.policy)}, peak "
             f"{self.peak_bytes:,} bytes, recompute {100 * self.recompute_fraction:.1f}% of "
             f"{self.step_flops:.3g} FLOPs ({len(self.tried)} compiled in {self.seconds:.0f} s)",
             f"{'peak bytes':>16} {'recompute %':>11} fits  policy"]
    for c in sorted(self.tried, key=lambda c: c.peak_bytes):
      share = 100 * c.recompute_flops / self.step_flops if self.step_flops else 0.0
      lines.append(f"{c.peak_bytes:>16,} {share:>11.1f} {'yes' if c.fits else 'no ':<4}  {c.label}")
    return "\n".join(lines)


MAX_ENUMERATED_NAMES = 16  # the refinement scores 2**len(names) sets


class BudgetError(ValueError):
  """No policy the search tried fits the budget."""


def plan(step_fn: Callable, *args, budget: int, names: tuple[str, ...] | None = None,
         candidates: tuple[Callable, ...] = (policies.minimal, policies.dots), refine: int = 4,
         donate_argnums: tuple[int, ...] = (), progress: bool = False,
         target: "targets.Target | str | None" = None) -> Plan:
  """Finds a remat policy of least recompute whose compiled step fits ``budget``.

  Least among the candidates compiled (see the module docstring for the search).

  Args:
    step_fn: the step, called as ``step_fn(*args, policy=policy)``; it passes
      ``policy`` to its `jax.checkpoint` / `nn.remat` (e.g. the reference
      models' ``remat_policy``). Give the plain function: it is jitted here.
    *args: arrays or `jax.ShapeDtypeStruct` pytrees; nothing runs.
    budget: bytes the compiled peak may reach.
    names: checkpoint names the policies may keep; default: every name the
      step tags.
    candidates: other policies to compile and weigh with the name sets.
    refine: how many name sets to compile after the greedy chain (none past
      `MAX_ENUMERATED_NAMES` names).
    donate_argnums: arguments the step donates (``jax.jit``'s), as a training
      step donates its parameters and optimizer state.
    progress: print each compiled candidate to stderr.
    target: what the budget is for and each candidate is compiled for (a
      `lowmem_jax.compile.targets.Target` or its name); default
      `lowmem_jax.compile.targets.default`, the GPU the figures are for.

  Returns:
    `Plan`: the chosen policy, its peak and recompute, and the candidates tried.

  Raises:
    BudgetError: if no policy compiled fits; the message gives the smallest
      peak reached.

  XLA's cost analysis counts the body of a loop once, so for a model that
  scans its layers the recompute figures are per layer, not per step.
  """
  if not callable(step_fn):
    raise TypeError(f"step_fn must be callable, got {type(step_fn).__name__}.")
  if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget <= 0:
    raise ValueError(f"budget must be a positive int of bytes, got {budget!r}.")
  if not all(callable(p) for p in candidates):
    raise TypeError(f"candidates must be policies (callables), got {candidates!r}.")
  if not isinstance(refine, int) or refine < 0:
    raise ValueError(f"refine must be an int >= 0, got {refine!r}.")
  start = time.perf_counter()
  target = targets.resolve(target)
  search = _Search(step_fn, target, target.place(args), int(budget), tuple(donate_argnums), progress)
  tagged = search.tagged_bytes()
  names = tuple(tagged) if names is None else _checked(names, tagged)
  base = search.compiled(policies.everything)
  if base.fits:
    return search.result(base, start)
  for policy in (policies.full, *candidates):
    search.compiled(policy)
  order = search.greedy_order(names, tagged)
  chain = [frozenset(order[i:]) for i in range(len(order) + 1)]
  lo, hi = 0, len(chain) - 1  # chain[hi] is full
  while lo < hi:
    mid = (lo + hi) // 2
    if search.compiled(_keeping(chain[mid])).fits:
      hi = mid
    else:
      lo = mid + 1
  if names:
    for subset in search.predicted_best(names, tagged, refine):
      search.compiled(_keeping(subset))
  fitting = [c for c in search.tried if c.fits]
  if not fitting:
    smallest = min(search.tried, key=lambda c: c.peak_bytes)
    raise BudgetError(
        f"budget {budget:,} bytes is below the smallest peak reachable: {smallest.peak_bytes:,} "
        f"bytes with {smallest.label} ({len(search.tried)} policies compiled). Lower the batch, "
        "or cut activations another way (approximate activations, MS norms, micro-batches).")
  best = min(fitting, key=lambda c: (c.recompute_flops, c.peak_bytes))
  return search.result(best, start)


def _keeping(names) -> policies.SaveOnly:
  """`policies.save_only` of names found tagged in the step: no vocabulary check, they are the
  step's own."""
  return policies.SaveOnly(frozenset(names))


def _checked(names, tagged) -> tuple[str, ...]:
  if isinstance(names, str) or not all(isinstance(n, str) for n in names):
    raise TypeError(f"names must be a sequence of str, got {names!r}.")
  missing = [n for n in names if n not in tagged]
  if missing:
    raise ValueError(f"names {missing} are not tagged in the step; it tags {sorted(tagged)}.")
  return tuple(dict.fromkeys(names))


class _Search:
  """The compiled candidates of one `plan` call, over a cache shared by calls."""

  def __init__(self, step_fn, target, args, budget, donate_argnums, progress):
    self.step_fn, self.target, self.args, self.budget = step_fn, target, args, budget
    self.donate_argnums = donate_argnums
    self.signature = _signature(args, target)
    self.progress = progress
    self.tried: list[Candidate] = []
    self.base_flops = None
    self.extra: dict[str, float] = {}  # estimated recompute FLOPs of dropping each name

  def compiled(self, policy) -> Candidate:
    for c in self.tried:
      if c.policy == policy:
        return c
    t = time.perf_counter()
    peak, flops = _measure(self.step_fn, self.signature, policy, self.donate_argnums)
    if self.base_flops is None:
      self.base_flops = flops  # the first candidate is always `everything`
    c = Candidate(policies.describe(policy), policy, peak, flops, flops - self.base_flops,
                  peak <= self.budget)
    self.tried.append(c)
    if self.progress:
      print(f"plan: {c.peak_bytes:>16,} bytes {100 * c.recompute_flops / self.base_flops:5.1f}% "
            f"recompute {'fits' if c.fits else 'over'} {c.label} ({time.perf_counter() - t:.1f} s)",
            file=sys.stderr, flush=True)
    return c

  def tagged_bytes(self) -> dict[str, int]:
    """Bytes of the values each checkpoint name tags, in vocabulary order."""
    with targets.compiling(self.target):
      jaxpr = jax.make_jaxpr(functools.partial(self.step_fn, policy=policies.everything))(*self.args)
    found = collections.Counter()
    for eqn, times in _jaxpr.walk(jaxpr.jaxpr):
      if eqn.primitive.name == "name":
        aval = eqn.outvars[0].aval
        found[eqn.params["name"]] += times * math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
    return {n: found[n] for n in _names.ordered(found)}

  def greedy_order(self, names, tagged) -> list[str]:
    """``names`` by bytes saved per FLOP recomputed, best to drop first."""
    flops_all = _lowered_flops(self.step_fn, _keeping(names), self.args, self.target)
    for n in names:
      rest = _keeping(m for m in names if m != n)
      self.extra[n] = max(_lowered_flops(self.step_fn, rest, self.args, self.target) - flops_all,
                          0.0)
    return sorted(names, key=lambda n: -tagged[n] / max(self.extra[n], 1.0))

  def predicted_best(self, names, tagged, count) -> list[frozenset]:
    """Up to ``count`` untried name sets predicted to fit, least estimated recompute first.

    The prediction is a least-squares line from tagged bytes to compiled peak
    over the ``save_only`` candidates compiled so far; the estimated recompute
    adds up each dropped name's. It enumerates every name set, so it skips
    vocabularies of more than `MAX_ENUMERATED_NAMES`.
    """
    considered = set(names)
    points = [(sum(tagged[n] for n in kept), c.peak_bytes) for c in self.tried
              if (kept := policies.kept_names(c.policy)) is not None and kept <= considered]
    if count == 0 or len(names) > MAX_ENUMERATED_NAMES or len({b for b, _ in points}) < 2:
      return []
    slope, intercept = np.polyfit(*zip(*points), 1)
    tried = {c.policy for c in self.tried}
    best_fit = min((c.recompute_flops for c in self.tried if c.fits), default=math.inf)
    scored = []
    for r in range(len(names) + 1):
      for kept in itertools.combinations(names, r):
        predicted = intercept + slope * sum(tagged[n] for n in kept)
        recompute = sum(self.extra[n] for n in names if n not in kept)
        if predicted <= self.budget and _keeping(kept) not in tried:
          scored.append((recompute, -predicted, frozenset(kept)))
    scored.sort(key=lambda s: s[:2])
    return [kept for recompute, _, kept in scored[:count] if recompute < best_fit]

  def result(self, best: Candidate, start: float) -> Plan:
    return Plan(best.policy, best.peak_bytes, best.recompute_flops, self.base_flops,
                self.budget, tuple(self.tried), time.perf_counter() - start)


def _signature(args, target) -> tuple:
  """A hashable stand-in for abstract ``args``, from which `_measure` rebuilds them.

  The target is part of it: the same shapes compile differently elsewhere.
  """
  leaves, treedef = jax.tree.flatten(args)
  return treedef, tuple(leaves), target


@functools.lru_cache(maxsize=512)
def _measure(step_fn, signature, policy, donate_argnums) -> tuple[int, float]:
  """Compiled peak bytes and FLOPs of ``step_fn(*args, policy=policy)``."""
  treedef, leaves, target = signature
  args = jax.tree.unflatten(treedef, leaves)
  lowered = target.lower(functools.partial(step_fn, policy=policy), *args,
                         donate_argnums=donate_argnums)
  compiled = target.compile_lowered(lowered)
  return memory.stats_of(compiled).peak_bytes, memory.step_flops(lowered, compiled)


def clear_cache() -> None:
  """Forgets every compiled candidate (and the step functions they hold)."""
  _measure.cache_clear()


def _lowered_flops(step_fn, policy, args, target) -> float:
  return memory.flops_of(target.lower(functools.partial(step_fn, policy=policy), *args))
