"""lowmem_jax/models/llama_hf.py: a Hugging Face LlamaForCausalLM checkpoint, written here,
loaded (its logits against a NumPy forward of transformers' code), or refused with the reason."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from third_party_promotion import OPTAX_APPLY_UPDATES, OPTAX_BIAS_CORRECTION, OPTAX_UPDATE_MOMENT

from lowmem_jax.models import llama_hf
from lowmem_jax.models.llama import Llama, LlamaConfig, RopeScaling

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
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
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
  config, params = llama_hf.from_hf(tmp_path)
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
  _, params = llama_hf.from_hf(tmp_path)
  assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(jnp.bfloat16)}
  np.testing.assert_array_equal(params["layers"]["feed_forward"]["w2"]["kernel"][1],
                                weights["model.layers.1.mlp.down_proj.weight"].T)


def test_from_hf_names_what_is_wrong(tmp_path):
  pytest.importorskip("safetensors")
  weights = _hf_weights(HF_CONFIG, np.random.default_rng(0))
  with pytest.raises(FileNotFoundError, match="config.json"):
    llama_hf.from_hf(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    llama_hf.from_hf(tmp_path)
  missing = {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
  _write_checkpoint(tmp_path, HF_CONFIG, missing)
  with pytest.raises(ValueError, match=r"model.safetensors has no tensor "
                                       r"'model.layers.1.mlp.up_proj.weight'"):
    llama_hf.from_hf(tmp_path)
  bad = {**weights, "model.layers.0.self_attn.k_proj.weight": weights[
      "model.layers.0.self_attn.q_proj.weight"]}
  _write_checkpoint(tmp_path, HF_CONFIG, bad)
  with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' in .* has "
                                       r"shape \(64, 64\); .* makes it \(32, 64\)"):
    llama_hf.from_hf(tmp_path)
  for key, value, message in (
      ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_type must be"),
      ("hidden_act", "gelu", "hidden_act must be 'silu'"), ("head_dim", 8, "head_dim must be 16"),
      ("num_hidden_layers", None, "no 'num_hidden_layers'")):
    hf = {k: v for k, v in {**HF_CONFIG, key: value}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=message):
      llama_hf.from_hf(tmp_path)


@pytest.mark.parametrize("change,message", [
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
     "model_type must be 'llama'.*got 'qwen2'"),
    ({"model_type": "mistral", "sliding_window": 4096}, "model_type must be 'llama'"),
    ({"architectures": ["MistralForCausalLM"]}, "architectures must hold 'LlamaForCausalLM'"),
    ({"sliding_window": 4096}, "sliding_window must be None"),
    ({"rope_scaling": {"factor": 2.0}}, "rope_scaling .* names no rope_type"),
    ({"rope_scaling": {k: v for k, v in HF_CONFIG["rope_scaling"].items()
                       if k != "low_freq_factor"}}, "llama3 rope_scaling has no 'low_freq_factor'"),
    ({"num_hidden_layers": 1}, r"holds 9 tensors this Llama would leave unread \(1 layers"),
])
def test_from_hf_refuses_a_config_that_is_not_this_llama(tmp_path, change, message):
  """Each of these loaded before, silently wrong: Qwen2's biases dropped, a sliding window
  ignored, a layer's tensors unread, a rope_scaling read as none; or failed with a KeyError."""
  pytest.importorskip("safetensors")
  _write_checkpoint(tmp_path, HF_CONFIG, _hf_weights(HF_CONFIG, np.random.default_rng(0)))
  (tmp_path / "config.json").write_text(json.dumps({**HF_CONFIG, **change}))
  with pytest.raises(ValueError, match=message):
    llama_hf.from_hf(tmp_path)


def test_from_hf_reads_every_tensor_or_names_those_left(tmp_path):
  pytest.importorskip("safetensors")
  rng = np.random.default_rng(0)
  weights = _hf_weights(HF_CONFIG, rng)
  extra = {"model.layers.0.self_attn.q_proj.lora_A.weight": np.ones((4, 64), np.float32),
           "model.layers.1.self_attn.q_proj.bias": np.ones(64, np.float32)}
  _write_checkpoint(tmp_path, HF_CONFIG, {**weights, **extra}, shards=2)
  with pytest.raises(ValueError, match=r"holds 2 tensors .* unread .*: "
                     r"model.layers.0.self_attn.q_proj.lora_A.weight, "
                     r"model.layers.1.self_attn.q_proj.bias\."):
    llama_hf.from_hf(tmp_path)
  rotary = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)
            for i in range(2)}  # older checkpoints saved them: computed here
  _write_checkpoint(tmp_path, HF_CONFIG, {**weights, **rotary})
  llama_hf.from_hf(tmp_path)
  tied = {**HF_CONFIG, "tie_word_embeddings": True}
  same = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}
  _write_checkpoint(tmp_path, tied, same)
  assert "output" not in llama_hf.from_hf(tmp_path)[1]
  _write_checkpoint(tmp_path, tied, weights)  # its own head under a tied config
  with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
    llama_hf.from_hf(tmp_path)


def test_from_hf_names_the_file_it_cannot_read_and_checks_finite_on_request(tmp_path):
  pytest.importorskip("safetensors")
  weights = _hf_weights(HF_CONFIG, np.random.default_rng(0))
  _write_checkpoint(tmp_path, HF_CONFIG, weights, shards=2)
  index = tmp_path / "model.safetensors.index.json"
  text = index.read_text()
  index.write_text(text[:len(text) // 2])
  with pytest.raises(ValueError, match="model.safetensors.index.json is not valid JSON"):
    llama_hf.from_hf(tmp_path)
  index.write_text(json.dumps({"metadata": {}}))
  with pytest.raises(ValueError, match="index.json has no weight_map"):
    llama_hf.from_hf(tmp_path)
  index.write_text(text)
  shard = tmp_path / "model-00002-of-00002.safetensors"
  shard.write_bytes(shard.read_bytes()[:1000])
  with pytest.raises(ValueError, match="model-00002-of-00002.safetensors cannot be read"):
    llama_hf.from_hf(tmp_path)
  config = (tmp_path / "config.json")
  config.write_text(json.dumps(HF_CONFIG)[:40])
  with pytest.raises(ValueError, match="config.json is not valid JSON"):
    llama_hf.from_hf(tmp_path)
  nan = {**weights, "model.norm.weight": weights["model.norm.weight"].copy()}
  nan["model.norm.weight"][3] = np.nan
  _write_checkpoint(tmp_path, HF_CONFIG, nan, shards=2)
  assert np.isnan(llama_hf.from_hf(tmp_path)[1]["norm"]["scale"][3])  # read as it is by default
  with pytest.raises(ValueError, match="'model.norm.weight' in .* holds 1 non-finite values"):
    llama_hf.from_hf(tmp_path, check_finite=True)


# A fine-tune as a user runs one: a checkpoint transformers wrote, loaded, trained with the set
# `plan` picks for Llama-3.1-8B on a 24 GB card (bf16+ms-norm+attention+fused-ce+8bit+bf16-params
# +stream:host+offload-opt), saved each step, killed, resumed.

def _fine_tune(folder: str, steps: int, kill_after: int | None = None):
  """From the checkpoint in ``folder``, ``steps`` steps of the layer-streamed step, each step's
  params and state saved by orbax under ``folder/run/<step>``, resumed from the last one saved;
  with ``kill_after``, the process kills itself (SIGKILL) once that step is saved. Returns
  ``(params, state)``."""
  import os
  import pathlib
  import signal

  import optax
  import orbax.checkpoint as ocp

  import lowmem_jax as lm
  from lowmem_jax.models.llama import layer_stack

  config, params = llama_hf.from_hf(folder)
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  net = Llama(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, norm="ms",
              attention="recompute", loss="fused", mlp_chunk_tokens=1024)
  tx = optax.chain(lm.lowbit.adamw_8bit(1e-3, weight_decay=1e-4), lm.lowbit.stochastic_rounding())
  layered = lm.optim.layer_streamed(layer_stack(net), tx, state="host", saved_inputs="host")
  step = jax.jit(layered.step, donate_argnums=(0, 1))
  tokens = np.random.default_rng(7).integers(0, config.vocab_size, (steps, 2, 17))
  runs = pathlib.Path(folder) / "run"
  with ocp.CheckpointManager(runs.absolute()) as manager:
    start = manager.latest_step()
    if start is None:
      state, start = layered.init(params), 0
    else:
      target = {"params": jax.eval_shape(lambda: params), "state": layered.abstract(params)}
      saved = manager.restore(start, args=ocp.args.StandardRestore(target))
      params, state, start = saved["params"], saved["state"], start + 1
    for i in range(start, steps):
      batch = jnp.asarray(tokens[i, :, :-1]), jnp.asarray(tokens[i, :, 1:])
      params, state, metrics = step(params, state, batch)
      assert bool(metrics["finite"])
      manager.save(i, args=ocp.args.StandardSave({"params": params, "state": state}))
      manager.wait_until_finished()
      if i == kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
  return params, state


def _transformers_checkpoint(folder):
  """config.json written by transformers' LlamaConfig, the weights as transformers names and
  lays them (``[out, in]``) in model.safetensors."""
  transformers = pytest.importorskip("transformers")
  from safetensors.numpy import save_file
  keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "intermediate_size", "rms_norm_eps", "rope_theta",
          "rope_scaling", "tie_word_embeddings")
  transformers.LlamaConfig(**{k: HF_CONFIG[k] for k in keys}).save_pretrained(folder)
  save_file(_hf_weights(HF_CONFIG, np.random.default_rng(3)), folder / "model.safetensors",
            metadata={"format": "pt"})


@pytest.mark.slow
@OPTAX_BIAS_CORRECTION
@OPTAX_UPDATE_MOMENT
@OPTAX_APPLY_UPDATES
def test_a_fine_tune_of_a_transformers_checkpoint_killed_and_resumed_is_bit_for_bit(tmp_path):
  import subprocess
  import sys
  killed, whole = tmp_path / "killed", tmp_path / "whole"
  for folder in (killed, whole):
    folder.mkdir()
    _transformers_checkpoint(folder)
  code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
          f"import test_llama_hf; test_llama_hf._fine_tune({str(killed)!r}, 4, kill_after=1)")
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
  assert run.returncode == -9, run.stderr[-2000:]  # killed by its own SIGKILL after step 1
  import orbax.checkpoint as ocp
  with ocp.CheckpointManager((killed / "run").absolute()) as manager:
    assert list(manager.all_steps()) == [0, 1]  # saved, then killed: the resume starts at 2
  resumed = _fine_tune(str(killed), 4)
  uninterrupted = _fine_tune(str(whole), 4)
  assert jax.tree.structure(resumed) == jax.tree.structure(uninterrupted)
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  config, start = llama_hf.from_hf(whole)
  moved = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)))
           for a, b in zip(jax.tree.leaves(uninterrupted[0]), jax.tree.leaves(start))]
  assert min(moved) > 0  # every parameter trained
