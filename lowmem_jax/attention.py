"""Softmax attention with its probabilities tagged for remat policies.

`dot_product_attention` is plain scaled dot-product attention (Vaswani et al.
2017, arXiv:1706.03762): autodiff keeps its float32 ``[batch, heads, L, L]``
probabilities, tagged `names.ATTN_PROBS` so a policy can drop or keep them.
For a bfloat16 or float16 ``v`` it also keeps their cast for the second
matmul, untagged: a remat policy recomputes it from the probabilities. It
takes `jax.nn.dot_product_attention`'s layout, with grouped-query heads.

    p = softmax(q k^T / sqrt(head_dim) + mask)     (float32)
    out = p v,   d logits = p * (dp - sum(p * dp))  (from the saved p alone)
"""

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax import names
from lowmem_jax._checks import check_float_array


@jax.custom_vjp
def _softmax(logits: jax.Array) -> jax.Array:
  return jax.nn.softmax(logits, axis=-1)


def _softmax_fwd(logits):
  probs = checkpoint_name(jax.nn.softmax(logits, axis=-1), names.ATTN_PROBS)
  return probs, probs


def _softmax_bwd(probs, dprobs):
  return (probs * (dprobs - jnp.sum(probs * dprobs, axis=-1, keepdims=True)),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                          mask: jax.Array | None = None, causal: bool = False) -> jax.Array:
  """Scaled dot-product attention whose probabilities carry a checkpoint name.

  Args:
    q: ``[batch, q_length, heads, head_dim]``, float16/bfloat16/float32.
    k, v: ``[batch, kv_length, kv_heads, head_dim]`` in q's dtype; ``heads``
      must be a multiple of ``kv_heads`` (grouped-query attention).
    mask: optional boolean, broadcastable to ``[batch, heads, q_length,
      kv_length]``; False masks a key out.
    causal: mask keys after the query's position, aligned at the top left as
      in `jax.nn.dot_product_attention` (query i sees keys 0..i).

  Returns:
    ``[batch, q_length, heads, head_dim]`` in q's dtype. The logits and
    softmax are float32; the probabilities are saved as `names.ATTN_PROBS`
    and cast to v's dtype for the second matmul.

  The mask is an additive bias of -0.7 * float32 max: a row with every key
  masked attends uniformly (as `jax.nn.dot_product_attention` does), and its
  gradient flows as for uniform attention where JAX's gives zero.
  """
  for name, x in (("q", q), ("k", k), ("v", v)):
    check_float_array(x, name)
    if x.ndim != 4:
      raise ValueError(f"{name} must be [batch, length, heads, head_dim], got shape {x.shape}.")
  batch, q_len, heads, head_dim = q.shape
  if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
    raise ValueError(
        f"k and v must be [batch={batch}, kv_length, kv_heads, head_dim={head_dim}] "
        f"and alike, got k {k.shape} and v {v.shape}.")
  if k.dtype != q.dtype or v.dtype != q.dtype:
    raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
  kv_len, kv_heads = k.shape[1], k.shape[2]
  if heads % kv_heads:
    raise ValueError(f"q's heads ({heads}) must be a multiple of k's and v's heads ({kv_heads}).")
  groups = heads // kv_heads
  # Grouped heads split q's head axis; without groups q stays as it is, so
  # autodiff keeps q itself rather than a reshaped copy.
  if groups == 1:
    q_spec, p_spec = "bqhd", "bhqk"
  else:
    q_spec, p_spec = "bqhgd", "bhgqk"
    q = q.reshape(batch, q_len, kv_heads, groups, head_dim)
  logits = jnp.einsum(f"{q_spec},bkhd->{p_spec}", q, k, preferred_element_type=jnp.float32)
  logits = logits / jnp.float32(math.sqrt(head_dim))
  keep = _keep(mask, causal, (batch, heads, q_len, kv_len))
  if keep is not None:
    # An additive bias, not a select: its derivative needs no saved mask.
    bias = jnp.where(keep, 0.0, -0.7 * jnp.finfo(jnp.float32).max).astype(jnp.float32)
    logits = logits + bias.reshape(bias.shape[:1] + logits.shape[1:])
  probs = _softmax(logits).astype(v.dtype)
  out = jnp.einsum(f"{p_spec},bkhd->{q_spec}", probs, v, preferred_element_type=jnp.float32)
  return out.reshape(batch, q_len, heads, head_dim).astype(q.dtype)


def _keep(mask, causal, shape):
  """Boolean ``[batch or 1, heads, q_length, kv_length]`` of the kept keys, or None."""
  batch, heads, q_len, kv_len = shape
  keep = None
  if causal:
    keep = jnp.tril(jnp.ones((1, 1, q_len, kv_len), bool))
  if mask is not None:
    if not hasattr(mask, "dtype") or mask.dtype != jnp.bool_:
      raise TypeError(f"mask must be a boolean array, got {getattr(mask, 'dtype', type(mask))}.")
    try:
      if mask.ndim > 4:
        raise ValueError(f"rank {mask.ndim}")
      jnp.broadcast_shapes(mask.shape, shape)
    except ValueError as e:
      raise ValueError(
          f"mask must broadcast to [batch, heads, q_length, kv_length] = {shape}, "
          f"got shape {mask.shape}.") from e
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    keep = mask if keep is None else mask & keep
  if keep is None:
    return None
  return jnp.broadcast_to(keep, (keep.shape[0], heads, q_len, kv_len))
