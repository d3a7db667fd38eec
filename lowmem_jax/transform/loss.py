"""The loss-head matcher: ``h @ w`` (+ a bias), its log-softmax taken at integer labels
(or summed against their one-hot), becomes `losses.linear_cross_entropy`, which never
holds the ``[tokens, vocab]`` logits (Cut Cross-Entropy, Wijmans et al., ICLR 2025,
arXiv:2411.09009).

Steps: the gather at the labels (`_takes_last`) and the log-probability it reads
(`_log_prob_at_label`), or the sum of a one-hot times a log-softmax
(`_one_hot_log_prob`); the matmul that makes the logits, through slices of the
token axes (`_head`); the pattern's equations (`_pattern`); then the
replacement (`_replacement`). A pattern left raises `Left` with the reason.
"""

import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from lowmem_jax.ops import losses
from lowmem_jax.transform.graph import (
  constant,
  feature_vector,
  fill_value,
  scalar,
  upstream,
)
from lowmem_jax.transform.interpreter import Action, eqns_fn
from lowmem_jax.transform.rewrites import Left

_DTYPES = frozenset(jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16))


def match(g, actions, pass_):
  """Replaces each cross-entropy of a matmul's logits in ``g``, anchored at its gather or,
  for one-hot labels, at the sum over the vocabulary."""
  for i in g.untaken({"gather"}):
    with pass_.leaving(g, "loss", i):
      if _takes_last(g.eqns[i]) and (found := _log_prob_at_label(g, i)) is not None:
        l, out, sign, via_lse = found
        _replace(g, l, g.eqns[i].invars[1], out, g.eqns[i].params["mode"], sign, via_lse,
                 actions, pass_)
  for i in g.untaken({"reduce_sum"}):
    if (found := _one_hot_log_prob(g, i)) is not None:
      with pass_.leaving(g, "loss", i):
        l, labels = found
        _replace(g, l, labels, g.eqns[i].outvars[0], None, -1, False, actions, pass_)


def _replace(g, l, labels, out, mode, sign, via_lse, actions, pass_):
  """Replaces ``out = sign * cross_entropy(l, labels)`` (`_replacement`) if the logits ``l``
  are a matmul's (`_head`); else raises `Left`."""
  h, w, layout, bias, lead_ops = _head(g, l)
  inputs = [h, w, labels] + ([] if bias is None else [bias])
  indices = _pattern(g, out, inputs)
  fn = _replacement(mode, l, h, w, layout, lead_ops, out, sign, via_lse)
  actions[g.index(out)] = Action(inputs, [out], fn)
  g.taken |= indices
  op = "linear_cross_entropy" + (" (tied embedding)" if layout == "vd" else "")
  matmul = min(i for i in indices if g.eqns[i].primitive.name == "dot_general")  # the user's line
  pass_.rewrote(g, "loss", op, matmul, inputs, eqns_fn(g, indices, inputs, [out]), fn)


def _head(g, l):
  """``(h, w, w_layout, bias, lead_ops)`` of the logits ``l`` (`_head_matmul`), in a dtype
  `linear_cross_entropy` takes and wider than ``h``."""
  head = _head_matmul(g, l)
  h, w = head[:2]
  if not {h.aval.dtype, w.aval.dtype} <= _DTYPES:
    raise Left(f"the matmul's inputs are {h.aval.dtype} and {w.aval.dtype}: "
               "linear_cross_entropy takes float32, bfloat16 and float16")
  vocab, d = l.aval.shape[-1], h.aval.shape[-1]
  if vocab <= d:
    raise Left(f"the logits ({vocab} wide) are no wider than the hidden states ({d}): "
               "nothing to save")
  return head


def _pattern(g, out, inputs):
  """The equations from ``inputs`` to ``out``, which nothing else reads or has taken."""
  indices = upstream(g, [out], set(inputs))
  made = {v for i in indices for v in g.eqns[i].outvars}
  free = {v for i in indices for v in g.eqns[i].invars if isinstance(v, jcore.Var)} - made
  if indices & g.taken or not free <= set(inputs) or not g.closed(indices, {out}):
    raise Left("the logits or their log-softmax are used elsewhere")
  return indices


def _replacement(mode, l, h, w, layout, lead_ops, out, sign, via_lse):
  """The function of ``(h, w, labels, *bias)`` that computes ``out`` with
  `linear_cross_entropy` on ``h`` sliced and reshaped as the logits were (``lead_ops``),
  the gather's ``mode`` kept for labels out of range (``mode`` None: one-hot labels, whose
  out-of-range rows are zeros, so their loss is 0)."""
  lead, vocab, d = l.aval.shape[:-1], l.aval.shape[-1], h.aval.shape[-1]
  dtype = jnp.result_type(h.aval.dtype, w.aval.dtype)

  def fn(hv, wv, iv, *bv):
    labels = iv.reshape(lead)
    if mode == lax.GatherScatterMode.CLIP:
      labels = jnp.clip(labels, 0, vocab - 1)
    for op in lead_ops:
      hv = op(hv)
    ce = losses.linear_cross_entropy(hv.reshape(lead + (d,)).astype(dtype), wv.astype(dtype),
                                     labels, bias=bv[0] if bv else None, reduction="none",
                                     w_layout=layout)
    ce = sign * ce
    valid = (labels >= 0) & (labels < vocab)
    if mode is None:
      ce = jnp.where(valid, ce, 0.0)
    elif mode == lax.GatherScatterMode.FILL_OR_DROP:  # out of range: the gather's NaN
      # through logsumexp the NaN is added to lse, whose gradient stays; else it replaces all
      ce = ce + jnp.where(valid, 0.0, jnp.nan) if via_lse else jnp.where(valid, ce, jnp.nan)
    return [ce.reshape(out.aval.shape).astype(out.aval.dtype)]

  return fn


# --- the log-probability at the labels ----------------------------------------------


def _row_back(g, v):
  """``v`` followed back through casts, stop_gradient and the reshapes and broadcasts of a
  per-row value that keep its rows in place (``[...] <-> [..., 1] -> [..., V]``)."""
  while (e := g.prod(v)) is not None and len(e.invars) == 1:
    x, out = e.invars[0].aval.shape, e.outvars[0].aval.shape
    name, n = e.primitive.name, len(out) - 1
    if name in ("convert_element_type", "stop_gradient", "copy") or (
        name == "reshape" and (x == out + (1,) or out == x + (1,))) or (
        name == "broadcast_in_dim" and x[:n] == out[:n] and len(x) in (n, n + 1)
        and tuple(e.params["broadcast_dimensions"]) == tuple(range(len(x)))):
      v = e.invars[0]
    else:
      break
  return v


def _row_max_of(g, m):
  """``l`` if ``m`` is ``max(l)`` over l's last axis, through the guards log_softmax and
  logsumexp put on it (``max(-inf, .)``, ``where(isfinite(.), ., 0)``, stop_gradient,
  broadcasts), else None."""
  m = _row_back(g, m)
  e = g.prod(m)
  if e is not None and e.primitive.name == "select_n" and len(e.invars) == 3:
    fin = g.prod(e.invars[0])
    if (fin is None or fin.primitive.name != "is_finite" or fin.invars[0] is not e.invars[2]
        or fill_value(g, e.invars[1]) != 0.0):
      return None
    m = _row_back(g, e.invars[2])
    e = g.prod(m)
  if e is not None and e.primitive.name == "max" and any(
      scalar(v) == -math.inf for v in e.invars):
    m = _row_back(g, next(v for v in e.invars if scalar(v) is None))
    e = g.prod(m)
  if e is None or e.primitive.name != "reduce_max" or tuple(e.params["axes"]) != (
      e.invars[0].aval.ndim - 1,):
    return None
  return e.invars[0]


def _shifted_of(g, s):
  """``l`` if ``s`` is ``l - max(l)`` (`_row_max_of`), else None."""
  e = g.prod(s)
  if e is None or e.primitive.name != "sub":
    return None
  return e.invars[0] if _row_max_of(g, e.invars[1]) is e.invars[0] else None


def _log_sum_exp_of(g, v):
  """``(l, shifted)`` if ``v`` is ``log(sum(exp(l - max(l))))`` over l's last axis
  (shifted True: log_softmax's) or that plus ``max(l)`` (False: ``logsumexp``), else None."""
  v = _row_back(g, v)
  e = g.prod(v)
  if e is not None and e.primitive.name == "add":
    for a, b in (e.invars, e.invars[::-1]):
      inner = _log_sum_exp_of(g, a)
      if inner is not None and inner[1] and _row_max_of(g, b) is inner[0]:
        return inner[0], False
    return None
  if e is None or e.primitive.name != "log":
    return None
  r = e.invars[0]
  if (a := g.prod(_row_back(g, r))) is not None and a.primitive.name == "abs":
    r = a.invars[0]
  r = g.prod(_row_back(g, r))
  if r is None or r.primitive.name != "reduce_sum" or tuple(r.params["axes"]) != (
      r.invars[0].aval.ndim - 1,):
    return None
  ex = g.prod(g.back(r.invars[0], {"convert_element_type"}))
  if ex is None or ex.primitive.name != "exp":
    return None
  l = _shifted_of(g, ex.invars[0])
  return None if l is None else (l, True)


_GATHER_MODES = (lax.GatherScatterMode.FILL_OR_DROP, lax.GatherScatterMode.CLIP,
                 lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def _takes_last(e) -> bool:
  """True if gather ``e`` is ``take_along_axis(x, idx[..., None], -1)``: one element of x's
  last axis per row, ``[..., V] -> [..., 1]``."""
  x, idx = e.invars
  n, dn = x.aval.ndim, e.params["dimension_numbers"]
  batching = tuple(dn.operand_batching_dims)  # the lead axes but unit ones (offset axes)
  units = [a for a in range(n - 1) if a not in batching]
  return (n >= 1 and tuple(dn.collapsed_slice_dims) == (n - 1,)
          and tuple(dn.start_index_map) == (n - 1,) and batching == tuple(sorted(batching))
          and tuple(dn.start_indices_batching_dims) == tuple(range(len(batching)))
          and all(x.aval.shape[a] == 1 for a in units)
          and idx.aval.size == math.prod(x.aval.shape[:-1])
          and all(size == 1 for size in e.params["slice_sizes"])
          and e.outvars[0].aval.shape == x.aval.shape[:-1] + (1,)
          and e.params["mode"] in _GATHER_MODES
          and (e.params["mode"] != lax.GatherScatterMode.FILL_OR_DROP
               or e.params["fill_value"] is None or np.isnan(e.params["fill_value"])))


def _log_softmax_of(g, v):
  """``l`` if ``v`` is ``log_softmax(l)`` over l's last axis (through casts), else None."""
  e = g.prod(g.back(v, {"convert_element_type"}))
  if e is None or e.primitive.name != "sub":
    return None
  lse, l = _log_sum_exp_of(g, e.invars[1]), _shifted_of(g, e.invars[0])
  return l if lse is not None and lse[1] and lse[0] is l else None


def _one_hot_log_prob(g, i):
  """``(l, labels)`` if equation ``i`` is ``sum(one_hot(labels) * log_softmax(l), -1)``, as
  ``optax.softmax_cross_entropy(l, jax.nn.one_hot(labels, V))`` writes it (the one-hot
  ``labels[..., None] == iota``, cast; ``labels`` ``[..., 1]``), else None."""
  e = g.eqns[i]
  x = e.invars[0]
  if tuple(e.params["axes"]) != (x.aval.ndim - 1,):
    return None
  m = g.prod(g.back(x, {"convert_element_type"}))
  if m is None or m.primitive.name != "mul":
    return None
  for a, b in (m.invars, m.invars[::-1]):
    l = _log_softmax_of(g, b)
    labels = None if l is None else _one_hot_of(g, a, l.aval.shape)
    if labels is not None:
      return l, labels
  return None


def _one_hot_of(g, v, shape):
  """``labels`` (integer ``shape[:-1] + (1,)``) if ``v`` is the ``shape`` one-hot
  ``labels == iota`` (the iota along the last axis), cast; else None."""
  e = g.prod(g.back(v, {"convert_element_type"}))
  if e is None or e.primitive.name != "eq" or e.outvars[0].aval.shape != shape:
    return None
  lead = shape[:-1]
  for labels, iota in (e.invars, e.invars[::-1]):
    it = g.prod(iota)
    if (it is not None and it.primitive.name == "iota" and isinstance(labels, jcore.Var)
        and it.params["dimension"] == len(shape) - 1
        and iota.aval.shape == (1,) * len(lead) + shape[-1:]
        and labels.aval.shape == lead + (1,) and jnp.issubdtype(labels.aval.dtype, jnp.integer)):
      return labels
  return None


def _log_prob_at_label(g, gi):
  """``(l, out, sign, via_lse)`` if gather ``gi`` starts ``out = sign * cross_entropy(l,
  labels)``: ``log_softmax(l)`` taken at the labels (``out`` the gather's output, sign -1,
  via_lse False), or ``logsumexp(l)`` less ``l`` taken at the labels (``out`` the
  difference, sign +1, or -1 for ``picked - logsumexp``; via_lse True); else None."""
  x = g.back(g.eqns[gi].invars[0], {"convert_element_type"})
  if (l := _log_softmax_of(g, x)) is not None:
    return l, g.eqns[gi].outvars[0], -1, False
  cur = g.eqns[gi].outvars[0]
  while (c := g.only_consumer(cur)) is not None:
    e = g.eqns[c]
    if e.primitive.name in ("squeeze", "reshape", "convert_element_type", "copy") or (
        e.primitive.name == "gather" and e.invars[0] is cur and e.invars[0].aval.shape[-1] == 1
        and e.outvars[0].aval.shape == cur.aval.shape[:-1]):  # optax's [..., 0]
      cur = e.outvars[0]
      continue
    if e.primitive.name != "sub":
      return None
    side = 1 if e.invars[1] is cur else 0
    lse = _log_sum_exp_of(g, e.invars[1 - side])
    if lse is None or lse[1] or g.back(lse[0], {"convert_element_type"}) is not x:
      return None
    return lse[0], e.outvars[0], 1 if side == 1 else -1, True
  return None


def _head_matmul(g, l):
  """``(h, w, w_layout, bias, lead_ops)`` if ``l`` is ``h @ w`` (+ a ``[V]`` bias) through
  casts, and slices and reshapes of the leading (token) axes that keep the vocabulary axis
  whole (`_lead_op`: ``lead_ops`` does them to ``h``, in order), ``w`` ``[d, V]`` ("dv") or
  ``[V, d]`` ("vd", also as ``table.T``); else raises `Left` naming the op that is not."""
  vocab, bias, v, ops = l.aval.shape[-1], None, l, []
  while (e := g.prod(v)) is not None:
    name = e.primitive.name
    if name in ("convert_element_type", "copy"):
      v = e.invars[0]
    elif name == "add" and bias is None:
      side = next((k for k in (0, 1) if feature_vector(g, e.invars[1 - k], vocab) is not None),
                  None)
      if side is None:
        raise Left(f"the logits are an `add` ({g.source(g.index(v))}) of no [{vocab}] bias, "
                   "not a matmul of the hidden states (+ a bias)")
      bias, v = feature_vector(g, e.invars[1 - side], vocab), e.invars[side]
    elif (op := _lead_op(g, e, vocab)) is not None:
      ops.append(op)
      v = e.invars[0]
    else:
      break
  if e is None:
    raise Left("the logits are an input of the function, not a matmul of the hidden states")
  where = f"`{e.primitive.name}` ({g.source(g.index(v))})"
  if e.primitive.name != "dot_general":
    axis = (" over the vocabulary axis" if e.primitive.name in _LEAD_OPS
            and e.invars[0].aval.shape[-1:] != (vocab,) else "")
    raise Left(f"the logits are a {where}{axis}, not a matmul of the hidden states (+ a bias)")
  (ca, cb), (ba, bb) = e.params["dimension_numbers"]
  h, w = e.invars
  if ba or bb or w.aval.ndim != 2 or h.aval.ndim < 1 or tuple(ca) != (h.aval.ndim - 1,) or (
      tuple(cb) not in ((0,), (1,))) or w.aval.shape[1 - cb[0]] != vocab:
    raise Left(f"the logits are a {where} that is not ``h @ w`` with a 2-D w contracting "
               "h's last axis")
  layout = "dv" if tuple(cb) == (0,) else "vd"
  t = g.prod(w)
  if (t is not None and t.primitive.name == "transpose" and g.only_consumer(w) is not None
      and isinstance(t.invars[0], jcore.Var)):  # a tied table as ``table.T``
    w, layout = t.invars[0], {"dv": "vd", "vd": "dv"}[layout]
  return h, w, layout, bias, ops[::-1]


_LEAD_OPS = frozenset({"slice", "dynamic_slice", "reshape", "squeeze"})


def _lead_op(g, e, vocab):
  """The function of ``h`` ``[..., d]`` that does to h's leading axes what ``e`` (a slice,
  a ``dynamic_slice`` at constant starts, a reshape or squeeze) does to the logits'
  ``[..., V]``, if ``e`` keeps their last axis whole; else None."""
  name, x, y = e.primitive.name, e.invars[0].aval.shape, e.outvars[0].aval.shape
  if name not in _LEAD_OPS or x[-1:] != (vocab,) or y[-1:] != (vocab,):
    return None
  if name == "squeeze" or name == "reshape" and e.params["dimensions"] is None:
    return lambda h: h.reshape(y[:-1] + h.shape[-1:])
  if name == "slice":
    start, limit = e.params["start_indices"], e.params["limit_indices"]
    strides = e.params["strides"] or (1,) * len(x)
    if start[-1] != 0 or limit[-1] != vocab or strides[-1] != 1:
      return None
    return lambda h: lax.slice(h, start[:-1] + (0,), limit[:-1] + h.shape[-1:],
                               strides[:-1] + (1,))
  if name == "dynamic_slice":
    starts = [constant(g, s) for s in e.invars[1:]]
    if None in starts:
      return None
    sizes = e.params["slice_sizes"]  # the last is V: its start clamps to 0
    start = tuple(min(max(int(s), 0), n - k) for s, n, k in zip(starts[:-1], x, sizes))
    limit = tuple(s + k for s, k in zip(start, sizes))
    return lambda h: lax.slice(h, start + (0,), limit + h.shape[-1:])
  return None
