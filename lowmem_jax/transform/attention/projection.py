"""The output projection, contracted over the output as saved: a merged-heads matmul
following the attention reads the output before its heads are merged.
"""


from jax import lax
from jax.extend import core as jcore


def merged_matmul(g, out):
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


def contract_merged(e, side, o, w):
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


def unbroadcast(g, var):
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
