import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowmem_jax as lm
from lowmem_jax.attention import dot_product_attention


def _qkv(dtype=jnp.float32, b=2, lq=5, lk=5, h=4, hk=4, d=8):
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(kq, (b, lq, h, d), dtype), jax.random.normal(kk, (b, lk, hk, d), dtype),
          jax.random.normal(kv, (b, lk, hk, d), dtype))


@pytest.mark.parametrize("hk", [4, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_matches_jax_attention_and_its_gradient(hk, causal, with_mask):
  q, k, v = _qkv(hk=hk)
  mask = jax.random.bernoulli(jax.random.key(3), 0.7, (2, 1, 5, 5)).at[..., 0].set(True) if with_mask else None
  ours = lambda q, k, v: dot_product_attention(q, k, v, mask=mask, causal=causal)
  theirs = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal)
  chex.assert_trees_all_close(ours(q, k, v), theirs(q, k, v), atol=1e-5)
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
  chex.assert_trees_all_close(jax.grad(loss(ours), (0, 1, 2))(q, k, v),
                              jax.grad(loss(theirs), (0, 1, 2))(q, k, v), atol=1e-5)


@pytest.mark.parametrize("lq,lk", [(3, 5), (5, 3)])
def test_causal_with_unequal_lengths_aligns_like_jax(lq, lk):
  q, k, v = _qkv(lq=lq, lk=lk)
  chex.assert_trees_all_close(dot_product_attention(q, k, v, causal=True),
                              jax.nn.dot_product_attention(q, k, v, is_causal=True), atol=1e-5)


def test_bfloat16_keeps_dtype_and_stays_close():
  q, k, v = _qkv(jnp.bfloat16)
  out = dot_product_attention(q, k, v, causal=True)
  assert out.dtype == jnp.bfloat16
  ref = jax.nn.dot_product_attention(*(t.astype(jnp.float32) for t in (q, k, v)), is_causal=True)
  np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=3e-2)


def test_the_probabilities_are_the_one_named_square_residual():
  q, k, v = _qkv(lq=16, lk=16)
  saved = lm.memory.saved_residuals(lambda q, k, v: dot_product_attention(q, k, v, causal=True), q, k, v)
  square = [r for r in saved.rows if r.shape[-2:] == (16, 16)]
  assert [r.name for r in square] == [lm.names.ATTN_PROBS]
  assert square[0].dtype == jnp.float32


def test_bad_inputs_are_named():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="q must be"):
    dot_product_attention(q[0], k, v)
  with pytest.raises(ValueError, match="multiple"):
    dot_product_attention(q, *_qkv(hk=3)[1:])
  with pytest.raises(ValueError, match="k and v"):
    dot_product_attention(q, k, v[:, :3])
  with pytest.raises(TypeError, match="share a dtype"):
    dot_product_attention(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
  with pytest.raises(TypeError, match="mask must be"):
    dot_product_attention(q, k, v, mask=jnp.ones((5, 5)))
  with pytest.raises(ValueError, match="mask must broadcast"):
    dot_product_attention(q, k, v, mask=jnp.ones((3, 5), bool))
  with pytest.raises(ValueError, match="mask must broadcast"):
    dot_product_attention(q, k, v, mask=jnp.ones((1, 2, 4, 5, 5), bool))


def test_flax_attention_fn_keeps_the_param_layout():
  import flax.linen as nn
  x = jax.random.normal(jax.random.key(0), (2, 6, 16))
  plain = nn.MultiHeadDotProductAttention(num_heads=4)
  ours = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=lm.linen.attention_fn)
  params = plain.init(jax.random.key(1), x, x)
  chex.assert_trees_all_close(ours.apply(params, x, x), plain.apply(params, x, x), atol=1e-5)
  with pytest.raises(NotImplementedError, match="dropout"):
    lm.linen.attention_fn(*_qkv(), dropout_rate=0.1, deterministic=False)
