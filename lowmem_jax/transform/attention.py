"""The attention matcher: ``softmax(q k^T * scale + bias, where mask) v`` becomes
`lowmem_jax.attention`, which keeps no L×L residual (Rabe & Staats 2021, arXiv:2112.05682).

Steps: the softmax (`_softmax_of`), the scores back to ``dot_general(q, k)``
with their scale, bias and mask (`_scores_chain`), the probabilities' matmul
with ``v`` (`_values_matmul`); then each operand's axes labelled in one
canonical layout (`_layout`), the operands read (`_operands`), the output
followed to its last layout op (`_output`), and the replacement installed
(`_install`). A pattern left raises `Left` with the reason.
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from lowmem_jax import attention_ops, names
from lowmem_jax.transform.graph import Graph, fill_value, scalar, upstream
from lowmem_jax.transform.interpreter import Action, apply_layout, eqns_fn, inline_jit
from lowmem_jax.transform.rewrites import Left


def match(g, actions, pass_):
  """Replaces each softmax attention of ``g``, anchored at its softmax's division."""
  for i in g.untaken({"div", "custom_vjp_call"}):
    with pass_.leaving(g, "attention", i):
      _match_at(g, i, actions, pass_)


def _match_at(g, i, actions, pass_):
  s = _softmax_of(g, i)
  if s is None:
    return
  qk_i, steps = _scores_chain(g, s)
  pp, pv_i = _values_matmul(g, g.eqns[i].outvars[0])
  layout = _layout(g.eqns[qk_i], steps, g.eqns[pv_i], pp)
  ops = _operands(g, g.eqns[qk_i], g.eqns[pv_i], pp, layout)
  out, out_labels, tags = _output(g, g.eqns[pv_i].outvars[0], layout.out_labels)
  layout = dataclasses.replace(layout, out_labels=out_labels)
  _install(g, i, layout, ops, out, tags, actions, pass_)


def _values_matmul(g, p):
  """``(p, index)``: the probabilities ``p`` (through casts) and the one matmul they feed."""
  while (c := g.only_consumer(p)) is not None and g.eqns[c].primitive.name == (
      "convert_element_type"):
    p = g.eqns[c].outvars[0]
  if c is None or g.eqns[c].primitive.name != "dot_general":
    raise Left("the probabilities feed something other than one matmul (dropout on them, "
               "or returned)")
  return p, c


# --- the layout: every operand's axes named in one canonical order ---------------


_ORDER_QKV = ("B0", "T", "B1", "D")  # the canonical axes of k and v (and q, ungrouped)


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Axis labels of the scores' operands and of the output, and the canonical orders.

  Labels: "B0", "B1" batch axes (batch, heads), "G" the query group axis of
  grouped-query attention, "T" queries (and the keys' and values' length axis),
  "S" keys, "D" features, "U" a unit axis.
  """
  k_side: int  # which operand of the query-key matmul is the keys
  stage: list  # (kind, eqn, operand, labels at that op) of each scale, bias and mask
  to_canon: dict  # the query-key matmul's labels ("L", "R", ...) -> canonical ones
  order_q: list  # the queries' canonical axes (with "G" when grouped)
  order_mask: list  # a bias's or mask's canonical axes
  q_labels: list
  k_labels: list
  v_labels: list
  out_labels: list

  @property
  def grouped(self) -> bool:
    return "G" in self.order_q


def _score_labels(qk):
  """``(lhs, rhs, out)``: labels of the query-key matmul's operands and output."""
  lhs = _operand_labels(qk, 0, "L")
  rhs = _operand_labels(qk, 1, "R")
  if lhs is None or rhs is None:
    raise Left("the query-key matmul has more than one query or key axis (and no group axis "
               "right after the kv heads)")
  if len(qk.params["dimension_numbers"][1][0]) > 2:
    raise Left("more than two batch axes in the scores")
  return lhs, rhs, _out_labels(qk, lhs, rhs)


def _stages(steps, labels):
  """``(labels, stage)``: the scores' labels at the softmax, and each scale, bias and mask
  with the labels at its op; one scale, before any bias or mask; one bias; one mask."""
  stage = []
  for kind, e, k in steps:
    if kind == "layout":
      labels = _relabel(e, labels)
      if labels is None:
        raise Left("a reshape of the scores merges or splits axes")
    else:
      stage.append((kind, e, k, list(labels)))
  if labels[-1] not in ("L", "R"):
    raise Left("the softmax is not over the keys")
  kinds = [st[0] for st in stage]
  if "scale" in kinds and any(kd in ("bias", "mask", "mask_not") for kd in
                              kinds[:kinds.index("scale")]):
    raise Left("the scores are scaled after a bias or mask")
  if kinds.count("scale") > 1 or kinds.count("bias") > 1 or len(
      [kd for kd in kinds if kd.startswith("mask")]) > 1:
    raise Left("more than one scale, bias or mask")
  return labels, stage


def _value_labels(pv, pp, p_labels, nb):
  """``(v_labels, out_labels)`` of the probabilities' matmul ``pv``, which contracts the
  keys of ``pp`` (canonical labels ``p_labels``) with one axis of the values."""
  p_side = pv.invars.index(pp)
  (lc, rc), (lb, rb) = pv.params["dimension_numbers"]
  p_contract, p_batch = (lc, lb) if p_side == 0 else (rc, rb)
  v_contract, v_batch = (rc, rb) if p_side == 0 else (lc, lb)
  if [p_labels[d] for d in p_contract] != ["S"] or sorted(
      p_labels[d] for d in p_batch) != [f"B{j}" for j in range(nb)]:
    raise Left("the probabilities' matmul does not contract the keys")
  v_var = pv.invars[1 - p_side]
  v_labels = [None] * v_var.aval.ndim
  for dp, dv in zip(p_batch, v_batch):
    v_labels[dv] = p_labels[dp]
  v_labels[v_contract[0]] = "T"  # v's key axis plays the length axis of its layout
  free_v = [d for d in range(v_var.aval.ndim) if v_labels[d] is None]
  big = [d for d in free_v if v_var.aval.shape[d] != 1]
  if len(big) != 1 or len(v_contract) != 1:
    raise Left("the values have more than one feature axis")
  for d in free_v:
    v_labels[d] = "D" if d == big[0] else "U"
  p_free = [p_labels[d] for d in range(len(p_labels)) if d not in p_contract and d not in p_batch]
  v_free = [v_labels[d] for d in free_v]
  out_labels = [f"B{j}" for j in range(nb)] + (v_free + p_free if p_side == 1 else p_free + v_free)
  return v_labels, out_labels


def _layout(qk, steps, pv, pp) -> _Layout:
  """The canonical layout of the attention of query-key matmul ``qk`` and ``pv``."""
  lhs, rhs, labels = _score_labels(qk)
  labels, stage = _stages(steps, labels)
  k_side = 0 if labels[-1] == "L" else 1
  to_canon = {"L" if k_side == 1 else "R": "T", "L" if k_side == 0 else "R": "S", "D": "D",
              "U": "U", "B0": "B0", "B1": "B1", "G": "G"}
  order_q, order_mask = list(_ORDER_QKV), ["B0", "B1", "T", "S"]
  if "G" in labels:  # grouped-query attention: q's heads are (B1, G), k's and v's B1
    if "G" in (lhs if k_side == 0 else rhs):
      raise Left("the keys, not the queries, have the group axis")
    order_q, order_mask = ["B0", "T", "B1", "G", "D"], ["B0", "B1", "G", "T", "S"]
  nb = len(qk.params["dimension_numbers"][1][0])
  v_labels, out_labels = _value_labels(pv, pp, [to_canon[lab] for lab in labels], nb)
  q_labels = [to_canon[lab] for lab in (lhs if k_side == 1 else rhs)]
  k_labels = [to_canon[lab] for lab in (rhs if k_side == 1 else lhs)]
  k_labels = ["T" if lab == "S" else lab for lab in k_labels]
  return _Layout(k_side, stage, to_canon, order_q, order_mask, q_labels, k_labels, v_labels,
                 out_labels)


# --- the operands, the output, and the replacement --------------------------------


@dataclasses.dataclass(frozen=True)
class _Operands:
  """What the replacement reads: q, k, v, each scale, bias and mask (``extras``, with the
  shape a broadcast one takes back), and the head size the scores are scaled by."""
  q: jcore.Var
  k: jcore.Var
  v: jcore.Var
  extras: list  # vars or literals, one per stage
  shapes: list  # None or the shape with unit new axes, one per stage
  head_dim: int

  @property
  def dynamic(self) -> list:
    return [v for v in self.extras if isinstance(v, jcore.Var)]


def _operands(g, qk, pv, pp, layout) -> _Operands:
  q, k = qk.invars[1 - layout.k_side], qk.invars[layout.k_side]
  v = pv.invars[1 - pv.invars.index(pp)]
  if q.aval.dtype != k.aval.dtype or q.aval.dtype != v.aval.dtype:
    raise Left("q, k and v differ in dtype")
  extras, shapes = [], []
  for kind, e, var, lab in layout.stage:
    var, shape = (var, None) if kind == "scale" else _unbroadcast(g, var)
    if kind != "scale" and len(shape or var.aval.shape) != len(lab):
      raise Left("a mask or bias of another rank than the scores")
    extras.append(var)
    shapes.append(shape)
  return _Operands(q, k, v, extras, shapes, q.aval.shape[layout.q_labels.index("D")])


def _output(g, out, out_labels):
  """``(out, labels, tags)``: the attention output followed through transposes, casts,
  unit reshapes and checkpoint names (``tags``, given again to the replacement's)."""
  tags = []
  while (c := g.only_consumer(out)) is not None and (
      g.eqns[c].primitive.name in ("transpose", "convert_element_type", "copy", "name")
      or g.eqns[c].primitive.name == "reshape" and _unit_reshape(g.eqns[c])):
    relabelled = _relabel(g.eqns[c], out_labels)
    if relabelled is None:
      break
    out_labels, out = relabelled, g.eqns[c].outvars[0]
    tags += [g.eqns[c]] if g.eqns[c].primitive.name == "name" else []
  return out, out_labels, tags


def _modifiers(layout, ops, ev):
  """``(factor, bias, mask)`` in the canonical layout from the stage's values ``ev``."""
  factor, bias, mask = math.sqrt(ops.head_dim), None, None
  for (kind, e, _, lab), x, shape in zip(layout.stage, ev, ops.shapes):
    lab = [layout.to_canon[t] for t in lab]
    if shape is not None:
      x = x.reshape(shape)
    if kind == "scale":
      factor = (factor * x) if e.primitive.name == "mul" else (factor / x)
    elif kind == "bias":
      bias = _to_canonical(x, lab, layout.order_mask)
    else:
      m = _to_canonical(x, lab, layout.order_mask)
      mask = m if kind == "mask" else jnp.logical_not(m)
  return factor, bias, mask


def _grouped_as_heads(layout, qc, bias, mask, kv_heads, groups):
  """Grouped queries, bias and mask with the group axis merged into the heads."""
  qc = _merge_groups(qc, layout.order_q)

  def grouped(x):
    if x is not None and x.shape[1:3] not in ((1, 1), (kv_heads, groups)):
      x = jnp.broadcast_to(x, x.shape[:1] + (kv_heads, groups) + x.shape[3:])
    return None if x is None else _merge_groups(x, layout.order_mask)
  return qc, grouped(bias), grouped(mask)


def _replacement(g, layout, ops, out, tags, merged):
  """The function of q, k, v, the dynamic extras (and the projection's weight, when
  ``merged``) that computes ``out`` (or the projection's output) with `lm.attention`."""
  def fn(qv, kv, vv, *dv):
    if merged is not None:
      *dv, wv = dv
    it = iter(dv)
    ev = [next(it) if isinstance(v, jcore.Var) else v.val for v in ops.extras]
    qc = _to_canonical(qv, layout.q_labels, layout.order_q)
    kc = _to_canonical(kv, layout.k_labels, _ORDER_QKV)
    vc = _to_canonical(vv, layout.v_labels, _ORDER_QKV)
    factor, bias, mask = _modifiers(layout, ops, ev)
    if layout.grouped:
      kv_heads, groups = qc.shape[2], qc.shape[3]
      qc, bias, mask = _grouped_as_heads(layout, qc, bias, mask, kv_heads, groups)
    if not (isinstance(factor, (float, np.generic)) and float(factor) == 1.0):
      qc = (qc.astype(jnp.float32) * factor).astype(qc.dtype)
    o = attention_ops.attention(qc, kc, vc, mask=mask, bias=bias)
    if layout.grouped:
      o = o.reshape(o.shape[:2] + (kv_heads, groups) + o.shape[3:])
    o = _from_canonical(o, layout.order_q, layout.out_labels, out.aval.shape).astype(
        out.aval.dtype)
    for tag in tags:
      o = apply_layout(tag, o, names.ATTN_OUT)
    if merged is not None:
      o = _contract_merged(g.eqns[merged[1]], merged[2], o, wv)
    return [o]

  return fn


def _install(g, sm_i, layout, ops, out, tags, actions, pass_):
  """The replacement in place of the output (or of the output projection it feeds,
  contracted over the output's own layout), and its log."""
  merged = _merged_matmul(g, out)  # the output projection, on out's own layout
  final = out if merged is None else g.eqns[merged[1]].outvars[0]
  fn = _replacement(g, layout, ops, out, tags, merged)
  inputs = [ops.q, ops.k, ops.v] + ops.dynamic + ([] if merged is None else [merged[0]])
  indices = upstream(g, [final], set(inputs))
  if not g.closed(indices, {final}):
    raise Left("the scores or probabilities are used elsewhere")
  actions[g.index(final)] = Action(inputs, [final], fn)
  g.taken |= indices
  op = "lm.attention" + ("" if merged is None else " + output projection on its layout")
  pass_.rewrote(g, "attention", op, sm_i, inputs, eqns_fn(g, indices, inputs, [final]), fn)
  if merged is not None:
    pass_.rewrote(g, "layout", "matmul over the attention output's heads and features",
                  merged[1])


# --- the softmax and the scores -------------------------------------------------

_SOFTMAX_BACK = frozenset({"broadcast_in_dim", "reshape", "stop_gradient", "convert_element_type"})
_MASK_FILL = -1e4  # a `where` fill at or below this masks a key out


def _softmax_of(g, i):
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
        and _softmax_of(ig, last) is inner.invars[0]):
      return e.invars[0]
    return None
  num, den = e.invars
  ex = g.prod(num)
  red = g.prod(g.back(den, _SOFTMAX_BACK))
  if ex is None or ex.primitive.name != "exp" or red is None:
    return None
  last = (num.aval.ndim - 1,)
  if red.primitive.name != "reduce_sum" or g.back(red.invars[0], {"convert_element_type"}) is not num or tuple(
      red.params["axes"]) != last:
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


def _scores_chain(g, s):
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
      raise Left("the scores are not a matmul of queries and keys")
    e = g.eqns[i]
    name = e.primitive.name
    if name == "dot_general":
      return i, steps[::-1]
    if name in ("convert_element_type", "transpose", "copy") or (
        name == "reshape" and _unit_reshape(e)):
      steps.append(("layout", e, None))
      v = e.invars[0]
    elif name in ("mul", "div") and _scalar_operand(e) is not None:
      k = _scalar_operand(e)
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
        raise Left("a select in the scores that is not a mask")
      steps.append((kind, e, e.invars[0]))
      v = e.invars[2] if kind == "mask" else e.invars[1]
    else:
      raise Left(f"the scores pass through {name}")


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


def _scalar_operand(e):
  """Which operand of a binary ``e`` is a scalar, or None."""
  for k, v in enumerate(e.invars):
    if v.aval.ndim == 0 and e.invars[1 - k].aval.ndim > 0:
      return k if e.primitive.name == "mul" or k == 1 else None
  return None


def _leads_to_dot(g, v, depth=8):
  for _ in range(depth):
    e = g.prod(v)
    if e is None:
      return False
    if e.primitive.name == "dot_general":
      return True
    v = e.invars[0] if len(e.invars) == 1 else max(e.invars, key=lambda w: w.aval.ndim)
  return False


def _unit_reshape(e) -> bool:
  old = [d for d in e.invars[0].aval.shape if d != 1]
  new = [d for d in e.outvars[0].aval.shape if d != 1]
  return old == new and e.params.get("dimensions") is None


def _relabel(e, labels):
  """Labels of ``e``'s output from its (first) input's ``labels``."""
  name = e.primitive.name
  if name == "transpose":
    return [labels[p] for p in e.params["permutation"]]
  if name == "reshape":
    shape = e.invars[0].aval.shape
    kept = [lab for lab, d in zip(labels, shape) if d != 1]
    if any(lab != "U" and d == 1 for lab, d in zip(labels, shape)):
      return None
    it = iter(kept)
    return [next(it) if d != 1 else "U" for d in e.outvars[0].aval.shape]
  return labels


def _operand_labels(e, side, free_label):
  """Labels of operand ``side`` of ``dot_general`` ``e``: B0.., "D", and its free axes.

  Two free axes are grouped-query attention's queries: the one right after
  the second batch axis (the kv heads) is the group axis "G".
  """
  (lc, rc), (lb, rb) = e.params["dimension_numbers"]
  contract, batch = (lc, lb) if side == 0 else (rc, rb)
  v = e.invars[side]
  labels = [None] * v.aval.ndim
  for j, d in enumerate(batch):
    labels[d] = f"B{j}"
  for d in contract:
    labels[d] = "D"
  free = [d for d in range(v.aval.ndim) if labels[d] is None]
  big = free if len(free) == 1 else [d for d in free if v.aval.shape[d] != 1]
  if len(big) == 2 and len(batch) == 2 and batch[1] + 1 in big:
    labels[batch[1] + 1] = "G"
    big.remove(batch[1] + 1)
  if len(big) != 1:
    return None
  for d in free:
    if labels[d] is None:
      labels[d] = free_label if d == big[0] else "U"
  return labels if len(contract) == 1 else None


def _merge_groups(x, order):
  """``x`` on ``order``'s axes with "B1", "G" adjacent: those two as one heads axis, kv-major."""
  i = order.index("B1")
  return x.reshape(x.shape[:i] + (x.shape[i] * x.shape[i + 1],) + x.shape[i + 2:])


def _out_labels(e, lhs, rhs):
  (lc, rc), (lb, _) = e.params["dimension_numbers"]
  free_l = [lab for d, lab in enumerate(lhs) if d not in lc and d not in lb]
  free_r = [lab for d, lab in enumerate(rhs) if d not in rc and not lab.startswith("B")]
  return [f"B{j}" for j in range(len(lb))] + free_l + free_r


def _to_canonical(x, labels, order):
  """``x`` (axes ``labels``) as the axes ``order``; an absent label becomes a unit axis."""
  keep = [d for d, lab in enumerate(labels) if lab != "U"]
  x = x.reshape([x.shape[d] for d in keep])
  labels = [labels[d] for d in keep]
  present = [lab for lab in order if lab in labels]
  x = jnp.transpose(x, [labels.index(lab) for lab in present])
  return x.reshape([x.shape[present.index(lab)] if lab in present else 1 for lab in order])


def _from_canonical(x, order, labels, shape):
  """Inverse of `_to_canonical` onto ``labels`` and ``shape``."""
  present = [lab for lab in labels if lab != "U"]
  x = x.reshape([x.shape[order.index(lab)] for lab in order if lab in present])
  have = [lab for lab in order if lab in present]
  x = jnp.transpose(x, [have.index(lab) for lab in present])
  return x.reshape(shape)



# --- the output projection, contracted over the output as saved -------------------

def _merged_matmul(g, out):
  """``(w, dot index, side)`` where ``out`` [..., h, d] is only reshaped to
  [..., h * d] for one ``dot_general`` contracting that axis with ``w``'s; else None.

  Contracting over ``out``'s two axes instead keeps one array for backward, not
  ``out`` and its reshape: autodiff counts them apart.
  """
  r = g.only_consumer(out)
  if r is None or g.eqns[r].primitive.name != "reshape" or out.aval.ndim < 2:
    return None
  merged = g.eqns[r].outvars[0]
  *lead, h, d = out.aval.shape
  if merged.aval.shape != (*lead, h * d) or g.eqns[r].params.get("dimensions") is not None:
    return None
  c = g.only_consumer(merged)
  if c is None or g.eqns[c].primitive.name != "dot_general":
    return None
  e = g.eqns[c]
  (lc, rc), (lb, rb) = e.params["dimension_numbers"]
  side = e.invars.index(merged)
  if lb or rb or e.invars[0] is e.invars[1] or list((lc, rc)[side]) != [len(lead)]:
    return None
  return e.invars[1 - side], c, side


def _contract_merged(e, side, o, w):
  """``dot_general`` ``e`` with its operand on ``side`` given as ``o`` [..., h, d],
  unmerged, and the other operand ``w`` split to match: the same result."""
  (lc, rc), _ = e.params["dimension_numbers"]
  axis = (rc, lc)[side][0]  # w's contracted axis
  h, d = o.shape[-2:]
  w = w.reshape(*w.shape[:axis], h, d, *w.shape[axis + 1:])
  o_axes, w_axes = (o.ndim - 2, o.ndim - 1), (axis, axis + 1)
  lhs, rhs, dims = (o, w, (o_axes, w_axes)) if side == 0 else (w, o, (w_axes, o_axes))
  return lax.dot_general(lhs, rhs, (dims, ((), ())),
                         precision=e.params.get("precision"),
                         preferred_element_type=e.params.get("preferred_element_type"),
                         out_sharding=e.params.get("out_sharding"))


def _unbroadcast(g, var):
  """``(source, shape)``: ``var`` is ``source`` broadcast; ``shape`` has 1 on new axes."""
  e = g.prod(var)
  if e is None or e.primitive.name != "broadcast_in_dim" or not isinstance(
      e.invars[0], jcore.Var) or list(e.params["broadcast_dimensions"]) != sorted(
          e.params["broadcast_dimensions"]):
    return var, None
  shape = [1] * var.aval.ndim
  for j, d in enumerate(e.params["broadcast_dimensions"]):
    shape[d] = e.invars[0].aval.shape[j]
  return e.invars[0], tuple(shape)
