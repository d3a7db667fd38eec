"""BERT encoder, post-LN (Devlin et al. 2019), that loads Hugging Face's BertModel weights.

Post-LN: each sublayer's output is added to its input and the sum normalised,
``x <- LN(x + f(x))``; the embeddings' sum is normalised first. Here each norm
sits in the layer that consumes it: ``layers_{i}/input_norm`` is the norm
before layer i's attention (Hugging Face's ``embeddings.LayerNorm`` for i = 0,
``encoder.layer.{i-1}.output.LayerNorm`` after), ``layers_{i}/attention_norm``
the norm before its MLP, and ``final_norm`` the last layer's output norm.

A post-LN norm feeds its layer's linear layers and the residual stream. With
``norm="ms"`` it is an MS-LayerNorm with its scale and bias
(`lowmem_jax.flax.linen.MSLayerNorm`, the same parameters): its output is the one
array the norm and the next matmuls save. The last norm, ``final_norm``, feeds no
linear layer inside the model and stays plain.

Switches: `TransformerSwitches` (the activation is the MLP's GELU, the norms
LayerNorms), ``remat`` /
``remat_policy`` for the layers. No dropout: the model is deterministic.
"""

import dataclasses
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax import names
from lowmem_jax.models._common import HeadsDense, TransformerSwitches, check_switches, gelu, normed
from lowmem_jax.ops.attention import attention, attention_reference


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """Sizes of a BERT encoder; the defaults are MiniLM-L6-H384 (all-MiniLM-L6-v2)."""
  vocab_size: int = 30522
  dim: int = 384
  n_layers: int = 6
  n_heads: int = 12
  ffn_dim: int = 1536
  max_len: int = 512
  type_vocab_size: int = 2
  norm_eps: float = 1e-12

  def __post_init__(self):
    if self.dim % self.n_heads:
      raise ValueError(f"n_heads ({self.n_heads}) must divide dim ({self.dim}).")

  @classmethod
  def from_hf(cls, config: Mapping[str, Any]) -> "BertConfig":
    """The sizes in a Hugging Face ``config.json`` of a BERT (``hidden_act`` "gelu")."""
    if config.get("hidden_act", "gelu") != "gelu":
      raise ValueError(f"config hidden_act must be 'gelu' (erf GELU), got {config['hidden_act']!r}.")
    if config.get("position_embedding_type", "absolute") != "absolute":
      raise ValueError("config position_embedding_type must be 'absolute', got "
                       f"{config['position_embedding_type']!r}.")
    return cls(vocab_size=config["vocab_size"], dim=config["hidden_size"],
               n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
               ffn_dim=config["intermediate_size"], max_len=config["max_position_embeddings"],
               type_vocab_size=config["type_vocab_size"], norm_eps=config["layer_norm_eps"])


class SelfAttention(nn.Module):
  """Bidirectional attention: ``[batch, length, dim]`` and a key mask ``bool[batch, 1, 1,
  length]`` to ``[batch, length, dim]``."""
  config: BertConfig
  attention: str
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x, mask):
    cfg = self.config
    head_dim = cfg.dim // cfg.n_heads
    b, length, _ = x.shape
    q, k, v = (nn.Dense(cfg.dim, dtype=self.dtype, param_dtype=self.param_dtype, name=name)(x)
               .reshape(b, length, cfg.n_heads, head_dim) for name in ("query", "key", "value"))
    q, k, v = (checkpoint_name(t, names.QKV) for t in (q, k, v))
    if self.attention == "recompute":
      out = attention(q, k, v, mask=mask)
    else:
      out = attention_reference(q, k, v, mask=mask)
    return HeadsDense(cfg.dim, self.dtype, self.param_dtype, use_bias=True, name="out")(out)


class Mlp(nn.Module):
  """``fc2(gelu(fc1(x)))``: ``[..., dim]`` to ``[..., dim]`` through ``[..., ffn_dim]``."""
  config: BertConfig
  activation: str
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x):
    dense = lambda n, name: nn.Dense(n, dtype=self.dtype, param_dtype=self.param_dtype, name=name)
    h = checkpoint_name(dense(self.config.ffn_dim, "fc1")(x), names.MLP_HIDDEN)
    return dense(self.config.dim, "fc2")(checkpoint_name(gelu(h, self.activation), names.MLP_ACT))


class Layer(nn.Module):
  """One post-LN layer, from the un-normalised sum before its input norm to the one after its MLP."""
  config: BertConfig
  activation: str
  norm: str
  attention: str
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x, mask):
    x = checkpoint_name(x, names.BLOCK_IN)
    norm = lambda name, x: normed(x, self.norm, self.config.norm_eps, self.dtype,
                                  self.param_dtype, name)
    x = norm("input_norm", x)
    x = norm("attention_norm", x + SelfAttention(
        self.config, self.attention, self.dtype, self.param_dtype, name="attention")(x, mask))
    return x + Mlp(self.config, self.activation, self.dtype, self.param_dtype, name="mlp")(x)


class Bert(TransformerSwitches):
  """BERT encoder (post-LN), without pooler.

  Input ``tokens: int32[batch, length]`` and ``mask: bool[batch, length]``
  (True for real tokens, False for padding); output the last hidden states,
  ``[batch, length, dim]`` in ``dtype``. Token type 0 throughout.

  Attributes:
    config: the sizes (the defaults are MiniLM-L6-H384's).
    activation, norm, attention, remat, remat_policy, dtype, param_dtype:
      `TransformerSwitches`' (keywords); ``norm="ms"`` takes the same params.
  """
  config: BertConfig = BertConfig()

  @nn.compact
  def __call__(self, tokens, mask):
    check_switches(self.activation, self.norm, self.attention)
    cfg = self.config
    if tokens.ndim != 2 or mask.shape != tokens.shape:
      raise ValueError(f"tokens must be [batch, length] and mask the same shape, got tokens "
                       f"{tokens.shape} and mask {mask.shape}.")
    if tokens.shape[1] > cfg.max_len:
      raise ValueError(f"tokens length {tokens.shape[1]} exceeds max_len {cfg.max_len}.")
    embed = lambda n, name: nn.Embed(n, cfg.dim, dtype=self.dtype, param_dtype=self.param_dtype,
                                     name=name)
    x = (embed(cfg.vocab_size, "word_embeddings")(tokens)
         + embed(cfg.max_len, "position_embeddings")(jnp.arange(tokens.shape[1]))[None]
         + embed(cfg.type_vocab_size, "token_type_embeddings")(jnp.zeros_like(tokens)))
    keys = mask.astype(bool)[:, None, None, :]  # [batch, 1 (heads), 1 (queries), length]
    layer = self.remat_block(Layer)
    for i in range(cfg.n_layers):
      x = layer(cfg, self.activation, self.norm, self.attention, self.dtype, self.param_dtype,
                name=f"layers_{i}")(x, keys)
    # No linear layer follows the last norm inside the model, so it stays plain.
    return normed(x, "plain", cfg.norm_eps, self.dtype, self.param_dtype, "final_norm")


class BertClassifier(Bert):
  """`Bert` (named ``encoder``), mean pooling over the real tokens and a linear
  ``head``: ``tokens: int32[batch, length]`` and an optional ``mask:
  bool[batch, length]`` (None: every token is real) to ``float32[batch, num_classes]``.

  Attributes:
    num_classes: outputs of the head.
    config, activation, norm, attention, remat, remat_policy, dtype,
      param_dtype: as `Bert`'s.
  """
  num_classes: int = 2

  @nn.compact
  def __call__(self, tokens, mask=None):
    mask = jnp.ones(tokens.shape, bool) if mask is None else mask
    hidden = Bert(self.config, **self.switches(), name="encoder")(tokens, mask)
    head = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype, name="head")
    return head(mean_pool(hidden, mask).astype(self.dtype)).astype(jnp.float32)


def mean_pool(hidden: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean of ``hidden: [batch, length, dim]`` over the tokens where ``mask`` is
  True, float32 ``[batch, dim]`` (sentence-transformers' mean pooling)."""
  weights = mask.astype(jnp.float32)[..., None]
  return (hidden.astype(jnp.float32) * weights).sum(1) / jnp.maximum(weights.sum(1), 1e-9)


def from_hf(tensors: Mapping[str, np.ndarray], config: BertConfig) -> dict:
  """Params of `Bert` from Hugging Face BertModel tensors (e.g. ``safetensors.numpy.load_file``).

  Linear weights ``[out, in]`` become kernels ``[in, out]``; a ``bert.``
  prefix is dropped; the pooler and ``position_ids`` are not used.

  Raises:
    ValueError: a tensor `Bert` needs is missing or has the wrong shape.
  """
  t = {k.removeprefix("bert."): v for k, v in tensors.items()}

  def get(key, shape):
    if key not in t:
      raise ValueError(f"tensors has no {key!r}; it holds e.g. {sorted(t)[:5]}.")
    if t[key].shape != shape:
      raise ValueError(f"tensors[{key!r}] has shape {t[key].shape}, config expects {shape}.")
    return jnp.asarray(t[key])

  d, f = config.dim, config.ffn_dim
  dense = lambda key, n_in, n_out: {"kernel": get(f"{key}.weight", (n_out, n_in)).T,
                                    "bias": get(f"{key}.bias", (n_out,))}
  norm = lambda key: {"scale": get(f"{key}.weight", (d,)), "bias": get(f"{key}.bias", (d,))}
  emb = lambda key, n: {"embedding": get(f"embeddings.{key}.weight", (n, d))}
  params = {"word_embeddings": emb("word_embeddings", config.vocab_size),
            "position_embeddings": emb("position_embeddings", config.max_len),
            "token_type_embeddings": emb("token_type_embeddings", config.type_vocab_size),
            "final_norm": norm(f"encoder.layer.{config.n_layers - 1}.output.LayerNorm")}
  for i in range(config.n_layers):
    hf = f"encoder.layer.{i}"
    params[f"layers_{i}"] = {
        "input_norm": norm("embeddings.LayerNorm" if i == 0
                           else f"encoder.layer.{i - 1}.output.LayerNorm"),
        "attention": {name: dense(f"{hf}.attention.self.{name}", d, d)
                      for name in ("query", "key", "value")}
                     | {"out": dense(f"{hf}.attention.output.dense", d, d)},
        "attention_norm": norm(f"{hf}.attention.output.LayerNorm"),
        "mlp": {"fc1": dense(f"{hf}.intermediate.dense", d, f),
                "fc2": dense(f"{hf}.output.dense", f, d)},
    }
  return params
