"""lowmem_jax/models/llama.py: stacked layers, the Llama 3 configs, `layer_stack`, `from_hf`."""

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from third_party_promotion import FLAX_NORM, OPTAX_BIAS_CORRECTION

from lowmem_jax import models
from lowmem_jax.models import llama
from lowmem_jax.models.llama import Llama, LlamaConfig, RopeScaling
from lowmem_jax.optim import per_leaf

TINY = LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48,
                   rope_scaling=RopeScaling(factor=4.0, original_max_position=64))


def _tokens(shape=(2, 8), vocab=64, seed=0):
  return jax.random.randint(jax.random.key(seed), shape, 0, vocab)


def _count(tree):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def test_layers_are_stacked_under_meta_names():
  params = jax.eval_shape(Llama(TINY).init, jax.random.key(0), _tokens())["params"]
  assert set(params) == {"tok_embeddings", "layers", "norm", "output"}
  assert set(params["layers"]) == {"attention_norm", "attention", "ffn_norm", "feed_forward"}
  assert set(params["layers"]["attention"]) == {"wq", "wk", "wv", "wo"}
  assert set(params["layers"]["feed_forward"]) == {"w1", "w2", "w3"}
  assert params["layers"]["attention"]["wk"]["kernel"].shape == (3, 32, 16)
  assert all(x.shape[0] == 3 for x in jax.tree.leaves(params["layers"]))
  tied = jax.eval_shape(Llama(dataclasses.replace(TINY, tie_embeddings=True)).init,
                        jax.random.key(0), _tokens())["params"]
  assert "output" not in tied and _count(tied) == _count(params) - 64 * 32


def test_unrolled_layers_are_the_same_model():
  """``scan=False``: the same function of the same params, each layer's at ``layers_{i}``."""
  scanned, unrolled = Llama(TINY), Llama(TINY, scan=False)
  tokens = _tokens()
  params = jax.jit(scanned.init)(jax.random.key(0), tokens)["params"]
  kernel = params["layers"]["attention"]["wq"]["kernel"]
  assert not np.allclose(kernel[0], kernel[1])  # each layer initialised apart
  per_layer = {k: v for k, v in params.items() if k != "layers"}
  per_layer |= {f"layers_{i}": jax.tree.map(lambda x, i=i: x[i], params["layers"])
                for i in range(TINY.n_layers)}
  shapes = jax.eval_shape(unrolled.init, jax.random.key(0), tokens)["params"]
  assert jax.tree.structure(shapes) == jax.tree.structure(per_layer)
  chex.assert_trees_all_close(jax.jit(unrolled.apply)({"params": per_layer}, tokens),
                              jax.jit(scanned.apply)({"params": params}, tokens), atol=1e-5)
  with pytest.raises(ValueError, match="model must stack its layers"):
    llama.layer_stack(unrolled)
  with pytest.raises(TypeError, match="split_layer must be a bool, got 'yes'"):
    llama.layer_stack(scanned, split_layer="yes")
  block = llama.TransformerBlock(TINY, "exact", "plain", "recompute", jnp.float32, jnp.float32,
                                 part="mlp")
  with pytest.raises(ValueError, match="TransformerBlock.part must be one of"):
    block.init(jax.random.key(0), jnp.zeros((1, 4, TINY.dim)))


@pytest.mark.parametrize("tied,chunk,switches", [
    (False, 4, {}), (True, 3, {}),
    (False, 4, dict(remat=True, remat_policy=jax.checkpoint_policies.nothing_saveable, norm="ms",
                    activation="approx"))], ids=["untied-4", "tied-3", "remat-ms-approx-4"])
def test_mlp_in_token_chunks_is_the_same_model(tied, chunk, switches):
  """``mlp_chunk_tokens``: the same params, loss and gradient (float32), and no
  ``[tokens, ffn_dim]`` tensor in the gradient's program, which the whole MLP makes."""
  config = dataclasses.replace(TINY, tie_embeddings=tied)
  whole = Llama(config, loss="fused", **switches)
  chunked = Llama(config, loss="fused", mlp_chunk_tokens=chunk, **switches)
  tokens = _tokens()
  labels = jnp.roll(tokens, -1, axis=1)
  params = whole.init(jax.random.key(1), tokens)["params"]
  chex.assert_trees_all_equal(chunked.init(jax.random.key(1), tokens)["params"], params)
  grad = lambda m: jax.value_and_grad(lambda p: m.apply({"params": p}, tokens, labels))
  got, want = jax.jit(grad(chunked))(params), jax.jit(grad(whole))(params)
  chex.assert_trees_all_close(got, want, atol=1e-6, rtol=1e-5)
  assert abs(float(got[0]) - float(want[0])) < 1e-6
  hidden = ("[2,8,48]", "[16,48]")  # the whole MLP's hidden, batched or flattened
  assert any(h in str(jax.make_jaxpr(grad(whole))(params)) for h in hidden)
  assert not any(h in str(jax.make_jaxpr(grad(chunked))(params)) for h in hidden)


def test_mlp_chunk_tokens_is_checked():
  for bad in (0, 2.0):
    with pytest.raises(ValueError, match="mlp_chunk_tokens must be a positive int"):
      Llama(TINY, mlp_chunk_tokens=bad).init(jax.random.key(0), _tokens())
  with pytest.raises(ValueError, match="mlp_chunk_tokens applies to the LLaMA models only"):
    models.workload("vit-tiny", batch=1, mlp_chunk_tokens=4)


@pytest.mark.parametrize("name,published", [
    ("llama-3.2-1b", 1_235_814_400), ("llama-3.2-3b", 3_212_749_824),
    ("llama-3.1-8b", 8_030_261_248), ("llama-3.1-70b", 70_553_706_496)])
def test_llama3_parameter_counts_are_the_published(name, published):
  """The counts of Meta's checkpoints (1.24B, 3.21B, 8.03B, 70.6B), from shapes alone."""
  params = models.workload(name, batch=1, seq=8, dtype=jnp.float32).abstract_params()
  assert _count(params) == published
  assert ("output" in params) == (not llama.CONFIGS[name].tie_embeddings)


def test_rope_scaling_keeps_high_frequencies_and_divides_low_ones():
  scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position=8192)
  plain = np.asarray(llama.rope_frequencies(128, 500000.0))
  scaled = np.asarray(llama.rope_frequencies(128, 500000.0, scaling))
  wavelength = 2 * np.pi / plain
  short, long = wavelength < 8192 / 4, wavelength > 8192
  assert short.any() and long.any() and (~short & ~long).any()
  np.testing.assert_array_equal(scaled[short], plain[short])
  np.testing.assert_allclose(scaled[long], plain[long] / 8, rtol=1e-6)
  between = ~short & ~long
  assert np.all(scaled[between] < plain[between]) and np.all(scaled[between] > plain[between] / 8)


def _stacked_loss(stack, params, batch):
  rest = {k: v for k, v in params.items() if k != "layers"}
  h, _ = jax.lax.scan(lambda h, p: (stack.run_layer(p, h, batch), None), stack.embed(rest, batch),
                      params["layers"])
  return stack.head(rest, h, batch)


@pytest.mark.slow
@pytest.mark.parametrize("tied,loss,remat,split_layer", [
    (False, "plain", False, False), (True, "fused", True, False), (False, "fused", True, True)],
    ids=["untied-plain", "tied-fused-remat", "untied-fused-remat-split"])
def test_layer_stack_is_the_model(tied, loss, remat, split_layer):
  config = dataclasses.replace(TINY, tie_embeddings=tied)
  model = Llama(config, loss=loss, remat=remat,
                remat_policy=jax.checkpoint_policies.nothing_saveable if remat else None)
  tokens = _tokens()
  batch = (tokens, jnp.roll(tokens, -1, axis=1))
  params = model.init(jax.random.key(1), tokens)["params"]
  stack = llama.layer_stack(model, split_layer=split_layer)
  assert stack.key == "layers" and len(stack.parts) == (2 if split_layer else 1)
  want = jax.jit(jax.value_and_grad(lambda p: model.apply({"params": p}, *batch)))(params)
  got = jax.jit(jax.value_and_grad(lambda p: _stacked_loss(stack, p, batch)))(params)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
  one = jax.tree.map(lambda x: x[0], params["layers"])
  h = jnp.zeros((2, 8, config.dim))
  halves = [{"attention", "attention_norm"}, {"feed_forward", "ffn_norm"}]
  for part, half in zip(stack.parts, halves if split_layer else [set().union(*halves)]):
    reads = per_leaf.reads(lambda p, h: part(p, h, batch), one, h)  # remat looked into
    assert {k for k, v in reads.items() if any(jax.tree.leaves(v))} == half
  eqns = jax.make_jaxpr(stack.run_layer)(one, h, batch).jaxpr.eqns
  policies = [e.params["policy"] for e in eqns if "policy" in e.params]
  assert policies == [jax.checkpoint_policies.nothing_saveable] * remat * len(stack.parts)


@FLAX_NORM
@OPTAX_BIAS_CORRECTION
def test_llama3_8b_train_step_lowers():
  """The 8B step traces and lowers on CPU from shapes alone (the layers scanned: ~1 s)."""
  wl = models.workload("llama-3.1-8b", batch=1, seq=128, loss="fused")
  tx = optax.adamw(1e-4)
  params = wl.abstract_params()
  lowered = jax.jit(wl.train_step(tx)).lower(params, jax.eval_shape(tx.init, params),
                                            (wl.inputs, wl.labels))
  assert "while" in lowered.as_text()  # one loop over the 32 layers, not 32 copies


# A Hugging Face LlamaForCausalLM checkpoint, written here, and its forward in NumPy.

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 80, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False,
    # Head size 16: wavelengths 6.3 (kept), 32 (interpolated), 167 and up (divided by 4).
    "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "tie_word_embeddings": False,
}


def _hf_weights(hf, rng):
  d, f = hf["hidden_size"], hf["intermediate_size"]
  hd = d // hf["num_attention_heads"]
  q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
  normal = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
  scale = lambda: (1 + 0.2 * rng.standard_normal(d)).astype(np.float32)
  w = {"model.embed_tokens.weight": rng.standard_normal((hf["vocab_size"], d)).astype(np.float32),
       "model.norm.weight": scale()}
  for i in range(hf["num_hidden_layers"]):
    p = f"model.layers.{i}."
    w |= {p + "input_layernorm.weight": scale(), p + "post_attention_layernorm.weight": scale(),
          p + "self_attn.q_proj.weight": normal(q, d), p + "self_attn.k_proj.weight": normal(kv, d),
          p + "self_attn.v_proj.weight": normal(kv, d), p + "self_attn.o_proj.weight": normal(d, q),
          p + "mlp.gate_proj.weight": normal(f, d), p + "mlp.up_proj.weight": normal(f, d),
          p + "mlp.down_proj.weight": normal(d, f)}
  if not hf["tie_word_embeddings"]:
    w["lm_head.weight"] = normal(hf["vocab_size"], d)
  return w


def _hf_inv_freq(hf, head_dim):
  """transformers' llama3 rope: kept below the high-frequency wavelength, divided by the
  factor above the low one, smoothly interpolated between."""
  inv = 1.0 / hf["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  s = hf["rope_scaling"]
  old = s["original_max_position_embeddings"]
  low_wavelen, high_wavelen = old / s["low_freq_factor"], old / s["high_freq_factor"]
  wavelen = 2 * np.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / s["factor"], inv)
  smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
  smoothed = (1 - smooth) * scaled / s["factor"] + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled)


def _hf_forward(hf, w, tokens):
  """LlamaForCausalLM's logits ``[batch, length, vocab]`` in float64 NumPy."""
  w = {k: v.astype(np.float64) for k, v in w.items()}
  heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
  hd = hf["hidden_size"] // heads
  eps = hf["rms_norm_eps"]
  rms = lambda x, g: g * x / np.sqrt(np.mean(x ** 2, -1, keepdims=True) + eps)
  rotate_half = lambda x: np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
  b, t = tokens.shape
  freqs = np.arange(t)[:, None] * _hf_inv_freq(hf, hd)[None]
  cos, sin = np.cos(np.concatenate([freqs, freqs], -1)), np.sin(np.concatenate([freqs, freqs], -1))
  causal = np.where(np.tril(np.ones((t, t), bool)), 0.0, -np.inf)
  split = lambda y, n: y.reshape(b, t, n, hd).transpose(0, 2, 1, 3)  # [b, heads, t, hd]
  x = w["model.embed_tokens.weight"][tokens]
  for i in range(hf["num_hidden_layers"]):
    p = f"model.layers.{i}."
    h = rms(x, w[p + "input_layernorm.weight"])
    q, k, v = (split(h @ w[p + f"self_attn.{name}_proj.weight"].T, n)
               for name, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)))
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd) + causal
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = (probs @ v).transpose(0, 2, 1, 3).reshape(b, t, heads * hd)
    x = x + out @ w[p + "self_attn.o_proj.weight"].T
    h = rms(x, w[p + "post_attention_layernorm.weight"])
    gate = h @ w[p + "mlp.gate_proj.weight"].T
    up = h @ w[p + "mlp.up_proj.weight"].T
    x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
  head = w["model.embed_tokens.weight"] if hf["tie_word_embeddings"] else w["lm_head.weight"]
  return rms(x, w["model.norm.weight"]) @ head.T


def _write_checkpoint(folder, hf, weights, shards=1):
  """config.json and model.safetensors, or ``shards`` files and their index."""
  from safetensors.numpy import save_file
  (folder / "config.json").write_text(json.dumps(hf))
  if shards == 1:
    save_file(weights, folder / "model.safetensors")
    return
  names = sorted(weights)
  weight_map = {}
  for s in range(shards):
    file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    part = names[s::shards]
    save_file({n: weights[n] for n in part}, folder / file)
    weight_map |= dict.fromkeys(part, file)
  (folder / "model.safetensors.index.json").write_text(
      json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("tied,shards", [(False, 1), (True, 1), (False, 2)],
                         ids=["untied", "tied", "sharded"])
def test_from_hf_logits_are_hugging_faces(tmp_path, tied, shards):
  pytest.importorskip("safetensors")
  hf = {**HF_CONFIG, "tie_word_embeddings": tied}
  weights = _hf_weights(hf, np.random.default_rng(0))
  _write_checkpoint(tmp_path, hf, weights, shards)
  config, params = llama.from_hf(tmp_path)
  assert config == LlamaConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                               ffn_dim=80, rope_theta=500000.0, tie_embeddings=tied,
                               rope_scaling=RopeScaling(4.0, 1.0, 4.0, 64))
  assert ("output" in params) == (not tied)
  tokens = np.random.default_rng(1).integers(0, 96, (2, 12))
  got = Llama(config).apply({"params": params}, jnp.asarray(tokens))
  np.testing.assert_allclose(got, _hf_forward(hf, weights, tokens), atol=2e-4, rtol=2e-4)


def test_from_hf_keeps_the_checkpoints_dtype(tmp_path):
  pytest.importorskip("safetensors")
  weights = {k: v.astype(jnp.bfloat16) for k, v in
             _hf_weights(HF_CONFIG, np.random.default_rng(0)).items()}
  _write_checkpoint(tmp_path, HF_CONFIG, weights)
  _, params = llama.from_hf(tmp_path)
  assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(jnp.bfloat16)}
  np.testing.assert_array_equal(params["layers"]["feed_forward"]["w2"]["kernel"][1],
                                weights["model.layers.1.mlp.down_proj.weight"].T)


def test_from_hf_names_what_is_wrong(tmp_path):
  pytest.importorskip("safetensors")
  weights = _hf_weights(HF_CONFIG, np.random.default_rng(0))
  with pytest.raises(FileNotFoundError, match="config.json"):
    llama.from_hf(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    llama.from_hf(tmp_path)
  missing = {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
  _write_checkpoint(tmp_path, HF_CONFIG, missing)
  with pytest.raises(ValueError, match=r"model.safetensors has no tensor "
                                       r"'model.layers.1.mlp.up_proj.weight'"):
    llama.from_hf(tmp_path)
  bad = {**weights, "model.layers.0.self_attn.k_proj.weight": weights[
      "model.layers.0.self_attn.q_proj.weight"]}
  _write_checkpoint(tmp_path, HF_CONFIG, bad)
  with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' in .* has "
                                       r"shape \(64, 64\); .* makes it \(32, 64\)"):
    llama.from_hf(tmp_path)
  for key, value, message in (
      ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_type must be"),
      ("hidden_act", "gelu", "hidden_act must be 'silu'"), ("head_dim", 8, "head_dim must be 16"),
      ("num_hidden_layers", None, "no 'num_hidden_layers'")):
    hf = {k: v for k, v in {**HF_CONFIG, key: value}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=message):
      llama.from_hf(tmp_path)
