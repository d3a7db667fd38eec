"""The jaxpr interpreter of `lowmem`: one evaluator, as `jax.core.eval_jaxpr`, that binds
each equation again or runs a matcher's `Action` in its place.

`eval_eqns` is the loop; `eval_jaxpr` runs a whole jaxpr through it, `eqns_fn` a
slice of one (a pattern, to count its residuals or to test it on points).
`evaluate` is the rewriting pass: ``jit`` calls inlined, the `Pass`'s matchers
run, and ``scan``, ``cond`` and ``jax.checkpoint`` rebuilt around their
rewritten bodies.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
from jax import lax
from jax.extend import core as jcore

from lowmem_jax import _jax
from lowmem_jax._jaxpr import bind
from lowmem_jax.transform.graph import Graph, aval, live


@dataclasses.dataclass
class Action:
  """Replaces one equation: reads ``inputs`` (vars or tokens), writes ``outputs``."""
  inputs: list
  outputs: list
  fn: Callable[..., list]


def apply_layout(e, x, own_name):
  """Layout equation ``e`` (reshape, cast, checkpoint name) applied to ``x``.

  A checkpoint name the replacement already gives its output is not given
  twice, which would make autodiff count the array twice.
  """
  name = e.primitive.name
  if name == "convert_element_type":
    return x.astype(e.params["new_dtype"])
  if name == "name" and e.params["name"] == own_name:
    return x
  return bind(e, [x])[0]


def eval_eqns(eqns, order, env, outputs, actions, bind_eqn=bind):
  """Runs equations ``order`` of ``eqns`` (an action in place of each equation it
  replaces) over ``env``, a dict var -> value, and reads ``outputs``."""

  def read(v):
    return v.val if isinstance(v, jcore.Literal) else env[v]

  for i in order:
    eqn = eqns[i]
    name_stack = _jax.source_info_util.current_name_stack() + eqn.source_info.name_stack
    with _jax.source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
      if i in actions:
        action = actions[i]
        env.update(zip(action.outputs, action.fn(*map(read, action.inputs))))
      else:
        env.update(zip(eqn.outvars, bind_eqn(eqn, list(map(read, eqn.invars)))))
  return list(map(read, outputs))


def eval_jaxpr(jaxpr, consts, args, actions, bind_eqn=bind):
  """``jaxpr`` evaluated at ``args``, with ``actions`` in place of the equations they replace."""
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  order = live(jaxpr.eqns, range(len(jaxpr.eqns)), actions, jaxpr.outvars)
  return eval_eqns(jaxpr.eqns, order, env, jaxpr.outvars, actions, bind_eqn)


def eqns_fn(g, indices, inputs, outputs, actions=None, bind_eqn=bind):
  """The equations ``indices`` of graph ``g`` as a function of ``inputs``, with
  ``actions`` in place, and each inlined call they hold whole bound again (`Graph.inlined`):
  what the function computed, its derivative rules kept."""
  indices = set(indices)
  bound = {i: a for inside, acts in g.inlined if inside <= indices for i, a in acts.items()}
  actions = {i: a for i, a in {**bound, **(actions or {})}.items() if i in indices}
  order = live(g.eqns, indices, actions, outputs)
  return lambda *vals: eval_eqns(g.eqns, order, dict(zip(inputs, vals)), outputs, actions,
                                 bind_eqn)


# JAX's own functions that jax 0.12.1 made ``custom_jvp`` calls (`jax.nn.softmax`,
# `jax.nn.logsumexp`), by their functions' names, where called on one array for one (no
# ``where``, ``b`` or sign): inlined so that the matchers read their equations, and bound
# again as the call where no match takes them, so that their derivative rule stays.
INLINED_CUSTOM_JVPS = frozenset({"_softmax", "_logsumexp_impl"})
_INLINED_SCOPE = "lowmem_jax_inlined_"  # the name scope an inlined call's equations carry


def inline_jit(jaxpr, consts):
  """``(jaxpr, consts)`` with the ``jit`` calls of ``jaxpr`` inlined, recursively, and the
  calls of `INLINED_CUSTOM_JVPS` (`inline_calls`): for reading a body, not for binding it."""
  return inline_calls(jaxpr, consts)[:2]


def inline_calls(jaxpr, consts):
  """``(jaxpr, consts, calls)``: ``jaxpr`` with its ``jit`` calls and its custom_jvp calls of
  `INLINED_CUSTOM_JVPS` inlined, recursively; ``calls`` pairs each custom_jvp call inlined
  (its equation) with the indices of the equations it became."""
  if not any(e.primitive.name in ("jit", "pjit") or _inlined_call(e) for e in jaxpr.eqns):
    return jaxpr, list(consts), []
  calls = []
  bind_inlining = functools.partial(_bind_inlining, calls=calls)
  closed = jax.make_jaxpr(lambda *a: eval_jaxpr(jaxpr, consts, a, {}, bind_inlining))(
      *map(aval, jaxpr.invars))
  made = [[] for _ in calls]
  eqns = []
  for i, e in enumerate(closed.jaxpr.eqns):
    stack = e.source_info.name_stack
    kept = tuple(s for s in stack.stack if not s.name.startswith(_INLINED_SCOPE))
    for scope in set(stack.stack) - set(kept):
      made[int(scope.name[len(_INLINED_SCOPE):])].append(i)
    names = dataclasses.replace(stack, stack=kept)  # the marks gone: none leaks into HLO
    eqns.append(e.replace(source_info=e.source_info.replace(name_stack=names)))
  return closed.jaxpr.replace(eqns=eqns), list(closed.consts), list(zip(calls, made))


def bound_again(g, call, indices):
  """``{index: Action}`` binding ``call`` again in place of the equations ``indices`` of
  graph ``g`` that inlining it made (`inline_calls`): at the one that makes its output."""
  inside = set(indices)
  made = {v for i in inside for v in g.eqns[i].outvars}
  reads = {v for i in indices for v in g.eqns[i].invars
           if isinstance(v, jcore.Var) and v not in made}
  outs = [v for v in made if v in g.outvars or any(
      c not in inside for c in g.consumers.get(v, []))]
  if len(reads) != 1 or len(outs) != 1:
    raise AssertionError(f"an inlined {call.primitive.name} of one array to one reads "
                         f"{len(reads)} and makes {len(outs)} arrays")
  return {g.index(outs[0]): Action(list(reads), outs, lambda x: bind(call, [x]))}


def _inlined_call(eqn) -> bool:
  """True for a custom_jvp call of `INLINED_CUSTOM_JVPS`, JAX's own, of one array to one."""
  if (eqn.primitive.name != "custom_jvp_call" or len(eqn.invars) != 1
      or len(eqn.outvars) != 1):
    return False
  info = getattr(eqn.params["call_jaxpr"].jaxpr, "debug_info", None)
  source = (getattr(info, "func_src_info", None) or "").replace("\\", "/")
  return getattr(info, "func_name", None) in INLINED_CUSTOM_JVPS and "jax/_src/" in source


def _bind_inlining(eqn, invals, calls):
  if eqn.primitive.name in ("jit", "pjit") or _inlined_call(eqn):
    inner = eqn.params["jaxpr" if eqn.primitive.name in ("jit", "pjit") else "call_jaxpr"]
    body = functools.partial(eval_jaxpr, _called_from(inner.jaxpr, eqn.source_info),
                             inner.consts, invals, {},
                             functools.partial(_bind_inlining, calls=calls))
    if not _inlined_call(eqn):
      return body()
    calls.append(eqn)
    with jax.named_scope(f"{_INLINED_SCOPE}{len(calls) - 1}"):
      return body()
  return bind(eqn, invals)


def _called_from(jaxpr, call):
  """``jaxpr``, a ``jit``'s body, with the traceback of ``call`` (the jit equation's source
  info) on each equation that has no user frame: a body's tracebacks stop where its trace
  began (inside ``take_along_axis``, say), so the call's frames hold the user's line."""
  eqns = [e if _jax.source_info_util.user_frame(e.source_info.traceback) is not None
          else e.replace(source_info=e.source_info.replace(traceback=call.traceback))
          for e in jaxpr.eqns]
  return jaxpr.replace(eqns=eqns)


def evaluate(jaxpr, consts, args, pass_):
  """Evaluates ``jaxpr`` with the patterns of ``pass_``'s matchers rewritten; logs to it."""
  jaxpr, consts, calls = inline_calls(jaxpr, consts)
  g = Graph(jaxpr)
  g.inlined = [(frozenset(indices), bound_again(g, call, indices)) for call, indices in calls]
  actions = {}
  for matcher in pass_.matchers:
    matcher(g, actions, pass_)
  for inside, bound in g.inlined:
    if not g.taken & inside:
      actions.update(bound)
  return eval_jaxpr(jaxpr, consts, args, actions, functools.partial(_bind_nested, pass_=pass_))


def _bind_nested(eqn, invals, pass_):
  """Binds ``eqn``, rewriting the jaxprs inside it by its primitive's rule in `_NESTED`."""
  rule = _NESTED.get(eqn.primitive.name)
  if rule is None:
    return bind(eqn, invals)
  return rule(eqn.params, invals, functools.partial(evaluate, pass_=pass_))


def _scan(params, invals, rec):
  body = params["jaxpr"]
  nc, nk = _jax.scan_counts(params)
  consts, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]

  def step(carry, x):
    outs = rec(body.jaxpr, body.consts, [*consts, *carry, *x])
    return outs[:nk], outs[nk:]

  carry, ys = lax.scan(step, init, xs, length=params["length"], reverse=params["reverse"],
                       unroll=params["unroll"])
  return [*carry, *ys]


def _cond(params, invals, rec):
  branches = [functools.partial(lambda br, *ops: rec(br.jaxpr, br.consts, ops), br)
              for br in params["branches"]]
  return lax.switch(invals[0], branches, *invals[1:])


def _checkpoint(params, invals, rec):
  body = params["jaxpr"]
  fn = jax.checkpoint(lambda *a: rec(body, [], a), prevent_cse=params["prevent_cse"],
                      policy=params["policy"])
  return fn(*invals)


# The primitives whose jaxprs are rewritten too: ``rule(params, invals, rec)`` binds one
# again with each nested jaxpr evaluated by ``rec(jaxpr, consts, args)``.
_NESTED = {"scan": _scan, "cond": _cond, "remat2": _checkpoint, "checkpoint": _checkpoint}
