"""LLaMA-style decoder: pre-RMSNorm, SwiGLU MLP, rotary positions, grouped-query heads.

Parameter layout (``tok_embeddings``, ``layers_{i}/{attention_norm,
attention/{wq,wk,wv,wo}, ffn_norm, feed_forward/{w1,w2,w3}}``, ``norm``,
``output``) follows Meta's reference code, so `lowmem_jax.affine_folding.LLAMA_RULES`
folds it. Rotary embedding uses the rotate-half convention (Hugging Face's).

Switches: `TransformerSwitches` (the activation is SiLU on the SwiGLU gate,
the norms RMSNorms), ``loss`` ("plain" float32 logits and `optax`
cross-entropy, or "fused", `lowmem_jax.losses.linear_cross_entropy`, which
never holds the logits) and ``remat`` / ``remat_policy`` for the layers.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax import names
from lowmem_jax.attention_ops import attention, attention_reference
from lowmem_jax.losses import linear_cross_entropy
from lowmem_jax.models._common import (HeadsDense, TransformerSwitches, check_switches,
                                       embed_layer, norm_layer, normed, silu)

LOSSES = ("plain", "fused")


def check_loss(loss: str) -> None:
  if loss not in LOSSES:
    raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}.")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Sizes of a LLaMA-style decoder."""
  vocab_size: int = 32000
  dim: int = 768
  n_layers: int = 12
  n_heads: int = 12
  n_kv_heads: int | None = None  # None: as many as n_heads
  ffn_dim: int = 2048
  norm_eps: float = 1e-5
  rope_theta: float = 10000.0


CONFIGS = {
    "llama-100m": LlamaConfig(),  # 134M parameters with its 32k vocabulary
    "llama-1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192),
    "llama-7b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008),
}


def rope(x: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding of ``x: [batch, length, heads, head_dim]`` (rotate-half)."""
  length, head_dim = x.shape[1], x.shape[-1]
  inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  cos = jnp.cos(jnp.concatenate([angles, angles], -1))[None, :, None, :]
  sin = jnp.sin(jnp.concatenate([angles, angles], -1))[None, :, None, :]
  x32 = x.astype(jnp.float32)
  half = head_dim // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], -1)
  return (x32 * cos + rotated * sin).astype(x.dtype)


class Attention(nn.Module):
  config: LlamaConfig
  attention: str
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    head_dim = cfg.dim // cfg.n_heads
    kv_heads = cfg.n_kv_heads or cfg.n_heads
    dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=self.dtype,
                                     param_dtype=self.param_dtype, name=name)
    b, length, _ = x.shape
    q = dense(cfg.n_heads * head_dim, "wq")(x).reshape(b, length, cfg.n_heads, head_dim)
    k = dense(kv_heads * head_dim, "wk")(x).reshape(b, length, kv_heads, head_dim)
    v = dense(kv_heads * head_dim, "wv")(x).reshape(b, length, kv_heads, head_dim)
    q, k = rope(q, cfg.rope_theta), rope(k, cfg.rope_theta)
    q, k, v = (checkpoint_name(t, names.QKV) for t in (q, k, v))
    if self.attention == "recompute":
      out = attention(q, k, v, is_causal=True)
    else:
      out = attention_reference(q, k, v, is_causal=True)
    return HeadsDense(cfg.dim, self.dtype, self.param_dtype, name="wo")(out)


class FeedForward(nn.Module):
  config: LlamaConfig
  activation: str
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x):
    dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=self.dtype,
                                     param_dtype=self.param_dtype, name=name)
    gate = checkpoint_name(dense(self.config.ffn_dim, "w1")(x), names.MLP_HIDDEN)
    gate = silu(gate, self.activation)
    up = checkpoint_name(dense(self.config.ffn_dim, "w3")(x), names.MLP_HIDDEN)
    return dense(self.config.dim, "w2")(checkpoint_name(gate * up, names.MLP_ACT))


class TransformerBlock(nn.Module):
  config: LlamaConfig
  activation: str
  norm: str
  attention: str
  dtype: Any
  param_dtype: Any

  def _normed(self, x, name):
    return normed(x, self.norm, self.config.norm_eps, self.dtype, self.param_dtype, name,
                  rms=True)

  @nn.compact
  def __call__(self, x):
    x = checkpoint_name(x, names.BLOCK_IN)
    x = x + Attention(self.config, self.attention, self.dtype, self.param_dtype, name="attention")(
        self._normed(x, "attention_norm"))
    ff = FeedForward(self.config, self.activation, self.dtype, self.param_dtype, name="feed_forward")
    return x + ff(self._normed(x, "ffn_norm"))


class Output(nn.Module):
  """The LM head, ``nn.Dense``'s kernel ``[dim, vocab]`` without bias.

  ``x: [..., dim]`` gives float32 logits ``[..., vocab]``; with int ``labels:
  [...]`` the mean cross-entropy, a float32 scalar: from the logits
  (``loss="plain"``) or from `linear_cross_entropy` (``"fused"``), which makes
  the logits block by block and keeps none.
  """
  vocab_size: int
  loss: str
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x, labels=None):
    kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.vocab_size),
                        self.param_dtype)
    x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
    if labels is not None and self.loss == "fused":  # labels as optax takes them:
      labels = jnp.where(labels < 0, labels + self.vocab_size, labels)  # -1 is the last class
      invalid = jnp.where((labels >= 0) & (labels < self.vocab_size), 0.0, jnp.nan)
      return jnp.mean(linear_cross_entropy(x, kernel, labels, reduction="none") + invalid)
    logits = jnp.dot(x, kernel).astype(jnp.float32)
    if labels is None:
      return logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class Llama(TransformerSwitches):
  """LLaMA-style causal language model.

  Input ``int32[batch, length]`` tokens; output ``float32[batch, length, vocab]``
  logits, or with ``labels: int32[batch, length]`` the mean cross-entropy, a
  float32 scalar.

  Attributes:
    config: the sizes (`CONFIGS` has the named ones).
    loss: with labels, "plain" (float32 logits, then `optax`'s cross-entropy) or
      "fused" (`lowmem_jax.losses.linear_cross_entropy`: no logits kept or made whole).
    embedding: "plain" or "late" (`lowmem_jax.models._common.embed_layer`).
    activation, norm, attention, remat, remat_policy, dtype, param_dtype:
      `TransformerSwitches`' (keywords).
  """
  config: LlamaConfig = LlamaConfig()
  loss: str = "plain"
  embedding: str = "plain"

  @nn.compact
  def __call__(self, tokens, labels=None):
    check_switches(self.activation, self.norm, self.attention)
    check_loss(self.loss)
    cfg = self.config
    x = embed_layer(self.embedding, cfg.vocab_size, cfg.dim, self.dtype, self.param_dtype,
                    "tok_embeddings")(tokens)
    block = self.remat_block(TransformerBlock)
    for i in range(cfg.n_layers):
      x = block(cfg, self.activation, self.norm, self.attention, self.dtype, self.param_dtype,
                name=f"layers_{i}")(x)
    x = norm_layer(self.norm, cfg.norm_eps, self.dtype, self.param_dtype, "norm", rms=True)(x)
    return Output(cfg.vocab_size, self.loss, self.dtype, self.param_dtype, name="output")(x, labels)
