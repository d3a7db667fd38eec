import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import lowmem_jax as lm
from lowmem_jax.models.llama import Llama, LlamaConfig
from third_party_promotion import OPTAX_BIAS_CORRECTION

# Duplicates, a negative id, and one out of range (NaN rows, no gradient) as jnp.take has them.
IDS = jnp.array([[0, 3, 3, -1], [6, 9, -8, 2]])
IN_RANGE = jnp.array([[0, 3, 3, -1], [6, 5, -7, 2]])


def same(a, b):
  return np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), equal_nan=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("ids", [IDS, IN_RANGE], ids=["out of range", "in range"])
def test_take_equals_jnp_take_bit_for_bit(dtype, ids):
  table = jax.random.normal(jax.random.key(0), (7, 3, 2), dtype)
  dy = jax.random.normal(jax.random.key(1), (*ids.shape, 3, 2), dtype)
  plain, late = (jax.vjp(lambda t, f=f: f(t, ids), table)
                 for f in (lambda t, i: jnp.take(t, i, axis=0), lm.embedding.take))
  assert plain[0].dtype == late[0].dtype == dtype
  assert same(plain[0], late[0])
  grads = plain[1](dy)[0], late[1](dy)[0]
  assert grads[1].dtype == dtype
  assert same(*grads)
  assert float(jnp.abs(grads[1].astype(jnp.float32)).sum()) > 0


def test_take_bad_arguments():
  with pytest.raises(ValueError, match="`ids` must be integers"):
    lm.embedding.take(jnp.ones((4, 2)), jnp.array([0.0, 1.0]))
  with pytest.raises(ValueError, match="`table`"):
    lm.embedding.take(jnp.ones(()), jnp.array([0]))


@pytest.mark.parametrize("rows", [7, 1])  # one row: Flax broadcasts it, whatever the id
@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_linen_and_nnx_embed_equal_flax(dtype, rows):
  ids = IN_RANGE % rows
  loss = lambda y: jnp.sum(jnp.sin(y.astype(jnp.float32)))
  plain, late = nn.Embed(rows, 3, dtype=dtype), lm.linen.Embed(rows, 3, dtype=dtype)
  params = plain.init(jax.random.key(0), ids)
  assert jax.tree.structure(late.init(jax.random.key(0), ids)) == jax.tree.structure(params)
  for f in (lambda m: m.apply(params, ids),
            lambda m: jax.grad(lambda p: loss(m.apply(p, ids)))(params)["params"]["embedding"]):
    assert same(f(plain), f(late))
  modules = [cls(rows, 3, dtype=dtype, rngs=nnx.Rngs(0)) for cls in (nnx.Embed, lm.nnx.Embed)]
  outs = [m(ids) for m in modules]
  grads = [nnx.grad(lambda m: loss(m(ids)))(m)["embedding"][...] for m in modules]
  assert same(*outs) and same(*grads)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_take_of_a_sharded_table(axis_type):
  """A table sharded along its features on 2 devices: the same gradient, sharded like it."""
  mesh = jax.make_mesh((2,), ("x",), axis_types=(axis_type,), devices=jax.devices()[:2])
  table = jax.random.normal(jax.random.key(0), (8, 4))
  loss = lambda t, take: jnp.sum(jnp.sin(take(t, IN_RANGE)))
  want = jax.grad(loss)(table, lambda t, i: jnp.take(t, i, axis=0))
  with jax.set_mesh(mesh):
    sharded = jax.device_put(table, NamedSharding(mesh, P(None, "x")))
    got = jax.jit(jax.grad(loss), static_argnums=1)(sharded, lm.embedding.take)
  assert same(want, got) and got.sharding.spec == P(None, "x")


def test_llama_embedding_switch_is_exact_and_checked():
  cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, ffn_dim=64)
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 64)
  plain, late = Llama(cfg), Llama(cfg, embedding="late")
  params = jax.jit(plain.init)(jax.random.key(1), tokens)["params"]
  grads = [jax.jit(jax.grad(lambda p, m=m: m.apply({"params": p}, tokens, tokens)))(params)
           for m in (plain, late)]
  assert all(jax.tree.leaves(jax.tree.map(same, *grads)))
  with pytest.raises(ValueError, match="embedding must be one of"):
    Llama(cfg, embedding="sparse").init(jax.random.key(1), tokens)


@pytest.mark.slow
@OPTAX_BIAS_CORRECTION
def test_late_embedding_buffer_leaves_adama_peak():
  """AdamA's micro-batch loop on the h100 target: with `nn.Embed` XLA once made the
  table-sized gradient buffer at the start of the backward, beside the logits; the late
  lookup's peak stays within half a table of the plain one's (the comment gives each)."""
  cfg = LlamaConfig(vocab_size=32768, dim=256, n_layers=2, n_heads=4, ffn_dim=512)
  k = 4
  tx = lm.adamaw(1e-3, k)
  peaks = {}
  for embedding in ("plain", "late"):
    model = Llama(cfg, embedding=embedding)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
    tokens = jax.ShapeDtypeStruct((k * 2, 512), jnp.int32)
    loss = lambda p, b, model=model: model.apply({"params": p}, *b)
    step = jax.jit(lm.microbatch_step(loss, tx, k, fold_in_backward=True), donate_argnums=(0, 1))
    peaks[embedding] = lm.memory.analyze(step, params, jax.eval_shape(tx.init, params),
                                         (tokens, tokens), target="h100").peak_bytes
  table = cfg.vocab_size * cfg.dim * 4
  # Since microbatch_step slices each micro-batch in the loop (session 10) the plain
  # embedding's step reaches the same peak here (534.66 MB both; 0.9 table apart before).
  # Since the LLaMA's layers are scanned (nn.scan, session 13) the late lookup's peak was 256
  # bytes of 558 MB above the plain one's (bisected to that change); a table is 32 MiB. With
  # jax 0.12.0.1 late is a table below plain (558,251,712 and 591,805,376 bytes); with 0.12.1
  # (CUDA 13's plugin) 0.44 of a table above it (636,382,400 and 621,689,536): two 32 MiB
  # gradients, the lookup's and the head's, live in the loop body's forward beside the logits.
  assert peaks["late"] <= peaks["plain"] + table // 2, (peaks, table)


def test_take_of_a_tied_table_matches():
  """A table looked up and used as the head too (tied): the same loss and gradient."""
  table = jax.random.normal(jax.random.key(0), (16, 8))
  labels = jnp.array([1, 2, 3])

  def loss(t, lookup):
    logits = lookup(t, IN_RANGE % 16).mean(axis=(0, 1)) @ t.T
    return optax.softmax_cross_entropy_with_integer_labels(jnp.tile(logits, (3, 1)), labels).mean()

  a = jax.value_and_grad(loss)(table, lambda t, i: jnp.take(t, i, axis=0))
  b = jax.value_and_grad(loss)(table, lm.embedding.take)
  assert same(a[0], b[0]) and same(a[1], b[1])
