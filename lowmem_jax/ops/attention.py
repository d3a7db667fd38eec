"""Scaled dot-product attention, with and without an L×L residual.

Both functions take `jax.nn.dot_product_attention`'s arguments, in its
order and under its names, and its layout, ``[batch, length, heads,
head_dim]``, with grouped-query heads; they compute

    s = scale * query key^T + bias, replaced by -0.7 * float32 max where masked
    p = softmax(s)    (float32),    out = p value

`attention` (the library's attention, exported as ``lowmem_jax.attention``)
keeps no L×L residual: its backward recomputes ``p`` chunk by chunk from
query, key, value and the float32 log-sum-exp of each row (Rabe & Staats
2021, arXiv:2112.05682; the backward of FlashAttention-2, Dao 2023,
arXiv:2307.08691). Its saved residuals are query, key, value, the mask and
bias as given (a ``[B, 1, 1, L]`` padding mask stays that size; for a causal
mask pass ``is_causal``), the output (`names.ATTN_OUT`) and the log-sum-exp
(`names.ATTN_LSE`). Dropout on the probabilities (``dropout_rate``,
``dropout_rng``, ``broadcast_dropout``: flax's names and draw) saves only the
key: the backward draws the keep-mask again from it, as FlashAttention does
(`attention_with_dropout` takes any function of a key that draws one, which
is how `lowmem_jax.lowmem` replays a model's own draw).

`attention_reference` is its exact twin, plain attention: autodiff keeps the
float32 probabilities, tagged `names.ATTN_PROBS`. Both name their output
`names.ATTN_OUT` themselves; a caller need not.

Both run under `jax.named_scope` (``lowmem/attention``,
``lowmem/attention_reference``), so the op names of memory reports and
profiles show them.

As in `jax.nn.dot_product_attention`, a row with every key masked attends
uniformly to all its keys: its output is the mean of value, and query, key
and the bias get no gradient through it. So does a row with every key
biased to -inf (NaN in `jax.nn`).

`attention`'s implementations (`IMPLS`, `lowmem_jax.ops.dispatch`'s vocabulary):
"xla" is the chunked `custom_vjp` here, any backend (not `jax.nn`'s "xla", which is
`attention_reference`). "cudnn" is `jax.nn.dot_product_attention(implementation=
"cudnn")`: NVIDIA GPU, float16 or bfloat16; it raises where cuDNN does not support the
call, e.g. a mask or bias that broadcasts along a length axis; cuDNN adds a mask as a
bias in query's dtype and does not treat -inf biases as masks. "auto" takes cuDNN on a
GPU where it accepts the call and both lengths are even (its training constraint with
a bias, which JAX's cuDNN rule sees under `jax.checkpoint` even without one; so a
one-token decoding step takes "xla" too), else "xla". "xla"'s transient memory,
forward and backward, beyond float32 accumulators of query's, key's and value's size,
is a few float32 arrays of ``[batch, heads, q_length, min(chunk_size, kv_length)]``.

Dropout on the probabilities (`attention`'s ``dropout_rate``): the keep-mask is flax's
draw, ``jax.random.bernoulli(dropout_rng, 1 - dropout_rate, shape)``, and the kept
probabilities are divided by ``1 - dropout_rate``, so the output equals
`flax.linen.dot_product_attention` (``deterministic=False``) with the same key. The
mask is drawn again in the backward from the key, not saved: once per call in the
forward and once in the backward it is a transient of 1 byte an element of ``shape``,
sliced per key chunk; drawing it takes what `jax.random.bernoulli` takes (on XLA:CPU
16 bytes an element of ``shape`` while it draws). Dropout always takes "xla".
"""

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax import _sharding, names
from lowmem_jax._checks import check_float_array
from lowmem_jax.ops import _layout, dispatch

IMPLS = ("auto", "xla", "cudnn")  # the implementations `attention` offers (`ops.dispatch`)
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # a masked logit (as jax.nn's)


@jax.named_scope("lowmem/attention")
def attention(query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None = None,
              mask: jax.Array | None = None, *, scale: float | None = None,
              is_causal: bool = False, query_seq_lengths: jax.Array | None = None,
              key_value_seq_lengths: jax.Array | None = None,
              local_window_size: int | tuple[int, int] | None = None,
              implementation: str | None = None, chunk_size: int = 512,
              dropout_rate: float = 0.0, dropout_rng: jax.Array | None = None,
              broadcast_dropout: bool = True) -> jax.Array:
  """Exact attention whose backward recomputes the probabilities.

  `jax.nn.dot_product_attention`'s arguments, less ``query_seq_lengths``,
  ``key_value_seq_lengths``, ``local_window_size`` and ``return_residual``
  (the first three raise where given), plus ``chunk_size`` and dropout on the
  probabilities under `flax.linen.dot_product_attention`'s names.

  Under "xla" the saved residuals are those of the module docstring: for causal attention
  pass ``is_causal=True``, not a mask, which would be an L×L one. cuDNN's carry no names.

  Args:
    query: ``[batch, q_length, heads, head_dim]``, float16/bfloat16/float32.
    key, value: ``[batch, kv_length, kv_heads, head_dim]`` in query's dtype;
      ``heads`` must be a multiple of ``kv_heads`` (grouped-query attention).
    bias: optional float array broadcastable to ``[batch, heads, q_length,
      kv_length]``, added to the scaled logits in float32; it gets a
      gradient, reduced to its own shape. A bias of -inf masks a key, as
      ``mask`` does.
    mask: optional boolean, broadcastable like ``bias``; False masks a key out.
    scale: the logits' factor, a Python number; ``None`` is ``1 / sqrt(head_dim)``.
    is_causal: mask keys after the query's position, aligned at the top left
      as in `jax.nn.dot_product_attention` (query i sees keys 0..i).
    implementation: "xla", "cudnn" or "auto" (`IMPLS`; module docstring); ``None`` reads
      ``$LOWMEM_JAX_IMPL`` where it names one of these, else is "auto".
    chunk_size: keys per chunk of the "xla" implementation (its transient memory: module
      docstring); a kv_length that is not a multiple is fine.
    dropout_rate: the probability of dropping a probability, a Python float in
      [0, 1); 0 is no dropout (flax's draw, drawn again in the backward: module docstring).
    dropout_rng: the key of the draw, needed where ``dropout_rate`` > 0.
    broadcast_dropout: as flax's: the mask's ``shape`` is ``[1, 1, q_length,
      kv_length]``, shared by the batch and heads; False draws ``[batch,
      heads, q_length, kv_length]``.

  Returns:
    ``[batch, q_length, heads, head_dim]`` in query's dtype. The logits,
    softmax and accumulation are float32; the probabilities are cast to
    value's dtype for the second matmul.

  Raises:
    NotImplementedError: the three unsupported arguments given, or dropout under "cudnn".
  """
  _check_qkv(query, key, value)
  _refuse_unsupported(query_seq_lengths=query_seq_lengths,
                      key_value_seq_lengths=key_value_seq_lengths,
                      local_window_size=local_window_size)
  shape = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
  mask = _check_mask(mask, shape)
  bias = _check_bias(bias, shape)
  scale = _check_scale(scale, query.shape[-1])
  impl, _ = dispatch.choose(implementation, "attention", IMPLS, argument="implementation")
  if not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
    raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")
  causal = bool(is_causal)
  drop = _check_dropout(dropout_rate, dropout_rng, broadcast_dropout, shape)
  if drop is not None:
    if impl == "cudnn":
      raise NotImplementedError("lowmem_jax.attention has no dropout under implementation="
                                "'cudnn'; pass implementation='xla'.")
    return attention_with_dropout(query, key, value, *drop, bias=bias, mask=mask, scale=scale,
                                  is_causal=causal, chunk_size=chunk_size)
  if impl == "cudnn":
    return _cudnn(query, key, value, mask, bias, scale, causal)
  # cuDNN refuses odd lengths with a bias in training, and only in the backward, too late
  # to fall back; under jax.checkpoint JAX's cuDNN rule sees a bias where none was given.
  odd = query.shape[1] % 2 or key.shape[1] % 2
  if impl == "auto" and dispatch.compiling_for() == "gpu" and not odd:
    try:
      return _cudnn(query, key, value, mask, bias, scale, causal)
    except (NotImplementedError, ValueError, RuntimeError):
      pass  # cuDNN's refusals: dtype, head size, mask shape; RuntimeError: no cuDNN (ROCm)
  return _chunked(query, key, value, mask, bias, (), scale, causal,
                  min(int(chunk_size), key.shape[1]), None)


@dataclasses.dataclass(frozen=True)
class Dropout:
  """Dropout on the probabilities: ``p * keep(*args) * factor`` (flax's ``factor`` is
  ``1 / (1 - rate)``).

  Attributes:
    keep: a function of the dropout's arrays that draws the boolean keep-mask,
      broadcastable to ``[batch, heads, q_length, kv_length]``; called once in
      the forward and once in the backward, so it must draw the same mask each
      time (a function of a key).
    factor: the kept probabilities' factor, a Python float.
  """
  keep: Callable[..., jax.Array]
  factor: float


def attention_with_dropout(query: jax.Array, key: jax.Array, value: jax.Array,
                           dropout: Dropout, dropout_args: tuple, *,
                           bias: jax.Array | None = None, mask: jax.Array | None = None,
                           scale: float | None = None, is_causal: bool = False,
                           chunk_size: int = 512) -> jax.Array:
  """`attention` ("xla") with ``dropout`` applied to the probabilities, its keep-mask
  drawn from ``dropout_args`` (e.g. ``(key,)``) in the forward and again in the backward.

  What `attention` runs for ``dropout_rate`` > 0, and what `lowmem_jax.lowmem`'s
  attention rewrite runs for a dropout the function draws itself. The
  arguments are `attention`'s; ``dropout_args`` get no gradient.
  """
  _check_qkv(query, key, value)
  shape = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
  mask = _check_mask(mask, shape)
  bias = _check_bias(bias, shape)
  scale = _check_scale(scale, query.shape[-1])
  if not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
    raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")
  # Typed keys travel as their uint32 data: a residual of a plain dtype, with no cotangent.
  impls = tuple(jax.random.key_impl(a) if _is_key(a) else None for a in dropout_args)
  raw = tuple(a if i is None else jax.random.key_data(a) for a, i in zip(dropout_args, impls))
  dropout = Dropout(functools.partial(_keep_of_data, dropout.keep, impls), dropout.factor)
  return _chunked(query, key, value, mask, bias, raw, scale, bool(is_causal),
                  min(int(chunk_size), key.shape[1]), dropout)


def _is_key(x):
  return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _keep_of_data(keep, impls, *raw):
  """``keep`` of the arguments ``raw``, each key among them (``impls``) wrapped again."""
  return keep(*(a if i is None else jax.random.wrap_key_data(a, impl=i)
                for a, i in zip(raw, impls)))


def _cudnn(q, k, v, mask, bias, scale, causal):
  out = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale,
                                     is_causal=causal, implementation="cudnn")
  dispatch.check_cudnn_compiles()  # after JAX's own refusals (dtype, head size, mask)
  return checkpoint_name(out, names.ATTN_OUT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _chunked(q, k, v, mask, bias, drop_args, scale, causal, chunk, dropout):
  return _chunked_fwd(q, k, v, mask, bias, drop_args, scale, causal, chunk, dropout)[0]


def _chunked_fwd(q, k, v, mask, bias, drop_args, scale, causal, chunk, dropout):
  """Online softmax over key chunks: a running max m, sum l and output acc per row."""
  qg = _grouped(q, k.shape[2])
  keep = _draw(dropout, drop_args)

  def step(i, carry):
    m, l, acc = carry
    start, kc, vc = _key_chunk(k, v, i, chunk)
    s = _chunk_logits(qg, kc, mask, bias, scale, causal, i, start, chunk, k.shape[1])
    m_new = jnp.maximum(m, s.max(-1))  # finite: each chunk has a key of its own
    p = jnp.exp(s - m_new[..., None])
    corr = jnp.exp(m - m_new)
    kept = _dropped(p, keep, dropout, start, chunk, k.shape[2])
    acc = acc * _per_row(corr) + jnp.einsum("bhgqk,bkhd->bqhgd", kept.astype(v.dtype), vc,
                                            preferred_element_type=jnp.float32)
    return jax.tree.map(_sharding.like, (m_new, l * corr + p.sum(-1), acc), carry)

  # The carries are made like q, so they take its sharding under explicit mesh axes too
  # (and keep it, whatever sharding of key, value, mask or bias a step reads); a row's are
  # [batch, kv_heads, groups, q_length].
  row = jnp.zeros_like(qg[..., 0], jnp.float32).transpose(0, 2, 3, 1)
  init = (jnp.full_like(row, -jnp.inf), row, jnp.zeros_like(qg, jnp.float32))
  m, l, acc = lax.fori_loop(0, _num_chunks(k.shape[1], chunk), step, init)
  # acc is laid out like q, so the output needs no transpose. The barrier
  # keeps XLA from fusing the division into each of out's users, which would
  # make a second output-sized array for the next layer and the backward.
  out, = _layout.barrier_rows((acc / _per_row(l)).reshape(q.shape).astype(q.dtype))
  out = checkpoint_name(out, names.ATTN_OUT)
  lse = checkpoint_name(m + jnp.log(l), names.ATTN_LSE)
  return out, (q, k, v, mask, bias, drop_args, out, lse)


def _draw(dropout, drop_args):
  """The whole keep-mask, rank 4, or None without dropout."""
  if dropout is None:
    return None
  keep = dropout.keep(*drop_args)
  return keep.reshape((1,) * (4 - keep.ndim) + keep.shape)


def _dropped(p, keep, dropout, start, chunk, kv_heads):
  """Chunk probabilities ``p`` ``[b, kv_heads, groups, q, chunk]`` with the dropout applied."""
  if dropout is None:
    return p
  keep_c = _grouped_heads(_slice_keys(keep, start, chunk), kv_heads)
  return jnp.where(keep_c, p * jnp.float32(dropout.factor), 0.0)


def _chunked_bwd(scale, causal, chunk, dropout, res, dout):
  """FlashAttention-2's backward: p = exp(s - lse) again, one key chunk at a time."""
  # Tying the residuals to the cotangent keeps XLA from computing the
  # probabilities again before this backward runs (they depend on residuals
  # only) or from merging them with the forward's: either keeps them alive.
  # The zero the gradients start from too: made before the cotangent, each layer's three
  # float32 accumulators were live from the first backward on (GPT-2 small: 36 of 24 MiB).
  q, k, v, mask, bias, drop_args, out, lse = res
  (q, k, v, mask, bias, drop_args, lse, zero), dout = lax.optimization_barrier(
      ((q, k, v, mask, bias, drop_args, lse, jnp.zeros((), jnp.float32)), dout))
  keep = _draw(dropout, drop_args)  # drawn again from the key, after the barrier
  kv_heads = k.shape[2]
  qg, dog = _grouped(q, kv_heads), _grouped(dout, kv_heads)
  # sum_k p * dp per row, from the output: D = rowsum(dout * out). A
  # product and a sum, not an einsum: a dot would ask XLA for out in another
  # layout, a copy that lives as long as out.
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  delta = delta.reshape(qg.shape[:-1]).transpose(0, 2, 3, 1)
  scale = jnp.float32(scale)
  # Only a mask or bias can mask a whole row (top-left causal never does).
  maskable = mask is not None or bias is not None

  def step(i, carry):
    dq, dk, dv, dbias = carry
    start, kc, vc = _key_chunk(k, v, i, chunk)
    s = _chunk_logits(qg, kc, mask, bias, scale, causal, i, start, chunk, k.shape[1])
    p = jnp.exp(s - lse[..., None])
    if maskable:
      # A row with every key masked attends uniformly; its log-sum-exp,
      # _MASKED + log(kv_length), rounds to _MASKED in float32.
      p = jnp.where((lse[..., None] <= 0.5 * _MASKED) & (s > -jnp.inf), 1 / k.shape[1], p)
    dv_c = jnp.einsum("bhgqk,bqhgd->bkhd", _dropped(p, keep, dropout, start, chunk, kv_heads)
                      .astype(v.dtype), dog, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", dog, vc, preferred_element_type=jnp.float32)
    dp = _dropped(dp, keep, dropout, start, chunk, kv_heads)  # d p, through the dropout
    ds = p * (dp - delta[..., None])  # d logits; d(q k^T) is ds * scale, applied to dq and dk
    if maskable:
      ds = jnp.where(s > _MASKED, ds, 0.0)  # a replaced logit passes no gradient back
    dq = dq + jnp.einsum("bhgqk,bkhd->bqhgd", ds.astype(q.dtype), kc,
                         preferred_element_type=jnp.float32)
    dk_c = scale * jnp.einsum("bhgqk,bqhgd->bkhd", ds.astype(q.dtype), qg,
                              preferred_element_type=jnp.float32)
    if bias is not None:
      dbias = _add_bias_grad(dbias, ds, bias.shape, start, chunk)
    # Chunks clamped at the end overlap the one before; p is zero on the
    # overlap, so adding (not writing) each chunk's gradient is exact.
    return jax.tree.map(_sharding.like,
                        (dq, _add_at(dk, dk_c, start), _add_at(dv, dv_c, start), dbias), carry)

  zeros = lambda x: None if x is None else _sharding.like(jnp.broadcast_to(zero, x.shape), x)
  init = (zeros(qg), zeros(k), zeros(v), zeros(bias))
  dq, dk, dv, dbias = lax.fori_loop(0, _num_chunks(k.shape[1], chunk), step, init)
  dbias = None if bias is None else dbias.astype(bias.dtype)
  dq = (scale * dq).reshape(q.shape).astype(q.dtype)
  drop_ct = jax.tree.map(lambda _: None, drop_args)
  return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, dbias, drop_ct


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def _num_chunks(kv_len, chunk):
  return -(-kv_len // chunk)


def _key_chunk(k, v, i, chunk):
  """Chunk i's start and keys and values, ``[batch, chunk, kv_heads, head_dim]``.

  The last chunk is clamped to end at kv_length, so it may overlap the one before.
  """
  start = jnp.minimum(i * chunk, k.shape[1] - chunk)
  return (start, lax.dynamic_slice_in_dim(k, start, chunk, axis=1),
          lax.dynamic_slice_in_dim(v, start, chunk, axis=1))


def _chunk_logits(qg, kc, mask, bias, scale, causal, i, start, chunk, kv_len):
  """Float32 ``[batch, kv_heads, groups, q_length, chunk]`` logits of chunk i.

  _MASKED where masked (or biased below it), -inf on keys of an earlier chunk.
  """
  q_len, kv_heads = qg.shape[1], qg.shape[2]
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, kc, preferred_element_type=jnp.float32)
  s = s * jnp.float32(scale)
  key_pos = start + jnp.arange(chunk)
  if bias is not None:  # laid out as q and k make s, however the bias is sharded
    biased = s + _grouped_heads(_slice_keys(bias, start, chunk), kv_heads).astype(jnp.float32)
    s = _sharding.like(jnp.maximum(biased, _MASKED), s)  # a key biased to -inf counts as masked
  keep = None if mask is None else _grouped_heads(_slice_keys(mask, start, chunk), kv_heads)
  if causal:
    below = (jnp.arange(q_len)[:, None] >= key_pos[None, :])[None, None, None]
    keep = below if keep is None else keep & below
  if keep is not None:
    s = jnp.where(keep, s, _MASKED)
  if kv_len % chunk:  # the last chunk is clamped and overlaps the one before
    s = jnp.where((key_pos >= i * chunk)[None, None, None, None], s, -jnp.inf)
  return s


def _per_row(x):
  """Per-row ``[batch, kv_heads, groups, q_length]`` as ``[batch, q_length, kv_heads, groups,
  1]``."""
  return x.transpose(0, 3, 1, 2)[..., None]


def _slice_keys(x, start, chunk):
  """A rank-4 mask or bias on chunk's keys (kept whole where its key axis broadcasts)."""
  return x if x.shape[-1] == 1 else lax.dynamic_slice_in_dim(x, start, chunk, axis=3)


def _grouped(x, kv_heads):
  """``[batch, length, heads, d]`` as ``[batch, length, kv_heads, groups, d]`` (a reshape)."""
  b, length, heads, d = x.shape
  return x.reshape(b, length, kv_heads, heads // kv_heads, d)


def _grouped_heads(x, kv_heads):
  """Rank-4 ``[b, heads or 1, q, k]`` as rank 5 ``[b, kv_heads or 1, groups or 1, q, k]``."""
  b, h, q, k = x.shape
  return x.reshape(b, 1, 1, q, k) if h == 1 else x.reshape(b, kv_heads, h // kv_heads, q, k)


def _add_bias_grad(dbias, ds, bias_shape, start, chunk):
  """Adds the chunk's float32 d logits, summed down to the bias's broadcast shape."""
  b, kv_heads, groups, q_len, _ = ds.shape
  ds = ds.reshape(b, kv_heads * groups, q_len, chunk)
  ds = jnp.sum(ds, axis=tuple(a for a in range(4) if bias_shape[a] == 1), keepdims=True)
  if bias_shape[3] == 1:
    return dbias + ds
  return _add_at(dbias, ds, start, axis=3)


def _add_at(x, update, start, axis=1):
  update = _sharding.like(update, x)
  return lax.dynamic_update_slice_in_dim(
      x, lax.dynamic_slice_in_dim(x, start, update.shape[axis], axis) + update, start, axis)


@jax.named_scope("lowmem/attention_reference")
def attention_reference(query: jax.Array, key: jax.Array, value: jax.Array,
                        bias: jax.Array | None = None, mask: jax.Array | None = None, *,
                        scale: float | None = None, is_causal: bool = False,
                        dropout_rate: float = 0.0, dropout_rng: jax.Array | None = None,
                        broadcast_dropout: bool = True) -> jax.Array:
  """Plain attention, the exact twin of `attention`: keeps the float32 probabilities.

  Args:
    query, key, value, bias, mask, scale, is_causal, dropout_rate, dropout_rng,
      broadcast_dropout: as in `attention`; autodiff keeps the dropout's mask.

  Returns:
    ``[batch, q_length, heads, head_dim]`` in query's dtype, named
    `names.ATTN_OUT`. The probabilities are saved as `names.ATTN_PROBS`
    (``[batch, heads, q_length, kv_length]``, float32); for a bfloat16 or
    float16 value autodiff also keeps their cast for the second matmul,
    untagged.
  """
  _check_qkv(query, key, value)
  batch, q_len, heads, head_dim = query.shape
  kv_len, kv_heads = key.shape[1], key.shape[2]
  mask = _check_mask(mask, (batch, heads, q_len, kv_len))
  bias = _check_bias(bias, (batch, heads, q_len, kv_len))
  scale = _check_scale(scale, head_dim)
  drop = _check_dropout(dropout_rate, dropout_rng, broadcast_dropout,
                        (batch, heads, q_len, kv_len))
  groups = heads // kv_heads
  # Grouped heads split query's head axis; without groups it stays as it is,
  # so autodiff keeps query itself rather than a reshaped copy.
  if groups == 1:
    q, q_spec, p_spec, per_head = query, "bqhd", "bhqk", lambda x: x
  else:
    q, q_spec, p_spec = _grouped(query, kv_heads), "bqhgd", "bhgqk"
    per_head = functools.partial(_grouped_heads, kv_heads=kv_heads)
  logits = jnp.einsum(f"{q_spec},bkhd->{p_spec}", q, key, preferred_element_type=jnp.float32)
  logits = logits * jnp.float32(scale)
  if bias is not None:
    logits = logits + per_head(bias).astype(jnp.float32)
  keep = mask
  if is_causal:
    below = jnp.tril(jnp.ones((1, 1, q_len, kv_len), bool))
    keep = below if keep is None else keep & below
  if keep is not None:
    # An additive bias, not a select: its derivative needs no saved mask.
    logits = logits + jnp.where(per_head(keep), 0.0, _MASKED).astype(jnp.float32)
  probs = _softmax(logits, keep is not None or bias is not None, bias is not None)
  if drop is not None:
    (dropout, args) = drop
    probs = jnp.where(per_head(_draw(dropout, args)), probs * jnp.float32(dropout.factor), 0.0)
  out = jnp.einsum(f"{p_spec},bkhd->{q_spec}", probs.astype(value.dtype), value,
                   preferred_element_type=jnp.float32)
  return checkpoint_name(out.reshape(query.shape).astype(query.dtype), names.ATTN_OUT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _softmax(logits: jax.Array, maskable: bool, floored: bool) -> jax.Array:
  """Softmax over the last axis; ``floored``: of the logits raised to at least _MASKED.

  A row whose every logit is masked (at or below 0.5 * _MASKED) attends
  uniformly and, where ``maskable``, passes no gradient back. Raising the
  logits needs no derivative of its own: it changes only probabilities that
  are zero, or rows that pass nothing back.
  """
  del maskable
  return jax.nn.softmax(_floored(logits, floored), axis=-1)


def _floored(logits, floored):
  return jnp.maximum(logits, _MASKED) if floored else logits


def _softmax_fwd(logits, maskable, floored):
  logits = _floored(logits, floored)
  # Made on the line that names them: memory reports match buffers to names by line.
  probs = checkpoint_name(jax.nn.softmax(logits, axis=-1), names.ATTN_PROBS)
  dead = jnp.max(logits, axis=-1, keepdims=True) <= 0.5 * _MASKED if maskable else None
  return probs, (probs, dead)


def _softmax_bwd(maskable, floored, res, dprobs):
  del floored
  probs, dead = res
  dlogits = probs * (dprobs - jnp.sum(probs * dprobs, axis=-1, keepdims=True))
  return (jnp.where(dead, 0.0, dlogits) if maskable else dlogits,)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def _check_qkv(query, key, value):
  for name, x in (("query", query), ("key", key), ("value", value)):
    check_float_array(x, name)
    if x.ndim != 4:
      hint = f"; add the batch axis, {name}[None]" if x.ndim == 3 else ""
      raise ValueError(
          f"{name} must be [batch, length, heads, head_dim], got shape {x.shape}{hint}.")
  batch, _, heads, head_dim = query.shape
  if key.shape != value.shape or key.shape[0] != batch or key.shape[3] != head_dim:
    raise ValueError(
        f"key and value must be [batch={batch}, kv_length, kv_heads, head_dim={head_dim}] "
        f"and alike, got key {key.shape} and value {value.shape}.")
  if key.dtype != query.dtype or value.dtype != query.dtype:
    raise TypeError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, "
                    f"{value.dtype}.")
  if key.shape[1] < 1:
    raise ValueError(f"key and value need at least one key, got kv_length {key.shape[1]}.")
  if heads % key.shape[2]:
    raise ValueError(f"query's heads ({heads}) must be a multiple of key's and value's heads "
                     f"({key.shape[2]}).")


def _refuse_unsupported(**options):
  """Raises for the options of `jax.nn.dot_product_attention` that `attention` lacks."""
  fixes = {
      "query_seq_lengths": "pass mask=(jnp.arange(q_length)[None, :] < query_seq_lengths[:, "
                           "None])[:, None, :, None] and zero the padded queries' outputs",
      "key_value_seq_lengths": "pass mask=(jnp.arange(kv_length)[None, :] < "
                               "key_value_seq_lengths[:, None])[:, None, None, :], a [batch, 1, "
                               "1, kv_length] mask",
      "local_window_size": "a window's mask would be [q_length, kv_length], an L×L residual",
  }
  for name, value in options.items():
    if value is not None:
      raise NotImplementedError(f"lowmem_jax.attention does not support {name}; {fixes[name]}.")


def _check_dropout(rate, rng, broadcast, shape):
  """``(Dropout, (rng,))`` for flax's dropout draw on probabilities of ``shape``; None
  where ``rate`` is 0."""
  if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0 <= rate < 1:
    raise ValueError(f"dropout_rate must be a Python float in [0, 1), got {rate!r}.")
  if rate == 0:
    return None
  if rng is None:
    raise ValueError(f"dropout_rng must be a key where dropout_rate > 0, got None "
                     f"(dropout_rate={rate!r}).")
  keep_prob = 1.0 - float(rate)
  draw = (1, 1) + shape[2:] if broadcast else shape
  return Dropout(functools.partial(_bernoulli, keep_prob, draw), 1 / keep_prob), (rng,)


def _bernoulli(keep_prob, shape, rng):
  return jax.random.bernoulli(rng, keep_prob, shape)


def _check_scale(scale, head_dim):
  """``scale`` as a Python float; ``1 / sqrt(head_dim)`` where it is None."""
  if scale is None:
    return 1 / math.sqrt(head_dim)
  if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
    raise TypeError(f"scale must be a finite Python number or None, got {scale!r}.")
  return float(scale)


def _check_mask(mask, shape):
  """A boolean ``mask`` that broadcasts to ``shape``, as rank 4; or None."""
  if mask is None:
    return None
  if getattr(mask, "dtype", None) != jnp.bool_:
    got = getattr(mask, "dtype", type(mask).__name__)
    raise TypeError(f"mask must be a boolean array, got {got}.")
  return _rank4(mask, "mask", shape)


def _check_bias(bias, shape):
  """A float ``bias`` that broadcasts to ``shape``, as rank 4; or None."""
  if bias is None:
    return None
  check_float_array(bias, "bias")
  return _rank4(bias, "bias", shape)


def _rank4(x, name, shape):
  """``x`` checked to broadcast to ``shape``, with leading axes of size 1 up to rank 4."""
  try:
    if x.ndim > 4:
      raise ValueError(f"rank {x.ndim}")
    jnp.broadcast_shapes(x.shape, shape)
  except ValueError as e:
    raise ValueError(
        f"{name} must broadcast to [batch, heads, q_length, kv_length] = {shape}, "
        f"got shape {x.shape}.") from e
  return x.reshape((1,) * (4 - x.ndim) + x.shape)
