"""Flax linen substitutes: drop-in modules over the functional core.

The approximate activations are plain functions and serve as ``activation=``
arguments as they are (`lowmem_jax.regelu2`, `lowmem_jax.resilu2`), and
`attention_fn` serves as `nn.MultiHeadDotProductAttention`'s.
"""

from typing import Any

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax import names
from lowmem_jax.attention import dot_product_attention
from lowmem_jax.norms import ms_layer_norm, ms_rms_norm


def attention_fn(query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None = None,
                 dropout_rate: float = 0.0, deterministic: bool = True) -> jax.Array:
  """Attention for ``nn.MultiHeadDotProductAttention(attention_fn=...)`` with named residuals.

  Tags the projected ``query, key, value`` as `names.QKV` and the output as
  `names.ATTN_OUT`, and runs `lowmem_jax.attention.dot_product_attention`
  (probabilities tagged `names.ATTN_PROBS`). The module's parameters are
  unchanged, so pretrained ones load as they are.

  Args:
    query: ``[batch, q_length, heads, head_dim]``.
    key, value: ``[batch, kv_length, heads, head_dim]``.
    mask: optional boolean ``[batch, heads, q_length, kv_length]`` (broadcast);
      False masks a key out.
    dropout_rate, deterministic: attention dropout is not supported; a rate
      above 0 outside deterministic mode raises.

  One batch axis only, and no ``sow_weights`` (the probabilities are not
  returned to Flax).
  """
  if dropout_rate > 0.0 and not deterministic:
    raise NotImplementedError(
        f"attention_fn has no attention dropout, got dropout_rate={dropout_rate} with "
        "deterministic=False; set dropout_rate=0.")
  query, key, value = (checkpoint_name(t, names.QKV) for t in (query, key, value))
  return checkpoint_name(dot_product_attention(query, key, value, mask=mask), names.ATTN_OUT)


class _MSNorm(nn.Module):
  epsilon: float = 1e-6
  dtype: Any = None
  _norm = None

  def __call__(self, x: jax.Array) -> jax.Array:
    return type(self)._norm(x, eps=self.epsilon, dtype=self.dtype)


class MSLayerNorm(_MSNorm):
  """LayerNorm without affine whose backward keeps only y and 1/sigma.

  MS-BP (Yang et al., ICML 2024, arXiv:2406.16282). It has no parameters: fold
  a pretrained ``scale``/``bias`` into the next Dense with `lowmem_jax.fold`.

  Attributes:
    epsilon: added to the variance.
    dtype: dtype of the output; give the dtype the next layer computes in.
      Defaults to the input's.
  """
  _norm = staticmethod(ms_layer_norm)


class MSRMSNorm(_MSNorm):
  """RMSNorm without scale whose backward keeps only y and 1/rms.

  MS-BP (Yang et al., ICML 2024, arXiv:2406.16282). It has no parameters: fold
  a pretrained ``scale`` into the next Dense with `lowmem_jax.fold`.

  Attributes:
    epsilon: added to the mean square.
    dtype: dtype of the output; give the dtype the next layer computes in.
      Defaults to the input's.
  """
  _norm = staticmethod(ms_rms_norm)
