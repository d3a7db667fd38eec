import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowmem_jax as lm
from lowmem_jax import models
from lowmem_jax.models import bert
from third_party_promotion import FLAX_NORM

TINY = bert.BertConfig(vocab_size=50, dim=16, n_layers=2, n_heads=2, ffn_dim=32, max_len=12)
TOKENS = jnp.arange(20, dtype=jnp.int32).reshape(2, 10) % 50
MASK = jnp.array([[True] * 10, [True] * 6 + [False] * 4])


def _hf_tensors(config, seed=0):
  """Random tensors under Hugging Face's BertModel names, norm affines away from (1, 0)."""
  rng = np.random.default_rng(seed)
  d, f = config.dim, config.ffn_dim
  shapes = {"embeddings.word_embeddings.weight": (config.vocab_size, d),
            "embeddings.position_embeddings.weight": (config.max_len, d),
            "embeddings.token_type_embeddings.weight": (config.type_vocab_size, d),
            "embeddings.LayerNorm.weight": (d,), "embeddings.LayerNorm.bias": (d,)}
  for i in range(config.n_layers):
    p = f"encoder.layer.{i}."
    for name, (n_out, n_in) in {"attention.self.query": (d, d), "attention.self.key": (d, d),
                                "attention.self.value": (d, d), "attention.output.dense": (d, d),
                                "intermediate.dense": (f, d), "output.dense": (d, f)}.items():
      shapes[p + name + ".weight"], shapes[p + name + ".bias"] = (n_out, n_in), (n_out,)
    for name in ("attention.output.LayerNorm", "output.LayerNorm"):
      shapes[p + name + ".weight"], shapes[p + name + ".bias"] = (d,), (d,)
  tensors = {k: (0.3 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
  for k in tensors:
    if "LayerNorm.weight" in k:
      tensors[k] += 1.0
  return tensors


def test_from_hf_matches_a_numpy_forward():
  import finetune_minilm  # examples/: its plain NumPy BERT under Hugging Face's names
  tensors = _hf_tensors(TINY)
  params = bert.from_hf({"bert." + k: v for k, v in tensors.items()}, TINY)
  model = bert.Bert(TINY)
  assert jax.tree.structure(params) == jax.tree.structure(
      model.init(jax.random.key(0), TOKENS, MASK)["params"])
  got = bert.mean_pool(model.apply({"params": params}, TOKENS, MASK), MASK)
  got = got / jnp.linalg.norm(got, axis=-1, keepdims=True)
  want = finetune_minilm.numpy_embeddings(tensors, TINY, np.asarray(TOKENS), np.asarray(MASK))
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["plain", "recompute"])
def test_ms_norms_take_the_same_params_and_give_the_same_function_and_gradient(attention):
  """Post-LN MS-LayerNorm with its scale and bias kept: the plain model's exact twin."""
  params = bert.from_hf(_hf_tensors(TINY), TINY)
  plain, ms = bert.Bert(TINY), bert.Bert(TINY, norm="ms", attention=attention)
  assert jax.tree.structure(params) == jax.tree.structure(
      ms.init(jax.random.key(0), TOKENS, MASK)["params"])
  chex.assert_trees_all_close(ms.apply({"params": params}, TOKENS, MASK),
                              plain.apply({"params": params}, TOKENS, MASK), atol=1e-5)
  loss = lambda model, p: jnp.sum(model.apply({"params": p}, TOKENS, MASK)[..., :3] ** 2)
  chex.assert_trees_all_close(jax.grad(lambda p: loss(ms, p))(params),
                              jax.grad(lambda p: loss(plain, p))(params), atol=1e-4, rtol=1e-4)


def test_approx_gelu_is_the_same_forward_and_a_near_gradient():
  params = bert.from_hf(_hf_tensors(TINY), TINY)
  exact, approx = bert.Bert(TINY), bert.Bert(TINY, activation="approx", remat=True)
  chex.assert_trees_all_close(approx.apply({"params": params}, TOKENS, MASK),
                              exact.apply({"params": params}, TOKENS, MASK), atol=1e-5)
  def grads(model):
    loss = lambda p: jnp.sum(model.apply({"params": p}, TOKENS, MASK)[..., :3] ** 2)
    return jnp.concatenate([g.ravel() for g in jax.tree.leaves(jax.grad(loss)(params))])
  g, g_exact = grads(approx), grads(exact)
  rel = float(jnp.linalg.norm(g - g_exact) / jnp.linalg.norm(g_exact))
  assert 0 < rel < 0.5  # ReGELU2's step derivative: 0.11 measured


def test_lowmem_switches_save_less():
  """MiniLM-L6 at batch 32 x 128 tokens, float32: autodiff's count, tracing only."""
  config, tokens = bert.BertConfig(), jax.ShapeDtypeStruct((32, 128), jnp.int32)
  mask = jax.ShapeDtypeStruct((32, 128), jnp.bool_)

  def saved(**switches):
    model = bert.Bert(config, **switches)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens, mask)["params"]
    loss = lambda p, t, m: jnp.sum(model.apply({"params": p}, t, m))
    return lm.memory.saved_residuals(loss, params, tokens, mask)

  base, ms = saved(), saved(norm="ms")
  every = saved(norm="ms", activation="approx", attention="recompute")
  assert lm.names.NORM_RSTD in ms.by_name()
  assert ms.activation_bytes < base.activation_bytes
  assert lm.names.ATTN_PROBS not in every.by_name()
  assert every.activation_bytes < 0.35 * base.activation_bytes  # 392 of 1175 MiB measured


def test_bad_input():
  params = bert.from_hf(_hf_tensors(TINY), TINY)
  model = bert.Bert(TINY)
  with pytest.raises(ValueError, match="mask the same shape"):
    model.apply({"params": params}, TOKENS, MASK[:, :5])
  with pytest.raises(ValueError, match="exceeds max_len 12"):
    model.apply({"params": params}, jnp.zeros((1, 13), jnp.int32), jnp.ones((1, 13), bool))
  tensors = _hf_tensors(TINY)
  with pytest.raises(ValueError, match="no 'encoder.layer.1.output.dense.weight'"):
    bert.from_hf({k: v for k, v in tensors.items() if k != "encoder.layer.1.output.dense.weight"},
                 TINY)
  with pytest.raises(ValueError, match=r"shape \(50, 16\), config expects \(51, 16\)"):
    bert.from_hf(tensors, bert.BertConfig(**{**TINY.__dict__, "vocab_size": 51}))
  with pytest.raises(ValueError, match="hidden_act"):
    bert.BertConfig.from_hf({"hidden_act": "relu"})
  with pytest.raises(ValueError, match="position_embedding_type"):
    bert.BertConfig.from_hf({"position_embedding_type": "relative_key"})
  with pytest.raises(ValueError, match=r"n_heads \(5\) must divide dim \(16\)"):
    bert.BertConfig(dim=16, n_heads=5)


def test_ms_norm_lowers_the_compiled_peak():
  """DESIGN asks the sharing be shown in the compiled figure: the gradient of a
  2-layer BERT (width 128) at batch 16 x 64, float32, on the CPU target (a
  proxy): on the H100 target the two peaks are equal (docs/benchmarks.md)."""
  config = bert.BertConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, ffn_dim=512, max_len=64)
  tokens, mask = jax.ShapeDtypeStruct((16, 64), jnp.int32), jax.ShapeDtypeStruct((16, 64), bool)

  def peak(norm):
    model = bert.Bert(config, norm=norm)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens, mask)["params"]
    loss = lambda p, t, m: jnp.sum(model.apply({"params": p}, t, m) ** 2)
    return lm.memory.analyze(jax.grad(loss), params, tokens, mask, target="cpu").peak_bytes

  assert peak("ms") < peak("plain")


@FLAX_NORM
def test_workload_builds_a_classifier_step():
  wl = models.workload("minilm-l6", batch=4, seq=16, activation="approx", norm="ms",
                       attention="recompute")
  params = wl.abstract_params()
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  # Hugging Face's MiniLM-L6 (22,713,216) without its pooler, with a 2-class head; the MS
  # norms keep their affines for the residual path.
  assert n == 22_713_216 - (384 * 384 + 384) + 384 * 2 + 2
  out = jax.eval_shape(wl.loss, params, wl.inputs, wl.labels)
  assert out.shape == () and out.dtype == jnp.float32
  with pytest.raises(ValueError, match="seq must be <= 512"):
    models.workload("minilm-l6", batch=1, seq=513)


def test_classifier_hands_its_switches_to_its_encoder():
  def saved_names(**switches):
    model = bert.BertClassifier(TINY, **switches)
    params = jax.eval_shape(model.init, jax.random.key(0), TOKENS)["params"]
    saved = lm.memory.saved_residuals(lambda p: model.apply({"params": p}, TOKENS, MASK).sum(),
                                      params)
    return set(saved.by_name()) - {None}
  plain = saved_names()
  lowmem = saved_names(activation="approx", norm="ms", attention="recompute")
  assert lm.names.ATTN_PROBS in plain and lm.names.ATTN_PROBS not in lowmem
  assert {lm.names.ACT_CODE, lm.names.NORM_RSTD, lm.names.ATTN_LSE} <= lowmem
  policy = lm.policies.save_only(lm.names.BLOCK_IN)
  assert saved_names(remat=True, remat_policy=policy) == {lm.names.BLOCK_IN}
