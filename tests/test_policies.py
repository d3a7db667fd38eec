import functools
import pickle

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import lowmem_jax as lm
from lowmem_jax import names
from lowmem_jax.compile import policies
from lowmem_jax.models.llama import LlamaConfig, TransformerBlock
from lowmem_jax.models.vit import Encoder1DBlock

TINY_LLAMA = LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64)


def _vit_block(activation="exact", norm="plain", attention="plain"):
  return Encoder1DBlock(mlp_dim=64, num_heads=2, activation=activation, norm=norm, attention=attention)


def _llama_block(activation="exact", norm="plain", attention="plain"):
  return TransformerBlock(TINY_LLAMA, activation, norm, attention, jnp.float32, jnp.float32)


BLOCKS = [(_vit_block, "exact", "plain", "plain"), (_vit_block, "approx", "ms", "recompute"),
          (_llama_block, "exact", "plain", "plain"), (_llama_block, "approx", "ms", "plain"),
          (_llama_block, "exact", "plain", "recompute")]


def _remat_block(make, activation, norm, attention="plain"):
  """A block, its params and input, and ``f(policy)``: the block under `jax.checkpoint`."""
  block = make(activation, norm, attention)
  x = jax.random.normal(jax.random.key(0), (2, 9, 32))
  params = block.init(jax.random.key(1), x)
  return params, x, lambda policy: jax.checkpoint(lambda p, x: block.apply(p, x), policy=policy)


def _saved_by_name(f, params, x):
  saved = lm.memory.saved_residuals(f, params, x)
  return saved.by_name()


@pytest.mark.slow
@pytest.mark.parametrize("make,activation,norm,attention", BLOCKS)
def test_each_policy_saves_exactly_the_names_it_keeps(make, activation, norm, attention):
  params, x, f = _remat_block(make, activation, norm, attention)
  present = set(_saved_by_name(f(policies.save_all_but()), params, x))
  attn = names.ATTN_PROBS if attention == "plain" else names.ATTN_LSE
  expected_present = {names.NORM_OUT, names.QKV, attn, names.ATTN_OUT, names.MLP_ACT}
  expected_present |= ({names.ACT_CODE, names.NORM_RSTD} if activation == "approx" else {names.MLP_HIDDEN})
  assert expected_present <= present
  # policy: (names it must keep, names it may keep). save_all_but may keep a
  # name the full set did not need, when it recomputes an excluded value from it.
  cases = {
      policies.full: (set(), set()),
      policies.compressed: (present & {names.ACT_CODE, names.NORM_RSTD},) * 2,
      policies.save_only(names.QKV, names.MLP_ACT): ({names.QKV, names.MLP_ACT},) * 2,
      policies.save_all_but(attn, names.MLP_ACT): (
          present - {attn, names.MLP_ACT}, set(names.ALL) - {attn, names.MLP_ACT}),
  }
  for policy, (must, may) in cases.items():
    kept = set(_saved_by_name(f(policy), params, x))  # an unnamed value would show as None
    assert must <= kept <= may, policies.describe(policy)


def test_compressed_keeps_the_codes_at_a_sixteenth_of_the_hidden_layer():
  params, x, f = _remat_block(_vit_block, "approx", "ms")
  saved = _saved_by_name(f(policies.compressed), params, x)
  hidden = _saved_by_name(f(policies.save_all_but()), params, x)[names.MLP_ACT]
  assert saved[names.ACT_CODE] * 16 == hidden  # 2 bits against float32
  assert saved[names.NORM_RSTD] == 2 * 2 * 9 * 4  # two norms, one float32 per row


@pytest.mark.parametrize("policy,batched", [(policies.dots, True), (policies.minimal, False)])
def test_dot_policies_keep_only_matmul_outputs(policy, batched):
  params, x, f = _remat_block(_vit_block, "exact", "plain")
  rows = [r for r in lm.memory.saved_residuals(f(policy), params, x).rows if not r.is_argument]
  assert rows and all(r.source.startswith("output of dot_general") for r in rows)
  assert any("ops/attention.py" in r.source for r in rows) == batched


def test_excluding_a_name_from_everything_would_keep_its_bytes():
  """Why save_all_but ranges over names: refusing only the tag saves the tag's input."""
  def naive(prim, *_, **params):
    return not (prim.name == "name" and params["name"] == names.MLP_HIDDEN)

  def mlp(x, w):
    return jnp.sum(jnp.sin(checkpoint_name(x @ w, names.MLP_HIDDEN)))

  x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
  everything = lm.memory.saved_residuals(jax.checkpoint(mlp, policy=policies.everything), x, w)
  excluded = lm.memory.saved_residuals(jax.checkpoint(mlp, policy=naive), x, w)
  assert excluded.activation_bytes == everything.activation_bytes == 8 * 32 * 4
  ours = lm.memory.saved_residuals(jax.checkpoint(mlp, policy=policies.save_all_but(names.MLP_HIDDEN)), x, w)
  assert ours.activation_bytes == 0


ALL_POLICIES = [*policies.READY_MADE.values(), policies.save_only(names.QKV),
                policies.save_all_but(names.MLP_HIDDEN), policies.offload(names.MLP_ACT),
                policies.combine(policies.minimal, policies.offload(names.BLOCK_IN))]


@pytest.mark.slow
@pytest.mark.parametrize("make,activation,norm,attention", [BLOCKS[0], BLOCKS[3], BLOCKS[4]])
def test_gradients_under_every_policy_equal_those_without_remat(make, activation, norm, attention):
  params, x, f = _remat_block(make, activation, norm, attention)
  block = make(activation, norm, attention)
  grad = lambda g: jax.grad(lambda p, x: jnp.sum(jnp.sin(g(p, x))), (0, 1))
  expected = jax.jit(grad(block.apply))(params, x)
  # every policy's gradient in one program: one compile, not one a policy
  got = jax.jit(lambda p, x: [grad(f(policy))(p, x) for policy in ALL_POLICIES])(params, x)
  for g in got:
    chex.assert_trees_all_close(g, expected, atol=1e-5, rtol=1e-5)


def test_offload_on_cpu_marks_host_residuals_and_compiles_like_save_only():
  params, x, f = _remat_block(_vit_block, "exact", "plain")
  offloaded = lm.memory.saved_residuals(f(policies.offload(names.MLP_ACT)), params, x)
  assert offloaded.host_bytes == 2 * 9 * 64 * 4 and offloaded.activation_bytes == 0
  grad = lambda policy: jax.grad(lambda p, x: jnp.sum(f(policy)(p, x)))
  cpu = lm.targets.get("cpu")
  lowered = cpu.lower(grad(policies.offload(names.MLP_ACT)), params, x).as_text()
  assert "pinned_host" not in lowered  # CPU device memory is host memory: no copies
  assert (lm.memory.analyze(grad(policies.offload(names.MLP_ACT)), params, x, target=cpu)
          == lm.memory.analyze(grad(policies.save_only(names.MLP_ACT)), params, x, target=cpu))


def _scanned_offload_peaks(target):
  """Device peaks of 4 scanned ViT blocks (mlp 1024) saving vs offloading MLP_ACT.

  Offload pays in a scan: the residuals live as one stacked host buffer. In a
  Python loop XLA's GPU scheduler defers the copies and the weight-gradient
  matmuls, and the peak rises instead (the H100 target and a real H100 agree).
  """
  block = Encoder1DBlock(mlp_dim=1024, num_heads=2)
  x = jax.ShapeDtypeStruct((64, 197, 32), jnp.float32)
  params = jax.tree.map(lambda a: jax.ShapeDtypeStruct((4, *a.shape), a.dtype),
                        jax.eval_shape(block.init, jax.random.key(0), x))

  def grad(policy):
    layer = jax.checkpoint(lambda p, x: block.apply(p, x), policy=policy)
    return jax.grad(lambda ps, x: jnp.sum(jax.lax.scan(lambda x, p: (layer(p, x), None), x, ps)[0]))
  return [lm.memory.analyze(grad(policy), params, x, target=target)
          for policy in (policies.save_only(names.MLP_ACT), policies.offload(names.MLP_ACT))]


def test_offload_in_a_scan_frees_h100_target_memory():
  saved, offloaded = _scanned_offload_peaks("h100")
  assert offloaded.host_temp_bytes > 0 and saved.host_temp_bytes == 0
  assert offloaded.peak_bytes < 0.7 * saved.peak_bytes


@pytest.mark.gpu
def test_offload_in_a_scan_frees_device_memory():
  saved, offloaded = _scanned_offload_peaks(None)
  assert offloaded.peak_bytes < 0.7 * saved.peak_bytes


def test_linen_remat_and_scan_accept_the_policies():
  class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return _vit_block()(x), None

  def stack(policy):
    layer = nn.remat(Layer, policy=policy, prevent_cse=False)
    return nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)()

  x = jax.random.normal(jax.random.key(0), (2, 9, 32))
  params = stack(policies.full).init(jax.random.key(1), x, None)
  saved = lambda policy: lm.memory.saved_residuals(
      lambda p, x: stack(policy).apply(p, x, None)[0], params, x).activation_bytes
  assert saved(policies.save_only(names.MLP_ACT)) - saved(policies.full) == 3 * 2 * 9 * 64 * 4


def test_nnx_remat_accepts_the_policies():
  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.up, self.down = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
      return self.down(jnp.sin(checkpoint_name(self.up(x), names.MLP_HIDDEN)))

  graphdef, state = nnx.split(MLP(nnx.Rngs(0)))
  x = jnp.ones((4, 8))

  def loss(state, x, policy):
    run = nnx.remat(lambda m, x: m(x), policy=policy)
    return jnp.sum(run(nnx.merge(graphdef, state), x))

  saved = lm.memory.saved_residuals(functools.partial(loss, policy=policies.save_only(names.MLP_HIDDEN)), state, x)
  assert saved.by_name() == {names.MLP_HIDDEN: 4 * 16 * 4}
  chex.assert_trees_all_close(jax.grad(loss)(state, x, policies.full),
                              jax.grad(loss)(state, x, policies.everything))


def test_bad_arguments_are_named():
  with pytest.raises(TypeError, match="save_only"):
    policies.save_only(names.QKV, 3)
  with pytest.raises(TypeError, match="save_all_but"):
    policies.save_all_but("")
  with pytest.raises(ValueError, match="dst"):
    policies.offload(names.QKV, dst="hbm")
  with pytest.raises(ValueError, match="differ"):
    policies.offload(names.QKV, src="device", dst="device")
  with pytest.raises(ValueError, match="at least one"):
    policies.combine()
  with pytest.raises(TypeError, match="callable"):
    policies.combine(policies.full, "dots")
  with pytest.raises(ValueError, match="'qkv' both kept on the device"):
    policies.combine(policies.save_only(names.QKV), policies.offload(names.QKV, names.MLP_ACT))


def test_combine_refuses_to_keep_and_offload_the_same_value():
  """save_all_but keeps what offload moves: refused when the value is met, naming it."""
  policy = policies.combine(policies.save_all_but(names.MLP_ACT), policies.offload(names.QKV))

  def f(x):
    return jnp.sin(jax.ad_checkpoint.checkpoint_name(jnp.sin(x), names.QKV)).sum()

  with pytest.raises(ValueError, match="keeps the value 'qkv' on the device and another "
                                       "offloads it"):
    jax.grad(jax.checkpoint(f, policy=policy))(jnp.ones(4))


def test_policies_are_hashable_and_read_well():
  assert policies.save_only(names.MLP_ACT, names.QKV) == policies.save_only(names.QKV, names.MLP_ACT)
  assert len({policies.full, policies.save_only(), policies.compressed}) == 2
  assert policies.describe(policies.save_only(names.MLP_ACT, names.QKV)) == "save_only('qkv', 'mlp_act')"
  assert policies.describe(policies.combine(policies.minimal, policies.full)) == "combine(minimal, full)"
  assert policies.describe(policies.save_all_but(names.QKV)) == "save_all_but('qkv')"
  assert policies.kept_names(policies.compressed) == {names.ACT_CODE, names.NORM_RSTD}
  assert policies.kept_names(policies.dots) is None
  moved = policies.offload(names.MLP_ACT, names.QKV)
  assert moved == policies.offload(names.QKV, names.MLP_ACT)
  assert len({moved, policies.offload(names.QKV, names.MLP_ACT), policies.offload(names.QKV)}) == 2
  assert policies.describe(moved) == "offload('qkv', 'mlp_act', src='device', dst='pinned_host')"


def test_the_code_of_a_policy_makes_it_also_for_a_steps_own_names():
  """`policies.code`, which `plan` prints: the factory's call for the vocabulary's names; for a
  step's own names, which `plan` keeps unchecked (the factory refuses them), the class's."""
  for policy in (policies.save_only(names.QKV), policies.offload(names.QKV), policies.dots,
                 policies.SaveOnly(frozenset({"unregistered_act"})),
                 policies.SaveAllBut(frozenset({"unregistered_act"})),
                 policies.Offload(frozenset({"unregistered_act"}), "device", "pinned_host")):
    assert eval(policies.code(policy), {"lm": lm}) == policy, policies.code(policy)
  assert policies.code(policies.save_only(names.QKV)) == "lm.policies.save_only('qkv')"


@pytest.mark.parametrize("factory", [policies.save_only, policies.save_all_but, policies.offload])
def test_unknown_names_are_refused_with_the_closest(factory):
  """A typo kept nothing (save_only) or everything (save_all_but), silently: each name is
  checked against the vocabulary and the names registered, the closest one suggested."""
  with pytest.raises(ValueError, match=r"unknown checkpoint name 'mlp_hiden'\. Did you mean "
                                       r"'mlp_hidden'\?"):
    factory(names.QKV, "mlp_hiden")
  own = f"own_of_{factory.__name__}"  # registered for the rest of the session
  with pytest.raises(ValueError, match=rf"names\.register\('{own}'\)"):
    factory(own)
  names.register(own)
  assert own in names.known() and own not in names.ALL
  assert describe_names(factory(own)) == {own}
  with pytest.raises(TypeError, match="register: each name must be a non-empty str, got 3"):
    names.register(3)


def describe_names(policy):
  """The names a policy of this module's factories holds."""
  return getattr(policy, "saveable_names", None) or policy.names


@pytest.mark.parametrize("policy", [lm.policies.save_only("mlp_hidden"),
                                    lm.policies.save_all_but("mlp_hidden"),
                                    lm.policies.offload("mlp_hidden")], ids=str)
def test_policies_pickle_hash_and_compare_by_their_names(policy):
  """JAX's own policies are closures from jax 0.11: ours pickle (a config that holds one),
  hash and compare by their fields all the same."""
  again = pickle.loads(pickle.dumps(policy))
  assert again == policy and hash(again) == hash(policy) and str(again) == str(policy)
