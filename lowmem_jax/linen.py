"""Flax linen substitutes: drop-in modules over the functional core.

The approximate activations are plain functions and serve as ``activation=``
arguments as they are (`lowmem_jax.regelu2`, `lowmem_jax.resilu2`).
"""

from typing import Any

import flax.linen as nn
import jax

from lowmem_jax.norms import ms_layer_norm, ms_rms_norm


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
