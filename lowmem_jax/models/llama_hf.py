"""A Hugging Face ``LlamaForCausalLM`` checkpoint loaded as `lowmem_jax.models.llama.Llama`
params, or refused with the reason: another architecture, a tensor left unread, a file
that cannot be read (named), a setting this model does not implement.

``config.json`` becomes a `LlamaConfig` (`config_from_hf`); the tensors (`HF_NAMES`) are
read from ``model.safetensors`` or the shards its index names (`from_hf`).
"""

import contextlib
import json
import pathlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from lowmem_jax.models.llama import Llama, LlamaConfig, RopeScaling

# Our params' paths -> Hugging Face LlamaForCausalLM's tensor names ({} the layer index).
# A kernel is the transposed Linear weight ([in, out] against [out, in]).
HF_NAMES = {
    ("tok_embeddings", "embedding"): "model.embed_tokens.weight",
    ("layers", "attention_norm", "scale"): "model.layers.{}.input_layernorm.weight",
    ("layers", "attention", "wq", "kernel"): "model.layers.{}.self_attn.q_proj.weight",
    ("layers", "attention", "wk", "kernel"): "model.layers.{}.self_attn.k_proj.weight",
    ("layers", "attention", "wv", "kernel"): "model.layers.{}.self_attn.v_proj.weight",
    ("layers", "attention", "wo", "kernel"): "model.layers.{}.self_attn.o_proj.weight",
    ("layers", "ffn_norm", "scale"): "model.layers.{}.post_attention_layernorm.weight",
    ("layers", "feed_forward", "w1", "kernel"): "model.layers.{}.mlp.gate_proj.weight",
    ("layers", "feed_forward", "w3", "kernel"): "model.layers.{}.mlp.up_proj.weight",
    ("layers", "feed_forward", "w2", "kernel"): "model.layers.{}.mlp.down_proj.weight",
    ("norm", "scale"): "model.norm.weight",
    ("output", "kernel"): "lm_head.weight",
}
# Tensors a checkpoint may hold that the model computes itself: older checkpoints saved
# each layer's rotary inverse frequencies.
_DERIVED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_LLAMA3_SCALING = ("factor", "low_freq_factor", "high_freq_factor",
                   "original_max_position_embeddings")


def config_from_hf(hf: dict[str, Any], source: str = "config.json") -> LlamaConfig:
  """The `LlamaConfig` of a Hugging Face ``LlamaConfig`` dict (a ``config.json``).

  Reads hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
  intermediate_size, vocab_size, rms_norm_eps, rope_theta, rope_scaling (None,
  "default" or "llama3") and tie_word_embeddings. Raises ValueError naming
  ``source`` and the key for a missing key or an architecture this model is not:
  a ``model_type`` other than "llama" or ``architectures`` without
  "LlamaForCausalLM" (Qwen2's q/k/v biases, Mistral's sliding window), an
  activation other than SiLU, biases, a head size other than hidden_size /
  num_attention_heads, a sliding window, a rope_scaling of another or no rope_type.
  """
  def get(key, default=None):
    if key not in hf and default is None:
      raise ValueError(f"{source} has no {key!r}.")
    return hf.get(key, default)

  if hf.get("model_type", "llama") != "llama":
    raise ValueError(f"{source}: model_type must be 'llama' for this model, got "
                     f"{hf['model_type']!r}; from_hf loads Llama checkpoints only.")
  if "LlamaForCausalLM" not in hf.get("architectures", ["LlamaForCausalLM"]):
    raise ValueError(f"{source}: architectures must hold 'LlamaForCausalLM', got "
                     f"{hf['architectures']!r}.")
  heads = get("num_attention_heads")
  for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                    ("head_dim", get("hidden_size") // heads), ("sliding_window", None)):
    if hf.get(key, want) != want:
      raise ValueError(f"{source}: {key} must be {want!r} for this model, got {hf[key]!r}.")
  return LlamaConfig(vocab_size=get("vocab_size"), dim=get("hidden_size"),
                     n_layers=get("num_hidden_layers"), n_heads=heads,
                     n_kv_heads=get("num_key_value_heads", heads),
                     ffn_dim=get("intermediate_size"), norm_eps=float(get("rms_norm_eps")),
                     rope_theta=float(get("rope_theta", 10000.0)),
                     rope_scaling=_rope_scaling(hf.get("rope_scaling"), source),
                     tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def _rope_scaling(scaling: Any, source: str) -> RopeScaling | None:
  """The `RopeScaling` of config.json's ``rope_scaling``: None, "default" or "llama3"."""
  if scaling is None:
    return None
  rope_type = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
  if rope_type is None:
    raise ValueError(f"{source}: rope_scaling {scaling!r} names no rope_type; this model takes "
                     "'default' or 'llama3'.")
  if rope_type not in ("default", "llama3"):
    raise ValueError(f"{source}: rope_scaling's rope_type must be 'default' or 'llama3', got "
                     f"{rope_type!r}.")
  if rope_type == "default":
    return None
  missing = [key for key in _LLAMA3_SCALING if key not in scaling]
  if missing:
    raise ValueError(f"{source}: the llama3 rope_scaling has no {missing[0]!r}.")
  return RopeScaling(float(scaling["factor"]), float(scaling["low_freq_factor"]),
                     float(scaling["high_freq_factor"]),
                     int(scaling["original_max_position_embeddings"]))


class _Checkpoint:
  """The tensors of a checkpoint folder: ``model.safetensors``, or the shards its index's
  ``weight_map`` names, each opened once (`read`) within ``files``' context."""

  def __init__(self, root: pathlib.Path, files: contextlib.ExitStack):
    from safetensors import SafetensorError, safe_open
    self.root, self.files, self.open, self.handles = root, files, safe_open, {}
    self.errors = (OSError, ValueError, SafetensorError)
    index = root / "model.safetensors.index.json"
    if index.exists():
      weight_map = _json(index).get("weight_map")
      if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no weight_map (tensor name -> file).")
      self.where = {name: root / file for name, file in weight_map.items()}
    else:
      single = _existing(root / "model.safetensors", f"nor {index}")
      self.where = {name: single for name in self._opened(single).keys()}

  def _opened(self, file: pathlib.Path):
    if file not in self.handles:
      try:
        self.handles[file] = self.files.enter_context(self.open(_existing(file),
                                                                framework="numpy"))
      except self.errors as e:
        raise ValueError(f"{file} cannot be read as safetensors: {e}") from e
    return self.handles[file]

  def read(self, name: str, shape: tuple[int, ...], transpose: bool,
           check_finite: bool) -> np.ndarray:
    """Tensor ``name`` as our leaf of ``shape`` (a Linear weight transposed to a kernel)."""
    if name not in self.where:
      held = "index's weight_map" if len(set(self.where.values())) > 1 else "model.safetensors"
      raise ValueError(f"{self.root}: the {held} has no tensor {name!r}.")
    file = self.where[name]
    handle = self._opened(file)
    if name not in handle.keys():
      raise ValueError(f"{file} has no tensor {name!r}.")
    try:
      tensor = handle.get_tensor(name)
    except self.errors as e:
      raise ValueError(f"tensor {name!r} in {file} cannot be read: {e}") from e
    want = shape[::-1] if transpose else shape
    if tensor.shape != want:
      raise ValueError(f"tensor {name!r} in {file} has shape {tensor.shape}; "
                       f"{self.root / 'config.json'} makes it {want}.")
    if check_finite and not np.isfinite(tensor.astype(np.float32)).all():
      bad = int((~np.isfinite(tensor.astype(np.float32))).sum())
      raise ValueError(f"tensor {name!r} in {file} holds {bad} non-finite values.")
    return tensor.T if transpose else tensor


def from_hf(path: str | pathlib.Path, *,
            check_finite: bool = False) -> tuple[LlamaConfig, dict[str, Any]]:
  """A Hugging Face ``LlamaForCausalLM`` checkpoint as ``(config, params)`` for `Llama`.

  ``path`` is the checkpoint's folder: ``config.json`` (`config_from_hf`) and
  ``model.safetensors``, or shards named by ``model.safetensors.index.json``'s
  ``weight_map``. The tensors (`HF_NAMES`) are read with ``safetensors.numpy``
  (the ``hf`` extra); each layer's are stacked under ``layers``, and Linear
  weights ``[out, in]`` become kernels ``[in, out]``. Hugging Face's q/k
  projections already use the rotate-half rotary convention `rope` uses. With
  tied embeddings an ``lm_head.weight`` is taken only where it equals the embedding.
  Every tensor of the checkpoint is read, but saved rotary frequencies.

  Args:
    path: the checkpoint's folder.
    check_finite: also refuse a tensor holding NaN or infinity (reads each in float32).

  Returns:
    The config and ``params``, a nested dict of NumPy arrays in the checkpoint's
    dtype (bfloat16 for Meta's), for ``Llama(config).apply({"params": params}, ...)``.

  Raises:
    FileNotFoundError: no config.json, or neither model.safetensors nor an index.
    ValueError: naming the file: a config `config_from_hf` refuses, a file that is
      not JSON or safetensors, a tensor missing, of the wrong shape or (with
      ``check_finite``) not finite, or tensors this model would leave unread (another
      layer count, LoRA adapters, biases).
  """
  try:
    import safetensors  # noqa: F401  (the hf extra)
  except ImportError as e:
    raise ImportError("from_hf reads safetensors: pip install 'lowmem-jax[hf]'.") from e
  root = pathlib.Path(path)
  config = config_from_hf(_json(_existing(root / "config.json")), str(root / "config.json"))
  shapes = jax.eval_shape(Llama(config).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
  with contextlib.ExitStack() as files:
    checkpoint = _Checkpoint(root, files)
    params, read = {}, set()
    for ours, shape in traverse_util.flatten_dict(shapes["params"]).items():
      name, transpose = HF_NAMES[ours], ours[-1] == "kernel"
      names = ([name.format(i) for i in range(config.n_layers)] if ours[0] == "layers"
               else [name])
      leaf_shape = shape.shape[1:] if ours[0] == "layers" else shape.shape
      leaves = [checkpoint.read(n, leaf_shape, transpose, check_finite) for n in names]
      params[ours] = np.stack(leaves) if ours[0] == "layers" else leaves[0]
      read.update(names)
    _check_all_read(checkpoint, read, config, params, check_finite)
  return config, traverse_util.unflatten_dict(params)


def _check_all_read(checkpoint: _Checkpoint, read: set, config: LlamaConfig, params: dict,
                    check_finite: bool) -> None:
  """Raises a ValueError naming the checkpoint's tensors the model did not read (a tied
  checkpoint's ``lm_head.weight`` is allowed where it equals the embedding)."""
  left = sorted(n for n in checkpoint.where if n not in read and not _DERIVED.fullmatch(n))
  if config.tie_embeddings and "lm_head.weight" in left:
    embedding = params[("tok_embeddings", "embedding")]
    head = checkpoint.read("lm_head.weight", embedding.shape, False, check_finite)
    if not np.array_equal(head, embedding):
      raise ValueError(f"{checkpoint.where['lm_head.weight']}: lm_head.weight differs from "
                       "model.embed_tokens.weight, but config.json ties them "
                       "(tie_word_embeddings); set it false to load the head.")
    left.remove("lm_head.weight")
  if left:
    shown = ", ".join(left[:6]) + (f" and {len(left) - 6} more" if len(left) > 6 else "")
    raise ValueError(f"{checkpoint.root} holds {len(left)} tensors this Llama would leave "
                     f"unread ({config.n_layers} layers by config.json): {shown}.")


def _json(file: pathlib.Path) -> dict:
  """The JSON object in ``file``, or a ValueError naming it."""
  try:
    value = json.loads(file.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{file} is not valid JSON: {e}") from e
  if not isinstance(value, dict):
    raise ValueError(f"{file} must hold a JSON object, got {type(value).__name__}.")
  return value


def _existing(file: pathlib.Path, also: str = "") -> pathlib.Path:
  """``file``, or FileNotFoundError naming it (and ``also``, what else was looked for)."""
  if not file.exists():
    raise FileNotFoundError(f"no {file}{' ' + also if also else ''}.")
  return file
