import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowmem_jax as lm
from lowmem_jax.optim import masked_sparsity
from third_party_promotion import OPTAX_BIAS_CORRECTION


SHAPES = {"b": (5,), "w1": (6, 5), "w2": (5, 4, 2)}
# A chain that several tests share, so that its update compiles once.
TX = optax.chain(optax.sgd(0.1), masked_sparsity.dynamic_sparsity(0.3, update_every=2))
STEP = jax.jit(TX.update)
# Two (4, 4) kernels, 8 active each, 8 of the 16 moved at every step.
HALF = masked_sparsity.dynamic_sparsity(0.5, update_every=1, prune_fraction=0.5)
HALF_STEP = jax.jit(HALF.update)


def make_params(seed=0):
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}


def random_grads(n, seed=1):
  return [make_params(seed + i) for i in range(n)]


def zeros_like(params):
  return jax.tree.map(jnp.zeros_like, params)


def sparse_masks(state):
  return [m for m in jax.tree.leaves(state.masks, is_leaf=lambda m: m is None) if m is not None]


def budget(params, density):
  return sum(round(density * p.size) for p in jax.tree.leaves(params) if p.ndim >= 2)


def assert_zero_outside_masks(params, state):
  for name, m in state.masks.items():
    if m is not None:
      np.testing.assert_array_equal(np.asarray(params[name])[~np.asarray(m)], 0.0)


@pytest.mark.parametrize("density", [0.1, 0.5, 1.0])
def test_init_masks_have_exact_counts(density):
  params = make_params()
  state = masked_sparsity.dynamic_sparsity(density, prune_fraction=0.0).init(params)
  assert state.masks["b"] is None
  for name in ("w1", "w2"):
    chex.assert_shape(state.masks[name], params[name].shape)
    assert state.masks[name].dtype == jnp.bool_
    assert int(state.masks[name].sum()) == round(density * params[name].size)
  assert int(state.count) == 0


def test_custom_sparse_selection():
  params = make_params()
  tx = masked_sparsity.dynamic_sparsity(0.4, sparse=lambda p: {"b": True, "w1": False, "w2": False})
  state = tx.init(params)
  assert state.masks["w1"] is None and state.masks["w2"] is None
  assert int(state.masks["b"].sum()) == 2


def test_first_step_zeroes_outside_masks():
  params = make_params()
  state = TX.init(params)
  (g,) = random_grads(1)
  updates, state = STEP(g, state, params)
  new = optax.apply_updates(params, updates)
  assert_zero_outside_masks(new, state[-1])
  for name, m in state[-1].masks.items():
    expected = params[name] - 0.1 * g[name]
    if m is not None:
      expected = jnp.where(m, expected, 0.0)
    np.testing.assert_array_equal(new[name], expected)


def test_budget_is_exact_and_masks_move():
  params = make_params()
  b = budget(params, 0.3)
  state = TX.init(params)
  initial = sparse_masks(state[-1])
  for i, g in enumerate(random_grads(10)):
    before = sparse_masks(state[-1])
    updates, state = STEP(g, state, params)
    params = optax.apply_updates(params, updates)
    after = sparse_masks(state[-1])
    assert sum(int(m.sum()) for m in after) == b
    assert_zero_outside_masks(params, state[-1])
    moved = sum(int((m & ~o).sum()) for m, o in zip(after, before))
    assert moved == (round(0.2 * b) if i % 2 == 1 else 0)
    for m, o, w in zip(after, before, (params["w1"], params["w2"])):  # regrown at zero
      np.testing.assert_array_equal(np.asarray(w)[np.asarray(m & ~o)], 0.0)
  assert any(bool((m & ~o).any()) for m, o in zip(sparse_masks(state[-1]), initial))


def half_setup(values):
  """The state of HALF, and params with ``values`` on its 16 active entries in flat order."""
  state = HALF.init({"a": jnp.zeros((4, 4)), "b": jnp.zeros((4, 4))})
  w = np.zeros(32, np.float32)
  w[flat(state.masks)] = values
  return state, {k: jnp.asarray(v.reshape(4, 4)) for k, v in zip("ab", np.split(w, 2))}


def flat(tree):
  return np.concatenate([np.ravel(tree[k]) for k in "ab"])


def test_prunes_smallest_magnitudes_globally():
  # The 8 smallest magnitudes, 1 to 8, are 5 of "a"'s and 3 of "b"'s: not 4 per leaf.
  magnitudes = np.array([3, 9, 1, 12, 5, 16, 7, 2, 10, 4, 14, 6, 11, 15, 8, 13], np.float32)
  state, params = half_setup(magnitudes * np.tile([1.0, -1.0], 8))
  w, old = flat(params), flat(state.masks)
  smallest = np.flatnonzero(old)[magnitudes <= 8]
  updates, new_state = HALF_STEP(zeros_like(params), state, params)
  new = flat(new_state.masks)
  np.testing.assert_array_equal(np.flatnonzero(old & ~new), smallest)
  grown = np.flatnonzero(new & ~old)
  assert len(grown) == 8
  new_w = flat(optax.apply_updates(params, updates))
  np.testing.assert_array_equal(new_w[grown], 0.0)
  np.testing.assert_array_equal(new_w[new & old], w[new & old])
  np.testing.assert_array_equal(new_w[~new], 0.0)


def test_ties_prune_in_leaf_order():
  state, params = half_setup(np.ones(16))
  _, new_state = HALF_STEP(zeros_like(params), state, params)
  old, new = flat(state.masks), flat(new_state.masks)
  np.testing.assert_array_equal(np.flatnonzero(old & ~new), np.flatnonzero(old)[:8])


def test_leaf_without_survivors_gets_no_regrowth():
  state, params = half_setup(np.repeat([1.0, 0.1], 8))  # "b" is pruned whole
  _, new_state = HALF_STEP(zeros_like(params), state, params)
  assert bool(new_state.masks["a"].all())
  assert int(new_state.masks["b"].sum()) == 0


def test_regrowth_follows_survivors():
  tx = masked_sparsity.dynamic_sparsity(0.25, update_every=1, prune_fraction=0.375)
  state = tx.init({"a": jnp.zeros((32, 32)), "b": jnp.zeros((32, 32))})
  rank_a = jnp.cumsum(state.masks["a"].ravel()).reshape(32, 32)
  # "a" keeps 64 of its 256 weights (its 192 smallest are the 192 pruned), "b" all 256.
  params = {"a": jnp.where(state.masks["a"], jnp.where(rank_a > 192, 10.0, 0.5), 0.0),
            "b": jnp.where(state.masks["b"], 1.0, 0.0)}
  _, new_state = jax.jit(tx.update)(zeros_like(params), state, params)
  grown = {k: int((new_state.masks[k] & ~state.masks[k]).sum()) for k in "ab"}
  assert grown["a"] + grown["b"] == 192
  # Expected shares 64 : 256 of the survivors, i.e. about 38 : 154; uniform would be 96 : 96.
  assert 19 <= grown["a"] <= 58, grown


def test_jit_and_scan_match_python_loop():
  params0 = make_params()
  tx = optax.chain(optax.sgd(0.1, momentum=0.9),
                   masked_sparsity.dynamic_sparsity(0.3, update_every=2, seed=3))
  grads = random_grads(4)

  def step(carry, g):
    params, state = carry
    updates, state = tx.update(g, state, params)
    return (optax.apply_updates(params, updates), state), None

  eager = jitted = (params0, tx.init(params0))
  for g in grads:
    eager, _ = step(eager, g)
    jitted, _ = jax.jit(step)(jitted, g)
  xs = jax.tree.map(lambda *g: jnp.stack(g), *grads)
  scanned, _ = jax.lax.scan(step, (params0, tx.init(params0)), xs)
  initial = sparse_masks(tx.init(params0)[-1])
  assert any(bool((a != b).any()) for a, b in zip(initial, sparse_masks(eager[1][-1])))
  for other in (jitted, scanned):
    chex.assert_trees_all_close(other[0], eager[0], rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_equal(other[1][-1].masks, eager[1][-1].masks)
    np.testing.assert_array_equal(other[1][-1].key, eager[1][-1].key)
    assert int(other[1][-1].count) == 4


def test_seed_makes_it_deterministic():
  params = make_params()
  masks = [sparse_masks(masked_sparsity.dynamic_sparsity(0.3, seed=s).init(params)) for s in (0, 0, 1)]
  chex.assert_trees_all_equal(masks[0], masks[1])
  assert any(bool((a != b).any()) for a, b in zip(masks[0], masks[2]))


@pytest.mark.parametrize("stop_after", [0, 3])
def test_stop_after_stops_mask_updates(stop_after):
  params = make_params()
  tx = masked_sparsity.dynamic_sparsity(0.3, update_every=1, stop_after=stop_after)
  state = tx.init(params)
  step = jax.jit(tx.update)
  for t in range(1, 7):
    before = sparse_masks(state)
    updates, state = step(zeros_like(params), state, params)
    params = optax.apply_updates(params, updates)
    changed = any(bool((a != b).any()) for a, b in zip(before, sparse_masks(state)))
    assert changed == (t <= stop_after), t


@pytest.mark.parametrize("kwargs, match", [
    ({"density": 0.0}, "density"),
    ({"density": 1.5}, "density"),
    ({"density": True}, "density"),
    ({"update_every": 0}, "update_every"),
    ({"update_every": 2.0}, "update_every"),
    ({"prune_fraction": 1.0}, "prune_fraction"),
    ({"prune_fraction": -0.1}, "prune_fraction"),
    ({"stop_after": -1}, "stop_after"),
    ({"stop_after": 1.5}, "stop_after"),
])
def test_bad_arguments_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    masked_sparsity.dynamic_sparsity(**{"density": 0.5, **kwargs})


def test_numpy_scalars_are_taken_as_python_numbers():
  params = {"w": jnp.ones((8, 8)), "b": jnp.ones(8)}
  mask = lambda tx: jax.tree.leaves(tx.init(params).masks)
  ours = masked_sparsity.dynamic_sparsity(np.float32(0.5), update_every=np.int64(2),
                                          prune_fraction=np.float64(0.25), seed=np.int32(1))
  chex.assert_trees_all_equal(mask(ours), mask(masked_sparsity.dynamic_sparsity(
      0.5, update_every=2, prune_fraction=0.25, seed=1)))


def test_bad_sparse_and_params_are_named():
  params = make_params()
  with pytest.raises(TypeError, match="sparse"):
    masked_sparsity.dynamic_sparsity(0.5, sparse="kernels")
  with pytest.raises(ValueError, match="sparse"):
    masked_sparsity.dynamic_sparsity(0.5, sparse=lambda p: {"w1": True}).init(params)
  with pytest.raises(ValueError, match="sparse"):
    masked_sparsity.dynamic_sparsity(0.5, sparse=lambda p: jax.tree.map(lambda _: False, p)).init(params)
  with pytest.raises(ValueError, match="prune_fraction"):
    masked_sparsity.dynamic_sparsity(1.0, prune_fraction=0.2).init(params)
  tx = masked_sparsity.dynamic_sparsity(0.5)
  state = tx.init(params)
  with pytest.raises(ValueError, match="params"):
    tx.update(params, state)
  with pytest.raises(TypeError, match="updates"):
    tx.update(jax.tree.map(lambda p: p.astype(jnp.bfloat16), params), state, params)


def test_storage_bytes():
  params = {"b": jnp.zeros(16), "w1": jnp.zeros((20, 10)),
            "w2": jnp.zeros((10, 30), jnp.bfloat16)}
  tx = optax.chain(optax.sgd(0.1), masked_sparsity.dynamic_sparsity(0.1))
  state = tx.init(params)
  got = masked_sparsity.storage_bytes(params, state, index_bytes=4)
  assert got == masked_sparsity.storage_bytes(params, state[-1], index_bytes=4)
  assert got["dense"] == sum(p.nbytes for p in jax.tree.leaves(params))
  assert got["dense"] == 16 * 4 + 200 * 4 + 300 * 2
  assert got["mask"] == 200 + 300
  assert got["projected_sparse"] == 16 * 4 + 20 * (4 + 4) + 30 * (2 + 4)
  assert got["projected_sparse"] < got["dense"]
  with pytest.raises(ValueError, match="index_bytes"):
    masked_sparsity.storage_bytes(params, state, index_bytes=-1)
  with pytest.raises(ValueError, match="state"):
    masked_sparsity.storage_bytes(params, optax.sgd(0.1).init(params))


@OPTAX_BIAS_CORRECTION
def test_after_adama_masks_move_at_the_optimizer_step():
  """Under AdamA over k micro-batches, update_every counts micro-batches."""
  params = make_params()
  x = jnp.asarray(np.random.default_rng(3).normal(size=(8, 5)), jnp.float32)

  def loss(p, batch):
    return jnp.sum((batch @ p["w1"].T + p["b"][:6].sum()) ** 2) + jnp.sum(p["w2"] ** 2)

  tx = optax.chain(lm.adama(k=2), masked_sparsity.dynamic_sparsity(0.3, update_every=2))
  step = jax.jit(lm.microbatch_step(loss, tx, 2))
  opt_state = tx.init(params)
  before = sparse_masks(opt_state[-1])
  for _ in range(2):
    params, opt_state, _ = step(params, opt_state, x)
    state = opt_state[-1]
    after = sparse_masks(state)
    assert sum(int(m.sum()) for m in after) == budget(params, 0.3)
    assert any(bool(jnp.any(a != b)) for a, b in zip(after, before))  # moved once a step
    assert_zero_outside_masks(params, state)
    before = after
  assert int(state.count) == 4
