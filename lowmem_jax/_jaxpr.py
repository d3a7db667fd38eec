"""The one jaxpr toolkit: what every walk of a jaxpr in the library uses.

A nested jaxpr is found by what an equation's parameter holds (JAX's
`jax.extend.core.jaxprs_in_params`), never by the parameter's name (``jaxpr``,
``call_jaxpr``, ``branches``, ``fun_jaxpr``... change between JAX versions).
`call_body` is the jaxpr a call-like equation (a ``jit``, a remat, a custom rule's
primal) runs once on its operands; `walk` visits every equation, nested ones
too, with how many times it runs; `live` is the backward sweep that keeps what
the outputs need, which `used_inputs` takes into nested calls; `bind` runs an equation
again. The users: the transformation's graph (`lowmem_jax.transform.graph`), the streamed
step's per-leaf check (`lowmem_jax.optim.per_leaf`) and its update's split
(`lowmem_jax.optim.hoisted`), and the planner's tag count (`lowmem_jax.compile.planner`).
"""

from collections.abc import Iterator, Sequence
from typing import NamedTuple

from jax.extend import core as jcore

# Equations whose nested jaxprs run other than once on their operands: a loop's body
# many times (and its carry feeds the next), a conditional's one branch of several.
LOOPS_AND_BRANCHES = frozenset({"scan", "while", "cond"})


def inner_jaxprs(eqn: jcore.JaxprEqn) -> list[jcore.Jaxpr]:
  """The jaxprs (open) held by ``eqn``'s parameters, whatever their names."""
  return list(jcore.jaxprs_in_params(eqn.params))


def call_body(eqn: jcore.JaxprEqn) -> jcore.Jaxpr | None:
  """The jaxpr a call-like ``eqn`` runs once on its operands, input for input (``jit``,
  remat, ``custom_jvp_call``/``custom_vjp_call``'s primal), else None (a loop, a
  conditional, a primitive)."""
  if eqn.primitive.name in LOOPS_AND_BRANCHES:
    return None
  bodies = [j for j in inner_jaxprs(eqn) if len(j.invars) == len(eqn.invars)]
  return bodies[0] if len(bodies) == 1 else None


def bind(eqn, invals):
  """``eqn``'s primitive bound again to ``invals``: its list of outputs."""
  params = eqn.primitive.get_bind_params(eqn.params)
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*invals, **params)
  return out if eqn.primitive.multiple_results else [out]


def walk(jaxpr: jcore.Jaxpr, times: int = 1) -> Iterator[tuple[jcore.JaxprEqn, int]]:
  """``(eqn, times)`` for every equation of ``jaxpr`` and of the jaxprs nested in it, in
  order, ``times`` the runs of it a run of ``jaxpr`` makes (a scan's body: its length;
  a loop of unknown trip count or a branch: once)."""
  for eqn in jaxpr.eqns:
    yield eqn, times
    inner = times * eqn.params.get("length", 1) if eqn.primitive.name == "scan" else times
    for sub in inner_jaxprs(eqn):
      yield from walk(sub, inner)


class Step(NamedTuple):
  """One step of a backward sweep: the vars it reads and makes, and whether it has effects
  (kept whether or not its outputs are needed)."""
  reads: Sequence
  makes: Sequence
  effects: bool


def live(steps: Sequence[Step], outputs: Sequence) -> list[int]:
  """The indices of ``steps`` that ``outputs`` need (and those with effects), in order.
  What a step reads and makes are vars, or any hashable token a rewrite passes between its
  steps; a literal read is no dependence."""
  needed = {v for v in outputs if not isinstance(v, jcore.Literal)}
  keep = []
  for i in reversed(range(len(steps))):
    if steps[i].effects or any(v in needed for v in steps[i].makes):
      keep.append(i)
      needed.update(v for v in steps[i].reads if not isinstance(v, jcore.Literal))
  return keep[::-1]


def used_inputs(jaxpr: jcore.Jaxpr) -> list[int]:
  """The indices of ``jaxpr``'s inputs its outputs read, into nested calls (a remat, a
  ``jit``: only what the call's body reads); a loop or conditional reads all it is given."""
  steps = []
  for eqn in jaxpr.eqns:
    body = call_body(eqn)
    reads = eqn.invars if body is None else [eqn.invars[i] for i in used_inputs(body)]
    steps.append(Step(reads, eqn.outvars, bool(eqn.effects)))
  needed = {v for i in live(steps, jaxpr.outvars) for v in steps[i].reads
            if isinstance(v, jcore.Var)}
  needed.update(v for v in jaxpr.outvars if isinstance(v, jcore.Var))
  return [i for i, v in enumerate(jaxpr.invars) if v in needed]
