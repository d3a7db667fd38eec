"""The norm matcher: LayerNorm / RMSNorm become `ms_layer_norm` / `ms_rms_norm` (MS-BP,
LowMemoryBP, arXiv:2406.16282), their affine folded into the matmuls they feed.

Steps: the statistics (`_stats`: ``rsqrt(var(x) + eps)`` or ``sqrt``), the
centred product chain after them with its optional scale ``g`` and bias ``b``
(`_norm_output`), the matmuls that read the output (`_foldable`), then the
norm's action and each matmul's (`_fold_action`).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from lowmem_jax import names
from lowmem_jax.ops import norms as norm_ops
from lowmem_jax.transform.graph import (LAYOUT, constant, feature_vector, fill_value, scalar,
                                        upstream)
from lowmem_jax.transform.interpreter import Action, apply_layout, bind, eqns_fn

_CASTS = frozenset({"convert_element_type", "copy"})


@dataclasses.dataclass(frozen=True)
class _Norm:
  """A norm found in the graph: ``z = norm(x) * scale + bias`` over x's last axis."""
  x: jcore.Var
  mu: jcore.Var | None  # the mean subtracted (LayerNorm), None for RMSNorm
  eps: float
  z: jcore.Var
  scale: jcore.Var | None  # [n]
  bias: jcore.Var | None  # [n]

  @property
  def params(self) -> list:
    return [p for p in (self.scale, self.bias) if p is not None]


def match(g, actions, pass_):
  """Replaces each LayerNorm and RMSNorm of ``g``, anchored at its ``rsqrt`` or ``sqrt``."""
  for i in g.untaken({"rsqrt", "sqrt"}):
    _match_at(g, i, actions, pass_)


def _match_at(g, ri, actions, pass_):
  st = _stats(g, g.eqns[ri])
  if st is None:
    return
  x, mu, eps = st
  if x.aval.ndim < 1 or not jnp.issubdtype(x.aval.dtype, jnp.floating):
    return
  out = _norm_output(g, ri, x, mu)
  if out is None:
    return
  norm = _Norm(x, mu, eps, *out)
  idx = upstream(g, [norm.z], {x, *norm.params})
  if not g.closed(idx, {norm.z}):
    pass_.left(g, "norm", g.index(norm.z), "an intermediate of the norm is used elsewhere")
    return
  if any(g.eqns[i].primitive.name in ("dot_general", "reduce_max") for i in idx):
    return
  _rewrite(g, norm, idx, actions, pass_)


# --- the statistics ------------------------------------------------------------


def _mean_of(g, v):
  """``w`` if ``v`` is the mean of ``w`` over its last axis, else None."""
  e = g.prod(g.back(v))
  if e is None or e.primitive.name not in ("div", "mul"):
    return None
  a, b = e.invars
  c = constant(g, b)
  if c is None:
    return None
  s = g.prod(g.back(a))
  if s is None or s.primitive.name != "reduce_sum":
    return None
  w = s.invars[0]
  n = w.aval.shape[-1] if w.aval.ndim else 0
  if tuple(s.params["axes"]) != (w.aval.ndim - 1,):
    return None
  ok = math.isclose(c, n) if e.primitive.name == "div" else math.isclose(c, 1 / n)
  return w if ok else None


def _square_of(g, v):
  e = g.prod(g.back(v, {"convert_element_type"}))
  if e is None:
    return None
  name = e.primitive.name
  if name == "square" or (name == "integer_pow" and e.params["y"] == 2):
    return e.invars[0]
  if name == "mul" and e.invars[0] is e.invars[1]:
    return e.invars[0]
  return None


def _is_zeros(g, v):
  return fill_value(g, v) == 0.0


def _always_true(g, pred) -> bool:
  """True if scalar ``pred`` is ``c > 0`` for a positive `constant` c (or a literal True)."""
  if isinstance(pred, jcore.Literal):
    return np.ndim(pred.val) == 0 and bool(pred.val)
  e = g.prod(pred)
  if e is None or e.primitive.name != "gt" or scalar(e.invars[1]) != 0.0:
    return False
  c = constant(g, e.invars[0])
  return c is not None and c > 0


def _centered(g, v, x, mu):
  """True if ``v`` is ``x - mu`` (LayerNorm) or ``x`` itself (``mu`` None: RMSNorm)."""
  v = g.back(v, _CASTS)
  e = g.prod(v)
  if e is not None and e.primitive.name == "sub":
    a, b = e.invars
    if g.back(a, _CASTS) is not x:
      return False
    if mu is None:
      return _is_zeros(g, b)
    return g.back(b) is g.back(mu) or _mean_of(g, b) is not None and g.back(
        _mean_of(g, b), _CASTS) is x
  return mu is None and v is x


def _variance(g, r_eqn):
  """``(var, eps)`` of ``rsqrt(var + eps)`` or ``sqrt(...)``, through a clip at 0 and
  ``jnp.var``'s guard, else None."""
  e = g.prod(g.back(r_eqn.invars[0]))
  if e is None or e.primitive.name != "add":
    return None
  eps = [scalar(v) for v in e.invars]
  if eps[0] is None and eps[1] is None:
    return None
  eps_val = eps[0] if eps[0] is not None else eps[1]
  var = g.back(e.invars[1] if eps[0] is not None else e.invars[0])
  clip = g.prod(var)
  if clip is not None and clip.primitive.name == "max" and 0.0 in map(scalar, clip.invars):
    var = g.back(next(v for v in clip.invars if scalar(v) is None))
  guard = g.prod(var)  # jnp.var's where(n - ddof > 0, var, nan), true for ddof < n
  if guard is not None and guard.primitive.name == "select_n" and len(guard.invars) == 3 and (
      _always_true(g, guard.invars[0]) and np.isnan(fill_value(g, guard.invars[1]) or 0.0)):
    var = g.back(guard.invars[2])
  return var, eps_val


def _moments(g, var):
  """``(x, mu)`` of a variance ``E[x^2] - E[x]^2``, else None."""
  sq, m2 = g.prod(var).invars
  mean_sq = _mean_of(g, sq)
  x = None if mean_sq is None else _square_of(g, mean_sq)
  mu = _square_of(g, m2)
  if x is None or mu is None or _mean_of(g, mu) is None:
    return None
  if g.back(_mean_of(g, mu), _CASTS) is not g.back(x, _CASTS):
    return None
  return g.back(x, _CASTS), mu


def _mean_square(g, var):
  """``(x, mu or None)`` of a variance ``mean((x - mu)^2)`` or ``mean(x^2)``, else None."""
  w = _mean_of(g, var)
  d = None if w is None else _square_of(g, w)
  if d is None:
    return None
  de = g.prod(g.back(d, _CASTS))
  if de is not None and de.primitive.name == "sub":
    a, b = de.invars
    x = g.back(a, _CASTS)
    if _is_zeros(g, b):
      return x, None
    m = _mean_of(g, b)
    if m is None or g.back(m, _CASTS) is not x:
      return None
    return x, b
  return g.back(d, _CASTS), None


def _stats(g, r_eqn):
  """``(x, mu or None, eps)`` of ``rsqrt(var(x) + eps)`` or ``sqrt(...)``, else None."""
  found = _variance(g, r_eqn)
  if found is None:
    return None
  var, eps = found
  ve = g.prod(var)
  x_mu = (_moments(g, var) if ve is not None and ve.primitive.name == "sub"
          else _mean_square(g, var))
  return None if x_mu is None else (*x_mu, eps)


# --- the output: centred, times a scale, plus a bias ----------------------------


def _other(e, cur):
  return e.invars[1] if e.invars[0] is cur else e.invars[0]


def _divided(g, ri, x, mu):
  """The output of ``(x - mu) / sqrt(...)`` for ``sqrt`` equation ``ri``, else None."""
  cur = g.eqns[ri].outvars[0]
  while (c := g.only_consumer(cur)) is not None and g.eqns[c].primitive.name in LAYOUT and (
      len(g.eqns[c].invars) == 1):
    cur = g.eqns[c].outvars[0]
  e = None if c is None else g.eqns[c]
  if e is None or e.primitive.name != "div" or e.invars[1] is not cur or not _centered(
      g, e.invars[0], x, mu):
    return None
  return e.outvars[0]


def _norm_output(g, ri, x, mu):
  """``(z, scale, bias)``: the product chain from the statistics forward, through layout
  ops, the centring (times ``rsqrt``), a scale and then a bias (and casts); else None."""
  n = x.aval.shape[-1]
  cur, scale, bias, centered = g.eqns[ri].outvars[0], None, None, False
  if g.eqns[ri].primitive.name == "sqrt":  # (x - mu) / sqrt(var + eps)
    cur, centered = _divided(g, ri, x, mu), True
    if cur is None:
      return None
  while (c := g.only_consumer(cur)) is not None:
    e = g.eqns[c]
    name = e.primitive.name
    if name in LAYOUT and len(e.invars) == 1:
      cur = e.outvars[0]
    elif name == "mul" and not centered and _centered(g, _other(e, cur), x, mu):
      cur, centered = e.outvars[0], True
    elif name == "mul" and scale is None and feature_vector(g, _other(e, cur), n) is not None:
      cur, scale = e.outvars[0], feature_vector(g, _other(e, cur), n)
    elif name == "add" and centered and bias is None and feature_vector(
        g, _other(e, cur), n) is not None:
      cur, bias = e.outvars[0], feature_vector(g, _other(e, cur), n)
      while (c := g.only_consumer(cur)) is not None and g.eqns[c].primitive.name in (
          "convert_element_type",):
        cur = g.eqns[c].outvars[0]
      break
    else:
      break
  if not centered or cur.aval.shape != x.aval.shape:
    return None
  return cur, scale, bias


# --- the rewrite: the norm, and its affine folded into the matmuls it feeds -----


def _rewrite(g, norm, idx, actions, pass_):
  z = norm.z
  folds, others = _foldable(g, z, z.aval.shape[-1])
  token = ("norm_out", z)
  keep_z = others or not folds
  anchor = g.index(z)
  actions[anchor] = _norm_action(g, norm, folds, others, token, keep_z)
  g.taken |= idx
  for d, side, chain in folds:
    actions[d] = _fold_action(g, d, side, chain, token, norm.scale, norm.bias)
    g.taken.add(d)
  affine = bool(norm.params)
  op = "ms_layer_norm" if norm.mu is not None else "ms_rms_norm"
  where = f" + fold into {len(folds)} matmul{'s' * (len(folds) != 1)}" if affine and folds else ""
  kept = " (affine kept for other users)" if affine and others else ""
  dots = sorted(d for d, _, _ in folds)
  outs = [z] * keep_z + [g.eqns[d].outvars[0] for d in dots]
  weights = [g.eqns[d].invars[1 - side] for d, side, _ in folds]
  ins = list(dict.fromkeys([norm.x, *norm.params]
                           + [w for w in weights if isinstance(w, jcore.Var)]))
  sub_idx = idx | set(dots) | {i for _, _, chain in folds for i in chain}
  pass_.rewrote(g, "norm", op + where + kept, anchor, ins, eqns_fn(g, sub_idx, ins, outs),
                eqns_fn(g, sub_idx, ins, outs, actions))


def _norm_action(g, norm, folds, others, token, keep_z):
  """The norm's `Action`: its output ``y`` as ``token`` (in the matmuls' dtype when they
  agree on one and nothing else reads it), and ``z = y * g + b`` where it is kept."""
  norm_fn = norm_ops.ms_layer_norm if norm.mu is not None else norm_ops.ms_rms_norm
  y_dtype = norm.z.aval.dtype
  if folds and not others:
    dtypes = {g.eqns[d].invars[side].aval.dtype for d, side, _ in folds}
    if len(dtypes) == 1:
      y_dtype = dtypes.pop()

  def fn(xv, *pv):
    y = norm_fn(xv, eps=norm.eps, dtype=y_dtype)
    return [y, _affine(y, norm.scale, norm.bias, pv, norm.z.aval.dtype)] if keep_z else [y]

  return Action([norm.x, *norm.params], [token, norm.z] if keep_z else [token], fn)
def _affine(y, scale, bias, pv, dtype):
  """``y * g + b`` in y's dtype, so the scale's gradient needs only the saved ``y``."""
  it = iter(pv)
  z = y
  if scale is not None:
    z = z * lax.broadcast_to_rank(next(it).astype(y.dtype), z.ndim)
  if bias is not None:
    z = z + lax.broadcast_to_rank(next(it).astype(y.dtype), z.ndim)
  return z.astype(dtype)


def _foldable(g, z, n):
  """The matmuls ``z`` feeds over its last axis: ``[(index, side, chain)]``, and other users."""
  folds, others = [], False
  todo = [(z, [])]
  while todo:
    v, chain = todo.pop()
    for c in g.consumers.get(v, []):
      e = g.eqns[c]
      name = e.primitive.name
      if name in ("convert_element_type", "name") or (
          name == "reshape" and e.outvars[0].aval.shape[-1:] == (n,)):
        todo.append((e.outvars[0], chain + [c]))
      elif (name == "dot_general" and _contracts_last(e, v) and c not in g.taken
            and _holds_folded_scale(e.invars[1 - e.invars.index(v)], v)):
        folds.append((c, e.invars.index(v), chain))
      else:
        others = True
    if v in g.outvars:
      others = True
  return folds, others


def _holds_folded_scale(w, y) -> bool:
  """Whether ``g[:, None] * w`` in w's dtype loses nothing against ``y * g``: w is
  floating point and at least as wide as y (not an int8 or narrower weight)."""
  return (jnp.issubdtype(w.aval.dtype, jnp.floating)
          and jnp.finfo(w.aval.dtype).bits >= jnp.finfo(y.aval.dtype).bits)


def _contracts_last(e, v) -> bool:
  (lc, rc), (lb, rb) = e.params["dimension_numbers"]
  if e.invars[0] is e.invars[1]:
    return False
  side = e.invars.index(v)
  contract, batch = (lc, lb) if side == 0 else (rc, rb)
  other_contract = rc if side == 0 else lc
  return (tuple(contract) == (v.aval.ndim - 1,) and not batch and len(other_contract) == 1)


def _fold_action(g, d, side, chain, token, scale, bias):
  """The `Action` of matmul ``d`` of the norm's affine output, from the shared output ``y``.

  Forward: ``dot(y, g[:, None] * W) + b @ W``, the affine folded into the
  weight. Backward: the plain form's, ``dot(y * g + b, W)``, with the
  activation-sized affine recomputed from ``y`` and the sums for ``g`` and
  ``b`` in float32, so the residuals are ``y`` and the parameters (no folded
  weight kept) and no weight-sized product is made in the backward. Measured
  on the stock-NNX ViT-B/16 (docs/benchmarks.md): folding both ways gave a
  CPU step ratio of 1.092 at batch 2 (now 1.035); the plain form both ways (``jax.checkpoint``
  of the affine and the matmul) cost 0.355 → 0.434 of the per-block memory
  for the H100 target, as XLA merged the q, k, v matmuls that then shared
  one operand and kept their merged output.
  """
  e = g.eqns[d]
  (lc, rc), _ = e.params["dimension_numbers"]
  kd = (rc if side == 0 else lc)[0]
  chain_eqns = [g.eqns[i] for i in chain]
  inputs = [token, e.invars[1 - side]] + [p for p in (scale, bias) if p is not None]

  def dot(y, wv):
    return bind(e, [y, wv] if side == 0 else [wv, y])[0]

  @jax.custom_vjp
  def folded_dot(y, wv, pv):
    it = iter(pv)
    gv = next(it) if scale is not None else None
    bv = next(it) if bias is not None else None
    w32 = wv.astype(jnp.float32)
    if gv is not None:
      wv = (w32 * lax.broadcast_in_dim(gv.astype(jnp.float32), w32.shape, (kd,))).astype(
          wv.dtype)
    res = dot(y, wv)
    if bv is not None:
      bw = lax.dot_general(bv.astype(jnp.float32), w32, (((0,), (kd,)), ((), ())),
                           preferred_element_type=jnp.float32)
      dims = list(range(res.ndim))
      dims = dims[res.ndim - bw.ndim:] if side == 0 else dims[:bw.ndim]
      res = (res.astype(jnp.float32) + lax.broadcast_in_dim(bw, res.shape, dims)).astype(
          res.dtype)
    return res

  def backward(res, dout):
    y, wv, pv = res
    z = _affine(y, scale, bias, pv, y.dtype)
    dz, dw = jax.vjp(dot, z, wv)[1](dout)
    dz32 = dz.astype(jnp.float32)
    axes = tuple(range(y.ndim - 1))  # the parameters' sums over tokens, in float32
    it = iter(pv)
    dp = []
    if scale is not None:
      gv = next(it)
      dp.append(jnp.sum(dz32 * y.astype(jnp.float32), axes).reshape(gv.shape).astype(gv.dtype))
      dz32 = dz32 * lax.broadcast_to_rank(gv.astype(jnp.float32), dz32.ndim)
    if bias is not None:
      bv = next(it)
      dp.append(jnp.sum(dz.astype(jnp.float32), axes).reshape(bv.shape).astype(bv.dtype))
    return dz32.astype(y.dtype), dw, tuple(dp)

  folded_dot.defvjp(lambda y, wv, pv: (folded_dot(y, wv, pv), (y, wv, pv)), backward)

  def fn(y, wv, *pv):
    for ce in chain_eqns:
      y = apply_layout(ce, y, names.NORM_OUT)
    return [folded_dot(y, wv, tuple(pv))]

  return Action(inputs, [e.outvars[0]], fn)
