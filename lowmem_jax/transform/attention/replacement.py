"""The operands the replacement reads, the output followed to its last layout op, and the
replacement `lowmem_jax.attention` installed in place of the pattern.
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from lowmem_jax import names
from lowmem_jax.ops import attention as attention_ops
from lowmem_jax.transform.attention.layout import (
  ORDER_QKV,
  from_canonical,
  merge_groups,
  relabel,
  to_canonical,
)
from lowmem_jax.transform.attention.mask import MaskParts, into_rank, mask_parts
from lowmem_jax.transform.attention.probabilities import DropoutFound
from lowmem_jax.transform.attention.projection import (
  contract_merged,
  merged_matmul,
  unbroadcast,
)
from lowmem_jax.transform.graph import (
  op_at,
  unit_reshape,
  upstream,
)
from lowmem_jax.transform.interpreter import (
  Action,
  apply_layout,
  eqns_fn,
)
from lowmem_jax.transform.rewrites import Left


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
  drop: DropoutFound | None
  heads: list  # the `_PerHead` factors

  @property
  def dynamic(self) -> list:
    """The vars the replacement reads beyond q, k and v: the extras', the per-head
    factors', the dropout's."""
    out = []
    for x in self.extras:
      out += x.inputs if isinstance(x, MaskParts) else [x] if isinstance(x, jcore.Var) else []
    return out + [h.var for h in self.heads] + (self.drop.inputs if self.drop else [])

  @property
  def causal(self) -> bool:
    return any(isinstance(x, MaskParts) and x.causal for x in self.extras)

  @property
  def stops(self) -> set:
    """The masks made in parts: the replacement reads their parts instead."""
    return {x.mask for x in self.extras if isinstance(x, MaskParts)}

  def values(self, vals):
    """``(extras, heads, dropout)``: the values of `dynamic`, ``vals``, each extra's, each
    per-head factor's and the dropout's inputs'."""
    it, out = iter(vals), []
    for x in self.extras:
      if isinstance(x, MaskParts):
        out.append(x(*[next(it) for _ in x.inputs]))
      else:
        out.append(next(it) if isinstance(x, jcore.Var) else x.val)
    return out, [next(it) for _ in self.heads], list(it)


def read_operands(g, qk, pv, pp, layout, drop, heads) -> _Operands:
  q, k = qk.invars[1 - layout.k_side], qk.invars[layout.k_side]
  v = pv.invars[1 - pv.invars.index(pp)]
  if q.aval.dtype != k.aval.dtype or q.aval.dtype != v.aval.dtype:
    raise Left.at(g, "q, k and v differ in dtype", pv)
  extras, shapes = [], []
  for kind, e, var, lab in layout.stage:
    parts = (mask_parts(g, var, [layout.to_canon[t] for t in lab], layout.order_mask)
             if kind == "mask" else None)
    if parts is not None:
      extras.append(parts)
      shapes.append(None)
      continue
    var, shape = (var, None) if kind == "scale" else unbroadcast(g, var)
    if kind != "scale" and len(shape or var.aval.shape) != len(lab):
      raise Left.at(g, "a mask or bias of another rank than the scores", e)
    extras.append(var)
    shapes.append(shape)
  return _Operands(q, k, v, extras, shapes, q.aval.shape[layout.q_labels.index("D")], drop,
                   heads)


def follow_output(g, out, out_labels):
  """``(out, labels, tags)``: the attention output followed through transposes, casts,
  unit reshapes and checkpoint names (``tags``, given again to the replacement's)."""
  tags = []
  while (c := g.only_consumer(out)) is not None and (
      g.eqns[c].primitive.name in ("transpose", "convert_element_type", "copy", "name")
      or g.eqns[c].primitive.name == "reshape" and unit_reshape(g.eqns[c])):
    relabelled = relabel(g.eqns[c], out_labels)
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
    if isinstance(extra, MaskParts):  # already canonical; None if causal and nothing else
      mask = x
    elif kind == "scale":
      factor = (factor * x) if e.primitive.name == "mul" else (factor / x)
    elif kind == "bias":
      bias = to_canonical(x, lab, layout.order_mask)
    else:
      m = to_canonical(x, lab, layout.order_mask)
      mask = m if kind == "mask" else jnp.logical_not(m)
  return factor, bias, mask


def _grouped(layout, x, kv_heads, groups):
  """A grouped bias or mask (or None) with the group axis merged into the heads."""
  if x is not None and x.shape[1:3] not in ((1, 1), (kv_heads, groups)):
    x = jnp.broadcast_to(x, x.shape[:1] + (kv_heads, groups) + x.shape[3:])
  return None if x is None else merge_groups(x, layout.order_mask)


def _keep_fn(g, layout, drop, grouping):
  """The dropout's keep-mask as a function of its inputs, in the canonical layout
  (``grouping``: ``(kv_heads, groups)`` of grouped queries, else None)."""
  draw = eqns_fn(g, drop.indices, drop.inputs, [drop.keep])
  labels = [layout.to_canon[t] for t in layout.p_labels]

  def keep(*vals):
    x = to_canonical(draw(*vals)[0].reshape(drop.shape), labels, layout.order_mask)
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
    qc = to_canonical(qv, layout.q_labels, layout.order_q)
    kc = to_canonical(kv, layout.k_labels, ORDER_QKV)
    vc = to_canonical(vv, layout.v_labels, ORDER_QKV)
    factor, bias, mask = _modifiers(layout, ops, ev)
    grouping = (qc.shape[2], qc.shape[3]) if layout.grouped else None
    if grouping:
      qc = merge_groups(qc, layout.order_q)
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
    o = from_canonical(o, layout.order_q, layout.out_labels, out.aval.shape).astype(
        out.aval.dtype)
    for tag in tags:
      o = apply_layout(tag, o, names.ATTN_OUT)
    if merged is not None:
      o = contract_merged(g.eqns[merged[1]], merged[2], o, wv)
    return [o]

  return fn


def _head_factor(layout, head, x):
  """The value ``x`` of `_PerHead` ``head`` on the output's canonical axes."""
  x = into_rank(x, head.dims, len(layout.p_labels))
  labels = [layout.to_canon[t] if n != 1 else "U" for t, n in zip(layout.p_labels, x.shape)]
  return to_canonical(x, labels, layout.order_q)


def install(g, sm_i, layout, ops, out, tags, actions, pass_):
  """The replacement in place of the output (or of the output projection it feeds,
  contracted over the output's own layout), and its log."""
  merged = merged_matmul(g, out)  # the output projection, on out's own layout
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
  `op_at` names it ("returned" for an output of the jaxpr); None if there is none."""
  for i in sorted(indices):
    for v in g.eqns[i].outvars:
      if v in outputs:
        continue
      if v in g.outvars:
        return f"the function's outputs ({g.source(i)})"
      outside = [c for c in g.consumers.get(v, []) if c not in indices]
      if outside:
        return op_at(g, outside[0])
  return None
