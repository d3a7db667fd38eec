"""lowmem_jax/models/llama.py: stacked layers, the Llama 3 configs, `layer_stack`."""

import dataclasses

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
from lowmem_jax.optim import layer_stack as layer_stack_module, per_leaf

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
  with pytest.raises(TypeError, match="split_at_mlp_hidden must be a bool, got 1"):
    llama.layer_stack(scanned, split_layer=False, split_at_mlp_hidden=1)
  with pytest.raises(ValueError, match="cuts the whole layer .* give split_layer=False"):
    llama.layer_stack(scanned, split_at_mlp_hidden=True)
  with pytest.raises(ValueError, match="keeps the MLP's hidden layer whole: .*got 4"):
    llama.layer_stack(scanned.clone(mlp_chunk_tokens=4), split_layer=False,
                      split_at_mlp_hidden=True)
  second = llama.layer_stack(scanned, split_layer=False, split_at_mlp_hidden=True).parts[1]
  with pytest.raises(TypeError, match=r"'from_mlp_hidden' takes \(x, gate, up\), .*got "
                     r"\(1, 8, 32\)"):
    second(jax.tree.map(lambda x: x[0], params["layers"]), jnp.ones((1, 8, 32)), None)
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
@pytest.mark.parametrize("tied,loss,remat,cut", [
    (False, "plain", False, "whole"), (True, "fused", True, "whole"),
    (False, "fused", True, "halves"), (True, "fused", False, "mlp_hidden")],
    ids=["untied-plain", "tied-fused-remat", "untied-fused-remat-split", "tied-fused-mlp-hidden"])
def test_layer_stack_is_the_model(tied, loss, remat, cut):
  """The layer whole, in halves (``split_layer``), or cut at the MLP's hidden layer
  (``split_at_mlp_hidden``: the second part reads the MLP's last matmul alone, its input the
  stream and the two ``[batch, length, ffn_dim]`` pre-activations)."""
  config = dataclasses.replace(TINY, tie_embeddings=tied)
  model = Llama(config, loss=loss, remat=remat,
                remat_policy=jax.checkpoint_policies.nothing_saveable if remat else None)
  tokens = _tokens()
  batch = (tokens, jnp.roll(tokens, -1, axis=1))
  params = model.init(jax.random.key(1), tokens)["params"]
  stack = llama.layer_stack(model, split_layer=cut == "halves",
                            split_at_mlp_hidden=cut == "mlp_hidden")
  assert stack.key == "layers" and len(stack.parts) == (1 if cut == "whole" else 2)
  want = jax.jit(jax.value_and_grad(lambda p: model.apply({"params": p}, *batch)))(params)
  got = jax.jit(jax.value_and_grad(lambda p: _stacked_loss(stack, p, batch)))(params)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
  one = jax.tree.map(lambda x: x[0], params["layers"])
  h = jnp.zeros((2, 8, config.dim))
  halves = [{"attention", "attention_norm"}, {"feed_forward", "ffn_norm"}]
  reads_by_cut = {"whole": [set().union(*halves)], "halves": halves,
                  "mlp_hidden": [set().union(*halves), {"feed_forward"}]}
  inputs = layer_stack_module.part_input_shapes(stack, one, h, batch)
  if cut == "mlp_hidden":
    hidden = jax.ShapeDtypeStruct((2, 8, config.ffn_dim), jnp.float32)
    assert inputs[1] == (jax.ShapeDtypeStruct(h.shape, h.dtype), hidden, hidden)
  for part, x, half in zip(stack.parts, inputs, reads_by_cut[cut]):
    reads = per_leaf.reads(lambda p, x: part(p, x, batch), one, x)  # remat looked into
    assert {k for k, v in reads.items() if any(jax.tree.leaves(v))} == half
    if cut == "mlp_hidden" and half == {"feed_forward"}:
      assert list(reads["feed_forward"]) == ["w1", "w2", "w3"]
      assert [any(jax.tree.leaves(reads["feed_forward"][w])) for w in ("w1", "w2", "w3")] == [
          False, True, False]
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
