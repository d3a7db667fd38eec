"""`lm.lowmem`'s loss head (`lowmem_jax.transform.loss`): each form of a linear layer's
cross-entropy rewritten as the fused loss, without the logits, against its exact twin; the
forms it leaves, and out-of-range labels."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from transform_checks import (KEY, LABELS, VOCAB, WIDTH, close, float_residuals, log_softmax_at,
                              normal)

import lowmem_jax as lm


LOSS_HEADS = {  # form: (per-token loss of (h, w, labels), w's shape)
    "log_softmax + take_along_axis": (lambda h, w, y: log_softmax_at(h @ w, y), (WIDTH, VOCAB)),
    "optax, integer labels": (lambda h, w, y: optax.softmax_cross_entropy_with_integer_labels(
        (h @ w).astype(jnp.float32), y), (WIDTH, VOCAB)),
    "optax, flattened tokens": (lambda h, w, y: optax.softmax_cross_entropy_with_integer_labels(
        (h @ w).reshape(-1, VOCAB), y.reshape(-1)).reshape(y.shape), (WIDTH, VOCAB)),
    "tied embedding": (lambda h, e, y: optax.softmax_cross_entropy_with_integer_labels(
        jnp.einsum("btd,vd->btv", h, e), y), (VOCAB, WIDTH)),
    "flax Dense with bias": (lambda h, w, y: log_softmax_at(nn.Dense(VOCAB).apply(
        {"params": {"kernel": w, "bias": jnp.linspace(-1.0, 1.0, VOCAB)}}, h), y),
        (WIDTH, VOCAB)),
}


@pytest.mark.parametrize("form", list(LOSS_HEADS))
def test_loss_head_rewritten_without_the_logits(form):
  per_token, w_shape = LOSS_HEADS[form]
  h, w = normal((2, 24, WIDTH)), normal(w_shape, key=jax.random.key(1), scale=0.3)
  loss = lambda h, w: jnp.mean(per_token(h, w, LABELS))
  fast = lm.lowmem(loss)
  rewrites = fast.explain(h, w)
  assert rewrites.counts == {"loss": 1} and "test_transform_loss.py" in rewrites[0].source
  close(jax.jit(fast)(h, w), jax.jit(loss)(h, w), 1e-5)
  close(*(jax.jit(jax.grad(f, (0, 1)))(h, w) for f in (fast, loss)), 1e-4)
  logits = [r for r in float_residuals(fast, h, w) if np.prod(r.shape) >= LABELS.size * VOCAB]
  assert not logits, logits
  assert [r for r in float_residuals(loss, h, w) if np.prod(r.shape) >= LABELS.size * VOCAB]


@pytest.mark.slow
def test_loss_head_labels_out_of_range_give_the_gathers_nan():
  h, w = normal((2, 24, WIDTH)), normal((WIDTH, VOCAB), key=jax.random.key(1), scale=0.3)
  labels = LABELS.at[0, 0].set(-1).at[0, 1].set(VOCAB).at[1, 0].set(-VOCAB - 3)
  per_token = lambda h, w: log_softmax_at(h @ w, labels)
  fast, plain = lm.lowmem(per_token)(h, w), per_token(h, w)
  assert lm.lowmem(per_token).explain(h, w).counts == {"loss": 1}
  np.testing.assert_array_equal(np.isnan(fast), np.isnan(plain))
  assert np.isnan(plain[0, 1]) and not np.isnan(plain[0, 0])  # -1 wraps to the last class
  close(jnp.nan_to_num(fast), jnp.nan_to_num(plain), 1e-5)
  kept = jnp.isfinite(plain)
  masked = lambda f: lambda h, w: jnp.sum(jnp.where(kept, f(h, w), 0.0))
  close(jax.grad(masked(lm.lowmem(per_token)), (0, 1))(h, w),
         jax.grad(masked(per_token), (0, 1))(h, w), 1e-4)
  # optax's form adds the NaN to the log-sum-exp, whose gradient stays
  optax_form = lambda h, w: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(h @ w, labels))
  assert np.isnan(lm.lowmem(optax_form)(h, w))
  close(jax.grad(lm.lowmem(optax_form), (0, 1))(h, w), jax.grad(optax_form, (0, 1))(h, w), 1e-4)


def _by_hand_without_keepdims(logits, labels):
  """A log-softmax whose max and log-sum-exp broadcast along the first axis (a user's bug)."""
  shifted = logits - jnp.max(logits, -1)[None, :]
  log_probs = shifted - jnp.log(jnp.sum(jnp.exp(shifted), -1))[None, :]
  return -jnp.take_along_axis(log_probs, labels[..., None], -1)[..., 0]


def test_loss_head_left_where_it_saves_nothing_or_the_logits_are_used():
  h, y = normal((2, 24, WIDTH)), LABELS % 8
  narrow = lambda h, w: jnp.mean(log_softmax_at(h @ w, y))
  rewrites = lm.lowmem(narrow).explain(h, normal((WIDTH, 8)))
  assert rewrites.counts == {} and "no wider" in rewrites[0].left
  w = normal((WIDTH, VOCAB))

  def reused(h, w):
    logits = h @ w
    return jnp.mean(log_softmax_at(logits, LABELS)) + jnp.mean(logits ** 2)
  rewrites = lm.lowmem(reused).explain(h, w)
  assert rewrites.counts == {} and "used elsewhere" in rewrites[0].left
  square = normal((VOCAB, WIDTH))  # as many tokens as classes: the shapes alone do not tell
  square_labels = jnp.arange(VOCAB)[::-1]
  shifted_by_column = lambda h, w: jnp.mean(_by_hand_without_keepdims(h @ w, square_labels))
  assert lm.lowmem(shifted_by_column).explain(square, w).counts == {}
  bias_by_row = lambda h, w: jnp.mean(log_softmax_at(
      h @ w + jnp.arange(VOCAB, dtype=jnp.float32).reshape(VOCAB, 1), square_labels))
  assert lm.lowmem(bias_by_row).explain(square, w).counts == {}
  int8 = lambda h, w: jnp.mean(log_softmax_at(jnp.matmul(
      h, w, preferred_element_type=jnp.float32), LABELS))
  rewrites = lm.lowmem(int8).explain(h.astype(jnp.int8), w.astype(jnp.int8))
  assert rewrites.counts == {} and "float32, bfloat16 and float16" in rewrites[0].left
  smoothed = lambda h, w: jnp.mean(optax.softmax_cross_entropy(
      h @ w, optax.smooth_labels(jax.nn.one_hot(LABELS, VOCAB), 0.1)))
  assert lm.lowmem(smoothed).explain(h, w).counts == {}
  assert lm.lowmem(lambda h, w: jnp.mean(log_softmax_at(h @ w, LABELS)),
                   loss=None).explain(h, w).counts == {}


@pytest.mark.slow
def test_llama_head_rewritten_as_the_fused_loss():
  wl = lm.models.workload("llama-100m", batch=1, seq=16, dtype=jnp.float32)
  wl = dataclasses.replace(wl, model=wl.model.clone(config=dataclasses.replace(
      wl.model.config, dim=32, n_layers=1, n_heads=2, ffn_dim=64, vocab_size=128)))
  params = wl.init(KEY)
  tokens, labels = wl.batch(jax.random.key(1))
  fast = lm.lowmem(wl.loss, activations=None)
  assert fast.explain(params, tokens, labels).counts == {"attention": 1, "norm": 3, "loss": 1}
  close(jax.jit(fast)(params, tokens, labels), jax.jit(wl.loss)(params, tokens, labels), 1e-5)
  close(*(jax.jit(jax.grad(f))(params, tokens, labels) for f in (fast, wl.loss)), 1e-4)
