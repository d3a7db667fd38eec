import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import lowmem_jax as lm
from lowmem_jax.compile import memory, targets
from lowmem_jax.compile.memory import breakdown
from third_party_promotion import OPTAX_BIAS_CORRECTION


def _mlp_grad():
  def loss(w, x):
    h = x
    for _ in range(3):
      h = jnp.tanh(h @ w)
    return h.sum()
  w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
  x = jax.ShapeDtypeStruct((1024, 256), jnp.float32)
  return jax.grad(loss), w, x


def test_analyze_on_abstract_shapes():
  grad, w, x = _mlp_grad()
  stats = memory.analyze(grad, w, x)
  assert stats.argument_bytes == memory.tree_bytes((w, x)) == (256 + 1024) * 256 * 4
  assert stats.output_bytes == 256 * 256 * 4
  # Three tanh outputs of [1024, 256] are needed for backward, so temp holds them.
  assert stats.temp_bytes >= 3 * 1024 * 256 * 4
  assert memory.analyze(jax.jit(grad), w, x) == stats  # a jitted function is used as it is


def test_tree_bytes_packs_sub_byte_dtypes_as_the_h100_target_does():
  codes = jax.ShapeDtypeStruct((1 << 20,), jnp.uint4)
  assert memory.tree_bytes(codes) == 1 << 19
  assert memory.analyze(lambda c: c.astype(jnp.float32), codes,
                        target="h100").argument_bytes == 1 << 19
  assert memory.tree_bytes(jax.ShapeDtypeStruct((3,), jnp.int4)) == 2  # a partial byte counts


def test_analyze_sees_donation():
  x = jax.ShapeDtypeStruct((512, 512), jnp.float32)
  donated = memory.analyze(jax.jit(lambda x: x * 2, donate_argnums=0), x)
  assert donated.alias_bytes == 512 * 512 * 4
  assert memory.analyze(lambda x: x * 2, x).alias_bytes == 0


def test_saved_residuals_rows():
  def f(w, x):
    h = jax.ad_checkpoint.checkpoint_name(jnp.sin(x @ w), "hidden")
    return jnp.sum(h @ w)
  res = memory.saved_residuals(f, jnp.ones((8, 8)), jnp.ones((4, 8)))
  named = [r for r in res.rows if r.name == "hidden"]
  assert len(named) == 1 and named[0].shape == (4, 8) and named[0].nbytes == 128
  assert any(r.is_argument for r in res.rows)
  assert res.activation_bytes == sum(r.nbytes for r in res.rows if not r.is_argument)
  assert res.by_name()["hidden"] == 128
  assert "hidden" in str(res)


def test_report_buffers_at_the_peak():
  grad, w, x = _mlp_grad()
  b = memory.report(grad, w, x, top=None)
  assert b.live_peak_bytes <= memory.analyze(grad, w, x).peak_bytes
  assert b.live_peak_bytes == max(b.live_bytes) == b.live_bytes[b.peak_position]
  sizes = [buf.nbytes for buf in b.buffers]
  assert sizes == sorted(sizes, reverse=True) and sum(sizes) == b.live_peak_bytes
  assert all(buf.start <= b.peak_position <= buf.end for buf in b.buffers)
  assert any("tanh" in buf.op_name or "dot_general" in buf.op_name for buf in b.buffers)
  assert any(buf.source.rsplit(":", 1)[0].endswith("test_memory.py") for buf in b.buffers)
  # Arguments not named params or opt_state are inputs; forward values are activations.
  assert b.at_peak["inputs"] == memory.tree_bytes((w, x))
  assert b.at_peak["activations"] >= 2 * 1024 * 256 * 4
  assert len(memory.report(grad, w, x, top=2).buffers) == 2


def test_closed_over_params_are_not_activations():
  w = jnp.ones((64, 64))
  res = memory.saved_residuals(lambda x: jnp.sum(jnp.tanh(x @ w)), jnp.ones((8, 64)))
  assert res.activation_bytes < 64 * 64 * 4  # w (closed over) is not an activation
  assert res.total_bytes - res.activation_bytes == 64 * 64 * 4


def _remat_stack_grad(policy, compiler_options=None):
  """Gradient of 6 remat'd MLP blocks, compiled: remat's effect on the figures."""
  def block(x, w1, w2):
    return x + jnp.sin(jnp.sin(x @ w1) @ w2)

  def loss(ws, x):
    for w1, w2 in ws:
      x = jax.checkpoint(block, policy=policy)(x, w1, w2)
    return jnp.sum(x)

  ws = [(jnp.full((64, 256), 0.01), jnp.full((256, 64), 0.01))] * 6
  x = jnp.ones((512, 64))
  return jax.jit(jax.grad(loss)).lower(ws, x).compile(compiler_options), (ws, x)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU pipeline's behaviour")
def test_cpu_compiles_keep_remat():
  """With CPU_KEEPS_REMAT, XLA's CPU pipeline keeps remat's recompute out of the forward pass:
  full remat holds less than half of what saving everything holds, and computes the same.
  (jax 0.10.2's CPU pipeline merged the recompute back without it, both at 8 MiB; jax 0.12's
  keeps remat either way.)"""
  kept = {p: _remat_stack_grad(p, targets.CPU_KEEPS_REMAT)[0]
          for p in (lm.policies.everything, lm.policies.full)}
  everything, full = (memory.stats_of(kept[p]).temp_bytes for p in kept)
  assert full < everything / 2
  _, args = _remat_stack_grad(lm.policies.full)
  for a, b in zip(jax.tree.leaves(kept[lm.policies.full](*args)),
                  jax.tree.leaves(kept[lm.policies.everything](*args))):
    np.testing.assert_allclose(a, b, rtol=1e-6)


class _NnxMLP(nnx.Module):
  def __init__(self, rngs):
    self.fc1 = nnx.Linear(64, 256, rngs=rngs)
    self.norm = nnx.LayerNorm(256, rngs=rngs)
    self.fc2 = nnx.Linear(256, 16, rngs=rngs)

  def __call__(self, x):
    return self.fc2(self.norm(nnx.gelu(self.fc1(x))))


@OPTAX_BIAS_CORRECTION
def test_report_finds_nnx_params_and_optimizer_by_type():
  """An nnx.jit step on an NNX model and nnx.Optimizer: no argument is named params or opt_state."""
  model = _NnxMLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  b = memory.report(step, model, optimizer, jnp.ones((32, 64)))
  weights = memory.tree_bytes(nnx.state(model, nnx.Param))
  assert b.at_peak["parameters"] == weights
  assert b.at_peak["optimizer state"] == 2 * weights + 4 + 4  # mu, nu; adam's count, the step
  assert b.at_peak["inputs"] == 32 * 64 * 4
  assert "none found" not in str(b)


@OPTAX_BIAS_CORRECTION
def test_report_finds_an_optax_state_by_type():
  """Arguments named w and s: s is an optax state; an unused argument and a static one
  are left out of the compiled program, which shifts the arguments' numbers."""
  tx = optax.adam(1e-3)

  def step(w, unused, s, x, scale):
    grads = jax.grad(lambda w: scale * jnp.sum(jnp.tanh(x @ w["k"])))(w)
    updates, s = tx.update(grads, s)
    return optax.apply_updates(w, updates), s

  w = {"k": jax.ShapeDtypeStruct((64, 128), jnp.float32)}
  x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
  b = memory.report(jax.jit(step, static_argnames="scale"), w, jnp.ones(7),
                    jax.eval_shape(tx.init, w), x, scale=2.0, target="cpu")
  assert b.at_peak["optimizer state"] == 2 * 64 * 128 * 4 + 4
  assert b.at_peak["inputs"] == (64 * 128 + 32 * 64) * 4  # w is named neither params nor an nnx.Param
  table = str(b)
  assert "parameters: none found among the step's arguments: pass them as an argument" in table
  assert "optimizer state: none found" not in table
  assert b.argument_components == {"optimizer state", "inputs"}


def _components(tree):
  return {c for _, c in breakdown._typed_leaves(tree)}


def test_components_of_typed_leaves():
  model = _NnxMLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  assert _components(nnx.state(model)) == {"parameters"}
  assert _components(optimizer) == {"optimizer state"}
  params = {"w": jnp.ones(3)}
  assert _components(optax.chain(lm.adama(2), optax.scale_by_learning_rate(1e-3)).init(params)) \
      == {"optimizer state"}
  assert _components((params, jnp.ones(2))) == {None}
  # An optax state over a Flax linen tree stays optimizer state under its "params" key.
  assert breakdown._argument_component("opt_state[0].mu['params']['w']") == "optimizer state"
  assert breakdown._argument_component("s[0].mu['params']['w']", "optimizer state") == "optimizer state"


def test_aot_compile_does_not_shadow_the_builtin():
  assert "compile" not in vars(memory)
  with pytest.raises(AttributeError, match="no attribute 'compile'"):
    _ = memory.compile


def test_bad_fn():
  with pytest.raises(TypeError, match="fn"):
    memory.analyze(3, jnp.ones(3))
  with pytest.raises(TypeError, match="fn"):
    memory.saved_residuals("f", jnp.ones(3))


@pytest.mark.parametrize("op_name, layer", [
    ("jit(step)/transpose(jvp(ViT))/Transformer/encoderblock_1/MlpBlock_0/Dense_1/dot_general",
     "Transformer/encoderblock_1"),
    ("jit(step)/jvp(lowmem/attention)/dot_general", "(top level)"),
    ("jit(step)/Llama/layers_0/jvp(lowmem/attention)/exp", "Llama/layers_0"),
])
def test_buffer_layer_keeps_scopes_inside_transforms_whole(op_name, layer):
  buffer = memory.Buffer("fusion.3{}", 4, "f32[1]", op_name, "", 0, 1, "activations")
  assert buffer.layer == layer
