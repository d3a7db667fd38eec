"""Flax NNX substitutes: drop-in modules over the functional core."""

from typing import Any, Callable

import jax
from flax import nnx

from lowmem_jax.linen import attention_fn
from lowmem_jax.norms import ms_layer_norm, ms_rms_norm


class MultiHeadAttention(nnx.MultiHeadAttention):
  """`flax.nnx.MultiHeadAttention` running `lowmem_jax.linen.attention_fn`: no L×L residual.

  Takes the same arguments and has the same parameters as Flax's, so a
  pretrained state loads unchanged; ``attention_fn`` defaults to ours. No
  attention dropout and no ``sow_weights``.
  """

  def __init__(self, *args, attention_fn: Callable[..., jax.Array] = attention_fn, **kwargs):
    super().__init__(*args, attention_fn=attention_fn, **kwargs)


class _MSNorm(nnx.Module):
  _norm = None

  def __init__(self, num_features: int | None = None, *, epsilon: float = 1e-6,
               dtype: Any = None, impl: str | None = None, rngs: nnx.Rngs | None = None):
    del rngs  # accepted so that the module replaces nnx.LayerNorm/RMSNorm as called
    self.num_features = num_features
    self.epsilon = epsilon
    self.dtype = dtype
    self.impl = impl

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.num_features is not None and x.shape[-1] != self.num_features:
      raise ValueError(
          f"x's last axis must be num_features={self.num_features}, got shape {x.shape}.")
    return type(self)._norm(x, eps=self.epsilon, dtype=self.dtype, impl=self.impl)


class MSLayerNorm(_MSNorm):
  """LayerNorm without affine whose backward keeps only y and 1/sigma.

  MS-BP (Yang et al., ICML 2024, arXiv:2406.16282). No parameters: fold a
  pretrained affine into the next Linear with `lowmem_jax.fold`.

  Args:
    num_features: if given, the size the input's last axis must have.
    epsilon: added to the variance.
    dtype: dtype of the output; defaults to the input's.
    impl: "xla", "pallas", "pallas_interpret" or "auto" (`lowmem_jax.dispatch`);
      ``None`` reads ``$LOWMEM_JAX_IMPL``, else "auto".
    rngs: accepted for signature compatibility with `nnx.LayerNorm`; unused.
  """
  _norm = staticmethod(ms_layer_norm)


class MSRMSNorm(_MSNorm):
  """RMSNorm without scale whose backward keeps only y and 1/rms.

  MS-BP (Yang et al., ICML 2024, arXiv:2406.16282). No parameters: fold a
  pretrained scale into the next Linear with `lowmem_jax.fold`.

  Args:
    num_features: if given, the size the input's last axis must have.
    epsilon: added to the mean square.
    dtype: dtype of the output; defaults to the input's.
    impl: "xla", "pallas", "pallas_interpret" or "auto" (`lowmem_jax.dispatch`);
      ``None`` reads ``$LOWMEM_JAX_IMPL``, else "auto".
    rngs: accepted for signature compatibility with `nnx.RMSNorm`; unused.
  """
  _norm = staticmethod(ms_rms_norm)
