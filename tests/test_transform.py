"""`lm.lowmem`: every rewrite against the function it replaces (its exact twin)."""

import dataclasses

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import lowmem_jax as lm
import plain_vit  # benchmarks/, on sys.path in conftest.py
from transform_checks import (KEY, LABELS, TOL, VOCAB, close, float_residuals, log_softmax_at,
                              normal)
from third_party_promotion import FLAX_NORM, JAX_DOT_PRODUCT_ATTENTION


ACTIVATIONS = {  # form: (function, the project's op it becomes)
    "jax.nn.gelu (tanh)": (jax.nn.gelu, "tanh"),
    "jax.nn.gelu (erfc)": (lambda x: jax.nn.gelu(x, approximate=False), lm.regelu2),
    # a user's float32 1/sqrt(2): erf runs in float32 whatever x's dtype, as it did when
    # np.sqrt(2.0) promoted x implicitly
    "erf by hand": (lambda x: (0.5 * x).astype(jnp.float32) * (1 + jax.lax.erf(
        x.astype(jnp.float32) / np.float32(np.sqrt(2.0)))), lm.regelu2),
    "jax.nn.silu": (jax.nn.silu, lm.resilu2),
    "x * sigmoid(x)": (lambda x: x * jax.nn.sigmoid(x), lm.resilu2),
    "jax.nn.relu": (jax.nn.relu, lm.relu),
    "maximum(x, 0)": (lambda x: jnp.maximum(x, 0.0), lm.relu),
}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("form", list(ACTIVATIONS))
def test_activation_rewritten_with_same_forward_and_the_ops_backward(form, dtype):
  fn, op = ACTIVATIONS[form]
  x = normal((4, 8, 64), dtype, scale=3.0)
  loss = lambda x: jnp.sum(fn(x).astype(jnp.float32) * jnp.arange(64.0)[None, None])
  fast = lm.lowmem(loss, activations="approx")
  assert fast.explain(x).counts == {"activation": 1}
  close(fast(x), loss(x), TOL[dtype] * 10)
  if op == "tanh":  # the tanh GELU keeps its forward and takes ReGELU2's backward
    op = lm.activations.regelu2_tanh
  twin = lambda x: jnp.sum(op(x).astype(jnp.float32) * jnp.arange(64.0)[None, None])
  chex.assert_trees_all_equal(jax.grad(fast)(x), jax.grad(twin)(x))
  saved = [r for r in float_residuals(fast, x) if r.shape == x.shape]
  assert not saved, "a float activation input is still saved"


def test_relu_gradient_is_exact():
  x = normal((8, 32))
  loss = lambda x: jnp.sum(jax.nn.relu(x) ** 2)
  chex.assert_trees_all_close(jax.grad(lm.lowmem(loss))(x), jax.grad(loss)(x), atol=1e-6)


class _PreLN(nn.Module):
  norm: type = nn.LayerNorm
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    h = self.norm(dtype=self.dtype)(x)
    return jnp.sum(nn.Dense(16, dtype=self.dtype)(h) ** 2) + jnp.sum(nn.Dense(8, dtype=self.dtype)(h))


class _PostLN(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    return jnp.sum((nn.Dense(32)(h) + h) ** 2)


def _perturbed(params):
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(KEY, len(leaves))
  return jax.tree.unflatten(tree, [p + 0.3 * jax.random.normal(k, p.shape, p.dtype)
                                   for p, k in zip(leaves, keys)])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=FLAX_NORM)])
@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.RMSNorm])
def test_linen_norm_folded_into_its_matmuls(norm, dtype):
  model = _PreLN(norm, dtype)
  x = normal((4, 16, 32), scale=2.0) + 1.0
  params = _perturbed(model.init(KEY, x))
  loss = lambda p, x: model.apply(p, x)
  fast = lm.lowmem(loss)
  (rewrite,) = fast.explain(params, x)
  assert rewrite.kind == "norm" and "fold into 2 matmuls" in rewrite.op, rewrite
  tol = 1e-5 if dtype == jnp.float32 else 3e-2
  close(jax.jit(fast)(params, x), jax.jit(loss)(params, x), tol)
  close(*(jax.jit(jax.grad(f, (0, 1)))(params, x) for f in (fast, loss)), tol * 10)
  names = {r.name for r in lm.memory.saved_residuals(fast, params, x).rows}
  assert {"norm_out", "norm_rstd"} <= names
  # the parameter tree is the user's: pretrained weights load as they are
  assert jax.tree.structure(jax.grad(fast)(params, x)) == jax.tree.structure(params)


def _along(v, x):
  """The ``[features]`` parameter ``v`` with x's rank, as a user's implicit broadcast makes it."""
  return jax.lax.broadcast_to_rank(v, x.ndim)


def _hand_ln(p, x):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) * jax.lax.rsqrt(var + 1e-5) * _along(p["g"], x) + _along(p["b"], x)


def _hand_rms(p, x):
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6) * _along(p["g"], x)


def _var_over_sqrt_ln(p, x):
  mu = x.mean(-1, keepdims=True)
  return ((x - mu) / jnp.sqrt(jnp.var(x, -1, keepdims=True) + 1e-5) * _along(p["g"], x)
          + _along(p["b"], x))


def _rms_over_sqrt(p, x):
  return _along(p["g"], x) * (x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6))


@pytest.mark.parametrize("norm", [_hand_ln, _hand_rms, _var_over_sqrt_ln, _rms_over_sqrt])
def test_hand_written_norm(norm):
  p = {"g": 1 + normal((32,), scale=0.2), "b": normal((32,)), "w": normal((32, 8)),
       "c": normal((8,))}
  x = normal((4, 16, 32), scale=3.0)
  loss = lambda p, x: jnp.sum(jnp.tanh(norm(p, x) @ p["w"] + p["c"][None, None]))
  fast = lm.lowmem(loss, activations=None)
  assert fast.explain(p, x).counts == {"norm": 1}
  close(jax.jit(fast)(p, x), jax.jit(loss)(p, x), 1e-5)
  close(*(jax.jit(jax.grad(f, (0, 1)))(p, x) for f in (fast, loss)), 1e-4)
  shapes = [r.shape for r in float_residuals(fast, p, x) if r.name is None]
  assert x.shape not in shapes, "the norm's input is still saved"


@pytest.mark.parametrize("w_dtype", [jnp.int8, jnp.bfloat16])
def test_no_fold_into_a_narrower_weight(w_dtype):
  """g * W rounded to an int8 or bfloat16 weight would change a float32 matmul's result."""
  p = {"g": 1 + normal((32,), scale=0.2), "b": normal((32,)),
       "w": (normal((32, 8)) * 20).astype(w_dtype)}
  x = normal((4, 16, 32), scale=3.0)
  loss = lambda p, x: jnp.sum(jnp.sin(jax.lax.dot_general(
      _hand_ln(p, x), p["w"], (((2,), (0,)), ((), ())), preferred_element_type=jnp.float32)))
  fast = lm.lowmem(loss, activations=None)
  (rewrite,) = fast.explain(p, x)
  assert "fold" not in rewrite.op and "affine kept" in rewrite.op, rewrite
  close(fast(p, x), loss(p, x), 1e-5)


def test_post_ln_keeps_the_affine_on_the_residual_path():
  model = _PostLN()
  x = normal((4, 16, 32))
  params = _perturbed(model.init(KEY, x))
  loss = lambda p, x: model.apply(p, x)
  fast = lm.lowmem(loss)
  (rewrite,) = fast.explain(params, x)
  assert "affine kept" in rewrite.op
  close(jax.grad(fast)(params, x), jax.grad(loss)(params, x), 1e-4)


def test_unbiased_variance_is_not_a_layer_norm():
  x = normal((4, 32))
  loss = lambda x: jnp.sum((x - x.mean(-1, keepdims=True)) / jnp.sqrt(
      jnp.var(x, -1, ddof=1, keepdims=True) + 1e-5) @ jnp.ones((32, 4)))
  assert lm.lowmem(loss).explain(x).counts == {}


def test_a_users_own_scalar_guard_on_the_variance_is_kept():
  x = normal((4, 32))

  def loss(x, ok):
    mu = x.mean(-1, keepdims=True)
    var = jnp.where(ok, jnp.mean(jnp.square(x - mu), -1, keepdims=True), jnp.nan)
    return jnp.sum(((x - mu) * jax.lax.rsqrt(var + 1e-5)) @ jnp.ones((32, 4)))
  ok = jnp.array(False)
  assert lm.lowmem(loss).explain(x, ok).counts == {}  # only jnp.var's n - ddof > 0 is passed
  assert np.isnan(lm.lowmem(loss)(x, ok))


def test_norm_like_expression_over_the_wrong_axis_is_left():
  x = normal((16, 32))
  def loss(x):
    mu = x.mean(0, keepdims=True)
    y = (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(0, keepdims=True) + 1e-5)
    return jnp.sum(y @ jnp.ones((32, 4)))
  assert lm.lowmem(loss).explain(x).counts == {}


L = 32
MASK = jnp.tril(jnp.ones((L, L), bool))[None, None]
BIAS = normal((1, 4, L, L), key=jax.random.key(3))


def _einsum_attention(q, k, v):
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (q.shape[-1] ** -0.5)
  s = jnp.where(MASK, s, -1e9)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


ATTENTIONS = {
    "jax.nn.dot_product_attention": lambda q, k, v: jax.nn.dot_product_attention(q, k, v),
    "jax.nn.dot_product_attention, mask": lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, mask=MASK),
    "flax.linen, mask": lambda q, k, v: nn.dot_product_attention(q, k, v, mask=MASK),
    "flax.linen, bias": lambda q, k, v: nn.dot_product_attention(q, k, v, bias=BIAS),
    "nnx, mask": lambda q, k, v: nnx.dot_product_attention(q, k, v, mask=MASK),
    "einsum by hand, where": _einsum_attention,
    "lm.attention_reference": lambda q, k, v: lm.attention_reference(q, k, v, is_causal=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("form", list(ATTENTIONS))
def test_attention_rewritten_without_an_lxl_residual(form):
  q, k, v = normal((3, 2, L, 4, 16))
  loss = lambda q, k, v: jnp.sum(ATTENTIONS[form](q, k, v) ** 2)
  fast = lm.lowmem(loss)
  assert fast.explain(q, k, v).counts == {"attention": 1}
  close(jax.jit(fast)(q, k, v), jax.jit(loss)(q, k, v), 1e-5)
  close(*(jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v) for f in (fast, loss)), 1e-4)
  lxl = [r for r in float_residuals(fast, q, k, v) if r.shape[-2:] == (L, L)]
  assert not lxl, lxl


HEAD_MASK = jax.random.bernoulli(jax.random.key(5), 0.7, (2, 8, L, L)) | jnp.eye(L, dtype=bool)
HEAD_BIAS = normal((1, 8, L, L), key=jax.random.key(6))


def _grouped_by_hand(q, k, v):
  b, t, n, d = q.shape
  s = jnp.einsum("btkgd,bskd->bkgts", q.reshape(b, t, k.shape[2], n // k.shape[2], d), k)
  s = jnp.where(MASK[:, :, None], s * d ** -0.5, -1e9)
  return jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, -1), v).reshape(b, t, n, d)


GROUPED = {
    "jax.nn, causal": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
    "jax.nn, a mask per head": lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, mask=HEAD_MASK),
    "jax.nn, bias": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias=HEAD_BIAS),
    "einsum by hand": _grouped_by_hand,
}


@pytest.mark.slow
@pytest.mark.parametrize("form", list(GROUPED))
def test_grouped_query_attention_rewritten_without_an_lxl_residual(form):
  q = normal((2, L, 8, 16))
  k, v = normal((2, 2, L, 2, 16), key=jax.random.key(1))
  loss = lambda q, k, v: jnp.sum(GROUPED[form](q, k, v) ** 2)
  fast = lm.lowmem(loss)
  assert fast.explain(q, k, v).counts == {"attention": 1}
  close(jax.jit(fast)(q, k, v), jax.jit(loss)(q, k, v), 1e-5)
  close(*(jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v) for f in (fast, loss)), 1e-4)
  scores = [r for r in float_residuals(fast, q, k, v) if np.prod(r.shape) == 2 * 8 * L * L]
  assert not scores, scores  # the [1, 8, L, L] bias, a constant here, has another size


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_output_projection_contracts_the_attention_output_as_saved(dtype):
  q, k, v = normal((3, 2, L, 4, 16), dtype)
  w = normal((64, 24), dtype, scale=0.1)
  loss = lambda q, k, v, w: jnp.sum(
      (_einsum_attention(q, k, v).reshape(2, L, 64) @ w).astype(jnp.float32) ** 2)
  fast = lm.lowmem(loss)
  assert fast.explain(q, k, v, w).counts == {"attention": 1, "layout": 1}
  close(jax.jit(fast)(q, k, v, w), jax.jit(loss)(q, k, v, w), 1e-5 if dtype == jnp.float32 else 2e-2)
  grads = [jax.jit(jax.grad(f, (0, 1, 2, 3)))(q, k, v, w) for f in (fast, loss)]
  scale = max(float(jnp.max(jnp.abs(g.astype(jnp.float32)))) for g in grads[1])
  close(*jax.tree.map(lambda g: g / scale, grads), 1e-4 if dtype == jnp.float32 else 3e-2)
  saved = [r.shape for r in float_residuals(fast, q, k, v, w)]
  assert (2, L, 4, 16) in saved and (2, L, 64) not in saved, saved


def test_attention_of_a_single_query():
  q = normal((2, 1, 4, 16))
  k, v = normal((2, 2, L, 4, 16), key=jax.random.key(1))
  loss = lambda q, k, v: jnp.sum(jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(
      jnp.einsum("bthd,bshd->bhts", q, k) / 4.0, -1), v) ** 2)
  fast = lm.lowmem(loss)
  assert fast.explain(q, k, v).counts == {"attention": 1}
  close(*(jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v) for f in (fast, loss)), 1e-4)


def test_softmax_not_followed_by_a_matmul_is_left():
  q, k = normal((2, 2, L, 4, 16))
  loss = lambda q, k: jnp.sum(jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), -1) ** 2)
  rewrites = lm.lowmem(loss).explain(q, k)
  assert rewrites.counts == {}
  assert [r.kind for r in rewrites] == ["attention"] and "matmul" in rewrites[0].left


class _Block(nnx.Module):
  """A transformer block of Flax's stock NNX modules."""

  def __init__(self, rngs):
    self.ln1 = nnx.LayerNorm(32, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(4, 32, decode=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(32, rngs=rngs)
    self.fc1 = nnx.Linear(32, 64, rngs=rngs)
    self.fc2 = nnx.Linear(64, 32, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))


@pytest.mark.slow
def test_nnx_block_of_stock_modules():
  graphdef, state = nnx.split(_Block(nnx.Rngs(0)))
  state = _perturbed(state)
  x = normal((2, 16, 32))
  loss = lambda state, x: jnp.mean(nnx.merge(graphdef, state)(x) ** 2)
  rewrites = lm.lowmem(loss, activations="approx").explain(state, x)
  assert rewrites.counts == {"attention": 1, "norm": 2, "activation": 1}
  # each source is the user's call of the stock module, not a line inside Flax
  assert {r.source.split(":")[0] for r in rewrites} == {"test_transform.py"}, rewrites
  exact = lm.lowmem(loss)  # the default: the GELU recomputed from its input, exact too
  assert exact.explain(state, x).counts == {"attention": 1, "norm": 2, "activation": 1}
  close(jax.jit(exact)(state, x), jax.jit(loss)(state, x), 1e-5)
  close(*(jax.jit(jax.grad(f))(state, x) for f in (exact, loss)), 1e-4)


def test_nested_scan_checkpoint_cond_and_jit_are_rewritten():
  ws = normal((3, 32, 32), scale=0.2)
  x = normal((4, 32))
  policy = jax.checkpoint_policies.save_only_these_names("act_code")

  @jax.jit
  def layer(h, w):
    return jax.nn.gelu(h @ w, approximate=False)

  def loss(ws, x):
    def body(h, w):
      h = jax.checkpoint(layer, policy=policy)(h, w)
      return jax.lax.cond(h.sum() > 0, jax.nn.relu, jax.nn.silu, h), None
    return jnp.sum(jax.lax.scan(body, x, ws)[0] ** 2)

  fast = lm.lowmem(loss, activations="approx")
  assert fast.explain(ws, x).counts == {"activation": 3}
  close(fast(ws, x), loss(ws, x), 1e-5)
  jaxpr = str(jax.make_jaxpr(fast)(ws, x))
  assert jaxpr.count("custom_vjp_call") == 3 and "remat" in jaxpr and "scan" in jaxpr
  grads = jax.jit(jax.grad(fast))(ws, x)
  assert np.isfinite(np.asarray(grads)).all()


def test_composes_with_vmap_and_jit():
  x = normal((3, 8, 64))
  fn = lambda x: jnp.sum(jax.nn.gelu(x) ** 2)
  fast = jax.jit(jax.vmap(jax.grad(lm.lowmem(fn, activations="approx"))))
  twin = jax.vmap(jax.grad(lambda x: jnp.sum(lm.activations.regelu2_tanh(x) ** 2)))
  close(fast(x), twin(x), 1e-6)


def _block_loss(p, x, labels, keep):
  """A pre-norm block (a hand-written layer norm, attention over the keys ``keep`` marks, a
  ReLU MLP: its rewrite is exact) and its LM head's loss."""
  h = _hand_ln(p["ln"], x)
  q, k, v = (jnp.einsum("bld,de->ble", h, p[n]).reshape(*x.shape[:2], 4, 8) for n in "qkv")
  o = jax.nn.dot_product_attention(q, k, v, mask=keep, is_causal=True)
  x = x + o.reshape(x.shape) @ p["o"]
  x = x + jax.nn.relu(x @ p["up"]) @ p["down"]
  return jnp.mean(log_softmax_at(x @ p["head"], labels))


BLOCK_SHARDINGS = {  # layout: the specs of the inputs and of the parameters
    "batch": (P("data"), P()),
    "fsdp": (P("data"), P("data")),
}


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("layout", list(BLOCK_SHARDINGS))
def test_sharded_block_is_rewritten_and_explained_as_unsharded(axis_type, layout):
  """On 4 x 2 devices of automatic or explicit axes, with the batch over "data" and the
  parameters replicated or over "data" too: the rewrites of the unsharded trace, the
  function's loss and gradients."""
  shapes = {"ln": {"g": (32,), "b": (32,)}, "q": (32, 32), "k": (32, 32), "v": (32, 32),
            "o": (32, 32), "up": (32, 64), "down": (64, 32), "head": (32, VOCAB)}
  keys = iter(jax.random.split(KEY, 9))
  params = jax.tree.map(lambda s: normal(s, key=next(keys), scale=0.3), shapes,
                        is_leaf=lambda s: isinstance(s, tuple))
  x, labels = normal((8, 16, 32), key=jax.random.key(1)), LABELS[:, :16].repeat(4, 0)
  keep = (jnp.arange(16)[None] < jnp.arange(8, 16)[:, None])[:, None, None]  # padded keys
  want = lm.lowmem(_block_loss).explain(params, x, labels, keep)
  assert want.counts == {"loss": 1, "attention": 1, "layout": 1, "norm": 1, "activation": 1}
  # the parameters gathered where used, as FSDP gathers them
  loss = lambda p, *batch: _block_loss(
      jax.tree.map(lambda w: jax.sharding.reshard(w, P()), p), *batch)
  fast = lm.lowmem(loss)
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(getattr(AxisType, axis_type),) * 2)
  batch_spec, param_spec = BLOCK_SHARDINGS[layout]
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  with jax.set_mesh(mesh):
    args = (jax.tree.map(lambda w: put(w, param_spec), params),
            *(put(a, batch_spec) for a in (x, labels, keep)))
    assert fast.explain(*args) == want
    got, ref = (jax.jit(jax.value_and_grad(f))(*args) for f in (fast, loss))
  close(got, ref, 1e-4)


def test_nothing_to_rewrite_gives_the_same_jaxpr():
  fn = lambda x, w: jnp.sum(jnp.tanh(x @ w) * 2.0 + 1.0)
  x, w = normal((4, 8)), normal((8, 8))
  assert str(jax.make_jaxpr(lm.lowmem(fn))(x, w)) == str(jax.make_jaxpr(fn)(x, w))


def test_jaxs_softmax_and_logsumexp_left_keep_their_own_derivative():
  """From jax 0.12.1 `jax.nn.softmax` and `jax.nn.logsumexp` are custom_jvp calls, inlined for
  the matchers: where no match takes one, the call is bound again (its derivative rule and
  residuals kept, no mark of the inlining left), under a nested `lowmem` and ``where`` too.
  Each function also holds an attention the rewrite takes, so that it rewrites at all."""
  x, w = normal((64, 512)), normal((512, 8))
  q = lambda x: x.reshape(1, 64, 8, 64)
  attention = lambda x: jnp.sum(jax.nn.dot_product_attention(q(x), q(x), q(x)) ** 2)
  lefts = [lambda x: jnp.sum(jax.nn.softmax(x) @ w),
           lambda x: jnp.sum(jax.nn.logsumexp(x, axis=-1)),
           lambda x: jnp.sum(jax.nn.softmax(x, where=x > 0) ** 2),
           lambda x: jnp.sum(jax.jit(lm.lowmem(lambda y: jax.nn.softmax(y, where=y > 0) * 2))(x)
                             + jax.nn.softmax(x, axis=0))]
  calls = lambda f: str(jax.make_jaxpr(f)(x)).count("custom_jvp_call")
  for left in lefts:
    f = lambda x, left=left: attention(x) + left(x)
    g = lm.lowmem(f)
    assert g.explain(x).counts == {"attention": 1}
    assert calls(g) == calls(left)  # the attention's softmax taken, the other one kept
    apart = lambda x, left=left: lm.lowmem(attention)(x) + left(x)
    assert (lm.memory.saved_residuals(g, x).total_bytes
            == lm.memory.saved_residuals(apart, x).total_bytes)
    np.testing.assert_allclose(jax.grad(g)(x), jax.grad(f)(x), rtol=1e-4, atol=1e-5)
    assert "lowmem_jax_inlined" not in jax.jit(jax.grad(g)).lower(x).as_text(debug_info=True)


def test_options_turn_rewrites_off_and_bad_options_raise():
  x = normal((4, 16, 32))
  fn = lambda x: jnp.sum(jax.nn.gelu(nn.LayerNorm().apply({"params": {"scale": jnp.ones(32),
                                                                      "bias": jnp.zeros(32)}}, x)))
  assert lm.lowmem(fn, norms=None, activations="approx").explain(x).counts == {"activation": 1}
  assert lm.lowmem(fn, activations=None, norms=None).explain(x).counts == {}
  with pytest.raises(ValueError, match="activations"):
    lm.lowmem(fn, activations=True)
  with pytest.raises(ValueError, match="norms"):
    lm.lowmem(fn, norms="fast")
  with pytest.raises(TypeError, match="remat"):
    lm.lowmem(fn, remat=True)
  with pytest.raises(TypeError, match="fn must be callable"):
    lm.lowmem(3)


def test_explain_counts_the_bytes_and_prints_a_table():
  q, k, v = normal((3, 2, L, 4, 16))
  loss = lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(q, k, v) ** 2)
  rewrites = lm.lowmem(loss).explain(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v)))
  plain = lm.memory.saved_residuals(loss, q, k, v).total_bytes
  fast = lm.memory.saved_residuals(lm.lowmem(loss), q, k, v).total_bytes
  assert plain - fast > 0  # counted on the pattern alone: equal up to scalars
  np.testing.assert_allclose(rewrites.saved_bytes, plain - fast, rtol=1e-3)
  assert "lm.attention" in str(rewrites) and "test_transform.py" in rewrites[0].source


def test_rewrites_is_a_frozen_sequence():
  x = normal((4, 8, 64))
  rewrites = lm.lowmem(lambda x: jnp.sum(jax.nn.gelu(x) ** 2), activations="approx").explain(x)
  assert isinstance(rewrites, lm.Rewrites) and dataclasses.is_dataclass(rewrites)
  assert len(rewrites) == 1 and rewrites[0] == rewrites.rewrites[0] == next(iter(rewrites))
  assert rewrites[0].op == "tanh-gelu → regelu2 backward" and rewrites[:1] == rewrites.rewrites
  with pytest.raises(dataclasses.FrozenInstanceError):
    rewrites.rewrites = ()


@JAX_DOT_PRODUCT_ATTENTION
def test_attention_compiles_for_the_h100_target_where_cudnn_refuses_the_length():
  # cuDNN takes the forward of L = 197 but refuses it once differentiated:
  # lm.attention falls back to its chunked backward under the caller's grad.
  q = jax.ShapeDtypeStruct((2, 197, 4, 64), jnp.bfloat16)
  loss = lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(q, k, v).astype(jnp.float32))
  stats = lm.memory.analyze(jax.grad(lm.lowmem(loss)), q, q, q, target="h100")
  assert stats.peak_bytes > 0


@pytest.mark.slow
@pytest.mark.heavy
def test_per_block_memory_of_a_plain_vit_on_the_h100_target():
  """benchmarks/plain_vit.py's model (plain JAX, written without the project)
  at width 256, batch 16 x 65 tokens, bfloat16: what one block keeps from its
  forward to its backward in XLA's buffer assignment for the H100 target.

  Through `lm.lowmem` a block keeps the two norm outputs, q, k, v, the
  attention output, the GELU output and its 2-bit code: 10.5 arrays of
  [16, 65, 256] bfloat16. Without the barriers (`_layout.barrier_rows` and
  the activation's) XLA kept 13.8: the norm and attention outputs in two
  layouts, the fc1 output for the code.
  """
  def shapes(depth):
    params = jax.eval_shape(lambda: plain_vit.init(
        KEY, depth=depth, dim=256, mlp=1024, image=128, classes=10))
    return (params, jax.ShapeDtypeStruct((16, 128, 128, 3), jnp.float32),
            jax.ShapeDtypeStruct((16,), jnp.int32))

  def per_block(fn):
    temp = [lm.memory.analyze(jax.grad(fn), *shapes(d), target="h100").temp_bytes for d in (4, 2)]
    return (temp[0] - temp[1]) / 2

  loss = lambda p, images, labels: plain_vit.loss(p, images, labels, heads=4)
  unit = 16 * 65 * 256 * 2
  plain, lowmem = per_block(loss), per_block(lm.lowmem(loss, activations="approx"))
  assert lowmem <= 11 * unit
  assert lowmem <= 0.5 * plain


def test_memory_report_names_the_rewritten_residuals():
  params = {"g": jnp.ones(64), "b": jnp.zeros(64), "w1": normal((64, 256)),
            "w2": normal((256, 64))}
  x = jax.ShapeDtypeStruct((128, 64), jnp.float32)
  fast = lm.lowmem(lambda p, x: jnp.mean(
      jax.nn.gelu(_hand_ln(p, x) @ p["w1"], approximate=False) @ p["w2"]), activations="approx")
  b = lm.memory.report(jax.grad(fast), params, x, loss_fn=fast, loss_args=(params, x), target="cpu")
  names = b.saved.by_name()
  assert {lm.names.NORM_OUT, lm.names.NORM_RSTD, lm.names.ACT_CODE} <= set(names)
  assert lm.names.NORM_OUT in str(b)


@pytest.mark.slow
def test_default_keeps_the_gradient_and_approx_changes_it():
  """The default rewrites only what keeps the gradient: the GELU and SiLU recomputed from
  their input (one residual each, not autodiff's several), ReLU's 1-bit mask; "approx"
  takes ReGELU2 and ReSiLU2, marked approximate."""
  p = {"g": jnp.ones(64), "b": jnp.zeros(64), "w1": normal((64, 256), scale=0.1),
       "w2": normal((256, 64), scale=0.1)}
  x = normal((32, 64))
  loss = lambda p, x: jnp.mean(jax.nn.relu(jax.nn.silu(jax.nn.gelu(
      _hand_ln(p, x) @ p["w1"]) @ p["w2"]) @ p["w1"]))
  exact, approx = lm.lowmem(loss), lm.lowmem(loss, activations="approx")
  rewrites = exact.explain(p, x)
  assert rewrites.counts == {"norm": 1, "activation": 3} and rewrites.exact
  assert [r.op for r in rewrites if r.kind == "activation"] == [
      "tanh GELU and the matmul it feeds, recomputed from its input",
      "SiLU and the matmul it feeds, recomputed from its input", "relu"]
  assert "exact gradient" in str(rewrites)
  close(jax.grad(exact)(p, x), jax.grad(loss)(p, x), 1e-5)
  sizes = [lm.memory.saved_residuals(f, p, x).activation_bytes for f in (exact, loss)]
  assert sizes[0] < sizes[1] - 4 * 32 * 256 * 4  # the GELU's and SiLU's extra arrays gone
  assert abs(exact.gradient_cosine(p, x) - 1.0) < 1e-5
  marked = approx.explain(p, x)
  assert marked.counts == {"norm": 1, "activation": 3} and not marked.exact
  assert sorted(r.exact for r in marked if r.kind == "activation") == [False, False, True]
  assert approx.gradient_cosine(p, x) < 0.9999
  with pytest.raises(ValueError, match="float array"):
    exact.gradient_cosine(jnp.arange(3))
