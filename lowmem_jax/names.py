"""The checkpoint-name vocabulary: the one registry of residual names.

Library functions and reference models tag their intermediate values with
`jax.ad_checkpoint.checkpoint_name` using these names, so remat policies
(`lowmem_jax.compile.policies`) and memory reports can refer to them. Nothing else in
the project spells them. One array carries one name: a norm output that feeds
the MLP is ``norm_out``, not a second ``mlp_in``. A model's own names join the
vocabulary through `register`; the policies refuse any other (`check`).
"""

import difflib

BLOCK_IN = "block_in"  # input of a transformer block (the residual stream)
NORM_OUT = "norm_out"  # output y of a norm: also the next matmul's input
NORM_RSTD = "norm_rstd"  # float32 1/sigma per row, saved by the MS norms
QKV = "qkv"  # query, key and value projections (after rotary embedding)
ATTN_PROBS = "attn_probs"  # softmax probabilities of attention: [batch, heads, L, L]
ATTN_OUT = "attn_out"  # attention output before the output projection
ATTN_LSE = "attn_lse"  # float32 log-sum-exp of each attention row: batch x heads x L values
MLP_HIDDEN = "mlp_hidden"  # pre-activation of the MLP's hidden layer (both halves of a gated MLP)
MLP_ACT = "mlp_act"  # activation output of the MLP (gated: the product): the second matmul's input
ACT_CODE = "act_code"  # packed 1- or 2-bit code of an approximate activation
COMPRESSED_IN = "compressed_in"  # quantised or pooled input of a layer (lowmem_jax.ops.compress)
COMPRESSED_SCALE = "compressed_scale"  # float32 per-row scales of a quantised input

ALL = (BLOCK_IN, NORM_OUT, NORM_RSTD, QKV, ATTN_PROBS, ATTN_OUT, ATTN_LSE, MLP_HIDDEN, MLP_ACT,
       ACT_CODE, COMPRESSED_IN, COMPRESSED_SCALE)


_registered: set[str] = set()  # the names `register` added


def _check_str(name, fn: str) -> None:
  if not isinstance(name, str) or not name:
    raise TypeError(f"{fn}: each name must be a non-empty str, got {name!r}.")


def register(*names: str) -> None:
  """Adds ``names`` (the `checkpoint_name` tags of a model's own values) to the vocabulary
  the policies accept.

  Example:
    >>> import lowmem_jax as lm
    >>> lm.names.register("router_logits")
    >>> lm.policies.save_only("router_logits")
    SaveOnly(saveable_names=frozenset({'router_logits'}))
  """
  for name in names:
    _check_str(name, "register")
  _registered.update(names)


def known() -> frozenset[str]:
  """The vocabulary: `ALL` and the names `register` added."""
  return frozenset(ALL) | _registered


def check(names, fn: str) -> frozenset[str]:
  """``names`` as a frozenset, each a name of the vocabulary (`known`).

  Raises:
    TypeError: for a name that is not a non-empty str.
    ValueError: for an unknown name (a typo would keep nothing), naming the closest.
  """
  vocabulary = known()
  for name in names:
    _check_str(name, fn)
    if name not in vocabulary:
      close = difflib.get_close_matches(name, vocabulary, n=1)
      hint = f" Did you mean {close[0]!r}?" if close else ""
      raise ValueError(
          f"{fn}: unknown checkpoint name {name!r}.{hint} The vocabulary is lowmem_jax.names "
          f"({', '.join(ordered(vocabulary))}); a model's own name joins it with "
          f"lowmem_jax.names.register({name!r}).")
  return frozenset(names)


def ordered(names) -> list[str]:
  """``names`` in vocabulary order, then any others sorted."""
  rank = {n: i for i, n in enumerate(ALL)}
  return sorted(names, key=lambda n: (rank.get(n, len(rank)), n))

KINDS = {
    ACT_CODE: "activation codes", NORM_OUT: "norm outputs", NORM_RSTD: "norm outputs",
    BLOCK_IN: "block inputs", MLP_HIDDEN: "activation inputs", MLP_ACT: "matmul inputs",
    QKV: "attention", ATTN_PROBS: "attention", ATTN_OUT: "attention", ATTN_LSE: "attention",
    COMPRESSED_IN: "compressed inputs", COMPRESSED_SCALE: "compressed inputs",
}


def kind(name: str | None) -> str:
  """What a residual of checkpoint name ``name`` is, for memory reports:
  ``KINDS[name]``, else "unnamed" or "other names"."""
  if name is None:
    return "unnamed"
  return KINDS.get(name, "other names")
