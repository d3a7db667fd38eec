"""The probabilities' path to the values matmul: casts, a scale, a dropout (whose keep-mask
equations become a function the op calls again in the backward) and per-head factors.
"""

import dataclasses

import jax.numpy as jnp
from jax.extend import core as jcore

from lowmem_jax.transform.graph import (
  constant,
  fill_value,
  free_vars,
  op_at,
  scalar_operand,
  shape_in,
  upstream,
)
from lowmem_jax.transform.rewrites import Left


def values_matmul(g, p):
  """``(p, index, dropout, heads)``: the probabilities ``p`` as the one matmul they feed reads
  them (through casts, a dropout: `_dropout_at`, and per-head factors: `_per_head`), that
  matmul, the `DropoutFound` or None, and the `_PerHead` factors."""
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
    k = scalar_operand(e) if e is not None and e.primitive.name in ("mul", "div") else None
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
      ops = [op_at(g, i) for i in g.consumers.get(p, [])]
      raise _other_than_one_matmul(
          "are returned" if p in g.outvars else "feed " + ", ".join(ops))
    heads.append(found[0])
    p = found[1]
  if drop is None and factor != 1.0:
    raise _other_than_one_matmul(f"are scaled, with no dropout, before {op_at(g, c)}")
  drop = None if drop is None else dataclasses.replace(drop, factor=factor * drop.factor)
  return p, c, drop, heads


def _other_than_one_matmul(where) -> Left:
  return Left("the probabilities feed something other than one matmul (dropout on them, or "
              f"returned): they {where}")


@dataclasses.dataclass(frozen=True)
class DropoutFound:
  """A dropout on the probabilities: ``p * keep * factor``, ``keep`` (``not keep`` where
  ``negated``) the boolean made by equations ``indices`` from the vars ``inputs`` (a key)."""
  keep: jcore.Var
  shape: tuple  # keep's shape with a 1 on each axis it is broadcast along, in p's rank
  negated: bool
  factor: float
  indices: frozenset
  inputs: list


def _dropout_at(g, e, p):
  """The `DropoutFound` equation ``e`` applies to ``p``: ``p * (keep.astype(dtype) / keep_prob)``
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
  return DropoutFound(keep, shape_in(keep, dims, p.aval.ndim), negated, factor, frozenset(made),
                  free_vars(g, made))


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
    k = scalar_operand(e) if name in ("mul", "div") else None
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
