"""`lm.lowmem` on models as Hugging Face writes them (issue 37): a plain-JAX GPT-2 written
the way ``FlaxGPT2LMHeadModel`` is (benchmarks/hf_style_gpt2.py), and transformers' own
Flax GPT-2 and BERT (small configs, random weights, dropout on), each against its plain
gradient (the default rewrites are exact) and with no ``[B, L, vocab]``, ``[B, 1, L, L]``
or ``[B, H, L, L]`` array among autodiff's residuals."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
import transformers

import hf_style_gpt2  # benchmarks/, on sys.path in conftest.py
import lowmem_jax as lm
from third_party_promotion import TRANSFORMERS_FLAX

pytestmark = pytest.mark.slow

B, L, H, VOCAB, LAYERS = 2, 32, 4, 512, 2


def _tokens_and_mask():
  tokens = jax.random.randint(jax.random.key(1), (B, L), 0, VOCAB)
  return tokens, jnp.ones((B, L), jnp.int32).at[1, L - 5:].set(0)  # the second one padded


@pytest.fixture(autouse=True)
def _rank_promotion():
  """Hugging Face's models add ``[D]`` biases to ``[B, L, D]`` arrays by NumPy's rank
  promotion (``FlaxConv1D``, ``FlaxBertSelfAttention``), and so does the model written as
  they write it; conftest.py's "raise" is for the project's own code."""
  with jax.numpy_rank_promotion("allow"):
    yield


def _check(fn, *args, counts):
  """``lm.lowmem(fn)``'s rewrites are ``counts``, its loss and gradient are ``fn``'s, and no
  logits- or scores-sized array is among its residuals."""
  fast = lm.lowmem(fn)
  rewrites = fast.explain(*args)
  assert rewrites.counts == counts, rewrites
  assert rewrites.exact and all(r.source != "?" for r in rewrites), rewrites
  got, want = (jax.jit(jax.value_and_grad(f))(*args) for f in (fast, fn))
  chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)
  shapes = [r.shape for r in lm.memory.saved_residuals(fast, *args).rows if not r.is_argument]
  big = [s for s in shapes if (s[-1:] == (VOCAB,) and len(s) > 1) or s[-2:] == (L, L)]
  assert not big, big


def test_plain_jax_gpt2_written_as_hugging_face_writes_it():
  params = hf_style_gpt2.init(jax.random.key(0), layers=LAYERS, dim=64, heads=H, vocab=VOCAB,
                              positions=64)
  fn = lambda *a: hf_style_gpt2.loss(*a, heads=H)
  _check(fn, params, *_tokens_and_mask(), jax.random.key(2),
         counts={"loss": 1, "attention": LAYERS, "layout": LAYERS, "norm": 2 * LAYERS + 1,
                 "activation": LAYERS})


@TRANSFORMERS_FLAX
def test_transformers_flax_gpt2_lm_head_model_shifted_after_the_head():
  config = transformers.GPT2Config(n_layer=LAYERS, n_embd=64, n_head=H, vocab_size=VOCAB,
                                   n_positions=64)
  model = transformers.FlaxGPT2LMHeadModel(config, seed=0)

  def loss(params, tokens, mask, rng):
    logits = model(tokens, attention_mask=mask, params=params, dropout_rng=rng, train=True).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

  _check(loss, model.params, *_tokens_and_mask(), jax.random.key(2),
         counts={"loss": 1, "attention": LAYERS, "layout": LAYERS, "norm": 2 * LAYERS + 1,
                 "activation": LAYERS})


@TRANSFORMERS_FLAX
def test_transformers_flax_bert_masked_lm_with_padding():
  config = transformers.BertConfig(num_hidden_layers=LAYERS, hidden_size=64,
                                   num_attention_heads=H, intermediate_size=128,
                                   vocab_size=VOCAB, max_position_embeddings=64)
  model = transformers.FlaxBertForMaskedLM(config, seed=0)

  def loss(params, tokens, mask, rng):
    logits = model(tokens, attention_mask=mask, params=params, dropout_rng=rng, train=True).logits
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
    return jnp.sum(per_token * mask) / jnp.sum(mask)

  # the norms: the embeddings', two a layer, the prediction head's transform
  _check(loss, model.params, *_tokens_and_mask(), jax.random.key(2),
         counts={"loss": 1, "attention": LAYERS, "layout": LAYERS, "norm": 2 * LAYERS + 2,
                 "activation": LAYERS + 1})
