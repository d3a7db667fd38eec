"""A function's small exact work on inputs known before a loop, split off to run before it.

The layer-streamed step updates each layer's leaves inside the layers' loop, and much of
an optax update reads only the leaf's small state: its step count, its rounding key, the
layer's index (the count incremented, the step's keys folded and split). Each such value is
a scalar kernel of its own on a GPU, a few microseconds each, dozens a layer of
Llama-3.2-1B (``docs/benchmarks.md``). `split` cuts the update's jaxpr in two, as JAX's
partial evaluation does (``jax.linearize``'s known and unknown parts), but keeping only
small integer, boolean and Threefry-key work on the known side: what the known inputs alone
determine runs before the loop for every layer at once (``jax.vmap``), and the loop's part
reads each layer's row of those values (the residuals). That work is exact however XLA
fuses it, and every floating-point operation stays where it was, with the operands it had
(XLA rewrites float expressions it sees whole, a multiply and an add into one fused
multiply-add, ``a / sqrt(b)`` into ``a * rsqrt(b)``, and a value made before the loop would
change the bits): the split step is the unsplit one, bit for bit. Other PRNG
implementations stay in the loop (``rbg``'s bits differ under ``jax.vmap``), and so do
callbacks and effects. An output that a flag of the loop's picks from known values
(a step count or key kept where the gradient is not finite: ``jnp.where(ok, new, old)``)
can be left to after the loop (`Later`): the loop writes the flag, and `picked` makes the
output for every layer at once.
"""

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from lowmem_jax import _jaxpr

SMALL = 64
"""The most elements an equation's output may have to run before the loop: the step's
scalars and keys, not a leaf's elements (a stochastic rounding's bits depend on the key
and the position alone, and would be made for every layer at once)."""
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call",
                    "custom_vjp_call", "custom_vjp_call_jaxpr", "checkpoint", "remat"})
"""The calls whose bodies `split` inlines: each runs its body once on its operands (not a
``shard_map``, whose body's collectives need its mesh axes)."""


class Later(NamedTuple):
  """An output that a boolean not known before the loop picks from values known before it
  (``jnp.where(ok, new_count, count)``): ``lax.select_n(flags[flag], *cases)``, ``cases``
  the indices of the residuals it picks from."""
  flag: int
  cases: tuple[int, ...]


class Split(NamedTuple):
  """A function of ``(known, unknown)`` leaves cut in two (`split`).

  Fields:
    known: ``known(*known_leaves) -> residuals``, the list of values the rest reads from
      the known side: known inputs themselves, and integer, boolean or Threefry key arrays
      of at most `SMALL` elements made from them.
    rest: ``rest(residuals, *unknown_leaves) -> (outputs, flags)``: the function's flat
      outputs, None for each `Later` one, and the bool ``[]`` flags that pick those.
    out_tree: the outputs' tree structure.
    rest_inputs: the shape and dtype of each of ``rest``'s unknown leaves.
    later: each flat output's `Later`, or None: the outputs `split`'s ``later`` let be
      picked after the loop.
  """
  known: Callable[..., list]
  rest: Callable[..., tuple[list, list]]
  out_tree: Any
  rest_inputs: list
  later: tuple[Later | None, ...]


def split(fn: Callable, known: Sequence[Any], unknown: Sequence[Any],
          small: int = SMALL, later: Sequence[bool] | None = None) -> Split:
  """``fn(*known, *unknown)`` cut into the small exact work on ``known`` alone and the rest.

  Args:
    fn: a function of ``len(known) + len(unknown)`` arrays, returning a pytree.
    known, unknown: their shapes and dtypes (``jax.ShapeDtypeStruct`` s or arrays): the
      inputs known before the loop and those made inside it.
    small: the most elements an equation's outputs, and every equation nested in it, may
      have to be on the known side (`_exact_before`).
    later: which of ``fn``'s flat outputs may be picked after the loop (`Later`) where a
      boolean scalar not known before the loop picks them from known values; None: none.

  Returns:
    The `Split`: ``rest(known(*k), *u)``'s outputs are ``fn(*k, *u)``'s leaves, for any
    ``k``, ``u`` of these shapes, bit for bit (the same equations on the same values), and
    so are its `Later` ones, picked from its flags after the loop (`picked`).
  """
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*known, *unknown)
  jaxpr = closed.jaxpr
  ops, values = [], dict(enumerate(closed.consts))
  env = dict(zip(jaxpr.constvars, values))
  env.update((v, len(values) + k) for k, v in enumerate(jaxpr.invars))
  outputs = _flatten(jaxpr, env, ops, itertools.count(len(env)))
  inputs = [env[v] for v in jaxpr.invars]
  is_known = set(inputs[:len(known)]) | {k for k, c in values.items() if jnp.size(c) <= small}
  first = []
  for k, op in enumerate(ops):
    if all(_atom_in(x, is_known) for x in op.reads) and _exact_before(op.eqn, small):
      is_known.update(op.makes)
      first.append(k)
  second = sorted(set(range(len(ops))) - set(first))
  read_later = {x for x in [*(x for k in second for x in ops[k].reads), *outputs]
                if not isinstance(x, jcore.Literal)}
  residuals = [x for x in [*inputs[:len(known)], *(x for k in first for x in ops[k].makes)]
               if x in read_later]

  def run(order, env, wanted):
    for k in _needed(ops, order, wanted):
      op = ops[k]
      env.update(zip(op.makes, _jaxpr.bind(op.eqn, [_read(env, x) for x in op.reads])))
    return [jnp.asarray(_read(env, x)) for x in wanted]

  def known_fn(*leaves):
    return run(first, values | dict(zip(inputs, leaves)), residuals)

  deferred = _picked(ops, second, inputs, jaxpr.invars, outputs, residuals,
                     later or [False] * len(outputs))
  flags = list(dict.fromkeys(flag for flag, _ in filter(None, deferred)))
  deferred = tuple(None if x is None else Later(flags.index(x[0]), x[1]) for x in deferred)

  def rest_fn(residual_values, *leaves):
    env = values | dict(zip(residuals, residual_values)) | dict(zip(inputs[len(known):], leaves))
    now = [x for x, d in zip(outputs, deferred) if d is None]
    made = iter(run(second, env, [*now, *flags]))
    return [None if d else next(made) for d in deferred], list(made)

  return Split(known_fn, rest_fn, jax.tree.structure(out_shape),
               [(jnp.shape(x), jnp.dtype(x.dtype)) for x in unknown], deferred)


def _picked(ops: list["_Op"], second: list[int], inputs: list, invars: list, outputs: list,
            residuals: list, allowed: Sequence[bool]) -> list:
  """Each output's ``(flag, cases)`` where ``allowed`` and it is ``select_n`` of residuals
  ``cases`` (their indices) on ``flag``, a boolean scalar not known before the loop (an
  unknown input, or made from one), else None."""
  makers = {x: ops[k] for k in second for x in ops[k].makes}
  avals = dict(zip(inputs, (v.aval for v in invars)))
  avals.update((x, v.aval) for op in ops for x, v in zip(op.makes, op.eqn.outvars))
  at = {x: k for k, x in enumerate(residuals)}
  out = []
  for x, allow in zip(outputs, allowed, strict=True):
    op = makers.get(x) if allow and not isinstance(x, jcore.Literal) else None
    if op is None or op.eqn.primitive.name != "select_n" or not all(
        not isinstance(c, jcore.Literal) and c in at for c in op.reads[1:]):
      out.append(None)
      continue
    flag = op.reads[0]
    aval = None if isinstance(flag, jcore.Literal) or flag in at else avals.get(flag)
    scalar_bool = aval is not None and aval.shape == () and aval.dtype == jnp.bool_
    out.append((flag, tuple(at[c] for c in op.reads[1:])) if scalar_bool else None)
  return out


class _Op(NamedTuple):
  """An equation of the flattened program: the values it reads (ids, or literals) and makes."""
  eqn: jcore.JaxprEqn
  reads: list
  makes: list


def _flatten(jaxpr: jcore.Jaxpr, env: dict, ops: list[_Op], ids: Iterator[int]) -> list:
  """Appends ``jaxpr``'s equations to ``ops``, each value made an id of its own (``env``:
  var -> id or literal, the inputs' given; ``ids``: the unused ones), a call's body inlined
  (a ``jit``, a custom rule's primal: the update is not differentiated) so its small work
  can be split from the rest; returns the outputs' ids."""
  for eqn in jaxpr.eqns:
    reads = [v if isinstance(v, jcore.Literal) else env[v] for v in eqn.invars]
    body = _jaxpr.call_body(eqn) if eqn.primitive.name in _CALLS else None
    if body is not None and not body.constvars and not eqn.effects:
      outs = _flatten(body, dict(zip(body.invars, reads)), ops, ids)
    else:
      outs = [next(ids) for _ in eqn.outvars]
      ops.append(_Op(eqn, reads, outs))
    env.update(zip(eqn.outvars, outs))
  return [v if isinstance(v, jcore.Literal) else env[v] for v in jaxpr.outvars]


class Table(NamedTuple):
  """A stacked leaf's update split by `stack_table`, with every layer's residuals.

  Fields:
    split: the update's `Split`.
    small: which of the state's leaves (``jax.tree.leaves`` order) are known inputs.
    residuals: the `Split`'s residuals of every layer, each ``[L, ...]``.
  """
  split: Split
  small: tuple[bool, ...]
  residuals: list


def stack_table(update: Callable, p: jax.Array, s: Any, small: int = SMALL,
                later: Any = None) -> Table:
  """The `Table` of ``update(i, g, s_i, p_i, ok) -> outputs``, the update of layer ``i`` of
  stacked leaf ``p`` (``[L, ...]``) whose state ``s`` is stacked too (each leaf ``[L, ...]``):
  the state's leaves of at most ``small`` elements a layer and ``i`` known before the loop;
  the gradient ``g`` (``p``'s dtype), the other state leaves, ``p_i`` and ``ok`` (bool [])
  not. Its residuals are made here for every layer at once: call it before the loop.
  ``later``: a prefix of the outputs' tree, True where they may be picked after the loop
  (`split`'s; `apply`, `picked`)."""
  layers = jnp.shape(p)[0]
  leaves, treedef = jax.tree.flatten(s)
  is_small = tuple(math.prod(jnp.shape(x)[1:]) <= small for x in leaves)
  one = lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], x.dtype)

  def fn(i, *inputs):
    known, (*big, g, p_i, ok) = inputs[:sum(is_small)], inputs[sum(is_small):]
    known, big = iter(known), iter(big)
    s_i = [next(known) if k else next(big) for k in is_small]
    return update(i, g, jax.tree.unflatten(treedef, s_i), p_i, ok)

  known = [jax.ShapeDtypeStruct((), jnp.int32), *[one(x) for x, k in zip(leaves, is_small) if k]]
  unknown = [*[one(x) for x, k in zip(leaves, is_small) if not k], one(p), one(p),
             jax.ShapeDtypeStruct((), jnp.bool_)]
  allowed = None if later is None else jax.tree.leaves(
      jax.tree.broadcast(later, jax.eval_shape(fn, *known, *unknown)))
  cut = split(fn, known, unknown, small, allowed)
  residuals = jax.vmap(cut.known)(jnp.arange(layers, dtype=jnp.int32),
                                   *[x for x, k in zip(leaves, is_small) if k])
  return Table(cut, is_small, residuals)


def apply(table: Table, i: jax.Array, g: jax.Array, s_i: Any, p_i: jax.Array,
          ok: jax.Array) -> tuple[Any, jax.Array]:
  """``(outputs, flags)``: `stack_table`'s ``update(i, g, s_i, p_i, ok)`` for layer ``i``
  (int32 []), from the table's residuals (``s_i``'s known leaves are not read), None in the
  places of the outputs picked after the loop; ``flags`` (bool ``[F]``) what picks them:
  give `picked` every layer's."""
  want = table.split.rest_inputs
  big = [x for x, k in zip(jax.tree.leaves(s_i), table.small) if not k]
  got = [(jnp.shape(x), jnp.dtype(jnp.result_type(x))) for x in (*big, g, p_i, ok)]
  if got != want:
    raise ValueError(f"layer {i}'s update was split for inputs {want}, given {got}.")
  out, flags = table.split.rest([r[i] for r in table.residuals], *big, g, p_i, ok)
  flags = jnp.stack(flags) if flags else jnp.zeros((0,), jnp.bool_)
  return jax.tree.unflatten(table.split.out_tree, out), flags


def made(new: Any, old: Any, put: Callable = lambda old, new: new) -> Any:
  """``old`` with ``put(old_leaf, new_leaf)`` where ``new`` (`apply`'s outputs) has a leaf,
  not None (a `Later` one, picked after the loop)."""
  return jax.tree.map(lambda n, o: o if n is None else put(o, n), new, old,
                      is_leaf=lambda x: x is None)


def flag_count(table: Table) -> int:
  """How many flags `apply` returns a layer."""
  return len({x.flag for x in table.split.later if x is not None})


def picked(table: Table, flags: jax.Array) -> Any:
  """The outputs `apply` left out, for every layer (each ``[L, ...]``; None for the others,
  in the outputs' tree), from ``flags`` (bool ``[L, F]``): each layer's `apply` flags."""
  out = []
  for later in table.split.later:
    if later is None:
      out.append(None)
      continue
    cases = [table.residuals[k] for k in later.cases]
    flag = flags[:, later.flag].reshape(-1, *[1] * (jnp.ndim(cases[0]) - 1))
    out.append(jax.lax.select_n(jnp.broadcast_to(flag, jnp.shape(cases[0])), *cases))
  return jax.tree.unflatten(table.split.out_tree, out)


def _atom_in(x: Any, known: set) -> bool:
  return isinstance(x, jcore.Literal) or x in known


def _exact_before(eqn: jcore.JaxprEqn, small: int) -> bool:
  """Whether ``eqn`` may run before the loop, for every layer at once: it and every equation
  nested in it (a loop's, a branch's; no other call) make only integer, boolean or Threefry
  key values of at most ``small`` elements each, from no key of another implementation,
  with no effects and no callback."""
  if _jaxpr.inner_jaxprs(eqn) and eqn.primitive.name not in _jaxpr.LOOPS_AND_BRANCHES:
    return False
  for e, _ in [(eqn, 1), *(x for j in _jaxpr.inner_jaxprs(eqn) for x in _jaxpr.walk(j))]:
    if e.effects or "callback" in e.primitive.name:
      return False
    if not all(_exact(v.aval, small) for v in e.outvars) or any(
        _other_key(v.aval) for v in e.invars if not isinstance(v, jcore.Literal)):
      return False
  return True


def _exact(aval: Any, small: int) -> bool:
  """An integer, boolean or Threefry key array of at most ``small`` elements."""
  dtype = aval.dtype
  keys = jnp.issubdtype(dtype, jax.dtypes.prng_key)
  return math.prod(aval.shape) <= small and (
      str(dtype) == "key<fry>" if keys else jnp.issubdtype(dtype, jnp.integer)
      or jnp.issubdtype(dtype, jnp.bool_))


def _other_key(aval: Any) -> bool:
  return jnp.issubdtype(aval.dtype, jax.dtypes.prng_key) and str(aval.dtype) != "key<fry>"


def _read(env: dict, x: Any) -> Any:
  return x.val if isinstance(x, jcore.Literal) else env[x]


def _needed(ops: list[_Op], order: list[int], outputs: Sequence) -> list[int]:
  """Those of ``ops`` at ``order`` that ``outputs`` need, in order."""
  steps = [_jaxpr.Step(ops[k].reads, ops[k].makes, bool(ops[k].eqn.effects)) for k in order]
  return [order[k] for k in _jaxpr.live(steps, outputs)]
