"""A mask made of a causal part and per-key parts: the causal flag and the small parts the
replacement reads instead of an L×L mask.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from lowmem_jax.transform.attention.layout import (
  to_canonical,
)
from lowmem_jax.transform.graph import (
  free_vars,
  scalar,
  shape_in,
  upstream,
)
from lowmem_jax.transform.interpreter import (
  bind,
  eqns_fn,
)

# Elementwise ops of one array (other operands literal scalars) a part of a mask may pass
# through after its broadcast: replayed on the part before the broadcast.
_PART_OPS = frozenset({"convert_element_type", "ne", "eq", "gt", "ge", "lt", "le", "not",
                          "copy"})


@dataclasses.dataclass(frozen=True)
class MaskParts:
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
        x = to_canonical(x, labels, self.order)
      mask = x if mask is None else mask & x
    return mask


def mask_parts(g, m, labels, order):
  """``m`` (canonical ``labels``) as `MaskParts`, or None where its constant parts are
  neither causal nor all true: ``and`` of parts, through ``gt(x.astype(..), 0)``,
  broadcasts and transposes."""
  constant_parts, inputs, chains, labels_of = [], [], [], []
  for v, dims in _conjuncts(g, m, list(range(m.aval.ndim))):
    made = upstream(g, [v], set())
    if not free_vars(g, made) and g.index(v) is not None:
      constant_parts.append((v, made, dims))
      continue
    src, chain, dims = _broadcast_source(g, v, dims)
    inputs.append(src)
    chains.append(chain)
    labels_of.append([labels[d] if src.aval.shape[j] != 1 else "U" for j, d in enumerate(dims)])
  causal = _is_causal(g, constant_parts, labels, m.aval.ndim)
  return None if causal is None else MaskParts(m, causal, inputs, chains, labels_of, order)


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


def into_rank(x, dims, ndim):
  """``x``, whose axes are the axes ``dims`` of a rank ``ndim`` array, in that rank with
  1 on the other axes."""
  order = sorted(range(len(dims)), key=dims.__getitem__)
  if order != list(range(len(dims))):
    x = jnp.transpose(x, order)
  return x.reshape(shape_in(x, sorted(dims), ndim))


def _is_causal(g, parts, labels, ndim):
  """True if the constant ``parts`` (anded) are the causal mask of the queries and keys
  (query i keeps keys 0..i), False if there are none or they keep every key, else None."""
  if not parts:
    return False
  with jax.ensure_compile_time_eval():
    mask = np.ones((), bool)
    for v, made, dims in parts:
      mask = mask & np.asarray(into_rank(eqns_fn(g, made, [], [v])()[0], dims, ndim))
  if mask.all():
    return False
  t, s = labels.index("T"), labels.index("S")
  if mask.shape[t] == 1 or mask.shape[s] == 1:
    return None
  pair = np.moveaxis(mask, (t, s), (-2, -1))
  return True if (pair == np.tril(np.ones(pair.shape[-2:], bool))).all() else None
