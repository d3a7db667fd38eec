"""Flax linen substitutes: drop-in modules over the functional core.

The approximate activations are plain functions and serve as ``activation=``
arguments as they are (`lowmem_jax.regelu2`, `lowmem_jax.resilu2`).
`MultiHeadDotProductAttention` and `MultiHeadAttention` are Flax's, with
`attention_fn` (`lowmem_jax.attention`: no L×L residual) in place of Flax's.
`Embed` is Flax's with `lowmem_jax.ops.embedding.take`, whose gradient buffer is
made late. `SparseConv` keeps its kernel as values and positions
(`lowmem_jax.optim.sparse`).
"""

import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax import names
from lowmem_jax.ops.attention import attention
from lowmem_jax.ops.embedding import take
from lowmem_jax.ops.norms import ms_layer_norm, ms_rms_norm
from lowmem_jax.optim.sparse import densify, tie_gradients


def attention_fn(query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None = None,
                 *, dropout_rng: jax.Array | None = None, dropout_rate: float = 0.0,
                 broadcast_dropout: bool = True, deterministic: bool = True, dtype: Any = None,
                 precision: Any = None, module: nn.Module | None = None, is_causal: bool = False,
                 impl: str | None = None, chunk_size: int = 512) -> jax.Array:
  """`lowmem_jax.attention` with the signature of Flax's ``attention_fn``.

  Serves as ``attention_fn`` of Flax's linen and NNX attention modules. It
  tags the projected ``query, key, value`` as `names.QKV`; the output is
  `names.ATTN_OUT` and the log-sum-exp `names.ATTN_LSE`. The modules'
  parameters are unchanged, so pretrained ones load as they are.

  Args:
    query: ``[batch, q_length, heads, head_dim]``.
    key, value: ``[batch, kv_length, kv_heads, head_dim]``.
    mask: optional, broadcastable to ``[batch, heads, q_length, kv_length]``;
      False or 0 masks a key out. Flax's mask helpers make float32 masks by
      default: pass ``dtype=bool`` to them to save the boolean copy made here.
    dropout_rng, dropout_rate, broadcast_dropout, deterministic: attention
      dropout is not supported; a rate above 0 outside deterministic mode raises.
    dtype: if given, q, k and v are cast to it first.
    precision: only the default (None); matmuls run at the backend's default.
    module: set by Flax for ``sow_weights=True``, which is not supported: the
      probabilities are never materialised whole.
    is_causal: causal masking (NNX passes it).
    impl: `lowmem_jax.attention`'s ``implementation``.
    chunk_size: as in `lowmem_jax.attention`.

  One batch axis only.
  """
  del dropout_rng, broadcast_dropout
  if dropout_rate > 0.0 and not deterministic:
    raise NotImplementedError(
        f"attention_fn has no attention dropout, got dropout_rate={dropout_rate} with "
        "deterministic=False; set dropout_rate=0.")
  if precision is not None:
    raise NotImplementedError(f"attention_fn runs at the default precision, got precision={precision}.")
  if module is not None:
    raise NotImplementedError(
        "attention_fn cannot sow attention weights (sow_weights=True): it never forms them whole.")
  if dtype is not None:
    query, key, value = (t.astype(dtype) for t in (query, key, value))
  if mask is not None:
    mask = mask.astype(bool)  # Flax's masks are nonzero where kept, float32 by default
  query, key, value = (checkpoint_name(t, names.QKV) for t in (query, key, value))
  return attention(query, key, value, mask=mask, is_causal=is_causal, implementation=impl,
                   chunk_size=chunk_size)


class MultiHeadDotProductAttention(nn.MultiHeadDotProductAttention):
  """`flax.linen.MultiHeadDotProductAttention` running `attention_fn`: no L×L residual.

  Same attributes, parameters and default names (``MultiHeadDotProductAttention_0``)
  as Flax's, so pretrained parameters load unchanged. No attention dropout
  and no ``sow_weights``.
  """
  attention_fn: Callable[..., jax.Array] = attention_fn


class MultiHeadAttention(nn.MultiHeadAttention):
  """`flax.linen.MultiHeadAttention` (default names ``MultiHeadAttention_0``) running `attention_fn`."""
  attention_fn: Callable[..., jax.Array] = attention_fn


class _MSNorm(nn.Module):
  epsilon: float = 1e-6
  dtype: Any = None
  param_dtype: Any = jnp.float32
  use_scale: bool = True
  impl: str | None = None
  _norm = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    used = {"scale": self.use_scale, "bias": getattr(self, "use_bias", False)}
    inits = {"scale": nn.initializers.ones, "bias": nn.initializers.zeros}
    affine = {name: self.param(name, inits[name], (x.shape[-1],), self.param_dtype)
              for name in ("scale", "bias") if used[name]}
    return type(self)._norm(x, **affine, eps=self.epsilon, dtype=self.dtype, impl=self.impl)


class MSLayerNorm(_MSNorm):
  """`flax.linen.LayerNorm` whose backward keeps only its output and 1/sigma.

  MS-BP (Yang et al., ICML 2024, arXiv:2406.16282). The same parameters as
  Flax's (``scale`` ``[features]``, ones, and ``bias``, zeros, in ``param_dtype``),
  trained as Flax's are, so pretrained ones load as they are. Without them
  (``use_scale=False, use_bias=False``) it is the paper's norm, whose pretrained
  affine `lowmem_jax.flax.affine_folding` folds into the next Dense.

  Attributes:
    epsilon: added to the variance.
    dtype: dtype of the output; give the dtype the next layer computes in.
      Defaults to the input's (Flax's promotes it with the parameters').
    param_dtype: the dtype of ``scale`` and ``bias``.
    use_scale, use_bias: whether the norm has them.
    impl: "xla", "pallas", "pallas_interpret" or "auto" (`lowmem_jax.ops.dispatch`);
      ``None`` reads ``$LOWMEM_JAX_IMPL``, else "auto".
  """
  use_bias: bool = True
  _norm = staticmethod(ms_layer_norm)


class MSRMSNorm(_MSNorm):
  """`flax.linen.RMSNorm` whose backward keeps only its output and 1/rms.

  MS-BP (Yang et al., ICML 2024, arXiv:2406.16282). The same parameter as
  Flax's (``scale`` ``[features]``, ones, in ``param_dtype``), trained as Flax's
  is. Without it (``use_scale=False``) it is the paper's norm, whose pretrained
  scale `lowmem_jax.flax.affine_folding` folds into the next Dense.

  Attributes:
    epsilon: added to the mean square.
    dtype: dtype of the output; give the dtype the next layer computes in.
      Defaults to the input's (Flax's promotes it with the parameter's).
    param_dtype: the dtype of ``scale``.
    use_scale: whether the norm has it.
    impl: "xla", "pallas", "pallas_interpret" or "auto" (`lowmem_jax.ops.dispatch`);
      ``None`` reads ``$LOWMEM_JAX_IMPL``, else "auto".
  """
  _norm = staticmethod(ms_rms_norm)


class Embed(nn.Embed):
  """`flax.linen.Embed` looking rows up with `lowmem_jax.ops.embedding.take`.

  The same attributes, parameter (``embedding``) and values, gradients bit for
  bit; the table-sized gradient buffer is made when the cotangent arrives,
  not at the start of the backward pass: for AdamA's micro-batch loop (a plain
  step is not helped; see `lowmem_jax.ops.embedding`).
  """

  def __call__(self, inputs: jax.Array) -> jax.Array:
    (embedding,) = self.promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
    if self.num_embeddings == 1 and jnp.issubdtype(inputs.dtype, jnp.integer):
      return jnp.broadcast_to(embedding, inputs.shape + (self.features,))  # as Flax's
    return take(embedding, inputs)


class SparseConv(nn.Module):
  """A convolution without bias whose kernel is stored sparse (`lowmem_jax.optim.sparse`).

  ``nn.Conv(features, kernel_size, strides, padding, use_bias=False)`` with the
  kernel ``[*kernel_size, in_features, features]`` kept as its
  ``nnz = round(density * size)`` active entries: the param ``kernel`` is
  ``param_dtype[nnz]``, initialised as ``kernel_init`` would the dense kernel's
  first ``nnz`` entries (i.i.d., so any ``nnz`` of them alike). Their flat
  positions are read from the ``"sparse"`` collection at the param's path
  (``{"sparse": lowmem_jax.optim.sparse.find_state(opt_state).positions}`` in
  ``apply``); the dense kernel is made by `lowmem_jax.optim.sparse.densify` at the
  call, so under `nn.remat` it is made again in the backward, not kept, and
  its gradient is gathered as the layer's backward runs
  (`lowmem_jax.optim.sparse.tie_gradients`: reverse-mode autodiff only).

  Attributes:
    features, kernel_size, strides, padding, dtype, param_dtype, kernel_init:
      as `flax.linen.Conv`'s.
    density: in (0, 1), the share of the kernel's entries stored.
    conv_general_dilated: the convolution, as `flax.linen.Conv`'s (e.g.
      `lowmem_jax.ops.compress.int8_conv`); None: `jax.lax.conv_general_dilated`.
  """
  features: int
  kernel_size: tuple[int, ...]
  density: float
  strides: int | tuple[int, ...] = 1
  padding: Any = "SAME"
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Callable = nn.initializers.lecun_normal()
  conv_general_dilated: Callable | None = None

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    if not (isinstance(self.density, float) and 0 < self.density < 1):
      raise ValueError(f"`density` must be a float in (0, 1), got {self.density!r}.")
    window = tuple(self.kernel_size)
    shape = (*window, inputs.shape[-1], self.features)
    nnz = max(1, round(self.density * math.prod(shape)))
    if nnz == math.prod(shape):
      raise ValueError(f"`density` {self.density} keeps all {nnz} entries of a {shape} kernel: "
                       "use nn.Conv, or a lower density.")
    values = self.param("kernel", lambda key: self.kernel_init(
        key, shape, self.param_dtype).reshape(-1)[:nnz])
    if self.has_variable("sparse", "kernel"):
      positions = self.get_variable("sparse", "kernel")
    elif self.is_initializing():  # shapes only: the positions are the optimizer's to draw
      positions = jnp.arange(nnz, dtype=jnp.int32)
    else:
      raise ValueError(f"{self.name}: no positions for the sparse kernel; apply the model with "
                       "{'params': ..., 'sparse': lowmem_jax.optim.sparse.find_state(opt_state)"
                       ".positions}.")
    inputs, values = tie_gradients(inputs, values)
    kernel = densify(values, positions, shape, after=inputs)
    inputs, kernel = nn.dtypes.promote_dtype(inputs, kernel, dtype=self.dtype)
    strides = (self.strides,) * len(window) if isinstance(self.strides, int) else self.strides
    conv = self.conv_general_dilated or jax.lax.conv_general_dilated
    spatial = "DHW"[-len(window):]
    return conv(inputs, kernel, strides, self.padding,
                dimension_numbers=(f"N{spatial}C", f"{spatial}IO", f"N{spatial}C"))
