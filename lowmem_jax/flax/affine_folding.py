"""Folding a pretrained norm's affine into the linear layers it feeds.

MS-BP (Yang et al., ICML 2024, arXiv:2406.16282) uses norms without affine
(`lowmem_jax.ops.norms` without ``scale``; `lowmem_jax.flax.linen.MSRMSNorm`
``use_scale=False``). The models here keep the affine and train it instead
(``norm="ms"`` takes the plain model's params): a folded model trains another
parameterisation, its norms' scales no longer trained on their own. A norm with
scale ``g`` and bias ``b`` followed by a
linear layer ``x @ W + c`` becomes the plain norm followed by

    x @ (g[:, None] * W) + (c + b @ W)

which is exact in real arithmetic. Where the norm feeds nothing but linear
layers (pre-LN blocks, a final norm before the head) its affine goes. In a
post-LN model the norm's output also feeds the residual stream: there
``keep_affine=True`` folds copies of ``g, b`` into the linear layers and keeps
them on the norm renamed ``residual_scale``, ``residual_bias``: the explicit
affine of the residual path only.
The new names make the folded tree differ from the unfolded one, so a model
given the wrong one fails to load it, and a second fold finds nothing to fold.

Stacked layers (params of ``nn.scan``'s layers, each leaf ``[layers, ...]``,
as `lowmem_jax.models.Llama` has them) fold layer by layer: a norm's
``scale``/``bias`` ``[*stack, n]`` goes into kernels ``[*stack, n, ...]``.

Params are nested dicts (Flax linen) or an ``nnx.State`` (Flax NNX, e.g.
``nnx.state(model, nnx.Param)``), whose leaves may be ``nnx.Variable``s; NNX
list indices are int keys, given as ints in a tuple path. For NNX, build the
model with `lowmem_jax.flax.nnx.MSLayerNorm` / `MSRMSNorm` in place of the folded
norms and ``nnx.update`` it with the folded state.
"""

from typing import Any, Mapping, Sequence

import flax
import jax.numpy as jnp
from flax import nnx, traverse_util

Path = str | tuple[str, ...]

# big_vision ViT (`big_vision/models/vit.py`), pool_type "gap", "tok" or "0",
# no `representation_size`. Not for a MAP head or `pre_logits`: there
# "encoder_norm" feeds other layers, and MAPHead_0/LayerNorm_0 would wrongly
# match the first rule.
VIT_RULES = {
    "LayerNorm_0": ("MultiHeadDotProductAttention_0/query",
                    "MultiHeadDotProductAttention_0/key",
                    "MultiHeadDotProductAttention_0/value"),
    "LayerNorm_1": ("MlpBlock_0/Dense_0",),
    "Transformer/encoder_norm": ("head",),
}
# LLaMA with Meta's module names, Flax leaves (nn.RMSNorm "scale", nn.Dense
# "kernel" of shape [in, out]) and an untied output layer (with tied embeddings
# the final norm feeds the table, which the input reads too: not foldable).
LLAMA_RULES = {
    "attention_norm": ("attention/wq", "attention/wk", "attention/wv"),
    "ffn_norm": ("feed_forward/w1", "feed_forward/w3"),
    "norm": ("output",),
}
# The names ``keep_affine`` gives a norm's kept ``scale`` and ``bias``.
RESIDUAL_PREFIX = "residual_"


def _path(path: Path, arg: str) -> tuple[str, ...]:
  """``path`` as a tuple of keys; a string is split on "/"."""
  if isinstance(path, str):
    path = tuple(path.split("/"))
  if not isinstance(path, tuple):
    raise TypeError(
        f"{arg} must be a '/'-separated string or a tuple of keys, got {path!r}.")
  if not path or "" in path:
    raise ValueError(f"{arg} must name a module, got the path {path!r}.")
  return path


def _paths(paths: Sequence[Path], arg: str) -> list[tuple[str, ...]]:
  if isinstance(paths, str):
    raise TypeError(
        f"{arg} must be a sequence of paths, got the string {paths!r}; use ({paths!r},).")
  paths = [_path(p, arg) for p in paths]
  if not paths or len(set(paths)) != len(paths):
    raise ValueError(f"{arg} must name at least one layer, each once, got {paths!r}.")
  return paths


def _name(path: tuple) -> str:
  """``path`` '/'-separated; NNX list indices are ints."""
  return "/".join(map(str, path))


def _node(flat: dict, path: tuple[str, ...], arg: str) -> dict[str, Any]:
  """The arrays directly under ``path``, by name; raises naming the missing key."""
  node = {k[-1]: v for k, v in flat.items() if k[:-1] == path}
  if node:
    return node
  name = _name(path)
  for i, key in enumerate(path):
    keys = sorted({k[i] for k in flat if len(k) > i and k[:i] == path[:i]}, key=str)
    if key not in keys:
      where = _name(path[:i]) or "the root"
      raise ValueError(
          f"{arg} path {name!r} not found: no {key!r} at {where}, which holds {keys}.")
  raise ValueError(f"{arg} path {name!r} is not a module's params (it holds no arrays directly).")


def _value(leaf: Any) -> Any:
  """The array of a leaf: an ``nnx.Variable``'s value, else the leaf itself (None stays None)."""
  return leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf


def _like(leaf: Any, value: jnp.ndarray) -> Any:
  """``value`` in ``leaf``'s place: a copy of an ``nnx.Variable`` holding it, else ``value``."""
  return leaf.replace(value) if isinstance(leaf, nnx.Variable) else value


def _over_kernel(v: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
  """A norm's ``v: [*stack, n]`` in float32, shaped to broadcast over a kernel ``w: [*stack, n,
  ...]``."""
  return jnp.reshape(jnp.asarray(v, jnp.float32), v.shape + (1,) * (w.ndim - v.ndim))


def _fold(flat: dict, norm: tuple[str, ...], into: list[tuple[str, ...]], keep_affine: bool) -> None:
  """Folds the norm at ``norm`` into the layers at ``into``, in place on ``flat``."""
  node = _node(flat, norm, "norm")
  g, b = _value(node.get("scale")), _value(node.get("bias"))
  if g is None and b is None:
    raise ValueError(
        f"norm {_name(norm)!r} has no 'scale' or 'bias' to fold; it holds {sorted(node)}.")
  for path in into:
    name, dense = _name(path), _node(flat, path, "into")
    if "kernel" not in dense:
      raise ValueError(
          f"into path {name!r} is not a Dense layer: no 'kernel' among {sorted(dense)}.")
    w = _value(dense["kernel"])
    for leaf, v in (("scale", g), ("bias", b)):
      if v is not None and v.shape != w.shape[:v.ndim]:
        raise ValueError(
            f"norm {leaf} shape {v.shape} does not match the leading (stacked layers, then "
            f"feature) axes of the kernel at {name!r}, shape {w.shape}.")
    w32 = jnp.asarray(w, jnp.float32)
    if b is not None and "bias" in dense:
      c = _value(dense["bias"])
      c32 = jnp.asarray(c, jnp.float32) + jnp.sum(_over_kernel(b, w) * w32, axis=b.ndim - 1)
      flat[path + ("bias",)] = _like(dense["bias"], c32.astype(c.dtype))
    elif b is not None and jnp.any(b != 0):
      raise ValueError(
          f"into path {name!r} has no 'bias' to take the norm's nonzero bias; "
          f"build that layer with use_bias=True and zero bias.")
    if g is not None:
      flat[path + ("kernel",)] = _like(dense["kernel"], (_over_kernel(g, w) * w32).astype(w.dtype))
  for leaf in ("scale", "bias"):
    value = flat.pop(norm + (leaf,), None)
    if keep_affine and value is not None:
      flat[norm + (RESIDUAL_PREFIX + leaf,)] = value


def _flatten(params: Mapping[str, Any]) -> dict:
  if isinstance(params, nnx.State):
    return dict(nnx.to_flat_state(params))
  if not isinstance(params, (dict, flax.core.FrozenDict)):
    raise TypeError(f"params must be a dict, FrozenDict or nnx.State, got {type(params).__name__}.")
  return traverse_util.flatten_dict(params, keep_empty_nodes=True)


def _folded(params: Mapping[str, Any], folds: list, keep_affine: bool) -> Mapping[str, Any]:
  """A copy of ``params`` (same container) with each ``(norm, into)`` of ``folds`` folded."""
  flat = _flatten(params)
  for norm, into in folds:
    _fold(flat, norm, into, keep_affine)
  if isinstance(params, nnx.State):
    return nnx.from_flat_state(flat)
  tree = traverse_util.unflatten_dict(flat)
  return flax.core.freeze(tree) if isinstance(params, flax.core.FrozenDict) else tree


def fold_norm_affine(params: Mapping[str, Any], norm: Path, into: Sequence[Path], *,
                     keep_affine: bool = False) -> Mapping[str, Any]:
  """Folds a norm's ``scale`` g and ``bias`` b into the Dense layers it feeds.

  Each kernel ``W`` of shape ``[n, ...]`` (Dense, or DenseGeneral such as
  attention's query ``[n, heads, head_dim]``) becomes ``g * W``, g broadcast
  over axis 0, and its bias ``c`` becomes ``c + tensordot(b, W, 1)``: float32
  math, cast back to each leaf's dtype. Stacked layers fold layer by layer: g
  and b ``[*stack, n]``, kernels ``[*stack, n, ...]``. The norm must feed
  nothing but ``into``, unless ``keep_affine`` keeps its affine for the other
  consumers.

  Args:
    params: nested dict or FrozenDict of arrays, or an ``nnx.State`` of arrays
      or ``nnx.Variable``s; paths are relative to it.
    norm: path of the norm's params (``"scale"``, ``"bias"``, either may be
      absent), e.g. ``"Transformer/encoderblock_0/LayerNorm_0"`` or a tuple.
    into: paths of every linear layer the norm feeds (``"kernel"``, optional ``"bias"``).
    keep_affine: keep the norm's ``scale`` and ``bias`` as ``residual_scale``
      and ``residual_bias`` (post-LN: the residual stream still takes
      ``g * y + b``); by default they go.

  Returns:
    A new tree of params' container type (params is not mutated), changed
    Variables replaced by copies holding the new values. The norm
    loses ``scale`` and ``bias`` (renamed with ``keep_affine``); its entry goes
    if that empties it, as a param-less Flax module
    (``nn.LayerNorm(use_scale=False, use_bias=False)``) has none.

  Raises:
    ValueError: a path is not in params (naming the keys where lookup failed), a
      feature size differs from a kernel's first axis, or the norm's bias is
      nonzero and a layer in ``into`` has no bias.
  """
  return _folded(params, [(_path(norm, "norm"), _paths(into, "into"))], keep_affine)


def fold_all(params: Mapping[str, Any], rules: Mapping[Path, Sequence[Path]], *,
             keep_affine: bool = False) -> Mapping[str, Any]:
  """Applies `fold_norm_affine` wherever a rule's norm occurs in ``params``.

  A rule ``norm: into`` matches at every sub-dict of ``params``, the root
  included, that holds ``norm``; ``into`` is relative to that sub-dict. E.g.
  `VIT_RULES`' ``"LayerNorm_0"`` matches in each encoder block.

  Args:
    params: as in `fold_norm_affine`.
    rules: norm path -> paths of the layers it feeds, e.g. `VIT_RULES`.
    keep_affine: as in `fold_norm_affine`; True for a post-LN model.

  Returns:
    The folded tree, as from `fold_norm_affine`; params is not mutated.

  Raises:
    ValueError: a rule matches nowhere (a typo would fold nothing), or as
      `fold_norm_affine`.
  """
  keys = _flatten(params)
  folds = []
  for norm, into in rules.items():
    n, into = _path(norm, "rules key"), _paths(into, f"rules[{norm!r}]")
    prefixes = dict.fromkeys(
        k[:i] for k in keys for i in range(len(k) - len(n)) if k[i:i + len(n)] == n)
    if not prefixes:
      raise ValueError(f"rule {norm!r}: {rules[norm]!r} matches nowhere in params.")
    folds += [(p + n, [p + t for t in into]) for p in prefixes]
  return _folded(params, folds, keep_affine)
