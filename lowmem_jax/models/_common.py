"""What the reference models share: their switches, the layers the switches select.

`Switches` holds the remat and dtype switches every reference model takes;
`TransformerSwitches` adds the technique switches of ViT, LLaMA and BERT
(``activation``, ``norm``, ``attention``), documented there once. Both hold
keyword-only fields, so a model's own fields (its sizes) keep their places.
"""

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax import names
from lowmem_jax.choices import Activation, Attention, Embedding, Norm, checked
from lowmem_jax.flax import linen as lm_linen
from lowmem_jax.ops.activations import regelu2, resilu2

# The activations a transformer takes (the WideResNet's ReLU takes its own, `ONE_BIT`).
ACTIVATIONS = (Activation.EXACT, Activation.APPROX)


def check_switches(activation: str, norm: str, attention: str) -> tuple[Activation, Norm,
                                                                        Attention]:
  """`TransformerSwitches`' switches as `lowmem_jax.choices` members; a ValueError names the
  first with an unknown value."""
  return (checked(Activation, activation, "activation", ACTIVATIONS),
          checked(Norm, norm, "norm"), checked(Attention, attention, "attention"))


class Switches(nn.Module):
  """The switches every reference model takes (keyword-only).

  Attributes:
    remat: wrap each block in `nn.remat` with ``remat_policy``.
    remat_policy: a `jax.checkpoint` policy; None saves nothing.
    dtype: compute dtype.
    param_dtype: parameter dtype.
  """
  _: dataclasses.KW_ONLY
  remat: bool = False
  remat_policy: Callable | None = None
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def remat_block(self, block: type[nn.Module], **remat_kwargs) -> type[nn.Module]:
    """``block`` under `nn.remat` with ``remat_policy`` (and ``remat_kwargs``) where ``remat``
    is set, else ``block`` itself."""
    return nn.remat(block, policy=self.remat_policy, **remat_kwargs) if self.remat else block

  def switches(self) -> dict[str, Any]:
    """This module's switches by name, for a submodule that takes the same."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.kw_only}


class TransformerSwitches(Switches):
  """The switches of the transformers (ViT, LLaMA, BERT), besides `Switches`' (keyword-only).

  Attributes:
    activation: "exact", the model's own activation (erf GELU in ViT's and
      BERT's MLP, SiLU on LLaMA's SwiGLU gate), or "approx", its twin whose
      backward keeps a 2-bit code (`lowmem_jax.regelu2`, `lowmem_jax.resilu2`;
      Approx-BP, an approximate gradient).
    norm: "plain", the model's own norm with its affine (LayerNorm, RMSNorm),
      or "ms", the memory-sharing norm (MS-BP: Yang et al., ICML 2024,
      arXiv:2406.16282; `MSLayerNorm`, `MSRMSNorm`), which keeps only its
      output and 1/sigma; the same parameters as "plain", trained the same
      way: the gradients are the plain norm's up to rounding.
    attention: "plain", which keeps the float32 probabilities, or "recompute",
      `lowmem_jax.attention`, which keeps none.
  """
  _: dataclasses.KW_ONLY
  activation: str = "exact"
  norm: str = "plain"
  attention: str = "plain"


def gelu(x: jax.Array, activation: str) -> jax.Array:
  """``activation`` "exact" erf GELU or "approx" `regelu2` of ``x``; same shape and dtype."""
  return regelu2(x) if activation == "approx" else nn.gelu(x, approximate=False)


def silu(x: jax.Array, activation: str) -> jax.Array:
  """``activation`` "exact" SiLU or "approx" `resilu2` of ``x``; same shape and dtype."""
  return resilu2(x) if activation == "approx" else nn.silu(x)


def norm_layer(norm: str, epsilon: float, dtype: Any, param_dtype: Any, name: str, *,
               rms: bool = False) -> nn.Module:
  """The norm the ``norm`` switch selects, emitting ``dtype``.

  Args:
    norm: "plain" (`nn.LayerNorm`, or `nn.RMSNorm` with ``rms``) or "ms"
      (`MSLayerNorm`, or `MSRMSNorm`), both with the same affine parameters.
    epsilon: added to the variance (mean square).
    dtype: compute dtype; param_dtype: parameter dtype.
    name: the module's name in the parameter tree.
    rms: an RMSNorm rather than a LayerNorm.
  """
  if norm == "ms":
    ms = lm_linen.MSRMSNorm if rms else lm_linen.MSLayerNorm
    return ms(epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, name=name)
  plain = nn.RMSNorm if rms else nn.LayerNorm
  return plain(epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, name=name)


def normed(x: jax.Array, norm: str, epsilon: float, dtype: Any, param_dtype: Any, name: str, *,
           rms: bool = False) -> jax.Array:
  """``x: [..., features]`` through `norm_layer`, its output named `names.NORM_OUT`.

  The MS norm names its own output, which it shares with the next matmul, so
  with ``norm="ms"`` the output is returned as it is. Same shape, ``dtype``.
  """
  y = norm_layer(norm, epsilon, dtype, param_dtype, name, rms=rms)(x)
  return y if norm == "ms" else checkpoint_name(y, names.NORM_OUT)


def embed_layer(embedding: str, num_embeddings: int, features: int, dtype: Any,
                param_dtype: Any, name: str) -> nn.Module:
  """The token embedding the ``embedding`` switch selects (same parameter, values and gradient).

  Args:
    embedding: "plain" (`nn.Embed`) or "late" (`lowmem_jax.flax.linen.Embed`, whose
      table-sized gradient buffer is made when its cotangent arrives: in
      AdamA's micro-batch loop XLA otherwise makes it at the start of the
      backward pass, beside the logits). What it saves depends on XLA's schedule: on the
      h100 target a table with jax 0.12.0.1, and 0.44 of a table more than "plain" with
      0.12.1 (tests/test_embedding.py::test_late_embedding_buffer_leaves_adama_peak).
    num_embeddings, features: the table's shape.
    dtype: compute dtype; param_dtype: parameter dtype.
    name: the module's name in the parameter tree.
  """
  embedding = checked(Embedding, embedding, "embedding")
  embed = lm_linen.Embed if embedding == "late" else nn.Embed
  return embed(num_embeddings, features, dtype=dtype, param_dtype=param_dtype, name=name)


class HeadsDense(nn.Module):
  """``[..., heads, head_dim] -> [..., features]`` with `nn.Dense`'s kernel.

  The kernel is ``[heads * head_dim, features]``, as `nn.Dense` would make it
  on the flattened heads. It contracts the heads without reshaping its input,
  so the matmul saves the attention output itself, the array attention
  already keeps, not a copy.

  Attributes:
    features: output size.
    dtype: compute dtype; param_dtype: parameter dtype.
    use_bias: add a bias ``[features]``, as `nn.Dense` would.
  """
  features: int
  dtype: Any
  param_dtype: Any
  use_bias: bool = False

  @nn.compact
  def __call__(self, x):
    heads, head_dim = x.shape[-2:]
    kernel = self.param("kernel", nn.initializers.lecun_normal(), (heads * head_dim, self.features),
                        self.param_dtype)
    kernel = kernel.reshape(heads, head_dim, self.features).astype(self.dtype)
    y = jnp.einsum("...hd,hdf->...f", x.astype(self.dtype), kernel)
    if self.use_bias:
      bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
      y = y + lax.broadcast_to_rank(bias.astype(self.dtype), y.ndim)
    return y
