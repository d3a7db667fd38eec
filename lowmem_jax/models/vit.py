"""Vision Transformer in big_vision's parameter layout (Dosovitskiy et al. 2021).

Pre-LN encoder blocks; the parameter tree matches big_vision's ``vit.py``
(``Transformer/encoderblock_{i}/{LayerNorm_0, MultiHeadDotProductAttention_0,
LayerNorm_1, MlpBlock_0}``, ``Transformer/encoder_norm``, ``embedding``,
``pos_embedding``, ``cls``, ``head``; class token pooling), so its
checkpoints load (`lowmem_jax.flax.affine_folding.VIT_RULES` folds it for a model of your
own whose MS norms have no affine).

Switches: `TransformerSwitches` (the activation is the MLP's GELU, the norms
LayerNorms), ``remat`` / ``remat_policy`` for the blocks.
"""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax import names
from lowmem_jax.flax import linen as lm_linen
from lowmem_jax.models._common import (TransformerSwitches, check_switches, gelu, norm_layer,
                                       normed)
from lowmem_jax.ops.attention import attention_reference

EPSILON = 1e-6  # of every LayerNorm


def plain_attention_fn(query, key, value, mask=None):
  """Flax ``attention_fn``: `attention_reference` (which names its probabilities and output)
  with q, k and v named."""
  query, key, value = (checkpoint_name(t, names.QKV) for t in (query, key, value))
  mask = None if mask is None else mask.astype(bool)  # Flax's masks: nonzero where kept
  return attention_reference(query, key, value, mask=mask)


class MlpBlock(nn.Module):
  mlp_dim: int
  activation: str = "exact"
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(self.mlp_dim, dtype=self.dtype, param_dtype=self.param_dtype)(x)
    h = checkpoint_name(h, names.MLP_HIDDEN)
    h = checkpoint_name(gelu(h, self.activation), names.MLP_ACT)
    return nn.Dense(x.shape[-1], dtype=self.dtype, param_dtype=self.param_dtype)(h)


class Encoder1DBlock(nn.Module):
  mlp_dim: int
  num_heads: int
  activation: str = "exact"
  norm: str = "plain"
  attention: str = "plain"
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def _normed(self, x, name):
    return normed(x, self.norm, EPSILON, self.dtype, self.param_dtype, name)

  @nn.compact
  def __call__(self, x):
    x = checkpoint_name(x, names.BLOCK_IN)
    y = self._normed(x, "LayerNorm_0")
    y = nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, dtype=self.dtype, param_dtype=self.param_dtype,
        deterministic=True,
        attention_fn=lm_linen.attention_fn if self.attention == "recompute" else plain_attention_fn,
        name="MultiHeadDotProductAttention_0")(y, y)
    x = x + y
    y = self._normed(x, "LayerNorm_1")
    y = MlpBlock(self.mlp_dim, self.activation, self.dtype, self.param_dtype, name="MlpBlock_0")(y)
    return x + y


class ViT(TransformerSwitches):
  """ViT classifier; defaults are ViT-B/16.

  Input ``float[batch, image, image, 3]``; output ``float32[batch, num_classes]``.

  Attributes:
    patch_size, width, depth, mlp_dim, num_heads, num_classes: the size.
    activation, norm, attention, remat, remat_policy, dtype, param_dtype:
      `TransformerSwitches`' (keywords).
  """
  patch_size: int = 16
  width: int = 768
  depth: int = 12
  mlp_dim: int = 3072
  num_heads: int = 12
  num_classes: int = 1000

  @nn.compact
  def __call__(self, images):
    check_switches(self.activation, self.norm, self.attention)
    p = self.patch_size
    x = nn.Conv(self.width, (p, p), strides=(p, p), padding="VALID", dtype=self.dtype,
                param_dtype=self.param_dtype, name="embedding")(images.astype(self.dtype))
    b, h, w, c = x.shape
    x = x.reshape(b, h * w, c)
    pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, h * w, c),
                     self.param_dtype)
    x = x + pos.astype(self.dtype)
    cls = self.param("cls", nn.initializers.zeros, (1, 1, c), self.param_dtype)
    x = jnp.concatenate([jnp.tile(cls.astype(self.dtype), (b, 1, 1)), x], axis=1)
    x = Encoder(self.depth, self.mlp_dim, self.num_heads, **self.switches(),
                name="Transformer")(x)
    head = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype, name="head")
    return head(x[:, 0]).astype(jnp.float32)


class Encoder(TransformerSwitches):
  depth: int
  mlp_dim: int
  num_heads: int

  @nn.compact
  def __call__(self, x):
    block = self.remat_block(Encoder1DBlock)
    for i in range(self.depth):
      x = block(self.mlp_dim, self.num_heads, self.activation, self.norm, self.attention,
                self.dtype, self.param_dtype, name=f"encoderblock_{i}")(x)
    return norm_layer(self.norm, EPSILON, self.dtype, self.param_dtype, "encoder_norm")(x)
