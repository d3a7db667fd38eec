"""LLaMA-style decoder: pre-RMSNorm, SwiGLU MLP, rotary positions, grouped-query heads.

Parameter layout (``tok_embeddings``, ``layers/{attention_norm,
attention/{wq,wk,wv,wo}, ffn_norm, feed_forward/{w1,w2,w3}}``, ``norm``,
``output``) follows Meta's reference code (`lowmem_jax.flax.affine_folding.LLAMA_RULES`
folds it for a model of your own whose MS norms have no scale). The layers are stacked, each leaf ``[n_layers, ...]``, and run by
`flax.linen.scan`, so compile time does not grow with depth (``scan=False``
unrolls them as ``layers_{i}``); `layer_stack`
gives the same model as pure functions over those params
(`lowmem_jax.optim.LayerStack`). With ``tie_embeddings`` the head is the
embedding table transposed and there is no ``output``. Rotary embedding uses
the rotate-half convention (Hugging Face's), with Llama-3.1's frequency
scaling where the config has `RopeScaling`; `lowmem_jax.models.llama_hf.from_hf`
loads a Hugging Face ``LlamaForCausalLM`` checkpoint or says why not.

`CONFIGS` names llama-100m, llama-1b and llama-7b (LLaMA-style sizes, 32k
vocabulary) and Meta's Llama 3 family: llama-3.2-1b, llama-3.2-3b (tied
embeddings), llama-3.1-8b and llama-3.1-70b (Meta's model cards and
``config.json`` files; 1.24B, 3.21B, 8.03B and 70.6B parameters).

Switches: `TransformerSwitches` (the activation is SiLU on the SwiGLU gate,
the norms RMSNorms), ``loss`` ("plain" float32 logits and `optax`
cross-entropy, or "fused", `lowmem_jax.ops.losses.linear_cross_entropy`, which
never holds the logits, or "fused-one-pass", the same with its backward in one
pass), ``mlp_chunk_tokens`` (each layer's MLP over token
chunks, recomputed chunk by chunk in the backward: `TransformerBlock`) and
``remat`` / ``remat_policy`` for the layers.
"""

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax import names
from lowmem_jax._checks import is_int
from lowmem_jax.choices import Loss, checked
from lowmem_jax.models._common import (
  HeadsDense,
  TransformerSwitches,
  check_switches,
  embed_layer,
  norm_layer,
  normed,
  silu,
)
from lowmem_jax.ops.attention import attention, attention_reference
from lowmem_jax.ops.losses import linear_cross_entropy
from lowmem_jax.ops.token_chunks import chunked_residual, token_chunks
from lowmem_jax.optim.layer_stack import LayerStack


def check_loss(loss: str) -> Loss:
  """``loss`` as a `lowmem_jax.choices.Loss`, or a ValueError naming it."""
  return checked(Loss, loss, "loss")


def check_mlp_chunk_tokens(mlp_chunk_tokens: int | None) -> None:
  if mlp_chunk_tokens is not None and (not is_int(mlp_chunk_tokens) or mlp_chunk_tokens < 1):
    raise ValueError(f"mlp_chunk_tokens must be a positive int or None, got {mlp_chunk_tokens!r}.")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3.1's rotary frequency scaling (Hugging Face's ``rope_type`` "llama3").

  A frequency whose wavelength ``2 pi / f`` is longer than
  ``original_max_position / low_freq_factor`` is divided by ``factor``, one
  shorter than ``original_max_position / high_freq_factor`` is kept, and those
  between are interpolated (`rope_frequencies`). Source: Meta's llama-models
  ``apply_scaling``; transformers' ``_compute_llama3_parameters``.

  Attributes:
    factor: the divisor of the low frequencies (8 in Llama 3.1, 32 in Llama 3.2).
    low_freq_factor, high_freq_factor: the wavelength bounds' divisors.
    original_max_position: the context the model was first trained at (8192).
  """
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Sizes of a LLaMA-style decoder.

  Attributes:
    vocab_size, dim, n_layers, n_heads: the sizes; the head size is ``dim // n_heads``.
    n_kv_heads: key/value heads (grouped-query attention); None: as many as ``n_heads``.
    ffn_dim: the SwiGLU MLP's hidden size.
    norm_eps: the RMSNorms' epsilon.
    rope_theta: the rotary base.
    rope_scaling: Llama-3.1's frequency scaling; None: none.
    tie_embeddings: the head is ``tok_embeddings``' table transposed (no ``output`` param).
  """
  vocab_size: int = 32000
  dim: int = 768
  n_layers: int = 12
  n_heads: int = 12
  n_kv_heads: int | None = None
  ffn_dim: int = 2048
  norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  tie_embeddings: bool = False


_LLAMA3 = {"vocab_size": 128256, "n_kv_heads": 8, "rope_theta": 500000.0}
CONFIGS = {
    "llama-tiny": LlamaConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                              ffn_dim=192),  # quick checks
    "llama-100m": LlamaConfig(),  # 134M parameters with its 32k vocabulary
    "llama-1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192),
    "llama-7b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008),
    # Meta's Llama 3 family, as their Hugging Face config.json files give it.
    "llama-3.2-1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, ffn_dim=8192,
                                rope_scaling=RopeScaling(factor=32.0), tie_embeddings=True,
                                **_LLAMA3),
    "llama-3.2-3b": LlamaConfig(dim=3072, n_layers=28, n_heads=24, ffn_dim=8192,
                                rope_scaling=RopeScaling(factor=32.0), tie_embeddings=True,
                                **_LLAMA3),
    "llama-3.1-8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, ffn_dim=14336,
                                rope_scaling=RopeScaling(), **_LLAMA3),
    "llama-3.1-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, ffn_dim=28672,
                                 rope_scaling=RopeScaling(), **_LLAMA3),
}


def rope_frequencies(head_dim: int, theta: float,
                     scaling: RopeScaling | None = None) -> jax.Array:
  """The rotary frequencies ``float32[head_dim // 2]``: ``theta ** (-2i / head_dim)``.

  With ``scaling`` (`RopeScaling`), with ``r = original_max_position / wavelength``
  and ``s = clip((r - low_freq_factor) / (high_freq_factor - low_freq_factor), 0, 1)``,
  each becomes ``f * (s + (1 - s) / factor)``: ``f / factor`` for long
  wavelengths (s = 0), ``f`` for short ones (s = 1), interpolated between.
  """
  inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  if scaling is None:
    return inv_freq
  ratio = scaling.original_max_position * inv_freq / (2 * math.pi)
  smooth = (ratio - scaling.low_freq_factor) / (scaling.high_freq_factor
                                               - scaling.low_freq_factor)
  smooth = jnp.clip(smooth, 0.0, 1.0)
  return inv_freq * (smooth + (1 - smooth) / scaling.factor)


def rope(x: jax.Array, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
  """Rotary embedding of ``x: [batch, length, heads, head_dim]`` (rotate-half) at positions
  ``0 .. length - 1``, frequencies `rope_frequencies`; same shape and dtype."""
  length, head_dim = x.shape[1], x.shape[-1]
  inv_freq = rope_frequencies(head_dim, theta, scaling)
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
    q, k = (rope(t, cfg.rope_theta, cfg.rope_scaling) for t in (q, k))
    q, k, v = (checkpoint_name(t, names.QKV) for t in (q, k, v))
    if self.attention == "recompute":
      out = attention(q, k, v, is_causal=True)
    else:
      out = attention_reference(q, k, v, is_causal=True)
    return HeadsDense(cfg.dim, self.dtype, self.param_dtype, name="wo")(out)


class FeedForward(nn.Module):
  """The SwiGLU MLP, ``w2(silu(x w1) * (x w3))``, in two stages: `hidden` and `out`."""
  config: LlamaConfig
  activation: str
  dtype: Any
  param_dtype: Any

  def setup(self):
    dense = lambda n: nn.Dense(n, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)
    self.w1, self.w3, self.w2 = (dense(self.config.ffn_dim), dense(self.config.ffn_dim),
                                 dense(self.config.dim))

  def hidden(self, x):
    """``(x w1, x w3)``: the hidden layer's two pre-activations, ``[..., ffn_dim]`` each."""
    return tuple(checkpoint_name(w(x), names.MLP_HIDDEN) for w in (self.w1, self.w3))

  def out(self, gate, up):
    """``w2(silu(gate) * up)``: the MLP's output from `hidden`'s, ``[..., dim]``."""
    return self.w2(checkpoint_name(silu(gate, self.activation) * up, names.MLP_ACT))

  def __call__(self, x):
    return self.out(*self.hidden(x))


PARTS = ("all", "attention", "feed_forward", "to_mlp_hidden", "from_mlp_hidden")


class TransformerBlock(nn.Module):
  """One pre-norm decoder layer: attention, then the SwiGLU MLP, each added to the stream.

  With ``mlp_chunk_tokens`` the MLP and its norm run over the flattened tokens in
  `lowmem_jax.ops.token_chunks.mlp_chunks` equal chunks (`chunked_residual`): the backward keeps the MLP's
  input and recomputes each chunk's ``[chunk, ffn_dim]`` hidden, so no
  ``[tokens, ffn_dim]`` tensor is made, and writes the input's gradient over the
  output's in place. The same function (the MLP works token by token); the
  weights' gradient is summed over the chunks in their dtype; reverse mode only,
  and the chunked MLP's intermediates are not captured (``capture_intermediates``).
  Under a mesh of ``Auto`` axes set for tracing (`jax.set_mesh`) a chunk holds
  whole positions of every sequence instead (`token_chunks`).

  ``part`` runs only the attention half (``"attention"``, its residual added) or
  only the MLP half (``"feed_forward"``), for `layer_stack`'s layer in two parts;
  ``"all"``: both. Or the layer cut at the MLP's hidden layer (`layer_stack`'s
  ``split_at_mlp_hidden``; the MLP whole): ``"to_mlp_hidden"`` takes ``x`` and returns
  ``(x, gate, up)``, the stream after the attention and the hidden layer's two
  pre-activations (`FeedForward.hidden`); ``"from_mlp_hidden"`` takes those and returns
  the stream with the MLP's output added.
  """
  config: LlamaConfig
  activation: str
  norm: str
  attention: str
  dtype: Any
  param_dtype: Any
  mlp_chunk_tokens: int | None = None
  part: str = "all"

  def _normed(self, x, name):
    return normed(x, self.norm, self.config.norm_eps, self.dtype, self.param_dtype, name,
                  rms=True)

  @nn.compact
  def __call__(self, x):
    if self.part not in PARTS:
      raise ValueError(f"TransformerBlock.part must be one of {PARTS}, got {self.part!r}.")
    if self.part in ("all", "attention", "to_mlp_hidden"):
      x = checkpoint_name(x, names.BLOCK_IN)
      x = x + Attention(self.config, self.attention, self.dtype, self.param_dtype,
                        name="attention")(self._normed(x, "attention_norm"))
    if self.part == "attention":
      return x
    feed_forward = FeedForward(self.config, self.activation, self.dtype, self.param_dtype,
                               name="feed_forward")
    if self.part in ("to_mlp_hidden", "from_mlp_hidden"):
      if self.mlp_chunk_tokens is not None:
        raise ValueError(f"TransformerBlock.part {self.part!r} keeps the MLP whole: give "
                         f"mlp_chunk_tokens=None, got {self.mlp_chunk_tokens!r}.")
      if self.part == "to_mlp_hidden":
        return x, *feed_forward.hidden(self._normed(x, "ffn_norm"))
      if not isinstance(x, tuple) or len(x) != 3:
        raise TypeError(f"TransformerBlock.part 'from_mlp_hidden' takes (x, gate, up), "
                        f"'to_mlp_hidden''s output; got {jax.tree.map(jnp.shape, x)}.")
      x, gate, up = x
      return x + feed_forward.out(gate, up)
    if len(token_chunks(x, self.mlp_chunk_tokens)[0]) == 1:
      return x + feed_forward(self._normed(x, "ffn_norm"))
    norm = norm_layer(self.norm, self.config.norm_eps, self.dtype, self.param_dtype, "ffn_norm",
                      rms=True)
    if self.is_initializing():  # the parameters, made on one token
      feed_forward(norm(x[:1, :1]))
    params = {"ffn_norm": norm.variables.get("params", {}),
              "feed_forward": feed_forward.variables["params"]}
    norm, feed_forward = norm.clone(parent=None), feed_forward.clone(parent=None)

    def branch(p, chunk):
      normed_chunk = norm.apply({"params": p["ffn_norm"]}, chunk)
      return feed_forward.apply({"params": p["feed_forward"]}, normed_chunk)
    return chunked_residual(branch, params, x, self.mlp_chunk_tokens)


def lm_head(x: jax.Array, kernel: jax.Array, labels: jax.Array | None, loss: str,
            dtype: Any) -> jax.Array:
  """The LM head: ``x: [..., dim]`` times ``kernel: [dim, vocab]``, both in ``dtype``.

  Without ``labels``, float32 logits ``[..., vocab]``; with int ``labels:
  [...]`` the mean cross-entropy, a float32 scalar: from the logits
  (``loss="plain"``) or from `linear_cross_entropy` (``"fused"``), which makes
  the logits block by block and keeps none (``"fused-one-pass"``: its ``backward_passes=1``,
  each block's logits made once in the backward, for a float32 ``[tokens, dim]``).
  """
  vocab_size = kernel.shape[-1]
  x, kernel = x.astype(dtype), kernel.astype(dtype)
  if labels is not None and loss in (Loss.FUSED, Loss.FUSED_ONE_PASS):  # labels as optax has:
    labels = jnp.where(labels < 0, labels + vocab_size, labels)  # -1 is the last class
    invalid = jnp.where((labels >= 0) & (labels < vocab_size), 0.0, jnp.nan)
    return jnp.mean(linear_cross_entropy(
        x, kernel, labels, reduction="none",
        backward_passes=1 if loss == Loss.FUSED_ONE_PASS else 2) + invalid)
  logits = jnp.dot(x, kernel).astype(jnp.float32)
  if labels is None:
    return logits
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class Output(nn.Module):
  """The untied LM head, `lm_head` with ``nn.Dense``'s kernel ``[dim, vocab]`` without bias."""
  vocab_size: int
  loss: str
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x, labels=None):
    kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.vocab_size),
                        self.param_dtype)
    return lm_head(x, kernel, labels, self.loss, self.dtype)


def _embedding(model: "Llama") -> nn.Module:
  """``model``'s token embedding, ``tok_embeddings``."""
  cfg = model.config
  return embed_layer(model.embedding, cfg.vocab_size, cfg.dim, model.dtype, model.param_dtype,
                     "tok_embeddings")


def _block_args(model: "Llama") -> tuple:
  """`TransformerBlock`'s fields for ``model``'s layers."""
  return (model.config, model.activation, model.norm, model.attention, model.dtype,
          model.param_dtype, model.mlp_chunk_tokens)


def _final_norm(model: "Llama") -> nn.Module:
  """``model``'s norm before the head, ``norm``."""
  return norm_layer(model.norm, model.config.norm_eps, model.dtype, model.param_dtype, "norm",
                    rms=True)


class Llama(TransformerSwitches):
  """LLaMA-style causal language model.

  Input ``int32[batch, length]`` tokens; output ``float32[batch, length, vocab]``
  logits, or with ``labels: int32[batch, length]`` the mean cross-entropy, a
  float32 scalar. The layers' params are stacked under ``layers`` (each leaf
  ``[n_layers, ...]``) and run by `nn.scan` (``scan``), each under `nn.remat`
  with ``remat``.

  Attributes:
    config: the sizes (`CONFIGS` has the named ones).
    loss: with labels, "plain" (float32 logits, then `optax`'s cross-entropy) or
      "fused" (`lowmem_jax.ops.losses.linear_cross_entropy`: no logits kept or made whole)
      or "fused-one-pass" (the same, its backward in one pass: `lm_head`).
    embedding: "plain" or "late" (`lowmem_jax.models._common.embed_layer`).
    mlp_chunk_tokens: each layer's MLP over token chunks of at most this many
      tokens, recomputed chunk by chunk in the backward (`TransformerBlock`); None: whole.
    scan: the layers stacked under ``layers`` and run by `nn.scan` (compile
      time flat in depth; what `layer_stack` and `llama_hf.from_hf` give), or, False,
      unrolled as ``layers_{i}``: `examples/sharded_train.py` keeps them so,
      where XLA's sharding propagation in the scan's loop shards the MLP's
      activations over FSDP and moves them between devices.
    activation, norm, attention, remat, remat_policy, dtype, param_dtype:
      `TransformerSwitches`' (keywords).
  """
  config: LlamaConfig = LlamaConfig()
  loss: str = "plain"
  embedding: str = "plain"
  mlp_chunk_tokens: int | None = None
  scan: bool = True

  @nn.compact
  def __call__(self, tokens, labels=None):
    check_switches(self.activation, self.norm, self.attention)
    check_loss(self.loss)
    check_mlp_chunk_tokens(self.mlp_chunk_tokens)
    cfg = self.config
    embed = _embedding(self)
    x = embed(tokens)
    block = self.remat_block(TransformerBlock, prevent_cse=not self.scan)
    if self.scan:
      layers = nn.scan(lambda module, h, _: (module(h), None), variable_axes={"params": 0},
                       split_rngs={"params": True}, length=cfg.n_layers)
      x, _ = layers(block(*_block_args(self), name="layers"), x, None)
    else:
      for i in range(cfg.n_layers):
        x = block(*_block_args(self), name=f"layers_{i}")(x)
    x = _final_norm(self)(x)
    if cfg.tie_embeddings:
      return lm_head(x, embed.embedding.T, labels, self.loss, self.dtype)
    return Output(cfg.vocab_size, self.loss, self.dtype, self.param_dtype, name="output")(x, labels)


def layer_stack(model: Llama, split_layer: bool = True,
                split_at_mlp_hidden: bool = False) -> LayerStack:
  """``model`` as pure functions over its params, for the layer-streamed step.

  With ``batch = (tokens, labels)`` (``int32[batch, length]`` each) and
  ``rest`` the params without ``layers``, ``head(rest, scan(run_layer)(embed(rest,
  batch)), batch)`` is ``model.apply({"params": params}, tokens, labels)``:
  ``embed`` looks the tokens up (``[batch, length, dim]`` in ``model.dtype``),
  ``layer`` runs one `TransformerBlock` on one slice of ``params["layers"]``
  (each part under `jax.checkpoint` with ``model.remat_policy`` where ``model.remat``),
  ``head`` is the final norm and `lm_head` (``model.loss``; the table
  transposed with ``tie_embeddings``), the mean loss in float32. With
  ``split_layer`` the layer is two parts, the attention half and the MLP half
  (`LayerStack.layer`): the streamed step then updates the MLP's parameters
  before the attention's backward, so their copy and gradient are not held
  through it, at the cost of one more forward of the attention half (none where the
  step keeps each part's input: `layer_streamed`'s ``keep_part_inputs``). With
  ``split_at_mlp_hidden`` (and ``split_layer=False``, no ``mlp_chunk_tokens``) the layer is
  two parts cut at the MLP's hidden layer: the attention and the MLP's first two matmuls,
  then the MLP's activation and last matmul, whose input is the stream and the hidden
  layer's two pre-activations (`TransformerBlock`'s ``"to_mlp_hidden"``). Where the step
  keeps each part's input, the backward then runs no forward matmul of the MLP, for two
  ``[batch, length, ffn_dim]`` kept a layer.
  """
  check_switches(model.activation, model.norm, model.attention)
  check_loss(model.loss)
  check_mlp_chunk_tokens(model.mlp_chunk_tokens)
  if not model.scan:
    raise ValueError("model must stack its layers (scan=True) for layer_stack, got scan=False.")
  for name, flag in (("split_layer", split_layer), ("split_at_mlp_hidden", split_at_mlp_hidden)):
    if not isinstance(flag, bool):
      raise TypeError(f"{name} must be a bool, got {flag!r}.")
  if split_at_mlp_hidden and split_layer:
    raise ValueError("split_at_mlp_hidden cuts the whole layer at the MLP's hidden layer: give "
                     "split_layer=False.")
  if split_at_mlp_hidden and model.mlp_chunk_tokens is not None:
    raise ValueError(f"split_at_mlp_hidden keeps the MLP's hidden layer whole: give the model "
                     f"mlp_chunk_tokens=None, got {model.mlp_chunk_tokens!r}.")
  cfg = model.config
  embedding, final_norm = _embedding(model), _final_norm(model)

  def embed(rest, batch):
    return embedding.apply({"params": rest["tok_embeddings"]}, batch[0])

  def layer_part(part):
    block = TransformerBlock(*_block_args(model), part=part)

    def run_block(layer_params, h):
      return block.apply({"params": layer_params}, h)
    if model.remat:
      run_block = jax.checkpoint(run_block, policy=model.remat_policy, prevent_cse=False)

    def layer(layer_params, h, batch):
      del batch  # positions are 0 .. length - 1, no mask beyond the causal one
      return run_block(layer_params, h)
    return layer

  def head(rest, h, batch):
    h = final_norm.apply({"params": rest.get("norm", {})}, h)
    if cfg.tie_embeddings:
      kernel = rest["tok_embeddings"]["embedding"].T
    else:
      kernel = rest["output"]["kernel"]
    return lm_head(h, kernel, batch[1], model.loss, model.dtype)

  if split_layer or split_at_mlp_hidden:
    layer = tuple(map(layer_part, ("attention", "feed_forward") if split_layer
                      else ("to_mlp_hidden", "from_mlp_hidden")))
  else:
    layer = layer_part("all")
  return LayerStack(embed, layer, head)
