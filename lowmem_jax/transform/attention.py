"""The attention matcher: ``softmax(q k^T * scale + bias, where mask) v`` becomes
`lowmem_jax.attention`, which keeps no L×L residual (Rabe & Staats 2021, arXiv:2112.05682).

Steps: the softmax (`_softmax_of`), the scores back to ``dot_general(q, k)``
with their scale, bias and mask (`_scores_chain`), the probabilities' matmul
with ``v``, through a dropout (`_values_matmul`, `_dropout_at`: the equations
that draw its keep-mask from a key become a function the op calls again in the
backward) and per-head factors (`_per_head`, applied to the output); then each
operand's axes labelled in one canonical layout (`_layout`), the operands read
(`_operands`; a mask made of parts split into a causal flag and small parts,
`_mask_parts`), the output followed to its last layout op (`_output`), and the
replacement installed (`_install`). A pattern left raises `Left` with the reason,
naming the op that broke it and its line.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from lowmem_jax import names
from lowmem_jax.ops import attention as attention_ops
from lowmem_jax.transform.graph import Graph, constant, fill_value, scalar, upstream
from lowmem_jax.transform.interpreter import (
  Action,
  apply_layout,
  bind,
  eqns_fn,
  inline_jit,
)
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
  pp, pv_i, drop, heads = _values_matmul(g, g.eqns[i].outvars[0])
  layout = _layout(g, g.eqns[qk_i], steps, g.eqns[pv_i], pp, i)
  ops = _operands(g, g.eqns[qk_i], g.eqns[pv_i], pp, layout, drop, heads)
  out, out_labels, tags = _output(g, g.eqns[pv_i].outvars[0], layout.out_labels)
  layout = dataclasses.replace(layout, out_labels=out_labels)
  _install(g, i, layout, ops, out, tags, actions, pass_)


def _values_matmul(g, p):
  """``(p, index, dropout, heads)``: the probabilities ``p`` as the one matmul they feed reads
  them (through casts, a dropout: `_dropout_at`, and per-head factors: `_per_head`), that
  matmul, the `_Dropout` or None, and the `_PerHead` factors."""
  factor, drop, heads = 1.0, None, []
  while True:
    c = g.only_consumer(p)
    e = None if c is None else g.eqns[c]
    if e is not None and e.primitive.name == "dot_general" and (
        e.params["dimension_numbers"][0][e.invars.index(p)]):  # it contracts p: p @ v
      break
    if e is not None and e.primitive.name == "convert_element_type":
      p = e.outvars[0]
      continue
    k = _scalar_operand(e) if e is not None and e.primitive.name in ("mul", "div") else None
    f = None if k is None or e.invars[1 - k] is not p else constant(g, e.invars[k])
    if f is not None and f != 0.0:
      factor = factor * f if e.primitive.name == "mul" else factor / f
      p = e.outvars[0]
      continue
    found = None if e is None or drop is not None else _dropout_at(g, e, p)
    if found is not None:
      drop, p = found, e.outvars[0]
      continue
    found = None if e is None else _per_head(g, e, p)
    if found is None:
      ops = [_op_at(g, i) for i in g.consumers.get(p, [])]
      raise _other_than_one_matmul(
          "are returned" if p in g.outvars else "feed " + ", ".join(ops))
    heads.append(found[0])
    p = found[1]
  if drop is None and factor != 1.0:
    raise _other_than_one_matmul(f"are scaled, with no dropout, before {_op_at(g, c)}")
  drop = None if drop is None else dataclasses.replace(drop, factor=factor * drop.factor)
  return p, c, drop, heads


def _other_than_one_matmul(where) -> Left:
  return Left("the probabilities feed something other than one matmul (dropout on them, or "
              f"returned): they {where}")


@dataclasses.dataclass(frozen=True)
class _Dropout:
  """A dropout on the probabilities: ``p * keep * factor``, ``keep`` (``not keep`` where
  ``negated``) the boolean made by equations ``indices`` from the vars ``inputs`` (a key)."""
  keep: jcore.Var
  shape: tuple  # keep's shape with a 1 on each axis it is broadcast along, in p's rank
  negated: bool
  factor: float
  indices: frozenset
  inputs: list


def _dropout_at(g, e, p):
  """The `_Dropout` equation ``e`` applies to ``p``: ``p * (keep.astype(dtype) / keep_prob)``
  (flax's `dot_product_attention_weights`) or ``select(keep, p, 0)`` (`flax.linen.Dropout`,
  ``jnp.where``; the division by keep_prob before it); else None."""
  name = e.primitive.name
  if name == "mul" and e.invars[0] is not e.invars[1]:
    other = e.invars[1 - e.invars.index(p)]
    keep, dims, factor = _multiplier(g, other, list(range(p.aval.ndim)))
    negated = False
  elif name == "select_n" and len(e.invars) == 3 and e.invars[0] is not p:
    zero = e.invars[1] if e.invars[2] is p else e.invars[2]
    if fill_value(g, zero) != 0.0:
      return None
    keep, dims = _through_broadcasts(g, e.invars[0], list(range(p.aval.ndim)))
    negated, factor = e.invars[1] is p, 1.0
  else:
    return None
  if keep is None or dims != sorted(dims):
    return None
  made = upstream(g, [keep], set())
  keys = {g.eqns[i].invars[0] for i in made if g.eqns[i].primitive.name == "random_bits"}
  if not keys:
    return None
  made = upstream(g, [keep], keys)
  return _Dropout(keep, _shape_in(keep, dims, p.aval.ndim), negated, factor, frozenset(made),
                  _free_vars(g, made))


@dataclasses.dataclass(frozen=True)
class _PerHead:
  """A factor of the probabilities constant along the keys (Hugging Face's head mask):
  ``var``, whose axes are the axes ``dims`` of ``p``. As ``(p * f) @ v == f * (p @ v)``,
  it multiplies the attention output instead."""
  var: jcore.Var
  dims: list


def _per_head(g, e, p):
  """``(factor, p)``: equation ``e`` multiplies ``p`` by a `_PerHead` factor, as
  ``jnp.einsum("...hqk,h->...hqk", p, m)`` (a ``dot_general`` that batches every axis of
  ``m`` and contracts none, transposed back to ``p``'s layout) or as ``p * m[:, None, None]``
  writes it; ``p`` after it. Else None."""
  name, ndim = e.primitive.name, p.aval.ndim
  if name == "mul" and e.invars[0] is not e.invars[1]:
    m, dims = _through_broadcasts(g, e.invars[1 - e.invars.index(p)], list(range(ndim)))
    out = e.outvars[0]
  elif name == "dot_general" and e.invars[0] is not e.invars[1]:
    side = e.invars.index(p)
    m = e.invars[1 - side]
    p_batch, m_batch = (e.params["dimension_numbers"][1][j] for j in (side, 1 - side))
    if len(m_batch) != m.aval.ndim:
      return None
    dims = [p_batch[list(m_batch).index(j)] for j in range(m.aval.ndim)]
    order = list(p_batch) + [d for d in range(ndim) if d not in p_batch]  # p's axes of out
    out = e.outvars[0]
    while order != list(range(ndim)) and (c := g.only_consumer(out)) is not None and (
        g.eqns[c].primitive.name == "transpose"):
      order = [order[j] for j in g.eqns[c].params["permutation"]]
      out = g.eqns[c].outvars[0]
    if order != list(range(ndim)):
      return None
  else:
    return None
  if not isinstance(m, jcore.Var) or not jnp.issubdtype(m.aval.dtype, jnp.number) or any(
      d == ndim - 1 and m.aval.shape[j] != 1 for j, d in enumerate(dims)):  # keys: last axis
    return None
  return _PerHead(m, dims), out


def _multiplier(g, v, dims):
  """``(keep, dims, factor)``: ``v`` is ``keep``, a boolean, cast, times ``factor`` and
  broadcast (``dims``: the axes of ``p`` keep's axes are); ``(None, dims, 1.0)`` if not."""
  factor = 1.0
  while (e := g.prod(v)) is not None:
    name = e.primitive.name
    k = _scalar_operand(e) if name in ("mul", "div") else None
    if k is not None and (f := constant(g, e.invars[k])) is not None and f != 0.0:
      factor = factor * f if name == "mul" else factor / f
      v = e.invars[1 - k]
    elif name == "broadcast_in_dim":
      dims, v = [dims[d] for d in e.params["broadcast_dimensions"]], e.invars[0]
    elif name == "convert_element_type" and e.invars[0].aval.dtype == jnp.bool_:
      keep, dims = _through_broadcasts(g, e.invars[0], dims)
      return keep, dims, factor
    else:
      break
  return None, dims, 1.0


def _through_broadcasts(g, v, dims):
  """``(source, dims)``: ``v`` followed back through broadcasts (None if not a var)."""
  while (e := g.prod(v)) is not None and e.primitive.name == "broadcast_in_dim":
    dims, v = [dims[d] for d in e.params["broadcast_dimensions"]], e.invars[0]
  return (v if isinstance(v, jcore.Var) else None), dims


def _op_at(g, e) -> str:
  """Equation ``e`` (or its index) for a reason: its primitive and source line."""
  i = e if isinstance(e, int) else g.index(e.outvars[0])
  return f"{g.eqns[i].primitive.name} ({g.source(i)})"


def _left(g, why, e, sep=": ") -> Left:
  """`Left` for the reason ``why``, naming equation ``e`` (or its index) and its line."""
  return Left(f"{why}{sep}{_op_at(g, e)}")


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
  p_labels: list  # the probabilities' labels (before the canonical ones)

  @property
  def grouped(self) -> bool:
    return "G" in self.order_q


def _score_labels(g, qk):
  """``(lhs, rhs, out)``: labels of the query-key matmul's operands and output."""
  lhs = _operand_labels(qk, 0, "L")
  rhs = _operand_labels(qk, 1, "R")
  if lhs is None or rhs is None:
    raise _left(g, "the query-key matmul has more than one query or key axis (and no group "
                "axis right after the kv heads)", qk)
  if len(qk.params["dimension_numbers"][1][0]) > 2:
    raise _left(g, "more than two batch axes in the scores", qk)
  return lhs, rhs, _out_labels(qk, lhs, rhs)


def _stages(g, steps, labels, sm_i):
  """``(labels, stage)``: the scores' labels at the softmax, and each scale, bias and mask
  with the labels at its op; one scale, before any bias or mask; one bias; one mask."""
  stage = []
  for kind, e, k in steps:
    if kind == "layout":
      labels = _relabel(e, labels)
      if labels is None:
        raise _left(g, "a reshape of the scores merges or splits axes", e)
    else:
      stage.append((kind, e, k, list(labels)))
  if labels[-1] not in ("L", "R"):
    raise _left(g, "the softmax is not over the keys", sm_i)
  kinds = [st[0] for st in stage]
  if "scale" in kinds and any(kd in ("bias", "mask", "mask_not") for kd in
                              kinds[:kinds.index("scale")]):
    raise _left(g, "the scores are scaled after a bias or mask", stage[kinds.index("scale")][1])
  for n, kind in enumerate(kinds):
    if kind.split("_")[0] in [kd.split("_")[0] for kd in kinds[:n]]:  # mask_not is a mask
      raise _left(g, "more than one scale, bias or mask", stage[n][1])
  return labels, stage


def _value_labels(g, pv, pp, p_labels, nb):
  """``(v_labels, out_labels)`` of the probabilities' matmul ``pv``, which contracts the
  keys of ``pp`` (canonical labels ``p_labels``) with one axis of the values."""
  p_side = pv.invars.index(pp)
  (lc, rc), (lb, rb) = pv.params["dimension_numbers"]
  p_contract, p_batch = (lc, lb) if p_side == 0 else (rc, rb)
  v_contract, v_batch = (rc, rb) if p_side == 0 else (lc, lb)
  if [p_labels[d] for d in p_contract] != ["S"] or sorted(
      p_labels[d] for d in p_batch) != [f"B{j}" for j in range(nb)]:
    raise _left(g, "the probabilities' matmul does not contract the keys", pv)
  v_var = pv.invars[1 - p_side]
  v_labels = [None] * v_var.aval.ndim
  for dp, dv in zip(p_batch, v_batch):
    v_labels[dv] = p_labels[dp]
  v_labels[v_contract[0]] = "T"  # v's key axis plays the length axis of its layout
  free_v = [d for d in range(v_var.aval.ndim) if v_labels[d] is None]
  big = [d for d in free_v if v_var.aval.shape[d] != 1]
  if len(big) != 1 or len(v_contract) != 1:
    raise _left(g, "the values have more than one feature axis", pv)
  for d in free_v:
    v_labels[d] = "D" if d == big[0] else "U"
  p_free = [p_labels[d] for d in range(len(p_labels)) if d not in p_contract and d not in p_batch]
  v_free = [v_labels[d] for d in free_v]
  out_labels = [f"B{j}" for j in range(nb)] + (v_free + p_free if p_side == 1 else p_free + v_free)
  return v_labels, out_labels


def _layout(g, qk, steps, pv, pp, sm_i) -> _Layout:
  """The canonical layout of the attention of query-key matmul ``qk``, ``pv`` and the
  softmax at equation ``sm_i``."""
  lhs, rhs, labels = _score_labels(g, qk)
  labels, stage = _stages(g, steps, labels, sm_i)
  k_side = 0 if labels[-1] == "L" else 1
  to_canon = {"L" if k_side == 1 else "R": "T", "L" if k_side == 0 else "R": "S", "D": "D",
              "U": "U", "B0": "B0", "B1": "B1", "G": "G"}
  order_q, order_mask = list(_ORDER_QKV), ["B0", "B1", "T", "S"]
  if "G" in labels:  # grouped-query attention: q's heads are (B1, G), k's and v's B1
    if "G" in (lhs if k_side == 0 else rhs):
      raise _left(g, "the keys, not the queries, have the group axis", qk)
    order_q, order_mask = ["B0", "T", "B1", "G", "D"], ["B0", "B1", "G", "T", "S"]
  nb = len(qk.params["dimension_numbers"][1][0])
  v_labels, out_labels = _value_labels(g, pv, pp, [to_canon[lab] for lab in labels], nb)
  q_labels = [to_canon[lab] for lab in (lhs if k_side == 1 else rhs)]
  k_labels = [to_canon[lab] for lab in (rhs if k_side == 1 else lhs)]
  k_labels = ["T" if lab == "S" else lab for lab in k_labels]
  return _Layout(k_side, stage, to_canon, order_q, order_mask, q_labels, k_labels, v_labels,
                 out_labels, labels)


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
  drop: _Dropout | None
  heads: list  # the `_PerHead` factors

  @property
  def dynamic(self) -> list:
    """The vars the replacement reads beyond q, k and v: the extras', the per-head
    factors', the dropout's."""
    out = []
    for x in self.extras:
      out += x.inputs if isinstance(x, _MaskParts) else [x] if isinstance(x, jcore.Var) else []
    return out + [h.var for h in self.heads] + (self.drop.inputs if self.drop else [])

  @property
  def causal(self) -> bool:
    return any(isinstance(x, _MaskParts) and x.causal for x in self.extras)

  @property
  def stops(self) -> set:
    """The masks made in parts: the replacement reads their parts instead."""
    return {x.mask for x in self.extras if isinstance(x, _MaskParts)}

  def values(self, vals):
    """``(extras, heads, dropout)``: the values of `dynamic`, ``vals``, each extra's, each
    per-head factor's and the dropout's inputs'."""
    it, out = iter(vals), []
    for x in self.extras:
      if isinstance(x, _MaskParts):
        out.append(x(*[next(it) for _ in x.inputs]))
      else:
        out.append(next(it) if isinstance(x, jcore.Var) else x.val)
    return out, [next(it) for _ in self.heads], list(it)


def _operands(g, qk, pv, pp, layout, drop, heads) -> _Operands:
  q, k = qk.invars[1 - layout.k_side], qk.invars[layout.k_side]
  v = pv.invars[1 - pv.invars.index(pp)]
  if q.aval.dtype != k.aval.dtype or q.aval.dtype != v.aval.dtype:
    raise _left(g, "q, k and v differ in dtype", pv)
  extras, shapes = [], []
  for kind, e, var, lab in layout.stage:
    parts = (_mask_parts(g, var, [layout.to_canon[t] for t in lab], layout.order_mask)
             if kind == "mask" else None)
    if parts is not None:
      extras.append(parts)
      shapes.append(None)
      continue
    var, shape = (var, None) if kind == "scale" else _unbroadcast(g, var)
    if kind != "scale" and len(shape or var.aval.shape) != len(lab):
      raise _left(g, "a mask or bias of another rank than the scores", e)
    extras.append(var)
    shapes.append(shape)
  return _Operands(q, k, v, extras, shapes, q.aval.shape[layout.q_labels.index("D")], drop,
                   heads)


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
  for (kind, e, _, lab), x, shape, extra in zip(layout.stage, ev, ops.shapes, ops.extras):
    lab = [layout.to_canon[t] for t in lab]
    if shape is not None:
      x = x.reshape(shape)
    if isinstance(extra, _MaskParts):  # already canonical; None if causal and nothing else
      mask = x
    elif kind == "scale":
      factor = (factor * x) if e.primitive.name == "mul" else (factor / x)
    elif kind == "bias":
      bias = _to_canonical(x, lab, layout.order_mask)
    else:
      m = _to_canonical(x, lab, layout.order_mask)
      mask = m if kind == "mask" else jnp.logical_not(m)
  return factor, bias, mask


def _grouped(layout, x, kv_heads, groups):
  """A grouped bias or mask (or None) with the group axis merged into the heads."""
  if x is not None and x.shape[1:3] not in ((1, 1), (kv_heads, groups)):
    x = jnp.broadcast_to(x, x.shape[:1] + (kv_heads, groups) + x.shape[3:])
  return None if x is None else _merge_groups(x, layout.order_mask)


def _keep_fn(g, layout, drop, grouping):
  """The dropout's keep-mask as a function of its inputs, in the canonical layout
  (``grouping``: ``(kv_heads, groups)`` of grouped queries, else None)."""
  draw = eqns_fn(g, drop.indices, drop.inputs, [drop.keep])
  labels = [layout.to_canon[t] for t in layout.p_labels]

  def keep(*vals):
    x = _to_canonical(draw(*vals)[0].reshape(drop.shape), labels, layout.order_mask)
    x = jnp.logical_not(x) if drop.negated else x
    return x if grouping is None else _grouped(layout, x, *grouping)
  return keep


def _replacement(g, layout, ops, out, tags, merged):
  """The function of q, k, v, the dynamic extras (and the projection's weight, when
  ``merged``) that computes ``out`` (or the projection's output) with `lm.attention`."""
  def fn(qv, kv, vv, *dv):
    if merged is not None:
      *dv, wv = dv
    ev, head_vals, drop_vals = ops.values(dv)
    qc = _to_canonical(qv, layout.q_labels, layout.order_q)
    kc = _to_canonical(kv, layout.k_labels, _ORDER_QKV)
    vc = _to_canonical(vv, layout.v_labels, _ORDER_QKV)
    factor, bias, mask = _modifiers(layout, ops, ev)
    grouping = (qc.shape[2], qc.shape[3]) if layout.grouped else None
    if grouping:
      qc = _merge_groups(qc, layout.order_q)
      bias, mask = _grouped(layout, bias, *grouping), _grouped(layout, mask, *grouping)
    if not (isinstance(factor, (float, np.generic)) and float(factor) == 1.0):
      qc = (qc.astype(jnp.float32) * factor).astype(qc.dtype)
    if ops.drop is None:
      o = attention_ops.attention(qc, kc, vc, mask=mask, bias=bias, is_causal=ops.causal)
    else:
      dropout = attention_ops.Dropout(_keep_fn(g, layout, ops.drop, grouping), ops.drop.factor)
      o = attention_ops.attention_with_dropout(qc, kc, vc, dropout, tuple(drop_vals), mask=mask,
                                               bias=bias, is_causal=ops.causal)
    if grouping:
      o = o.reshape(o.shape[:2] + grouping + o.shape[3:])
    for head, x in zip(ops.heads, head_vals):
      o = o * _head_factor(layout, head, x).astype(o.dtype)
    o = _from_canonical(o, layout.order_q, layout.out_labels, out.aval.shape).astype(
        out.aval.dtype)
    for tag in tags:
      o = apply_layout(tag, o, names.ATTN_OUT)
    if merged is not None:
      o = _contract_merged(g.eqns[merged[1]], merged[2], o, wv)
    return [o]

  return fn


def _head_factor(layout, head, x):
  """The value ``x`` of `_PerHead` ``head`` on the output's canonical axes."""
  x = _into_rank(x, head.dims, len(layout.p_labels))
  labels = [layout.to_canon[t] if n != 1 else "U" for t, n in zip(layout.p_labels, x.shape)]
  return _to_canonical(x, labels, layout.order_q)


def _install(g, sm_i, layout, ops, out, tags, actions, pass_):
  """The replacement in place of the output (or of the output projection it feeds,
  contracted over the output's own layout), and its log."""
  merged = _merged_matmul(g, out)  # the output projection, on out's own layout
  final = out if merged is None else g.eqns[merged[1]].outvars[0]
  fn = _replacement(g, layout, ops, out, tags, merged)
  inputs = [ops.q, ops.k, ops.v] + ops.dynamic + ([] if merged is None else [merged[0]])
  indices = upstream(g, [final], set(inputs) | ops.stops)  # a mask in parts stays for others
  if (used := _used_outside(g, indices, {final})) is not None:
    raise Left(f"the scores or probabilities are used elsewhere: by {used}")
  actions[g.index(final)] = Action(inputs, [final], fn)
  g.taken |= indices
  op = "lm.attention" + ("" if merged is None else " + output projection on its layout")
  op += " (causal)" if ops.causal else ""
  before = eqns_fn(g, upstream(g, [final], set(inputs)), inputs, [final])
  pass_.rewrote(g, "attention", op, sm_i, inputs, before, fn)
  if merged is not None:
    pass_.rewrote(g, "layout", "matmul over the attention output's heads and features",
                  merged[1])


def _used_outside(g, indices, outputs):
  """The first use, outside ``indices``, of a var they make (less ``outputs``), as
  `_op_at` names it ("returned" for an output of the jaxpr); None if there is none."""
  for i in sorted(indices):
    for v in g.eqns[i].outvars:
      if v in outputs:
        continue
      if v in g.outvars:
        return f"the function's outputs ({g.source(i)})"
      outside = [c for c in g.consumers.get(v, []) if c not in indices]
      if outside:
        return _op_at(g, outside[0])
  return None


# --- a mask made of a causal part and per-key parts ---------------------------------

# Elementwise ops of one array (other operands literal scalars) a part of a mask may pass
# through after its broadcast: replayed on the part before the broadcast.
_PART_OPS = frozenset({"convert_element_type", "ne", "eq", "gt", "ge", "lt", "le", "not",
                          "copy"})


@dataclasses.dataclass(frozen=True)
class _MaskParts:
  """A boolean mask as ``causal and part_1 and ...``: its constant parts a causal mask
  (evaluated at trace time), each other part an array of the function's broadcast to
  the scores (a ``[B, L]`` padding mask, a mask it is given).

  Called with the parts' ``inputs``, gives their ``and`` in the canonical layout, each
  at its own size (``[B, 1, 1, L]`` for a ``[B, L]`` padding mask; a ``[B, 1, L, L]``
  argument as it is, no reshape of it), or None where there is none.
  """
  mask: jcore.Var  # the whole mask, as the function makes it
  causal: bool
  inputs: list  # one var per part, before its broadcast
  chains: list  # the elementwise equations after each input's broadcast, in order
  labels: list  # each input's canonical axis labels
  order: list  # the canonical order of a mask's axes

  def __call__(self, *vals):
    mask = None
    for x, chain, labels in zip(vals, self.chains, self.labels):
      for e in chain:
        x = bind(e, [x] + [w.val for w in e.invars[1:]])[0]
      present = [lab for lab in labels if lab != "U"]
      if present == sorted(present, key=self.order.index):  # one reshape; none if no change
        x = x.reshape([x.shape[labels.index(lab)] if lab in labels else 1 for lab in self.order])
      else:
        x = _to_canonical(x, labels, self.order)
      mask = x if mask is None else mask & x
    return mask


def _mask_parts(g, m, labels, order):
  """``m`` (canonical ``labels``) as `_MaskParts`, or None where its constant parts are
  neither causal nor all true: ``and`` of parts, through ``gt(x.astype(..), 0)``,
  broadcasts and transposes."""
  constant_parts, inputs, chains, labels_of = [], [], [], []
  for v, dims in _conjuncts(g, m, list(range(m.aval.ndim))):
    made = upstream(g, [v], set())
    if not _free_vars(g, made) and g.index(v) is not None:
      constant_parts.append((v, made, dims))
      continue
    src, chain, dims = _broadcast_source(g, v, dims)
    inputs.append(src)
    chains.append(chain)
    labels_of.append([labels[d] if src.aval.shape[j] != 1 else "U" for j, d in enumerate(dims)])
  causal = _is_causal(g, constant_parts, labels, m.aval.ndim)
  return None if causal is None else _MaskParts(m, causal, inputs, chains, labels_of, order)


def _conjuncts(g, v, dims):
  """``(part, dims)`` of boolean ``v``'s ``and``s, through broadcasts and transposes
  (``dims``: the axes of ``m`` a part's axes are) and ``x != 0``, ``x > 0`` of a boolean
  cast."""
  e = g.prod(v)
  name = None if e is None else e.primitive.name
  if name == "and" and all(isinstance(w, jcore.Var) for w in e.invars):
    return [c for w in e.invars for c in _conjuncts(g, w, dims)]
  if name in ("broadcast_in_dim", "transpose") and isinstance(e.invars[0], jcore.Var):
    return _conjuncts(g, e.invars[0], _dims_before(e, dims))
  if name in ("ne", "gt") and scalar(e.invars[1]) == 0.0:
    c = g.prod(e.invars[0])
    if c is not None and c.primitive.name == "convert_element_type" and (
        c.invars[0].aval.dtype == jnp.bool_):
      return _conjuncts(g, c.invars[0], dims)
  return [(v, dims)]


def _dims_before(e, dims):
  """``dims`` of a broadcast's or transpose's operand, from those of its output."""
  if e.primitive.name == "broadcast_in_dim":
    return [dims[d] for d in e.params["broadcast_dimensions"]]
  before = [None] * len(dims)
  for i, j in enumerate(e.params["permutation"]):
    before[j] = dims[i]
  return before


def _broadcast_source(g, v, dims):
  """``(source, chain, dims)``: ``v`` is ``source`` broadcast and transposed (``dims``),
  passed through the elementwise equations ``chain``."""
  chain = []
  while (e := g.prod(v)) is not None:
    name = e.primitive.name
    if name in ("broadcast_in_dim", "transpose"):
      dims = _dims_before(e, dims)
    elif name not in _PART_OPS or not all(isinstance(w, jcore.Literal) and np.ndim(w.val) == 0
                                              for w in e.invars[1:]):
      break
    else:
      chain.append(e)
    v = e.invars[0]
    if not isinstance(v, jcore.Var):
      break
  return v, chain[::-1], dims


def _into_rank(x, dims, ndim):
  """``x``, whose axes are the axes ``dims`` of a rank ``ndim`` array, in that rank with
  1 on the other axes."""
  order = sorted(range(len(dims)), key=dims.__getitem__)
  if order != list(range(len(dims))):
    x = jnp.transpose(x, order)
  return x.reshape(_shape_in(x, sorted(dims), ndim))


def _free_vars(g, indices):
  """The vars equations ``indices`` read that none of them makes, in order."""
  return list(dict.fromkeys(v for i in sorted(indices) for v in g.eqns[i].invars
                            if isinstance(v, jcore.Var) and g.index(v) not in indices))


def _shape_in(v, dims, ndim):
  """The shape of ``v`` (a var or an array), whose axes are the axes ``dims`` (in order)
  of a rank ``ndim`` array, in that rank with 1 on the other axes."""
  shape = [1] * ndim
  for j, d in enumerate(dims):
    shape[d] = (v.aval if isinstance(v, jcore.Var) else v).shape[j]
  return tuple(shape)


def _is_causal(g, parts, labels, ndim):
  """True if the constant ``parts`` (anded) are the causal mask of the queries and keys
  (query i keeps keys 0..i), False if there are none or they keep every key, else None."""
  if not parts:
    return False
  with jax.ensure_compile_time_eval():
    mask = np.ones((), bool)
    for v, made, dims in parts:
      mask = mask & np.asarray(_into_rank(eqns_fn(g, made, [], [v])()[0], dims, ndim))
  if mask.all():
    return False
  t, s = labels.index("T"), labels.index("S")
  if mask.shape[t] == 1 or mask.shape[s] == 1:
    return None
  pair = np.moveaxis(mask, (t, s), (-2, -1))
  return True if (pair == np.tril(np.ones(pair.shape[-2:], bool))).all() else None


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
      at = steps[-1][1] if steps else g.consumers[s][0]  # the op that reads the input
      raise _left(g, "the scores are not a matmul of queries and keys (an input reaches)", at)
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
        raise _left(g, "a select in the scores that is not a mask", e)
      steps.append((kind, e, e.invars[0]))
      v = e.invars[2] if kind == "mask" else e.invars[1]
    else:
      raise _left(g, "the scores pass through", e, sep=" ")


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
