"""The attention matcher: ``softmax(q k^T * scale + bias, where mask) v`` becomes
`lowmem_jax.attention`, which keeps no L×L residual (Rabe & Staats 2021, arXiv:2112.05682).

One module a step: the softmax and the scores back to ``dot_general(q, k)`` with their
scale, bias and mask (`scores`); the probabilities' matmul with ``v``, through a dropout
(the equations that draw its keep-mask from a key become a function the op calls again in
the backward) and per-head factors, applied to the output (`probabilities`); each
operand's axes labelled in one canonical layout (`layout`); a mask made of parts split
into a causal flag and small parts (`mask`); a merged-heads output projection contracted
over the output as saved (`projection`); the operands read, the output followed to its
last layout op and the replacement installed (`replacement`). A pattern left raises
`Left` with the reason, naming the op that broke it and its line.
"""

import dataclasses

from lowmem_jax.transform.attention.layout import layout_of
from lowmem_jax.transform.attention.probabilities import values_matmul
from lowmem_jax.transform.attention.replacement import (
  follow_output,
  install,
  read_operands,
)
from lowmem_jax.transform.attention.scores import scores_chain, softmax_of


def match(g, actions, pass_):
  """Replaces each softmax attention of ``g``, anchored at its softmax's division."""
  for i in g.untaken({"div", "custom_vjp_call"}):
    with pass_.leaving(g, "attention", i):
      _match_at(g, i, actions, pass_)


def _match_at(g, i, actions, pass_):
  s = softmax_of(g, i)
  if s is None:
    return
  qk_i, steps = scores_chain(g, s)
  pp, pv_i, drop, heads = values_matmul(g, g.eqns[i].outvars[0])
  layout = layout_of(g, g.eqns[qk_i], steps, g.eqns[pv_i], pp, i)
  ops = read_operands(g, g.eqns[qk_i], g.eqns[pv_i], pp, layout, drop, heads)
  out, out_labels, tags = follow_output(g, g.eqns[pv_i].outvars[0], layout.out_labels)
  layout = dataclasses.replace(layout, out_labels=out_labels)
  install(g, i, layout, ops, out, tags, actions, pass_)


