"""The softmax and the scores: the softmax's division back to ``dot_general(q, k)`` through
its scale, bias and mask.
"""

import math

from lowmem_jax.transform.graph import (
  Graph,
  fill_value,
  scalar,
  scalar_operand,
  unit_reshape,
)
from lowmem_jax.transform.interpreter import inline_jit
from lowmem_jax.transform.rewrites import Left

_SOFTMAX_BACK = frozenset({"broadcast_in_dim", "reshape", "stop_gradient", "convert_element_type"})
_MASK_FILL = -1e4  # a `where` fill at or below this masks a key out


def softmax_of(g, i):
  """``s`` if equation ``i`` is ``exp(s - max(s)) / sum(exp(...))`` over the last axis,
  or a ``custom_vjp`` function of ``s`` that computes only that."""
  e = g.eqns[i]
  if e.primitive.name == "custom_vjp_call":
    inner, _ = inline_jit(e.params["call_jaxpr"].jaxpr, e.params["call_jaxpr"].consts)
    ig = Graph(inner)
    last = len(inner.eqns) - 1
    if (len(inner.invars) == 1 and len(inner.outvars) == 1 and last >= 0
        and inner.outvars[0] is inner.eqns[last].outvars[0]
        and inner.eqns[last].primitive.name == "div"
        and softmax_of(ig, last) is inner.invars[0]):
      return e.invars[0]
    return None
  num, den = e.invars
  ex = g.prod(num)
  red = g.prod(g.back(den, _SOFTMAX_BACK))
  if ex is None or ex.primitive.name != "exp" or red is None:
    return None
  last = (num.aval.ndim - 1,)
  if red.primitive.name != "reduce_sum" or g.back(red.invars[0], {"convert_element_type"}) is not (
      num) or tuple(red.params["axes"]) != last:
    return None
  sub = g.prod(ex.invars[0])
  if sub is None or sub.primitive.name != "sub":
    return None
  s, m = sub.invars
  m = g.back(m, _SOFTMAX_BACK | {"transpose"})
  me = g.prod(m)
  if me is not None and me.primitive.name == "max" and any(
      scalar(v) == -math.inf for v in me.invars):
    m = g.back(next(v for v in me.invars if scalar(v) is None), _SOFTMAX_BACK | {"transpose"})
    me = g.prod(m)
  if me is None or me.primitive.name != "reduce_max" or tuple(me.params["axes"]) != (
      me.invars[0].aval.ndim - 1,):
    return None
  if _untransposed(g, me.invars[0]) is not _untransposed(g, s):
    return None
  return s


def _untransposed(g, v):
  """``v`` followed back through transposes that keep the last axis last."""
  while (e := g.prod(v)) is not None and e.primitive.name == "transpose" and (
      e.params["permutation"][-1] == len(e.params["permutation"]) - 1):
    v = e.invars[0]
  return v


def scores_chain(g, s):
  """Walks back from the softmax input to ``dot_general(q, k)``.

  Returns ``(dot_index, steps)``, steps in forward order as ``(kind, eqn, operand)``
  with kind one of "layout", "scale", "bias", "mask", "mask_not"; raises `Left` with
  the reason where the scores are not such a chain.
  """
  steps = []
  v = s
  while True:
    i = g.index(v)
    if i is None:
      at = steps[-1][1] if steps else g.consumers[s][0]  # the op that reads the input
      raise Left.at(g, "the scores are not a matmul of queries and keys (an input reaches)", at)
    e = g.eqns[i]
    name = e.primitive.name
    if name == "dot_general":
      return i, steps[::-1]
    if name in ("convert_element_type", "transpose", "copy") or (
        name == "reshape" and unit_reshape(e)):
      steps.append(("layout", e, None))
      v = e.invars[0]
    elif name in ("mul", "div") and scalar_operand(e) is not None:
      k = scalar_operand(e)
      steps.append(("scale", e, e.invars[k]))
      v = e.invars[1 - k]
    elif name == "add":
      side = 0 if _leads_to_dot(g, e.invars[0]) else 1
      bias = e.invars[1 - side]
      steps.append(_additive_mask(g, e, bias) or ("bias", e, bias))
      v = e.invars[side]
    elif name == "select_n" and len(e.invars) == 3:
      kind = _mask_kind(g, e.invars[1], e.invars[2])
      if kind is None:
        raise Left.at(g, "a select in the scores that is not a mask", e)
      steps.append((kind, e, e.invars[0]))
      v = e.invars[2] if kind == "mask" else e.invars[1]
    else:
      raise Left.at(g, "the scores pass through", e, sep=" ")


def _mask_kind(g, on_false, on_true):
  """"mask" if ``select_n(pred, on_false, on_true)`` keeps where pred, "mask_not" if it
  keeps where not pred (the other case a fill at or below ``_MASK_FILL``), else None."""
  f, t = fill_value(g, on_false), fill_value(g, on_true)
  if f is not None and f <= _MASK_FILL:
    return "mask"
  if t is not None and t <= _MASK_FILL:
    return "mask_not"
  return None


def _additive_mask(g, e, bias):
  """A bias ``where(keep, 0, fill)`` as the mask step it is, else None."""
  sel = g.prod(g.back(bias))
  if sel is None or sel.primitive.name != "select_n" or len(sel.invars) != 3:
    return None
  kind = _mask_kind(g, sel.invars[1], sel.invars[2])
  zero = sel.invars[2] if kind == "mask" else sel.invars[1]
  if kind is None or fill_value(g, zero) != 0.0:
    return None
  return kind, e, sel.invars[0]


def _leads_to_dot(g, v, depth=8):
  for _ in range(depth):
    e = g.prod(v)
    if e is None:
      return False
    if e.primitive.name == "dot_general":
      return True
    v = e.invars[0] if len(e.invars) == 1 else max(e.invars, key=lambda w: w.aval.ndim)
  return False
