"""`lowmem_jax.attention` with dropout on the probabilities: flax's draw, kept nowhere."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import attention as flax_attention
from jax.extend import core as jex_core

import lowmem_jax as lm

_RNG = jax.random.key(7)


def _qkv(b=2, lq=9, lk=9, h=4, hk=4, d=8):
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(kq, (b, lq, h, d)), jax.random.normal(kk, (b, lk, hk, d)),
          jax.random.normal(kv, (b, lk, hk, d)))


def _value_and_grads(f, *args):
  loss = lambda *a: jnp.sum(jnp.sin(f(*a)))
  return jax.jit(lambda *a: (f(*a), jax.grad(loss, tuple(range(len(a))))(*a)))(*args)


def _flax(q, k, v, rng=_RNG, rate=0.1, broadcast=True, mask=None, bias=None):
  """flax.linen's dot_product_attention in training, grouped heads repeated."""
  groups = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
  return flax_attention.dot_product_attention(
      q, k, v, bias=bias, mask=mask, dropout_rng=rng, dropout_rate=rate,
      broadcast_dropout=broadcast, deterministic=False)


@pytest.mark.parametrize("broadcast", [True, False])
@pytest.mark.parametrize("hk,chunk_size", [(4, 4), (2, 5), (1, 512)])
def test_dropout_is_flaxs_with_the_same_key(broadcast, hk, chunk_size):
  """Values and gradients equal flax's dot_product_attention, grouped heads too; chunks of
  4 and 5 divide neither length."""
  q, k, v = _qkv(hk=hk)
  ours = lambda q, k, v: lm.attention(q, k, v, dropout_rate=0.1, dropout_rng=_RNG,
                                      broadcast_dropout=broadcast, chunk_size=chunk_size)
  theirs = lambda q, k, v: _flax(q, k, v, broadcast=broadcast)
  chex.assert_trees_all_close(_value_and_grads(ours, q, k, v), _value_and_grads(theirs, q, k, v),
                              atol=1e-5)


def test_dropout_drops_and_another_key_drops_others():
  q, k, v = _qkv()
  plain = lm.attention(q, k, v)
  one = lm.attention(q, k, v, dropout_rate=0.5, dropout_rng=_RNG)
  other = lm.attention(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(8))
  assert np.abs(one - plain).max() > 0.1 and np.abs(one - other).max() > 0.1


def test_dropout_with_a_mask_and_a_bias_is_flaxs():
  q, k, v = _qkv(lq=7, lk=9)
  mask = jax.random.bernoulli(jax.random.key(3), 0.7, (2, 1, 7, 9)).at[..., 0].set(True)
  bias = jax.random.normal(jax.random.key(4), (1, 4, 7, 9))
  ours = lambda q, k, v, bias: lm.attention(q, k, v, bias, mask, dropout_rate=0.2,
                                            dropout_rng=_RNG, broadcast_dropout=False,
                                            chunk_size=4)
  theirs = lambda q, k, v, bias: _flax(q, k, v, rate=0.2, broadcast=False, mask=mask, bias=bias)
  chex.assert_trees_all_close(_value_and_grads(ours, q, k, v, bias),
                              _value_and_grads(theirs, q, k, v, bias), atol=1e-5)


@pytest.mark.parametrize("rng", [jax.random.PRNGKey(3), jax.random.key(3)])
def test_the_twin_drops_as_flax_does_for_raw_and_typed_keys(rng):
  q, k, v = _qkv(hk=2)
  ours = lambda q, k, v: lm.attention_reference(q, k, v, is_causal=True, dropout_rate=0.1,
                                                dropout_rng=rng, broadcast_dropout=False)
  theirs = lambda q, k, v: _flax(q, k, v, rng=rng, broadcast=False,
                                 mask=jnp.tril(jnp.ones((9, 9), bool)))
  chex.assert_trees_all_close(_value_and_grads(ours, q, k, v), _value_and_grads(theirs, q, k, v),
                              atol=1e-5)
  chex.assert_trees_all_close(
      lm.attention(q, k, v, is_causal=True, dropout_rate=0.1, dropout_rng=rng,
                   broadcast_dropout=False), ours(q, k, v), atol=1e-5)


def test_the_mask_is_drawn_again_in_the_backward_not_saved():
  """No [B, H, L, L] (or [L, L]) residual, only the key's two words; random bits drawn twice."""
  q, k, v = _qkv(lq=64, lk=64)
  f = lambda q, k, v: lm.attention(q, k, v, dropout_rate=0.1, dropout_rng=_RNG,
                                   broadcast_dropout=False, chunk_size=16)
  saved = lm.memory.saved_residuals(f, q, k, v)
  assert not [r for r in saved.rows if r.shape[-2:] == (64, 64)]
  assert [r.shape for r in saved.rows if r.dtype == np.uint32] == [(2,)]
  twin = lambda q, k, v: lm.attention_reference(q, k, v, dropout_rate=0.1, dropout_rng=_RNG,
                                                broadcast_dropout=False)
  assert [r for r in lm.memory.saved_residuals(twin, q, k, v).rows if r.shape[-2:] == (64, 64)]
  grad = jax.make_jaxpr(jax.grad(lambda q: f(q, k, v).sum()))(q)
  assert _draws(grad.jaxpr) == 2


def _draws(jaxpr) -> int:
  """``random_bits`` equations run by ``jaxpr``, each nested jaxpr counted where it is used
  (a printed jaxpr shows a sub-jaxpr used twice once, from jax 0.12)."""
  return sum((e.primitive.name == "random_bits")
             + sum(_draws(inner) for inner in jex_core.jaxprs_in_params(e.params))
             for e in jaxpr.eqns)


def test_bad_dropout_arguments_are_named():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="dropout_rate must be a Python float in \\[0, 1\\), got 1"):
    lm.attention(q, k, v, dropout_rate=1.0, dropout_rng=_RNG)
  with pytest.raises(ValueError, match="dropout_rng must be a key"):
    lm.attention(q, k, v, dropout_rate=0.1)
  with pytest.raises(NotImplementedError, match="no dropout under implementation='cudnn'"):
    lm.attention(q, k, v, dropout_rate=0.1, dropout_rng=_RNG, implementation="cudnn")
  chex.assert_trees_all_close(lm.attention(q, k, v, dropout_rate=0.0), lm.attention(q, k, v))
