"""`lm.lowmem`'s attention matcher on attention as Hugging Face's Flax GPT-2 writes it: a
causal mask from iotas, a padding mask, an additive bias, dropout on the probabilities."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen.attention import dot_product_attention_weights
from jax import lax

import lowmem_jax as lm

B, L, H, D, MAX_POSITIONS = 2, 16, 2, 8, 32
PADDING = jnp.ones((B, L), jnp.int32).at[1, -5:].set(0)  # right-padded: no row fully masked


def _qkv(n=3, heads=H):
  return [jax.random.normal(k, (B, L, heads, D)) for k in jax.random.split(jax.random.key(0), n)]


def _gpt2_bias(attention_mask):
  """FlaxGPT2Attention's bias: causal mask from iotas, sliced, and padding, combined."""
  causal = nn.make_causal_mask(jnp.ones((1, MAX_POSITIONS), bool), dtype=bool)[:, :, :L, :L]
  causal = jnp.broadcast_to(causal, (B,) + causal.shape[1:])
  mask = jnp.broadcast_to(jnp.expand_dims(attention_mask, axis=(-3, -2)), causal.shape)
  mask = nn.combine_masks(mask, causal)
  return lax.select(mask > 0, jnp.full(mask.shape, 0.0), jnp.full(mask.shape, -3.4e38))


def _by_hand_dropout(w, rng, rate):
  """`flax.linen.Dropout` as it writes the drop: ``select(keep, x / keep_prob, 0)``."""
  keep = jax.random.bernoulli(rng, 1.0 - rate, w.shape)
  return lax.select(keep, w / (1.0 - rate), jnp.zeros_like(w))


def _gpt2_attention(q, k, v, attention_mask, rng, dropout):
  bias = _gpt2_bias(attention_mask)
  if dropout == "flax weights":
    w = dot_product_attention_weights(q, k, bias=bias, dropout_rng=rng, dropout_rate=0.1)
  else:
    w = _by_hand_dropout(dot_product_attention_weights(q, k, bias=bias), rng, 0.1)
  return jnp.einsum("...hqk,...khd->...qhd", w, v)


def _value_and_grads(f, *args):
  return jax.jit(lambda *a: (f(*a), jax.grad(f, (0, 1, 2))(*a)))(*args)


def _square(r):
  return [row for row in r.rows if row.shape[-2:] == (L, L)]


@pytest.mark.standard_promotion("flax.linen.combine_masks: logical_and of int and bool")
@pytest.mark.parametrize("dropout", ["flax weights", "flax.linen.Dropout by hand"])
@pytest.mark.parametrize("rng", [jax.random.key(1), jax.random.PRNGKey(1)])
def test_gpt2_attention_with_dropout_and_masks_is_rewritten_exactly(dropout, rng):
  """Values and gradients equal the plain function with the same key; no [B, H, L, L]
  and no [B, 1, L, L] residual: the causal part is is_causal, the padding [B, 1, 1, L]."""
  q, k, v = _qkv()
  loss = lambda q, k, v: jnp.sum(_gpt2_attention(q, k, v, PADDING, rng, dropout) ** 2)
  fast = lm.lowmem(loss)
  rewrites = fast.explain(q, k, v)
  assert rewrites.counts == {"attention": 1}
  assert rewrites[0].op == "lm.attention (causal)"
  chex.assert_trees_all_close(_value_and_grads(fast, q, k, v), _value_and_grads(loss, q, k, v),
                              atol=1e-5, rtol=1e-5)
  saved = lm.memory.saved_residuals(fast, q, k, v)
  assert not _square(saved), _square(saved)
  assert [r.shape for r in saved.rows if r.dtype == jnp.bool_] == [(B, 1, 1, L)]
  assert _square(lm.memory.saved_residuals(loss, q, k, v))  # the plain one keeps them
  undropped = lambda q, k, v: jnp.sum(jnp.einsum(
      "...hqk,...khd->...qhd", dot_product_attention_weights(q, k, bias=_gpt2_bias(PADDING)),
      v) ** 2)
  assert abs(float(fast(q, k, v)) - float(undropped(q, k, v))) > 1e-2  # it does drop


def _bert_attention(q, k, v, head_mask, rng, form):
  """FlaxBertSelfAttention's: a padding bias, dropout on the probabilities (``rng`` None:
  none), then Hugging Face's head mask on them, as its einsum or as a broadcast product."""
  padding = jnp.expand_dims(PADDING, axis=(-3, -2))
  bias = lax.select(padding > 0, jnp.full(padding.shape, 0.0),
                    jnp.full(padding.shape, jnp.finfo(jnp.float32).min))
  w = dot_product_attention_weights(q, k, bias=bias, dropout_rng=rng, dropout_rate=0.1,
                                    broadcast_dropout=True, deterministic=rng is None)
  if form == "einsum":
    w = jnp.einsum("...hqk,h->...hqk", w, head_mask)
  else:
    w = w * head_mask[None, :, None, None]
  return jnp.einsum("...hqk,...khd->...qhd", w, v)


@pytest.mark.parametrize("form", ["einsum", "broadcast"])
@pytest.mark.parametrize("rng", [None, jax.random.key(5)], ids=["no dropout", "dropout"])
@pytest.mark.parametrize("head_mask", [[1.0] * 4, [1.0, 0.0, 0.5, 1.0]], ids=["ones", "mask"])
def test_a_head_mask_on_the_probabilities_multiplies_the_output_exactly(head_mask, rng, form):
  """``(p * m_h) @ v == m_h * (p @ v)``: values and gradients, the head mask's too, are the
  plain function's; no [B, H, L, L] residual."""
  q, k, v = _qkv(heads=4)
  head_mask = jnp.array(head_mask)
  loss = lambda q, k, v, m: jnp.sum(_bert_attention(q, k, v, m, rng, form) ** 2)
  fast = lm.lowmem(loss)
  assert [r.op for r in fast.explain(q, k, v, head_mask)] == ["lm.attention"]
  both = lambda f: jax.jit(lambda *a: (f(*a), jax.grad(f, (0, 1, 2, 3))(*a)))(q, k, v, head_mask)
  chex.assert_trees_all_close(both(fast), both(loss), atol=1e-5, rtol=1e-5)
  assert not _square(lm.memory.saved_residuals(fast, q, k, v, head_mask))
  assert _square(lm.memory.saved_residuals(loss, q, k, v, head_mask))


@pytest.mark.standard_promotion("flax.linen.combine_masks: logical_and of int and bool")
def test_two_layers_with_split_keys_give_two_attentions():
  q, k, v = _qkv()
  padding = PADDING

  def loss(q, k, v, rng):
    x = q
    for layer_rng in jax.random.split(rng, 2):
      x = _gpt2_attention(x, k, v, padding, layer_rng, "flax weights")
    return jnp.sum(x ** 2)

  rng = jax.random.key(3)
  fast = lm.lowmem(loss)
  assert fast.explain(q, k, v, rng).counts == {"attention": 2}
  chex.assert_trees_all_close(_value_and_grads(fast, q, k, v, rng),
                              _value_and_grads(loss, q, k, v, rng), atol=1e-5, rtol=1e-5)
  assert not _square(lm.memory.saved_residuals(lambda q, k, v: fast(q, k, v, rng), q, k, v))


@pytest.mark.parametrize("causal", [
    lambda: jnp.tril(jnp.ones((L, L), bool)),
    lambda: jnp.arange(L)[:, None] >= jnp.arange(L)[None, :]])
def test_a_causal_mask_made_in_the_function_becomes_is_causal(causal):
  q, k, v = _qkv()
  loss = lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(q, k, v, mask=causal()) ** 2)
  fast = lm.lowmem(loss)
  assert [r.op for r in fast.explain(q, k, v)] == ["lm.attention (causal)"]
  chex.assert_trees_all_close(_value_and_grads(fast, q, k, v), _value_and_grads(loss, q, k, v),
                              atol=1e-5, rtol=1e-5)
  saved = lm.memory.saved_residuals(fast, q, k, v)
  assert not [r for r in saved.rows if r.dtype == jnp.bool_], saved


def test_a_constant_mask_that_is_not_causal_is_kept_as_given():
  q, k, v = _qkv()
  band = lambda: jnp.abs(jnp.arange(L)[:, None] - jnp.arange(L)[None, :]) <= 2
  loss = lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(q, k, v, mask=band()) ** 2)
  fast = lm.lowmem(loss)
  assert [r.op for r in fast.explain(q, k, v)] == ["lm.attention"]
  chex.assert_trees_all_close(_value_and_grads(fast, q, k, v), _value_and_grads(loss, q, k, v),
                              atol=1e-5, rtol=1e-5)


def test_a_mask_given_as_an_argument_is_kept_once_as_given():
  """A [B, 1, L, L] argument cannot be seen to be causal at trace time: the op keeps the
  argument itself, no copy of it."""
  q, k, v = _qkv()
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((L, L), bool)), (B, 1, L, L))
  loss = lambda q, k, v, mask: jnp.sum(jax.nn.dot_product_attention(q, k, v, mask=mask) ** 2)
  fast = lm.lowmem(loss)
  assert [r.op for r in fast.explain(q, k, v, mask)] == ["lm.attention"]
  saved = lm.memory.saved_residuals(lambda q, k, v: fast(q, k, v, mask), q, k, v)
  assert not [r for r in _square(saved) if not r.is_argument], saved


def test_dropout_not_made_from_random_bits_is_left_naming_the_op_and_line():
  q, k, v = _qkv()
  w = jax.random.uniform(jax.random.key(2), (B, H, L, L))

  def loss(q, k, v, w):
    p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), -1)
    return jnp.sum(jnp.einsum("bhqk,bkhd->bqhd", p * w, v) ** 2)

  rewrites = lm.lowmem(loss).explain(q, k, v, w)
  assert rewrites.counts == {}
  reason = rewrites[0].left
  assert "the probabilities feed something other than one matmul" in reason
  assert "feed mul (test_transform_attention_patterns.py:" in reason, reason


def test_scores_through_an_unknown_op_are_left_naming_it():
  q, k, v = _qkv()

  def loss(q, k, v):
    s = jnp.tanh(jnp.einsum("bqhd,bkhd->bhqk", q, k))
    return jnp.sum(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v) ** 2)

  reason = lm.lowmem(loss).explain(q, k, v)[0].left
  assert reason.startswith("the scores pass through tanh (test_transform_attention_patterns.py:")


def test_a_dropout_key_used_elsewhere_is_no_obstacle_and_its_mask_used_elsewhere_is_named():
  q, k, v = _qkv()
  rng = jax.random.key(4)

  def loss(q, k, v, returned):
    w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), -1)
    keep = jax.random.bernoulli(rng, 0.9, w.shape)
    out = jnp.einsum("bhqk,bkhd->bqhd", jnp.where(keep, w / 0.9, 0.0), v)
    extra = jnp.sum(keep.astype(jnp.float32)) if returned else jax.random.normal(rng, ())
    return jnp.sum(out ** 2) + extra

  kept = lm.lowmem(lambda q, k, v: loss(q, k, v, False)).explain(q, k, v)
  assert kept.counts == {"attention": 1}
  left = lm.lowmem(lambda q, k, v: loss(q, k, v, True)).explain(q, k, v)
  assert left.counts == {} and "used elsewhere: by " in left[0].left, left[0].left
  np.testing.assert_allclose(
      lm.lowmem(lambda q, k, v: loss(q, k, v, False))(q, k, v), loss(q, k, v, False), rtol=1e-5)


@pytest.mark.standard_promotion("transformers' FlaxGPT2LMHeadModel")
def test_hugging_faces_flax_gpt2_in_training_keeps_no_square_array():
  """A 2-layer FlaxGPT2LMHeadModel, attn_pdrop 0.1, right-padded: both attentions become
  causal `lm.attention` with its dropout; values and gradients are the model's."""
  transformers = pytest.importorskip("transformers")
  with jax.numpy_rank_promotion("allow"):  # the model adds [1, 1, n] to [n]
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64,
                                     vocab_size=50)
    model = transformers.FlaxGPT2LMHeadModel(config, seed=0)
    ids = jax.random.randint(jax.random.key(0), (B, L), 0, 50)

    def loss(params, rng):
      logits = model(ids, attention_mask=PADDING, params=params, dropout_rng=rng,
                     train=True).logits
      return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
          logits, ids[..., None], -1)[..., 0])

    rng = jax.random.key(1)
    fast = lm.lowmem(loss, activations=None, norms=None, loss=None)  # attention alone: exact
    rewrites = fast.explain(model.params, rng)
    assert [r.op for r in rewrites if r.kind == "attention"] == [
        "lm.attention + output projection on its layout (causal)"] * 2
    chex.assert_trees_all_close(jax.jit(jax.value_and_grad(fast))(model.params, rng),
                                jax.jit(jax.value_and_grad(loss))(model.params, rng),
                                atol=1e-5, rtol=1e-5)
    assert not _square(lm.memory.saved_residuals(lambda p: fast(p, rng), model.params))
    assert _square(lm.memory.saved_residuals(lambda p: loss(p, rng), model.params))


def _grouped_with_dropout(q, k, v, rng):
  """Grouped-query attention by hand, a keep-mask per group head, ``jnp.where`` dropout."""
  b, t, n, d = q.shape
  kv_heads = k.shape[2]
  s = jnp.einsum("btkgd,bskd->bkgts", q.reshape(b, t, kv_heads, n // kv_heads, d), k)
  p = jax.nn.softmax(s * d ** -0.5, -1)
  p = jnp.where(jax.random.bernoulli(rng, 0.8, p.shape), p / 0.8, 0.0)
  return jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(b, t, n, d)


def test_grouped_query_attention_with_dropout_is_rewritten_exactly():
  q = jax.random.normal(jax.random.key(5), (B, L, 4, D))
  k, v = _qkv(2)
  rng = jax.random.key(6)
  loss = lambda q, k, v: jnp.sum(_grouped_with_dropout(q, k, v, rng) ** 2)
  fast = lm.lowmem(loss)
  assert fast.explain(q, k, v).counts == {"attention": 1}
  chex.assert_trees_all_close(_value_and_grads(fast, q, k, v), _value_and_grads(loss, q, k, v),
                              atol=1e-5, rtol=1e-5)
  assert not _square(lm.memory.saved_residuals(fast, q, k, v))


def test_probabilities_used_twice_are_left_naming_both_uses():
  q, k, v = _qkv()

  def loss(q, k, v):
    p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), -1)
    return jnp.sum(jnp.einsum("bhqk,bkhd->bqhd", p, v) ** 2) + jnp.sum(jnp.log(p))

  reason = lm.lowmem(loss).explain(q, k, v)[0].left
  assert "they feed dot_general (test_transform_attention_patterns.py:" in reason, reason
  assert ", log (test_transform_attention_patterns.py:" in reason, reason


def test_linen_multi_head_attention_with_dropout_is_rewritten_exactly():
  """flax.linen's MultiHeadDotProductAttention in training (broadcast dropout, its default)."""
  x = jax.random.normal(jax.random.key(7), (B, L, 32))
  module = nn.MultiHeadDotProductAttention(num_heads=4, dropout_rate=0.1, deterministic=False)
  params = module.init({"params": jax.random.key(8), "dropout": jax.random.key(9)}, x)
  loss = lambda params, x: jnp.sum(module.apply(
      params, x, rngs={"dropout": jax.random.key(10)}) ** 2)
  fast = lm.lowmem(loss)
  assert fast.explain(params, x).counts == {"attention": 1}
  grads = [jax.jit(jax.value_and_grad(f, (0, 1)))(params, x) for f in (fast, loss)]
  chex.assert_trees_all_close(*grads, atol=1e-4, rtol=1e-5)
  assert not _square(lm.memory.saved_residuals(fast, params, x))
