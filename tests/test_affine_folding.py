import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lowmem_jax as lm
from lowmem_jax.flax import affine_folding


class MlpBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    y = nn.gelu(nn.Dense(4 * x.shape[-1])(x))
    return nn.Dense(x.shape[-1])(y)


class Encoder1DBlock(nn.Module):
  affine: bool

  @nn.compact
  def __call__(self, x):
    norm = lambda: nn.LayerNorm(use_scale=self.affine, use_bias=self.affine)
    x = x + nn.MultiHeadDotProductAttention(num_heads=2)(norm()(x))
    return x + MlpBlock()(norm()(x))


class Encoder(nn.Module):
  affine: bool

  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = Encoder1DBlock(self.affine, name=f"encoderblock_{i}")(x)
    return nn.LayerNorm(use_scale=self.affine, use_bias=self.affine, name="encoder_norm")(x)


class ViT(nn.Module):
  """big_vision's pre-LN layout, pool_type="gap"."""
  affine: bool = True

  @nn.compact
  def __call__(self, x):
    x = Encoder(self.affine, name="Transformer")(x)
    return nn.Dense(3, name="head")(jnp.mean(x, axis=1))


class Attention(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = lambda name: nn.Dense(x.shape[-1], use_bias=False, name=name)
    q, k, v = (dense(n)(x).reshape(*x.shape[:-1], 2, -1) for n in ("wq", "wk", "wv"))
    out = nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(x[..., 0]))
    return dense("wo")(out.reshape(x.shape))


class FeedForward(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = lambda features, name: nn.Dense(features, use_bias=False, name=name)
    h = nn.silu(dense(2 * x.shape[-1], "w1")(x)) * dense(2 * x.shape[-1], "w3")(x)
    return dense(x.shape[-1], "w2")(h)


class Layer(nn.Module):
  affine: bool

  @nn.compact
  def __call__(self, x):
    norm = lambda name: nn.RMSNorm(use_scale=self.affine, name=name)
    x = x + Attention(name="attention")(norm("attention_norm")(x))
    return x + FeedForward(name="feed_forward")(norm("ffn_norm")(x))


class Llama(nn.Module):
  """Meta's LLaMA names: layers_i/{attention_norm, attention, ...}, norm, output."""
  affine: bool = True

  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = Layer(self.affine, name=f"layers_{i}")(x)
    x = nn.RMSNorm(use_scale=self.affine, name="norm")(x)
    return nn.Dense(5, use_bias=False, name="output")(x)


def _normal(rng, shape):
  return jnp.asarray(rng.standard_normal(shape, np.float32))


def _random_params(module, x):
  """Random params of ``module``'s shapes: non-trivial norm scales/biases, Dense biases."""
  shapes = jax.eval_shape(module.init, jax.random.key(0), x)["params"]
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda s: 0.5 * _normal(rng, s.shape), shapes)


@pytest.mark.parametrize(
    "model,rules", [(ViT, affine_folding.VIT_RULES), (Llama, affine_folding.LLAMA_RULES)], ids=["vit", "llama"])
def test_folded_model_matches_original(model, rules):
  x = _normal(np.random.default_rng(1), (2, 5, 8))
  params = _random_params(model(), x)
  folded = affine_folding.fold_all(params, rules)
  plain = model(affine=False)
  chex.assert_trees_all_equal_shapes_and_dtypes(folded, _random_params(plain, x))
  got = jax.jit(plain.apply)({"params": folded}, x)
  chex.assert_trees_all_close(
      got, jax.jit(model().apply)({"params": params}, x), atol=1e-5, rtol=1e-5)


def test_stacked_layers_fold_layer_by_layer():
  """Leaves ``[layers, ...]`` (nn.scan's params) fold as each layer's slice would."""
  rng = np.random.default_rng(0)
  layers, n = 3, 6
  params = {"ln": {"scale": 1 + _normal(rng, (layers, n)), "bias": _normal(rng, (layers, n))},
            "attn": {"query": {"kernel": _normal(rng, (layers, n, 2, 3)),
                               "bias": _normal(rng, (layers, 2, 3))}}}
  out = affine_folding.fold_norm_affine(params, "ln", ["attn/query"])
  for i in range(layers):
    one = affine_folding.fold_norm_affine(jax.tree.map(lambda x, i=i: x[i], params), "ln",
                                          ["attn/query"])
    chex.assert_trees_all_close(jax.tree.map(lambda x, i=i: x[i], out), one, atol=1e-6)
  with pytest.raises(ValueError, match=r"shape \(3, 6\) does not match the leading"):
    affine_folding.fold_norm_affine(
        {**params, "attn": {"query": {"kernel": params["attn"]["query"]["kernel"][:, :4]}}},
        "ln", ["attn/query"])


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 5e-2)])
@pytest.mark.parametrize(
    "leaves", [("scale",), ("bias",), ("scale", "bias")], ids=["scale", "bias", "both"])
def test_fold_norm_affine_into_rank3_kernel(dtype, tol, leaves):
  rng = np.random.default_rng(0)
  n, heads, head_dim = 6, 2, 3
  g = 1 + _normal(rng, (n,)) if "scale" in leaves else jnp.ones(n)
  b = _normal(rng, (n,)) if "bias" in leaves else jnp.zeros(n)
  w = _normal(rng, (n, heads, head_dim)).astype(dtype)
  c = _normal(rng, (heads, head_dim)).astype(dtype)
  norm = {"scale": g, "bias": b}
  params = {"ln": {k: norm[k] for k in leaves}, "attn": {"query": {"kernel": w, "bias": c}}}

  out = affine_folding.fold_norm_affine(params, ("ln",), ["attn/query"])

  assert set(out) == {"attn"}
  q = out["attn"]["query"]
  assert q["kernel"].dtype == dtype and q["bias"].dtype == dtype
  z = _normal(rng, (4, n))
  f32 = lambda a: a.astype(jnp.float32)
  want = jnp.einsum("bn,nhk->bhk", z * g[None] + b[None], f32(w)) + f32(c)[None]
  got = jnp.einsum("bn,nhk->bhk", z, f32(q["kernel"])) + f32(q["bias"])[None]
  chex.assert_trees_all_close(got, want, atol=tol, rtol=tol)


def _tiny(bias=1.0):
  rng = np.random.default_rng(0)
  return {"enc": {
      "ln": {"scale": 1 + _normal(rng, (6,)), "bias": jnp.full((6,), bias)},
      "fc": {"kernel": _normal(rng, (6, 3)), "bias": _normal(rng, (3,))},
      "fc_nobias": {"kernel": _normal(rng, (6, 3))},
  }}


@pytest.mark.parametrize("container", [dict, flax.core.freeze], ids=["dict", "frozen"])
def test_input_not_mutated_and_container_kept(container):
  params = container(_tiny())
  before = jax.tree.map(np.array, params)
  out = affine_folding.fold_norm_affine(params, "enc/ln", ["enc/fc"])
  assert type(out) is type(params)
  assert set(out["enc"]) == {"fc", "fc_nobias"}
  chex.assert_trees_all_equal(params, before)
  chex.assert_trees_all_equal(out["enc"]["fc_nobias"], params["enc"]["fc_nobias"])


def test_zero_norm_bias_needs_no_layer_bias():
  params = _tiny(bias=0.0)
  out = affine_folding.fold_norm_affine(params, "enc/ln", ["enc/fc_nobias"])
  assert set(out["enc"]["fc_nobias"]) == {"kernel"}
  chex.assert_trees_all_close(
      out["enc"]["fc_nobias"]["kernel"],
      params["enc"]["ln"]["scale"][:, None] * params["enc"]["fc_nobias"]["kernel"])


@pytest.mark.parametrize("call,error,match", [
    (lambda p: affine_folding.fold_norm_affine(p, "enc/ln", ["enc/fc", "enc/fc_nobias"]),
     ValueError, "'enc/fc_nobias' has no 'bias'"),
    (lambda p: affine_folding.fold_norm_affine(
        {**p, "wide": {"kernel": jnp.ones((7, 3))}}, "enc/ln", ["wide"]),
     ValueError, r"\(6,\).*\(7, 3\)"),
    (lambda p: affine_folding.fold_norm_affine(p, "enc/ln_x", ["enc/fc"]),
     ValueError, r"'enc/ln_x' not found: no 'ln_x' at enc, which holds "
     r"\['fc', 'fc_nobias', 'ln'\]"),
    (lambda p: affine_folding.fold_norm_affine(p, "enc/ln", ["dec/fc"]),
     ValueError, r"'dec/fc' not found: no 'dec' at the root, which holds \['enc'\]"),
    (lambda p: affine_folding.fold_norm_affine(p, "enc/ln", "enc/fc"), TypeError, "sequence of paths"),
    (lambda p: affine_folding.fold_all(p, {"ln": ("fc",), "LayerNorm_9": ("fc",)}),
     ValueError, "'LayerNorm_9'.*matches nowhere"),
], ids=["missing-bias", "shape", "unknown-norm", "unknown-into", "into-str", "rule-nowhere"])
def test_errors(call, error, match):
  with pytest.raises(error, match=match):
    call(_tiny())


def test_keep_affine_folds_copies_and_keeps_the_norm():
  params = _tiny()
  out = affine_folding.fold_norm_affine(params, "enc/ln", ["enc/fc"], keep_affine=True)
  chex.assert_trees_all_equal(out["enc"]["ln"], {"residual_scale": params["enc"]["ln"]["scale"],
                                                 "residual_bias": params["enc"]["ln"]["bias"]})
  chex.assert_trees_all_close(out["enc"]["fc"],
                              affine_folding.fold_norm_affine(params, "enc/ln", ["enc/fc"])["enc"]["fc"])
  with pytest.raises(ValueError, match="no 'scale' or 'bias' to fold"):  # folded once only
    affine_folding.fold_norm_affine(out, "enc/ln", ["enc/fc"], keep_affine=True)


class NnxBlock(nnx.Module):
  """A stock NNX pre-LN block: a LayerNorm (or its stand-in) feeding a Linear."""

  def __init__(self, norm, rngs):
    self.ln = norm(6, rngs=rngs)
    self.fc = nnx.Linear(6, 3, rngs=rngs)

  def __call__(self, x):
    return self.fc(self.ln(x))


class NnxModel(nnx.Module):
  def __init__(self, norm, rngs):
    self.blocks = nnx.List([NnxBlock(norm, rngs) for _ in range(2)])  # int keys in the state

  def __call__(self, x):
    return jnp.concatenate([block(x) for block in self.blocks], axis=-1)


@pytest.mark.parametrize("pure", [False, True], ids=["variables", "arrays"])
def test_nnx_state_folds_like_a_dict(pure):
  model = NnxModel(nnx.LayerNorm, nnx.Rngs(0))
  rng = np.random.default_rng(0)
  for block in model.blocks:
    block.ln.scale[...] = 1 + 0.5 * _normal(rng, (6,))
    block.ln.bias[...] = 0.5 * _normal(rng, (6,))
    block.fc.bias[...] = 0.5 * _normal(rng, (3,))
  state = nnx.state(model, nnx.Param)
  state = nnx.as_pure(state) if pure else state
  folded = affine_folding.fold_all(state, {"ln": ("fc",)})
  assert type(folded) is nnx.State
  assert type(folded["blocks"][0]["fc"]["kernel"]) is type(state["blocks"][0]["fc"]["kernel"])
  chex.assert_trees_all_close(nnx.to_pure_dict(folded),
                              affine_folding.fold_all(nnx.to_pure_dict(state), {"ln": ("fc",)}))
  one = affine_folding.fold_norm_affine(state, ("blocks", 1, "ln"), [("blocks", 1, "fc")])
  chex.assert_trees_all_close(nnx.to_pure_dict(one)["blocks"][1],
                              nnx.to_pure_dict(folded)["blocks"][1])

  plain = NnxModel(lm.nnx.MSLayerNorm, nnx.Rngs(1))
  nnx.update(plain, folded)
  x = _normal(rng, (4, 6))
  chex.assert_trees_all_close(plain(x), model(x), atol=1e-5, rtol=1e-5)
