import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowmem_jax as lm
from lowmem_jax import models
from lowmem_jax.models.llama import Llama, LlamaConfig
from lowmem_jax.models.vit import ViT
from third_party_promotion import FLAX_NORM

TINY_VIT = dict(patch_size=4, width=32, depth=2, mlp_dim=64, num_heads=2, num_classes=10)
TINY_LLAMA = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


def _perturb(params, seed=1):
  """Random non-trivial norm affines, so that folding has work to do."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [l + 0.1 * jax.random.normal(k, l.shape, l.dtype)
                                   for l, k in zip(leaves, keys)])


@pytest.mark.parametrize("make,inputs", [
    (lambda **kw: ViT(**TINY_VIT, **kw), jnp.ones((2, 16, 16, 3))),
    (lambda **kw: Llama(TINY_LLAMA, **kw), jnp.arange(16).reshape(2, 8) % 64),
])
@pytest.mark.slow
def test_ms_norm_is_the_plain_model_with_the_same_params(make, inputs):
  """``norm="ms"`` holds the plain norms' scales (and biases) and trains them: the same
  parameter tree, function and gradient (the exact twin), every norm parameter included."""
  plain = make()
  params = _perturb(plain.init(jax.random.key(0), inputs)["params"])
  if inputs.dtype != jnp.int32:
    inputs = jax.random.normal(jax.random.key(2), inputs.shape)
  ms = make(norm="ms")
  ms_params = ms.init(jax.random.key(0), inputs)["params"]
  assert jax.tree.structure(params) == jax.tree.structure(ms_params)
  loss = lambda model: (lambda p: jnp.sum(jnp.sin(model.apply({"params": p}, inputs))))
  chex.assert_trees_all_close(ms.apply({"params": params}, inputs),
                              plain.apply({"params": params}, inputs), atol=1e-5, rtol=1e-5)
  # Float32 rounding apart: the sums over tokens in another order, 16 float32 epsilons of a
  # leaf's largest gradient at least (jax 0.12 moved one of the tiny LLaMA's embedding
  # gradients, which reach 77, by 2.8e-5).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=1e-4, atol=max(1e-5, 16 * np.finfo(np.float32).eps * np.max(np.abs(b)))),
      jax.grad(loss(ms))(params), jax.grad(loss(plain))(params))


@pytest.mark.parametrize("make,inputs", [
    (lambda **kw: ViT(**TINY_VIT, **kw), jnp.ones((2, 16, 16, 3))),
    (lambda **kw: Llama(TINY_LLAMA, **kw), jnp.arange(16).reshape(2, 8) % 64),
])
@pytest.mark.slow
def test_switches_and_remat(make, inputs):
  base = make()
  params = base.init(jax.random.key(0), inputs)["params"]
  out = base.apply({"params": params}, inputs)
  approx = make(activation="approx")
  chex.assert_trees_all_close(approx.apply({"params": params}, inputs), out, atol=1e-5)
  loss = lambda m: (lambda p: jnp.sum(m.apply({"params": p}, inputs) ** 2))
  g = jax.grad(loss(approx))(params)
  g_remat = jax.grad(loss(make(activation="approx", remat=True)))(params)
  # Float32 rounding apart, remat or not placing the sums differently: a sum over the 16
  # tokens rounded in another order, 16 float32 epsilons of the largest gradient (jax 0.12
  # moved one of the tiny LLaMA's embedding gradients, which reach 64, by 5.3e-5).
  scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g))
  chex.assert_trees_all_close(g_remat, g, atol=16 * float(jnp.finfo(jnp.float32).eps) * scale)
  # The approximate gradient differs from the exact one, but not wildly: the
  # relative distance measured 0.27 on the tiny LLaMA (sum-of-squares loss).
  # Whether training still converges is a convergence test's job, not this.
  g_exact = jax.grad(loss(base))(params)
  flat, flat_exact = (jnp.concatenate([l.ravel() for l in jax.tree.leaves(t)]) for t in (g, g_exact))
  rel = float(jnp.linalg.norm(flat - flat_exact) / jnp.linalg.norm(flat_exact))
  assert 0 < rel < 0.5


@pytest.mark.slow
@pytest.mark.parametrize("make,inputs", [
    (lambda **kw: ViT(**TINY_VIT, **kw), jnp.ones((2, 16, 16, 3))),
    (lambda **kw: Llama(TINY_LLAMA, **kw), jnp.arange(16).reshape(2, 8) % 64),
])
def test_recompute_attention_is_the_same_function_and_gradient(make, inputs):
  plain, recompute = make(), make(attention="recompute")
  params = plain.init(jax.random.key(0), inputs)["params"]
  assert jax.tree.structure(recompute.init(jax.random.key(0), inputs)["params"]) == jax.tree.structure(params)
  loss = lambda m: (lambda p: jnp.sum(m.apply({"params": p}, inputs) ** 2))
  chex.assert_trees_all_close(jax.value_and_grad(loss(recompute))(params),
                              jax.value_and_grad(loss(plain))(params), atol=1e-4, rtol=1e-4)


@FLAX_NORM
def test_approx_and_ms_variants_save_less():
  """ViT-B/16 at batch 64, bfloat16 compute: tracing only, nothing compiles."""
  def saved(**switches):
    wl = models.workload("vit-b16", batch=64, **switches)
    labels = jnp.zeros(wl.labels.shape, jnp.int32)
    return lm.memory.saved_residuals(lambda p, x: wl.loss(p, x, labels), wl.abstract_params(),
                                     wl.inputs)
  base, both = saved(), saved(activation="approx", norm="ms")
  # 0.507 measured (0.46 before the MS LayerNorms kept their bias: in bfloat16 they save
  # their output before the affine besides the one the matmul saves, to stay exact)
  assert both.activation_bytes < 0.55 * base.activation_bytes
  assert both.by_name()[lm.names.ACT_CODE] > 0
  every = saved(activation="approx", norm="ms", attention="recompute")
  assert lm.names.ATTN_PROBS not in every.by_name()
  assert not [r for r in every.rows if r.shape[-2:] == (197, 197)]
  assert every.activation_bytes < both.activation_bytes - 0.5 * both.by_name()[lm.names.ATTN_PROBS]


def test_workload_validates():
  with pytest.raises(ValueError, match="name"):
    models.workload("vit-x", batch=1)
  with pytest.raises(ValueError, match="batch"):
    models.workload("vit-b16", batch=0)
  with pytest.raises(ValueError, match="activation"):
    models.workload("vit-b16", batch=1, activation="fast")
  with pytest.raises(ValueError, match="attention"):
    models.workload("vit-b16", batch=1, attention="flash")
  with pytest.raises(ValueError, match="loss"):
    models.workload("llama-100m", batch=1, loss="chunked")
  with pytest.raises(ValueError, match="loss='fused' applies to the LLaMA models"):
    models.workload("vit-b16", batch=1, loss="fused")


@pytest.mark.slow
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5),
                                        pytest.param(jnp.bfloat16, 3e-2, marks=FLAX_NORM)])
def test_llama_fused_loss_is_the_plain_loss_without_the_logits(dtype, tol):
  config = models.LlamaConfig(vocab_size=256, dim=32, n_layers=1, n_heads=2, ffn_dim=64)
  plain = models.Llama(config, dtype=dtype)
  fused = plain.clone(loss="fused")
  tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, 256)
  labels = jnp.roll(tokens, -1, axis=1)
  params = plain.init(jax.random.key(1), tokens)["params"]
  losses = [lambda p, m=m: m.apply({"params": p}, tokens, labels) for m in (plain, fused)]
  applies = [jax.jit(m.apply) for m in (plain, fused)]  # compiled once, for every labels
  values = [f({"params": params}, tokens, labels) for f in applies]
  np.testing.assert_allclose(values[0], values[1], rtol=tol)
  reference = jax.jit(lambda p: optax.softmax_cross_entropy_with_integer_labels(
      plain.apply({"params": p}, tokens), labels).mean())
  np.testing.assert_allclose(values[0], reference(params), rtol=1e-6)
  grads = [jax.jit(jax.grad(f))(params) for f in losses]
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads[0]))
  chex.assert_trees_all_close(*jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads),
                              atol=tol * 10)
  saved = lm.memory.saved_residuals(losses[1], params).rows
  assert not [r for r in saved if np.prod(r.shape) >= tokens.size * 256], saved
  for bad, finite in ((labels.at[0, 0].set(-1), True), (labels.at[0, 0].set(256), False)):
    values = [f({"params": params}, tokens, bad) for f in applies]  # optax's
    assert bool(jnp.isfinite(values[1])) is finite
    np.testing.assert_allclose(values[0], values[1], rtol=tol)


@FLAX_NORM
def test_workload_batch_and_loss_run():
  wl = models.workload("llama-100m", batch=1, seq=8)
  params = wl.abstract_params()
  n = sum(np.prod(x.shape) for x in jax.tree.leaves(params))
  assert 120e6 < n < 140e6
  out = jax.eval_shape(wl.loss, params, wl.inputs, wl.labels)
  assert out.shape == () and out.dtype == jnp.float32


def test_workload_batches_draw_token_ids_from_the_vocabulary():
  """BERT's token ids span its vocabulary, its labels its classes."""
  wl = models.workload("minilm-l6", batch=4, seq=64)
  tokens, labels = wl.batch(jax.random.key(0))
  assert int(tokens.max()) >= 1000 and int(tokens.max()) < wl.model.config.vocab_size
  assert set(np.unique(labels)) <= {0, 1}
