"""Which leaves a function reads, whether an optimizer's update of one leaf reads another's,
and whether its update of one slice of a leaf reads another slice's: the checks that let
`lowmem_jax.optim.layer_streamed` update a model a layer (a part of one, a slice of a leaf)
at a time. They follow the jaxpr with `lowmem_jax._jaxpr`, into nested calls."""

import math
from typing import Any, Callable

import jax
import optax
from jax.extend import core as jcore

from lowmem_jax import _jaxpr
from lowmem_jax._jax import source_info_util


def reads(fn: Callable, tree: Any, *args) -> Any:
  """Bool pytree like ``tree``: whether ``fn(tree, *args)`` reads each leaf."""
  closed = jax.make_jaxpr(fn)(tree, *args)
  n = len(jax.tree.leaves(tree))
  used = set(_jaxpr.used_inputs(closed.jaxpr))
  return jax.tree.unflatten(jax.tree.structure(tree), [i in used for i in range(n)])


def check_per_leaf(tx: optax.GradientTransformation, params: Any) -> None:
  """Raises ValueError if ``tx``'s update of one leaf reads another leaf's gradient or param.

  Traces ``tx.update`` on ``params`` (two copies of it where it has one leaf) and follows
  each output back through the jaxpr to the leaves it reads (into nested calls;
  conservatively through loops and conditionals).

  Args:
    tx: the transformation.
    params: the parameters (arrays or ``ShapeDtypeStruct``), laid out as ``tx`` sees
      them: `lowmem_jax.optim.layer_streamed` gives its whole tree with one layer.
  """
  probe = params if len(jax.tree.leaves(params)) > 1 else {"a": params, "b": params}
  state = jax.eval_shape(tx.init, probe)
  n = len(jax.tree.leaves(probe))
  closed = jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))(probe, state, probe)
  jaxpr = closed.jaxpr
  n_state = len(jaxpr.invars) - 2 * n
  groups = ([frozenset({i}) for i in range(n)] + [frozenset()] * n_state
            + [frozenset({i}) for i in range(n)])
  mixed = []
  outs = _dependencies(jaxpr, groups, mixed)
  if mixed or any(len(o) > 1 for o in outs):
    where = mixed[0] if mixed else "its outputs"
    raise ValueError(
        f"The optimizer's update of one parameter leaf reads other leaves' gradients (first "
        f"at {where}): it needs the whole gradient (a global norm, a finiteness check of the "
        "whole tree) and cannot run inside the backward, one layer at a time. Clip per leaf "
        "instead (optax.clip_by_block_rms, optax.clip), or per layer inside `LayerStack.layer`.")


def _dependencies(jaxpr, groups: list[frozenset], mixed: list[str]) -> list[frozenset]:
  """For each outvar of ``jaxpr``, the union of the input groups it depends on; appends to
  ``mixed`` the source of each equation whose output first joins two groups."""
  env = dict(zip(jaxpr.invars, groups))
  read = lambda v: env.get(v, frozenset()) if isinstance(v, jcore.Var) else frozenset()
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    inner = _jaxpr.call_body(eqn)
    if inner is not None:
      outs = _dependencies(inner, ins, mixed)
    else:
      together = frozenset().union(*ins)
      outs = [together] * len(eqn.outvars)
      if len(together) > 1 and all(len(i) <= 1 for i in ins) and not mixed:
        mixed.append(_source(eqn))
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _short(path: str) -> str:
  """``path`` from its package on (``optax/_src/clipping.py``) where it is installed."""
  return path.rsplit("site-packages/", 1)[-1]


# Primitives whose output element i reads only the operands' elements i (scalars aside).
_ELEMENTWISE = frozenset("""
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type
    copy copy_p cos cosh div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow
    is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or
    population_count pow real reduce_precision rem round rsqrt select_n shift_left
    shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient sub
    tan tanh threefry2x32 xor""".split())
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                         "reduce_or", "reduce_xor", "argmax", "argmin"})
_MIXED = "mixed"  # a value that reads more than one slice


def check_per_slice(update: Callable, grads: Any, state: Any, n: int) -> str | None:
  """Where ``update(grads, state, params=grads)`` (a transformation's update of one leaf,
  ``grads`` its only leaf) reads more than one of the leaf's ``n`` equal slices along its
  first axis to make an output (a statistic of the whole leaf: muon's orthogonalization,
  lamb's trust ratio, a block of 8-bit moments across slices): the equation's source,
  or None.

  Each value is followed as the elements per slice in row-major order (a slice is a run of
  the flat array): elementwise operations, reshapes, bit casts, a broadcast or reduction
  along trailing axes, a pad or slice, an optimization barrier (each output its operand)
  keep it a slice's; a value that does not depend on the leaf (a step count, a key, an
  ``iota``) reads none. A state leaf of the leaf's rank and rows is taken as sliced alike.
  Anything else on a sliced value reads across slices: a shift along the first axis,
  ``dot_general``, a reduction over the first axis, a loop or conditional. So a refusal
  can be conservative (a broadcast over a size-1 axis between data axes, a ``dot_general``
  with a matrix that is not the leaf's, a loop of elementwise steps), never silent. The
  state is taken as ``tx.init`` of the whole leaf makes it: an ``init`` that takes a
  statistic of the params is not checked.
  """
  leaf = jax.tree.leaves(grads)[0]
  closed = jax.make_jaxpr(lambda g, s, p: update(g, s, p))(grads, state, grads)
  size = math.prod(leaf.shape)
  # A state leaf laid out as the leaf (its rank, its rows: moments, 8-bit codes and their
  # scales) is sliced as it is; another (a step count, a key's data) reads no slice.
  chunk = lambda x: (math.prod(x.shape) // n if len(x.shape) == len(leaf.shape)
                     and x.shape[:1] == leaf.shape[:1] and math.prod(x.shape) % n == 0 else None)
  inputs = [size // n] + [chunk(x) for x in jax.tree.leaves(state)] + [size // n]
  found = []
  _slices(closed.jaxpr, inputs, found)  # the first value that mixes slices is found
  return found[0] if found else None


def _slices(jaxpr, inputs: list, found: list) -> list:
  """For each outvar: None (reads no slice), the elements per slice (reads one), or
  `_MIXED`; ``found`` gets the source of the first equation that mixes slices."""
  env = dict(zip(jaxpr.invars, inputs))
  read = lambda v: env.get(v) if isinstance(v, jcore.Var) else None
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    inner = _jaxpr.call_body(eqn)
    if inner is not None:
      outs = _slices(inner, ins, found)
    elif all(c is None for c in ins):
      outs = [None] * len(eqn.outvars)
    elif eqn.primitive.name == "optimization_barrier":  # each output is its operand
      outs = ins
    else:
      outs = [_slice_rule(eqn, ins)] * len(eqn.outvars)
      if _MIXED in outs and _MIXED not in ins and not found:
        found.append(_source(eqn))
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _suffix_ok(shape: tuple, first: int, c: int) -> bool:
  """Whether the axes from ``first`` on lie within a slice (their size divides ``c``)."""
  return c % max(1, math.prod(shape[first:])) == 0


def _slice_rule(eqn, ins: list):
  """The elements per slice of ``eqn``'s outputs, given its operands' (one at least
  sliced), or `_MIXED`."""
  if _MIXED in ins:
    return _MIXED
  name = eqn.primitive.name
  shapes = [getattr(v.aval, "shape", ()) for v in eqn.invars]
  out = eqn.outvars[0].aval.shape
  sliced = [(c, s) for c, s in zip(ins, shapes) if c is not None]
  if name in _ELEMENTWISE:  # an operand's size-1 axes broadcast (jax's binary operations do)
    cs = {_broadcast(c, s, [d for d in range(len(s)) if s[d] != 1], out)
          if len(s) == len(out) else _MIXED for c, s in sliced}
    return cs.pop() if len(cs) == 1 else _MIXED
  if len(sliced) > 1:
    return _MIXED
  c, shape = sliced[0]
  grown = c * math.prod(out)
  scaled = lambda: grown // math.prod(shape) if grown % math.prod(shape) == 0 else _MIXED
  if name in ("reshape", "squeeze", "expand_dims", "bitcast_convert_type"):
    return scaled()
  if name in _REDUCTIONS:
    axes = eqn.params["axes"]
    return scaled() if _suffix_ok(shape, min(axes), c) else _MIXED
  if name == "broadcast_in_dim":
    kept = eqn.params["broadcast_dimensions"]
    return _broadcast(c, shape, [kept[k] for k in range(len(kept)) if shape[k] != 1], out)
  if name == "transpose":
    perm = eqn.params["permutation"]
    moved = [i for i, p in enumerate(perm) if p != i]
    return c if not moved or _suffix_ok(shape, min(moved), c) else _MIXED
  if name == "pad" and any(interior for *_, interior in eqn.params["padding_config"]):
    return _MIXED
  if name == "slice" and any(st != 1 for st in eqn.params["strides"] or ()):
    return _MIXED
  if name in ("pad", "slice"):
    changed = [d for d in range(len(shape)) if shape[d] != out[d]
               or (name == "pad" and eqn.params["padding_config"][d][0] != 0)
               or (name == "slice" and eqn.params["start_indices"][d] != 0)]
    offset = (eqn.params["start_indices"][0] if name == "slice"
              else eqn.params["padding_config"][0][0])
    if changed == [0] and offset == 0:  # the first axis cut or padded at its end only
      return c
    return scaled() if not changed or _suffix_ok(shape, min(changed), c) else _MIXED
  return _MIXED


def _broadcast(c: int, shape: tuple, data: list, out: tuple):
  """The elements per slice of a broadcast of ``shape`` (``c`` a slice) to ``out``, its
  axes of more than one element at ``data`` of ``out``'s: each element repeated over
  trailing axes only keeps a slice a run, else `_MIXED`."""
  grown = [d for d in range(len(out)) if out[d] != 1 and d not in data]
  if grown and min(grown) < max(data, default=-1):
    return _MIXED
  return c * math.prod(out) // max(1, math.prod(shape))


def _source(eqn) -> str:
  frames = list(source_info_util.user_frames(eqn.source_info.traceback))[:3]
  return " <- ".join([eqn.primitive.name] + [
      f"{f.function_name} ({_short(f.file_name)}:{f.start_line})" for f in frames])
