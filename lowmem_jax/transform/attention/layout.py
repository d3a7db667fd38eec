"""Every operand's axes named in one canonical order: the labels of the scores' operands,
the stages (scale, bias, mask) between the scores and the softmax, the values and the output.
"""

import dataclasses

import jax.numpy as jnp

from lowmem_jax.transform.rewrites import Left

ORDER_QKV = ("B0", "T", "B1", "D")  # the canonical axes of k and v (and q, ungrouped)


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
    raise Left.at(g, "the query-key matmul has more than one query or key axis (and no group "
                "axis right after the kv heads)", qk)
  if len(qk.params["dimension_numbers"][1][0]) > 2:
    raise Left.at(g, "more than two batch axes in the scores", qk)
  return lhs, rhs, _out_labels(qk, lhs, rhs)


def _stages(g, steps, labels, sm_i):
  """``(labels, stage)``: the scores' labels at the softmax, and each scale, bias and mask
  with the labels at its op; one scale, before any bias or mask; one bias; one mask."""
  stage = []
  for kind, e, k in steps:
    if kind == "layout":
      labels = relabel(e, labels)
      if labels is None:
        raise Left.at(g, "a reshape of the scores merges or splits axes", e)
    else:
      stage.append((kind, e, k, list(labels)))
  if labels[-1] not in ("L", "R"):
    raise Left.at(g, "the softmax is not over the keys", sm_i)
  kinds = [st[0] for st in stage]
  if "scale" in kinds and any(kd in ("bias", "mask", "mask_not") for kd in
                              kinds[:kinds.index("scale")]):
    raise Left.at(g, "the scores are scaled after a bias or mask", stage[kinds.index("scale")][1])
  for n, kind in enumerate(kinds):
    if kind.split("_")[0] in [kd.split("_")[0] for kd in kinds[:n]]:  # mask_not is a mask
      raise Left.at(g, "more than one scale, bias or mask", stage[n][1])
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
    raise Left.at(g, "the probabilities' matmul does not contract the keys", pv)
  v_var = pv.invars[1 - p_side]
  v_labels = [None] * v_var.aval.ndim
  for dp, dv in zip(p_batch, v_batch):
    v_labels[dv] = p_labels[dp]
  v_labels[v_contract[0]] = "T"  # v's key axis plays the length axis of its layout
  free_v = [d for d in range(v_var.aval.ndim) if v_labels[d] is None]
  big = [d for d in free_v if v_var.aval.shape[d] != 1]
  if len(big) != 1 or len(v_contract) != 1:
    raise Left.at(g, "the values have more than one feature axis", pv)
  for d in free_v:
    v_labels[d] = "D" if d == big[0] else "U"
  p_free = [p_labels[d] for d in range(len(p_labels)) if d not in p_contract and d not in p_batch]
  v_free = [v_labels[d] for d in free_v]
  out_labels = [f"B{j}" for j in range(nb)] + (v_free + p_free if p_side == 1 else p_free + v_free)
  return v_labels, out_labels


def layout_of(g, qk, steps, pv, pp, sm_i) -> _Layout:
  """The canonical layout of the attention of query-key matmul ``qk``, ``pv`` and the
  softmax at equation ``sm_i``."""
  lhs, rhs, labels = _score_labels(g, qk)
  labels, stage = _stages(g, steps, labels, sm_i)
  k_side = 0 if labels[-1] == "L" else 1
  to_canon = {"L" if k_side == 1 else "R": "T", "L" if k_side == 0 else "R": "S", "D": "D",
              "U": "U", "B0": "B0", "B1": "B1", "G": "G"}
  order_q, order_mask = list(ORDER_QKV), ["B0", "B1", "T", "S"]
  if "G" in labels:  # grouped-query attention: q's heads are (B1, G), k's and v's B1
    if "G" in (lhs if k_side == 0 else rhs):
      raise Left.at(g, "the keys, not the queries, have the group axis", qk)
    order_q, order_mask = ["B0", "T", "B1", "G", "D"], ["B0", "B1", "G", "T", "S"]
  nb = len(qk.params["dimension_numbers"][1][0])
  v_labels, out_labels = _value_labels(g, pv, pp, [to_canon[lab] for lab in labels], nb)
  q_labels = [to_canon[lab] for lab in (lhs if k_side == 1 else rhs)]
  k_labels = [to_canon[lab] for lab in (rhs if k_side == 1 else lhs)]
  k_labels = ["T" if lab == "S" else lab for lab in k_labels]
  return _Layout(k_side, stage, to_canon, order_q, order_mask, q_labels, k_labels, v_labels,
                 out_labels, labels)


def relabel(e, labels):
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


def merge_groups(x, order):
  """``x`` on ``order``'s axes with "B1", "G" adjacent: those two as one heads axis, kv-major."""
  i = order.index("B1")
  return x.reshape(x.shape[:i] + (x.shape[i] * x.shape[i + 1],) + x.shape[i + 2:])


def _out_labels(e, lhs, rhs):
  (lc, rc), (lb, _) = e.params["dimension_numbers"]
  free_l = [lab for d, lab in enumerate(lhs) if d not in lc and d not in lb]
  free_r = [lab for d, lab in enumerate(rhs) if d not in rc and not lab.startswith("B")]
  return [f"B{j}" for j in range(len(lb))] + free_l + free_r


def to_canonical(x, labels, order):
  """``x`` (axes ``labels``) as the axes ``order``; an absent label becomes a unit axis."""
  keep = [d for d, lab in enumerate(labels) if lab != "U"]
  x = x.reshape([x.shape[d] for d in keep])
  labels = [labels[d] for d in keep]
  present = [lab for lab in order if lab in labels]
  x = jnp.transpose(x, [labels.index(lab) for lab in present])
  return x.reshape([x.shape[present.index(lab)] if lab in present else 1 for lab in order])


def from_canonical(x, order, labels, shape):
  """Inverse of `to_canonical` onto ``labels`` and ``shape``."""
  present = [lab for lab in labels if lab != "U"]
  x = x.reshape([x.shape[order.index(lab)] for lab in order if lab in present])
  have = [lab for lab in order if lab in present]
  x = jnp.transpose(x, [have.index(lab) for lab in present])
  return x.reshape(shape)
