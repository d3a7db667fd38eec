"""lowmem_jax.optim.sparse: weights stored as values and positions, moved in O(nnz) memory."""

import functools

import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowmem_jax as lm
from lowmem_jax.models.wrn import WideResNet
from lowmem_jax.optim import lowbit, sparse
from third_party_promotion import FLAX_NORM, OPTAX_BIAS_CORRECTION, OPTAX_UPDATE_MOMENT


def test_densify_is_a_scatter_and_its_gradient_a_gather():
  values = jax.random.normal(jax.random.key(0), (30,))
  positions = sparse.random_positions(jax.random.key(1), 96, 30)
  assert len(set(np.asarray(positions).tolist())) == 30
  twin = np.zeros(96, np.float32)
  twin[np.asarray(positions)] = np.asarray(values)
  for after in (None, jnp.ones(3)):
    dense, vjp = jax.vjp(lambda v: sparse.densify(v, positions, (4, 4, 6), after=after), values)
    np.testing.assert_array_equal(dense, twin.reshape(4, 4, 6))
    cotangent = jax.random.normal(jax.random.key(2), (4, 4, 6))
    np.testing.assert_array_equal(vjp(cotangent)[0], cotangent.reshape(-1)[positions])
  tree = {"w": values, "b": jnp.ones(3)}
  positions_tree = {"w": positions, "b": None}
  dense = sparse.to_dense(tree, positions_tree, {"w": jnp.zeros((4, 4, 6)), "b": jnp.ones(3)})
  jax.tree.map(np.testing.assert_array_equal, sparse.to_values(dense, positions_tree), tree)
  with pytest.raises(ValueError, match=r"`values` and `positions` must both be \[nnz\]"):
    sparse.densify(values, positions[:5], (96,))
  with pytest.raises(TypeError, match="`positions` must be integers"):
    sparse.densify(values, positions.astype(jnp.float32), (96,))


def test_tie_gradients_is_the_identity_with_its_cotangents_in_one_barrier():
  x, values = jnp.arange(6.0).reshape(2, 3), jnp.ones(4)
  out, vjp = jax.vjp(sparse.tie_gradients, x, values)
  jax.tree.map(np.testing.assert_array_equal, out, (x, values))
  cotangents = (jnp.full((2, 3), 2.0), jnp.full(4, 3.0))
  jax.tree.map(np.testing.assert_array_equal, vjp(cotangents), cotangents)
  backward = jax.make_jaxpr(lambda c: vjp(c))(cotangents)
  assert [e.primitive.name for e in backward.eqns].count("optimization_barrier") == 1


@OPTAX_BIAS_CORRECTION
@OPTAX_UPDATE_MOMENT
def test_tied_gradients_lower_an_adama_steps_peak_on_the_h100_target():
  """Six sparse 3x3 convs under AdamA over 4 micro-batches: tied, each weight gradient is
  gathered as its layer's backward runs, and the peak is lower (by 0.84 MiB, 0.42 of an
  output cotangent, with jax 0.10.2's XLA; by 0.14 MiB, 0.07 of it, with jax 0.12's, which
  schedules the untied step better; the WideResNet-28-2's is docs/benchmarks.md's)."""
  channels, layers = 64, 6
  size = 9 * channels * channels
  positions = [sparse.random_positions(jax.random.key(i), size, size // 10)
               for i in range(layers)]

  def loss(params, x, tie):
    for i, kept in enumerate(positions):
      values = params[i]
      if tie:
        x, values = sparse.tie_gradients(x, values)
      kernel = sparse.densify(values, kept, (3, 3, channels, channels), after=x)
      x = jax.nn.relu(jax.lax.conv_general_dilated(
          x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))
    return jnp.mean(x * x)

  params = [jax.ShapeDtypeStruct((size // 10,), jnp.float32)] * layers
  batch = jax.ShapeDtypeStruct((32, 32, 32, channels), jnp.float32)
  tx = lm.adamaw(1e-3, 4)
  peaks = [lm.memory.analyze(
      jax.jit(lm.microbatch_step(functools.partial(loss, tie=tie), tx, 4),
              donate_argnums=(0, 1)), params, jax.eval_shape(tx.init, params), batch,
      target="h100").peak_bytes for tie in (False, True)]
  cotangent = 8 * 32 * 32 * channels * 4
  assert peaks[1] < peaks[0] - 0.03 * cotangent, peaks


def test_prune_and_regrow_moves_the_smallest_to_fresh_positions():
  nnz, size, moves = 200, 1000, 40
  values = jax.random.normal(jax.random.key(0), (nnz,))
  positions = sparse.random_positions(jax.random.key(1), size, nnz)
  new_values, new_positions, moved = jax.jit(
      sparse.prune_and_regrow, static_argnames=("size", "moves"))(
          values, positions, jax.random.key(2), size=size, moves=moves)
  moved, old = np.asarray(moved), np.asarray(positions)
  assert moved.sum() == moves
  smallest = np.argsort(np.abs(np.asarray(values)), kind="stable")[:moves]
  assert set(np.flatnonzero(moved)) == set(smallest)
  new = np.asarray(new_positions)
  assert len(set(new.tolist())) == nnz and new.min() >= 0 and new.max() < size
  assert not set(new[moved]) & set(old.tolist())  # regrown where nothing was before the move
  np.testing.assert_array_equal(new[~moved], old[~moved])
  np.testing.assert_array_equal(np.asarray(new_values)[moved], 0)
  np.testing.assert_array_equal(np.asarray(new_values)[~moved], np.asarray(values)[~moved])
  same = sparse.prune_and_regrow(values, positions, jax.random.key(2), size=size, moves=0)
  assert same[0] is values and same[1] is positions and not same[2].any()


@pytest.mark.parametrize("nnz", [100, 500, 900])
def test_regrowth_is_full_and_o_moves_at_any_density(nnz):
  """Every draw is a free position (ranks among the free ones), so the moves are all made
  with 2 moves + 32 draws, up to moves = half the free positions, at 10% to 90% density."""
  size, moves = 1000, min(50, (1000 - nnz) // 2)
  values = jax.random.normal(jax.random.key(0), (nnz,))
  regrow = jax.jit(jax.vmap(
      lambda key: sparse.prune_and_regrow(values, positions, key, size=size, moves=moves)))
  positions = sparse.random_positions(jax.random.key(1), size, nnz)
  _, new, moved = regrow(jax.random.split(jax.random.key(2), 200))
  assert bool(jnp.all(moved.sum(-1) == moves))
  old = set(np.asarray(positions).tolist())
  for row, m in zip(np.asarray(new), np.asarray(moved)):
    assert len(set(row.tolist())) == nnz and not set(row[m].tolist()) & old
  text = jax.jit(sparse.prune_and_regrow, static_argnames=("size", "moves")).lower(
      values, positions, jax.random.key(2), size=size, moves=moves).as_text()
  assert f"tensor<{2 * moves + 32}xi32>" in text  # the draws: none of the dense size
  with pytest.raises(ValueError, match="`moves` must be a static int"):
    sparse.prune_and_regrow(values, positions, jax.random.key(2), size=size,
                            moves=size - nnz + 1)
  with pytest.raises(ValueError, match="`size` must be a static int above nnz"):
    sparse.prune_and_regrow(values, positions, jax.random.key(2), size=nnz, moves=1)


def _sgd_setup():
  dense = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32), "b": jnp.zeros(8)}
  params = {"w": jnp.arange(1.0, 17.0), "b": jnp.zeros(8)}
  return dense, params


def test_sparse_storage_moves_every_update_every_steps():
  dense, params = _sgd_setup()
  tx = sparse.sparse_storage(optax.sgd(0.0), dense, update_every=2, prune_fraction=0.25, seed=3)
  state = tx.init(params)
  first = state.positions["w"]
  assert state.positions["b"] is None and first.dtype == jnp.int32
  grads = jax.tree.map(jnp.zeros_like, params)
  update = jax.jit(tx.update)
  updates, state = update(grads, state, params)
  params = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(state.positions["w"], first)  # step 1: no move
  updates, state = update(grads, state, params)
  params = optax.apply_updates(params, updates)
  moved = np.asarray(state.positions["w"] != first)
  assert moved.sum() == 4 and np.flatnonzero(moved).tolist() == [0, 1, 2, 3]  # |w| 1..4
  np.testing.assert_array_equal(params["w"], np.where(moved, 0, np.arange(1.0, 17.0)))
  assert int(state.count) == 2


@OPTAX_BIAS_CORRECTION
@OPTAX_UPDATE_MOMENT
@pytest.mark.parametrize("inner", ["adamw", "adamw_8bit", "adama"])
def test_moved_slots_start_with_zero_moments(inner):
  n = 8192  # 8-bit moments from lowbit.MIN_SIZE = 4096 entries
  dense = {"w": jax.ShapeDtypeStruct((4 * n,), jnp.float32)}
  params = {"w": jax.random.normal(jax.random.key(0), (n,))}
  k = 2 if inner == "adama" else 1
  opt = {"adamw": optax.adamw(1e-3), "adamw_8bit": lowbit.adamw_8bit(1e-3),
         "adama": lm.adamaw(1e-3, k)}[inner]
  tx = sparse.sparse_storage(opt, dense, update_every=1, prune_fraction=0.1)
  state = tx.init(params)
  before = state.positions["w"]
  update = jax.jit(tx.update)
  for micro in range(k):
    grads = {"w": jax.random.normal(jax.random.key(micro + 1), (n,))}
    updates, state = update(grads, state, params)
    moved = np.asarray(state.positions["w"] != before)
    assert moved.sum() == (n // 10 if micro == k - 1 else 0)  # at the optimizer step only
  params = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(np.asarray(params["w"])[moved], 0)
  found = []
  optax.tree_utils.tree_map_params(opt, found.append, state.inner, is_leaf=lowbit.is_quantized)
  assert len(found) == 2  # mu and nu of w
  for leaf in found:
    stored = np.asarray(leaf.codes if lowbit.is_quantized(leaf) else leaf)
    assert np.all(stored[moved] == 0) and (stored[~moved] != 0).mean() > 0.9


@OPTAX_BIAS_CORRECTION
@OPTAX_UPDATE_MOMENT
def test_a_skipped_micro_step_is_no_optimizer_step():
  """Under AdamA a step completes when its count moves: a micro-step that
  `optax.apply_if_finite` skips (the state kept) neither counts nor moves."""
  n = 256
  dense = {"w": jax.ShapeDtypeStruct((4 * n,), jnp.float32)}
  params = {"w": jax.random.normal(jax.random.key(0), (n,))}
  tx = sparse.sparse_storage(optax.apply_if_finite(lm.adamaw(1e-3, 2), 5), dense,
                             update_every=1, prune_fraction=0.1)
  state = tx.init(params)
  before = state.positions["w"]
  update = jax.jit(tx.update)
  _, state = update({"w": jnp.full(n, jnp.nan)}, state, params)
  assert int(state.count) == 0
  np.testing.assert_array_equal(state.positions["w"], before)
  for micro in range(2):
    _, state = update({"w": jnp.ones(n)}, state, params)
  assert int(state.count) == 1 and int((state.positions["w"] != before).sum()) == round(n / 10)


@OPTAX_BIAS_CORRECTION
@OPTAX_UPDATE_MOMENT
def test_microbatch_step_moves_after_its_loop_only():
  """microbatch_step tells the updates inside its loop that they complete no step: the
  move (its top_k) is compiled once, after the loop, and still happens every step."""
  n = 256
  dense = {"w": jax.ShapeDtypeStruct((4 * n,), jnp.float32)}
  params = {"w": jax.random.normal(jax.random.key(0), (n,))}
  tx = sparse.sparse_storage(lm.adamaw(1e-3, 4), dense, update_every=1, prune_fraction=0.1)
  step = lm.microbatch_step(lambda p, b: jnp.mean((b @ p["w"]) ** 2), tx, 4)
  batch = jax.random.normal(jax.random.key(1), (8, n))
  state = tx.init(params)
  jaxpr = jax.make_jaxpr(step)(params, state, batch).jaxpr

  def top_ks(eqns):
    return sum(e.primitive.name == "top_k" for e in eqns)
  loops = [e for e in jaxpr.eqns if e.primitive.name in ("scan", "while")]
  assert len(loops) == 1 and top_ks(loops[0].params["jaxpr"].jaxpr.eqns) == 0
  assert "top_k" in str(jaxpr)  # the move after the loop
  new_params, new_state, _ = jax.jit(step)(params, state, batch)
  moved = np.asarray(new_state.positions["w"] != state.positions["w"])
  assert int(new_state.count) == 1 and moved.sum() == round(n / 10)
  np.testing.assert_array_equal(np.asarray(new_params["w"])[moved], 0)
  # the hint reaches no one else: a strict extra-args transformation, inside and beside
  strict = optax.GradientTransformationExtraArgs(lambda p: (), lambda u, s, p=None: (u, s))
  for tx in (sparse.sparse_storage(optax.chain(lm.adamaw(1e-3, 4), strict), dense,
                                   update_every=1, prune_fraction=0.1),
             optax.chain(lm.adamaw(1e-3, 4), strict)):
    step = lm.microbatch_step(lambda p, b: jnp.mean((b @ p["w"]) ** 2), tx, 4)
    jax.jit(step)(params, tx.init(params), batch)
  # AdamA over 2 under a step of 4 (two optimizer steps a call) is refused
  tx = sparse.sparse_storage(lm.adamaw(1e-3, 2), dense, update_every=100)
  step = lm.microbatch_step(lambda p, b: jnp.mean((b @ p["w"]) ** 2), tx, 4)
  with pytest.raises(ValueError, match="AdamA over k=2 .* into k=4"):
    jax.jit(step)(params, tx.init(params), batch)


@OPTAX_BIAS_CORRECTION
@OPTAX_UPDATE_MOMENT
def test_state_round_trips_through_flax_serialization():
  dense, params = _sgd_setup()
  tx = sparse.sparse_storage(optax.adam(0.1), dense, update_every=1, prune_fraction=0.25)
  state = tx.update(params, tx.init(params), params)[1]
  restored = flax.serialization.from_bytes(tx.init(params), flax.serialization.to_bytes(state))
  jax.tree.map(np.testing.assert_array_equal, restored, state)
  np.testing.assert_array_equal(tx.update(params, restored, params)[1].positions["w"],
                                tx.update(params, state, params)[1].positions["w"])


@pytest.mark.parametrize("kwargs, match", [
    (dict(seed=0.5), "`seed` must be an int"),
    (dict(update_every=0), "`update_every` must be a positive int"),
    (dict(prune_fraction=1.0), r"`prune_fraction` must be a number in \[0, 1\)"),
    (dict(prune_fraction=True), r"`prune_fraction` must be a number in \[0, 1\)"),
    (dict(stop_after=-1), "`stop_after` must be None or an int >= 0"),
])
def test_bad_arguments_are_named(kwargs, match):
  dense, _ = _sgd_setup()
  with pytest.raises(ValueError, match=match):
    sparse.sparse_storage(optax.sgd(0.1), dense, **kwargs)


def test_numpy_scalars_are_taken_as_pythons():
  dense, _ = _sgd_setup()
  sparse.sparse_storage(optax.sgd(0.1), dense, update_every=np.int32(2),
                        prune_fraction=np.float32(0.25), seed=np.int64(3))


@pytest.mark.parametrize("params, match", [
    ({"w": jnp.ones(16)}, "`dense` must have the params' tree structure"),
    ({"w": jnp.ones((4, 4)), "b": jnp.zeros(8)}, r"A sparse leaf must be \[nnz\]"),
    ({"w": jnp.ones((8, 8)), "b": jnp.zeros(8)}, "No leaf of the params is sparse"),
    ({"w": jnp.ones(60), "b": jnp.zeros(8)}, "only 4 positions are free"),
])
def test_bad_params_are_named(params, match):
  dense, _ = _sgd_setup()
  tx = sparse.sparse_storage(optax.sgd(0.1), dense, prune_fraction=0.5)
  with pytest.raises(ValueError, match=match):
    tx.init(params)


def test_sparse_conv_is_a_conv_with_the_dense_kernel():
  x = jax.random.normal(jax.random.key(0), (2, 8, 8, 4))
  conv = lm.linen.SparseConv(6, (3, 3), density=0.25, strides=2)
  values = conv.init(jax.random.key(1), x)["params"]["kernel"]
  assert values.shape == (round(0.25 * 3 * 3 * 4 * 6),)
  positions = sparse.random_positions(jax.random.key(2), 3 * 3 * 4 * 6, values.shape[0])
  twin = nn.Conv(6, (3, 3), strides=2, use_bias=False)

  def sparse_out(v):
    return conv.apply({"params": {"kernel": v}, "sparse": {"kernel": positions}}, x)

  def dense_out(v):
    return twin.apply({"params": {"kernel": sparse.densify(v, positions, (3, 3, 4, 6))}}, x)

  np.testing.assert_allclose(sparse_out(values), dense_out(values), rtol=1e-6, atol=1e-6)
  g_sparse = jax.grad(lambda v: jnp.sum(sparse_out(v) ** 2))(values)
  g_dense = jax.grad(lambda v: jnp.sum(dense_out(v) ** 2))(values)
  np.testing.assert_allclose(g_sparse, g_dense, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="no positions for the sparse kernel"):
    conv.apply({"params": {"kernel": values}}, x)
  with pytest.raises(ValueError, match="`density` 0.99 keeps all 16 entries"):
    lm.linen.SparseConv(4, (1, 1), density=0.99).init(jax.random.key(0), jnp.ones((1, 2, 2, 4)))


def _small_wrn(density):
  return WideResNet(depth=10, widen=1, density=density)


@pytest.mark.slow
@FLAX_NORM
@OPTAX_BIAS_CORRECTION
def test_sparse_training_equals_dense_training_with_the_gradient_masked():
  """The exact twin: the dense model on the densified kernels, Adam on gradients that are
  zero off the positions (so are its moments and updates there)."""
  images = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
  labels = jnp.arange(4) % 10
  model = _small_wrn(0.25)
  values = model.init(jax.random.key(1), images)["params"]
  dense_params = jax.eval_shape(_small_wrn(None).init, jax.random.key(1), images)["params"]
  tx = sparse.sparse_storage(optax.adam(1e-2), dense_params, update_every=100)
  state = tx.init(values)
  positions = state.positions

  def to_dense(v):
    return sparse.to_dense(v, positions, dense_params)

  def loss(model, variables):
    logits, _ = model.apply(variables, images, mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  twin_tx = optax.adam(1e-2)
  dense = to_dense(values)
  twin_state = twin_tx.init(dense)
  masks = to_dense(jax.tree.map(jnp.ones_like, values))
  @jax.jit
  def step(values, state):
    grads = jax.grad(lambda v: loss(model, {"params": v, "sparse": positions}))(values)
    updates, state = tx.update(grads, state, values)
    return optax.apply_updates(values, updates), state

  @jax.jit
  def twin_step(dense, twin_state):
    twin_grads = jax.grad(lambda d: loss(_small_wrn(None), {"params": d}))(dense)
    twin_grads = jax.tree.map(lambda g, m: g * m, twin_grads, masks)
    twin_updates, twin_state = twin_tx.update(twin_grads, twin_state, dense)
    return optax.apply_updates(dense, twin_updates), twin_state

  for _ in range(3):
    values, state = step(values, state)
    dense, twin_state = twin_step(dense, twin_state)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               to_dense(values), dense)


def test_a_move_takes_o_nnz_temporaries_on_the_h100_target():
  """A sparse leaf of 1M dense entries, 1% stored: the step that moves it (both branches of
  its cond compiled) holds far less than one dense float32 copy, 4 MiB."""
  dense = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
  params = {"w": jax.ShapeDtypeStruct((10486,), jnp.float32)}
  tx = sparse.sparse_storage(optax.sgd(0.1), dense, update_every=1)
  state = jax.eval_shape(tx.init, params)
  stats = lm.memory.analyze(jax.jit(tx.update), params, state, params, target="h100")
  assert stats.temp_bytes < 0.1 * 4 * 2**20, stats.temp_bytes


@pytest.mark.slow
@FLAX_NORM
@OPTAX_BIAS_CORRECTION
@pytest.mark.heavy
def test_sparse_storage_lowers_the_compiled_peak_on_the_h100_target():
  images = jax.ShapeDtypeStruct((2, 16, 16, 3), jnp.float32)
  labels = jax.ShapeDtypeStruct((2,), jnp.int32)
  peaks = {}
  for density in (None, 0.1):
    model = WideResNet(depth=10, widen=4, density=density)
    params = jax.eval_shape(model.init, jax.random.key(0), images)["params"]
    tx = optax.adamw(1e-3)
    if density is not None:
      tx = sparse.sparse_storage(
          tx, jax.eval_shape(WideResNet(depth=10, widen=4).init, jax.random.key(0),
                             images)["params"])

    def step(params, opt_state, x, y, model=model, tx=tx, density=density):
      variables = lambda p: ({"params": p} if density is None else
                             {"params": p, "sparse": sparse.find_state(opt_state).positions})
      grads = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
          model.apply(variables(p), x, mutable=["batch_stats"])[0], y).mean())(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    peaks[density] = lm.memory.analyze(
        jax.jit(step, donate_argnums=(0, 1)), params, jax.eval_shape(tx.init, params), images,
        labels, target="h100").peak_bytes
    if density is None:
      dense_bytes = lm.memory.tree_bytes(params)
  # params, gradient and two moments, nearly all in the blocks' convs: 4 dense copies
  assert peaks[0.1] < peaks[None] - 2 * dense_bytes, (peaks, dense_bytes)


@FLAX_NORM
def test_the_workload_asks_for_positions_exactly_when_sparse():
  sparse_wl = lm.models.workload("wrn-28-2", batch=2, image=8, density=0.1)
  dense_wl = lm.models.workload("wrn-28-2", batch=2, image=8)
  assert sparse_wl.sparse and not dense_wl.sparse
  assert jax.tree.structure(sparse_wl.dense_params()) == jax.tree.structure(
      sparse_wl.abstract_params())
  x, y = jnp.zeros((2, 8, 8, 3)), jnp.zeros(2, jnp.int32)
  with pytest.raises(ValueError, match="`positions` must be given for a model with sparse"):
    sparse_wl.loss(None, x, y)
  with pytest.raises(ValueError, match="the model is dense"):
    dense_wl.loss(None, x, y, positions={})
  with pytest.raises(ValueError, match="density \\(sparse storage\\) applies to the WideResNet"):
    lm.models.workload("vit-tiny", batch=2, density=0.1)


@pytest.mark.slow
@FLAX_NORM
@OPTAX_BIAS_CORRECTION
@OPTAX_UPDATE_MOMENT
def test_the_workloads_step_moves_and_its_next_forward_reads_the_new_positions():
  """A sparse WRN-10-1 workload's jitted step under AdamA over 2 micro-batches, a move every
  2 steps: once the moved slots have been trained (a move leaves them at zero), the next
  step's forward reads the new positions (its loss is the loss there, not at the old)."""
  wl = lm.models.Workload("wrn-10-1", WideResNet(depth=10, widen=1, density=0.25),
                          jax.ShapeDtypeStruct((4, 8, 8, 3), jnp.float32),
                          jax.ShapeDtypeStruct((4,), jnp.int32))
  tx = sparse.sparse_storage(lm.adamaw(1e-2, 2), wl.dense_params(), update_every=2)
  params, batch = jax.jit(wl.init)(jax.random.key(0)), wl.batch(jax.random.key(1))
  step = jax.jit(wl.train_step(tx, 2))
  states = [tx.init(params)]
  for _ in range(3):  # the move at the end of the second step
    params, state, _ = step(params, states[-1], batch)
    states.append(state)
  old, new = states[1].positions, states[2].positions
  assert any(bool(jnp.any(a != b)) for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new)))
  jax.tree.map(np.testing.assert_array_equal, states[3].positions, new)

  @jax.jit
  def loss(positions):  # the step's: the mean over its strided micro-batches
    return jnp.mean(jnp.stack([wl.loss(params, batch[0][i::2], batch[1][i::2], positions)
                               for i in range(2)]))
  _, _, metrics = step(params, states[3], batch)
  np.testing.assert_allclose(metrics["loss"], loss(new), rtol=1e-5)
  assert abs(float(loss(old) - loss(new))) > 1e-4
