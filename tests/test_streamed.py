"""The layer-streamed step against its exact twins: optax on `jax.grad` of the whole loss,
`microbatch_step` for AdamA, `scale_by_adam_8bit` over the whole tree; the refusal of
transformations that read the whole gradient; the state and saved inputs on the host."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from third_party_promotion import OPTAX_APPLY_UPDATES, OPTAX_BIAS_CORRECTION

import lowmem_jax as lm
from lowmem_jax import _jaxpr
from lowmem_jax.optim import per_leaf, streamed

pytestmark = OPTAX_BIAS_CORRECTION

VOCAB, DIM, HIDDEN, LAYERS = 64, 16, 32, 3


def rms(x, w):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w[None, None]


def stack(tied: bool = False) -> streamed.LayerStack:
  """A small pre-norm residual MLP language model, written as a user would."""
  def embed(rest, batch):
    return jnp.take(rest["embedding"], batch[0], axis=0)

  def layer(p, h, batch):
    del batch
    return h + jax.nn.gelu(rms(h, p["norm"]) @ p["w1"]) @ p["w2"]

  def head(rest, h, batch):
    out = rest["embedding"].T if tied else rest["output"]
    logits = rms(h, rest["norm"]).astype(jnp.float32) @ out.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

  return streamed.LayerStack(embed, layer, head)


def stack_in_parts() -> streamed.LayerStack:
  """`stack`'s model with each layer in two parts that share the norm; a leaf no part reads."""
  def first(p, h, batch):
    del batch
    return h + jax.nn.gelu(rms(h, p["norm"]) @ p["w1"]) @ p["w1"].T

  def second(p, h, batch):
    del batch
    return h + jnp.tanh(rms(h, p["norm"]) @ p["w2"].T) @ p["w2"]

  whole = stack()  # a part under jax.checkpoint reads only the leaves its body reads
  return streamed.LayerStack(whole.embed, (jax.checkpoint(first), second), whole.head)


def params_of(key, tied=False, dtype=jnp.float32, dim=DIM, hidden=HIDDEN):
  k = jax.random.split(key, 4)
  params = {
      "embedding": jax.random.normal(k[0], (VOCAB, dim)),
      "norm": jnp.ones(dim),
      "layers": {"norm": jnp.ones((LAYERS, dim)),
                 "w1": jax.random.normal(k[1], (LAYERS, dim, hidden)) / dim ** 0.5,
                 "w2": jax.random.normal(k[2], (LAYERS, hidden, dim)) / hidden ** 0.5},
  }
  if not tied:
    params["output"] = jax.random.normal(k[3], (dim, VOCAB)) / dim ** 0.5
  return jax.tree.map(lambda x: x.astype(dtype), params)


def batch_of(key, n=4, length=8):
  tokens = jax.random.randint(key, (n, length + 1), 0, VOCAB)
  return tokens[:, :-1], tokens[:, 1:]


def plain_step(model, tx):
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(model.loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return jax.jit(step)


def run_both(model, tx, params, batches, twin=None, **places):
  """The streamed step of ``model`` and the plain step of ``twin`` (default ``model``)."""
  layered = streamed.layer_streamed(model, tx, **places)
  step, state = jax.jit(layered.step), layered.init(params)
  plain, plain_state = plain_step(model if twin is None else twin, tx), tx.init(params)
  got, want = params, params
  for batch in batches:
    got, state, metrics = step(got, state, batch)
    want, plain_state, loss = plain(want, plain_state, batch)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
  return got, want, state


def assert_close(got, want, rtol=1e-5, atol=1e-5):
  """Parameters after a few steps at learning rate 1e-2: ``atol`` is 0.1% of one step. Adam
  turns a near-zero gradient's float rounding into more of its update: other summation orders
  (an H100's, jax 0.11.2's on CPU) moved one or two elements in a thousand by up to 3e-6."""
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=atol), got, want)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_adamw_equals_optax_on_the_whole_gradient(tied):
  model, params = stack(tied), params_of(jax.random.key(0), tied)
  batches = [batch_of(jax.random.key(i)) for i in range(3)]
  got, want, _ = run_both(model, optax.adamw(1e-2, weight_decay=0.1), params, batches)
  assert_close(got, want)
  assert not np.allclose(got["layers"]["w1"], params["layers"]["w1"])  # it trained


@pytest.mark.slow
@pytest.mark.parametrize("state,slice_elements,kept", [
    ("device", 2 ** 24, False), ("host", 128, False), ("host", 128, True)],
    ids=["device", "host-sliced", "host-sliced-part-inputs"])
def test_a_layer_in_parts_equals_optax_on_the_whole_gradient(state, slice_elements, kept):
  """Each part's parameters updated after its backward: the shared norm after the first
  part's (both gradients summed), a leaf no part reads with a zero gradient (weight decay
  still moves it), the stacks updated in place a slice at a time; with ``kept``, each
  part's input kept on the host by the forward, not recomputed."""
  model = stack_in_parts()
  params = params_of(jax.random.key(6))
  params["layers"]["unread"] = jnp.ones((LAYERS, DIM))
  batches = [batch_of(jax.random.key(i)) for i in range(3)]
  places = dict(saved_inputs="host", keep_part_inputs=True) if kept else {}
  got, want, _ = run_both(model, optax.adamw(1e-2, weight_decay=0.1), params, batches,
                          state=state, slice_elements=slice_elements, **places)
  assert_close(got, want)
  one = jax.tree.map(lambda x: x[0], params["layers"])
  h = jnp.zeros((2, 8, DIM))
  assert [{k for k, r in per_leaf.reads(lambda p, h: part(p, h, None), one, h).items() if r}
          for part in model.parts] == [{"norm", "w1"}, {"norm", "w2"}]
  for name in ("norm", "w1", "w2", "unread"):
    assert not np.allclose(got["layers"][name], params["layers"][name]), name


def test_kept_part_inputs_give_the_same_step_with_the_first_parts_forward_once():
  """``keep_part_inputs``: the forward keeps the second part's input, so the backward runs
  the first part's forward (its two matmuls) once, inside its backward, not also before."""
  model, params = stack_in_parts(), params_of(jax.random.key(6))
  tx, batch = optax.adamw(1e-2, weight_decay=0.1), batch_of(jax.random.key(1))
  steps = [streamed.layer_streamed(model, tx, keep_part_inputs=kept) for kept in (False, True)]
  dots = [sum(e.primitive.name == "dot_general" for e, _ in _jaxpr.walk(
      jax.make_jaxpr(s.step)(params, s.init(params), batch).jaxpr)) for s in steps]
  assert dots[0] - dots[1] == 2, dots
  got, want = (jax.jit(s.step)(params, s.init(params), batch)[0] for s in steps)
  assert_close(got, want, rtol=1e-6, atol=1e-6)


def _not_norms(params):
  """True for every leaf but the norms' scales: weight decay's usual mask, by path."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "norm" not in jax.tree_util.keystr(path), params)


@pytest.mark.parametrize("state,slice_elements", [("device", 2 ** 24), ("host", 128)],
                         ids=["device", "host-sliced"])
@pytest.mark.parametrize("tx_name", ["adamw-mask", "partition", "masked"])
def test_masks_and_partitions_by_path_select_as_on_the_whole_tree(tx_name, state,
                                                                  slice_elements):
  """Each leaf reaches ``tx`` at its path: norms not decayed, a frozen embedding unmoved.
  Given the bare leaf, a mask function saw no path: every norm decayed, the table trained."""
  frozen = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: "frozen" if path[0].key == "embedding" else "trained", params)
  tx = {"adamw-mask": optax.adamw(1e-2, weight_decay=0.5, mask=_not_norms),
        "partition": optax.partition({"frozen": optax.set_to_zero(), "trained": optax.adam(1e-2)},
                                     frozen),
        "masked": optax.chain(optax.masked(optax.add_decayed_weights(0.5), _not_norms),
                              optax.sgd(1e-2))}[tx_name]
  model, params = stack(), params_of(jax.random.key(4))
  batches = [batch_of(jax.random.key(i)) for i in range(3)]
  got, want, _ = run_both(model, tx, params, batches, state=state,
                          slice_elements=slice_elements)
  assert_close(got, want)
  if tx_name == "partition":
    np.testing.assert_array_equal(got["embedding"], params["embedding"])


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [1, 2])
def test_the_state_and_saved_inputs_on_the_host_give_the_same_step(prefetch):
  """Brought over one layer ahead, or two, and written back a layer late (3 layers: a pair of
  trips and one alone; the head's and embedding's leaves in 4 slices, in two banks either
  way)."""
  model, params = stack(), params_of(jax.random.key(1))
  batches = [batch_of(jax.random.key(i)) for i in range(2)]
  got, want, state = run_both(model, optax.adam(1e-2), params, batches, state="host",
                              saved_inputs="host", prefetch=prefetch, slice_elements=256)
  assert_close(got, want)
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state)} == {"pinned_host"}
  assert {x.sharding.memory_kind for x in jax.tree.leaves(got)} == {"device"}
  assert (len(state.layers.banks), len(state.rest["embedding"].banks)) == (prefetch, 2)


def test_a_state_made_with_another_prefetch_is_refused_by_name():
  model, params, batch = stack(), params_of(jax.random.key(0)), batch_of(jax.random.key(1))
  one, two = (streamed.layer_streamed(model, optax.adam(1e-2), state="host", prefetch=k)
              for k in (1, 2))
  with pytest.raises(ValueError, match=r"should be uint8\[3, \d+\] in 2 bank\(s\), got .* in "
                                       r"1 bank\(s\).*`prefetch`"):
    jax.eval_shape(two.step, params, one.init(params), batch)


@pytest.mark.parametrize("prefetch", [0, 3, 1.0, True])
def test_a_prefetch_other_than_1_or_2_is_refused_by_name(prefetch):
  with pytest.raises(ValueError, match="`prefetch` must be 1 or 2"):
    streamed.layer_streamed(stack(), optax.adam(1e-2), state="host", prefetch=prefetch)


def test_a_stateless_transformation_with_its_state_on_the_host():
  """optax.sgd keeps nothing: its host rows have no bytes, made eagerly, traced or jitted."""
  model, params = stack(), params_of(jax.random.key(1))
  got, want, state = run_both(model, optax.sgd(1e-2), params, [batch_of(jax.random.key(0))],
                              state="host")
  assert_close(got, want)
  assert state.layers.joined().shape == (LAYERS, 0)
  layered = streamed.layer_streamed(model, optax.sgd(1e-2), state="host")
  assert jax.tree.structure(jax.jit(layered.init)(params)) == jax.tree.structure(state)
  assert jax.tree.structure(jax.eval_shape(layered.init, params)) == jax.tree.structure(state)


def test_the_host_state_is_made_a_layer_at_a_time():
  """In host memory each layer's state is made on the device and moved before the next one's
  (a whole 8B's 8-bit state made on the device does not fit beside its parameters on a 24 GB
  card), and equals the state made whole (traced, as under jit). A typed key in the state
  (one a layer) is stacked too."""
  params = params_of(jax.random.key(1))
  adam = optax.adam(1e-2)
  seen = []

  def init(p):
    seen.append((any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(p)), sum(
        x.nbytes for x in jax.live_arrays() if x.sharding.memory_kind == "device")))
    return {"adam": adam.init(p), "key": jax.random.key(0)}

  tx = optax.GradientTransformation(init, lambda g, s, p=None: (adam.update(g, s["adam"], p)[0], s))
  layered = streamed.layer_streamed(stack(), tx, state="host")
  state = layered.init(params)
  layer_leaves = jax.tree.leaves(params["layers"])
  one_layer = sum(x[0].nbytes for x in layer_leaves)
  made = [bytes_ for traced, bytes_ in seen if not traced]
  assert len(made) == len(jax.tree.leaves(params)) + (LAYERS - 1) * len(layer_leaves), seen
  # At most one layer's Adam state (twice its parameters) and its copy of them at a time.
  assert max(made) - min(made) <= 3 * one_layer, (made, one_layer)
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state)} == {"pinned_host"}
  whole = jax.jit(layered.init)(params)
  assert jax.tree.structure(state) == jax.tree.structure(whole)
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(whole)):
    if jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key):
      got, want = jax.random.key_data(got), jax.random.key_data(want)
    np.testing.assert_array_equal(got, want)


def test_each_leafs_host_state_is_sliced_out_of_its_row_behind_its_own_barrier():
  """The backward reads a layer's packed host row one leaf's state at a time, each behind an
  ``optimization_barrier`` on what its update waits for (`Row.read_after`): every slice of a
  row is made from a barrier's output, each state leaf's bytes once, one barrier a parameter
  leaf (a whole unpack a leaf would slice the row 3 x 9 times)."""
  params = params_of(jax.random.key(1))
  layered = streamed.layer_streamed(stack(), optax.adam(1e-2), state="host")
  state = layered.init(params)
  jaxpr = jax.make_jaxpr(layered.step)(params, state, batch_of(jax.random.key(0))).jaxpr
  made = {v: e for e, _ in _jaxpr.walk(jaxpr) for v in e.outvars}
  barriers = {}
  for e, _ in _jaxpr.walk(jaxpr):
    x = e.invars[0] if e.invars else None
    if e.primitive.name == "slice" and x.aval.dtype == jnp.uint8 and x.aval.ndim == 1:
      assert x in made and made[x].primitive.name == "optimization_barrier", e
      barriers.setdefault(id(made[x]), []).append(e.params["start_indices"][0])
  leaves = state.layers.layout.leaves
  assert sorted(s for starts in barriers.values() for s in starts) == [
      sum(leaf.nbytes for leaf in leaves[:k]) for k in range(len(leaves))]
  assert len(barriers) == len(jax.tree.leaves(params["layers"]))


@pytest.mark.parametrize("tx", [optax.adam(1e-2), optax.inject_hyperparams(optax.adam)(1e-2)],
                         ids=["adam", "inject_hyperparams"])
def test_the_layers_loop_writes_a_row_of_flags_not_each_leafs_count(tx):
  """With the state on the device, each layer leaf's count (int32 a layer) and constant
  hyperparameters (float32 a layer) are kept or stepped on its gradient's finiteness alone:
  the layers' loop writes one row of flags a layer, and every layer's are picked after it
  (`hoisted.picked`), not written a leaf at a time in the loop (a kernel each on a GPU).
  The values: the exact-twin tests above."""
  params = params_of(jax.random.key(1))
  layered = streamed.layer_streamed(stack(), tx)
  state = layered.init(params)
  jaxpr = jax.make_jaxpr(layered.step)(params, state, batch_of(jax.random.key(0))).jaxpr
  written = [(e.invars[0].aval.dtype, e.invars[0].aval.shape)
             for loop, _ in _jaxpr.walk(jaxpr) if loop.primitive.name in ("scan", "while")
             for body in _jaxpr.inner_jaxprs(loop) for e, _ in _jaxpr.walk(body)
             if e.primitive.name == "dynamic_update_slice"]
  assert not {(jnp.dtype(jnp.int32), (LAYERS,)), (jnp.dtype(jnp.float32), (LAYERS,))} & set(
      written), written
  assert written.count((jnp.dtype(bool), (LAYERS, 3))) == 1  # a flag for each of 3 leaves


@pytest.mark.slow
@pytest.mark.parametrize("state_bits", [None, 8])
def test_adama_equals_microbatch_step(state_bits):
  """One call per micro-batch, AdamA applying at the k-th: `microbatch_step`'s update. With
  8-bit moments (rounded stochastically, the whole tree's bits) the kernels and the
  embedding are wide enough for 8 bits (`lowbit.MIN_SIZE` elements a layer)."""
  k = 2
  model = stack()
  params = params_of(jax.random.key(2), **({} if state_bits is None else dict(dim=64, hidden=128)))
  tx = lm.adamaw(1e-2, k, weight_decay=0.1, state_bits=state_bits, seed=4)
  batches = [batch_of(jax.random.key(i), n=4) for i in range(2)]
  layered = streamed.layer_streamed(model, tx)
  step, state, got = jax.jit(layered.step), layered.init(params), params
  reference = jax.jit(lm.optim.microbatch_step(model.loss, tx, k))
  want, ref_state = params, tx.init(params)
  for batch in batches:
    before = got
    for i in range(k):  # microbatch_step's strided micro-batches
      got, state, _ = step(got, state, jax.tree.map(lambda x, i=i: x[i::k], batch))
      if i < k - 1:  # folded, not applied
        jax.tree.map(np.testing.assert_array_equal, got, before)
    want, ref_state, _ = reference(want, ref_state, batch)
  if state_bits is None:
    assert_close(got, want)
  else:
    # 8-bit moments: a gradient summed in another order can round an element's moment to the
    # next code, which moves that element's update by a code's width over its own sqrt(v):
    # a few elements, each within a tenth of a step (jax 0.12 on CPU moved 2 of 24,576 by 5e-5).
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      off = np.abs(np.asarray(a) - np.asarray(b)) > 1e-5 + 1e-5 * np.abs(np.asarray(b))
      assert off.mean() <= 1e-3, off.sum()
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-2 / 10)
  if state_bits == 8:
    assert lm.lowbit.is_quantized(state.layers["w1"][0].mu["layers"]["w1"])  # w1 at its path


@pytest.mark.slow
def test_8bit_moments_equal_scale_by_adam_8bit_over_the_whole_tree():
  """Rounding to nearest (no keys): blocks run along the last axis, so a layer's slice
  quantises as the stacked leaf does; every leaf is past min_size in both."""
  tx = optax.chain(lm.lowbit.scale_by_adam_8bit(block=16, min_size=16, stochastic=False),
                   optax.scale_by_learning_rate(1e-2))
  model, params = stack(), params_of(jax.random.key(3))
  batches = [batch_of(jax.random.key(i)) for i in range(3)]
  got, want, state = run_both(model, tx, params, batches)
  assert_close(got, want)
  assert lm.lowbit.is_quantized(state.layers["w1"][0].mu["layers"]["w1"])  # w1 at its path


@pytest.mark.slow
@OPTAX_APPLY_UPDATES
@pytest.mark.parametrize("slice_elements,parts", [(2 ** 24, False), (128, False), (128, True)],
                         ids=["whole", "sliced", "sliced-parts"])
def test_stochastic_rounding_draws_the_whole_trees_bits(slice_elements, parts):
  """8-bit moments and bfloat16 parameters, both rounded stochastically: each layer's
  leaves (and with small ``slice_elements`` each slice of a leaf) are rounded with the
  bits the whole tree draws there (`lowbit.Position`), so the step equals the whole-tree
  step."""
  tx = optax.chain(lm.lowbit.scale_by_adam_8bit(block=16, min_size=16, seed=3),
                   optax.scale_by_learning_rate(1e-2), lm.lowbit.stochastic_rounding(seed=5))
  model = stack_in_parts() if parts else stack()
  params = params_of(jax.random.key(4), dtype=jnp.bfloat16)
  batches = [batch_of(jax.random.key(i)) for i in range(3)]
  got, want, _ = run_both(model, tx, params, batches, slice_elements=slice_elements)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == jnp.bfloat16
  assert_close(got, want, rtol=0, atol=0)


def test_a_partition_of_8bit_and_float32_moments_draws_the_whole_trees_bits():
  """`optax.partition` masks the leaves of the other label: each leaf keeps its place
  (`lowbit.positions_of`), so the 8-bit half rounds as over the whole tree."""
  labels = lambda params: jax.tree.map(lambda x: "8bit" if x.shape[-1] == HIDDEN else "f32",
                                       params)
  tx = optax.chain(optax.partition({"8bit": lm.lowbit.scale_by_adam_8bit(block=16, min_size=16,
                                                                          seed=3),
                                    "f32": optax.scale_by_adam()}, labels),
                   optax.scale_by_learning_rate(1e-2))
  model, params = stack(), params_of(jax.random.key(5))
  got, want, state = run_both(model, tx, params, [batch_of(jax.random.key(i)) for i in range(2)])
  assert_close(got, want)


@pytest.mark.parametrize("tx", [
    optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
    optax.apply_if_finite(optax.adam(1e-3), 3),
], ids=["clip_by_global_norm", "apply_if_finite"])
def test_a_transformation_that_reads_the_whole_gradient_is_refused(tx):
  params = params_of(jax.random.key(0))
  with pytest.raises(ValueError, match="reads other leaves' gradients.*optax"):
    streamed.layer_streamed(stack(), tx).init(params)


def test_a_per_leaf_statistic_of_a_layer_leaf_is_the_layers():
  """`optax.clip_by_block_rms`, engaged (every leaf's gradient RMS above the clip; before SGD,
  whose update it scales): on a layer leaf each layer's own, as optax takes it on a model
  whose layers are leaves of their own; elsewhere the leaf's, as on the whole tree."""
  tx = optax.chain(optax.clip_by_block_rms(1e-4), optax.sgd(1.0))
  model, params = stack(), params_of(jax.random.key(5))
  batch = batch_of(jax.random.key(0))
  grads = jax.grad(model.loss)(params, batch)
  apart = lambda t: {**t, "layers": [jax.tree.map(lambda x: x[i], t["layers"])
                                     for i in range(LAYERS)]}
  assert all(jnp.sqrt(jnp.mean(g ** 2)) > 1e-4 for g in jax.tree.leaves(apart(grads)))
  updates, _ = tx.update(apart(grads), tx.init(apart(params)))
  want = optax.apply_updates(params, {**updates, "layers": jax.tree.map(
      lambda *xs: jnp.stack(xs), *updates["layers"])})
  layered = streamed.layer_streamed(model, tx)
  got, _, _ = jax.jit(layered.step)(params, layered.init(params), batch)
  assert_close(got, want, atol=1e-7)
  whole, _ = tx.update(grads, tx.init(params))  # the stack's RMS: another step
  assert not np.allclose(optax.apply_updates(params, whole)["layers"]["w1"],
                         got["layers"]["w1"], atol=1e-7)


def test_slices_below_the_8bit_moments_min_size_are_refused():
  """8-bit moments of a leaf in slices each below ``min_size``: float32 moments a slice, where
  the whole tree's leaf takes 8-bit ones (2.6 times the state, another update), refused."""
  tx = lm.scale_by_adam_8bit(block=8, min_size=128)
  params = params_of(jax.random.key(0))
  streamed.layer_streamed(stack(), tx, slice_elements=128).init(params)  # each slice 8-bit
  with pytest.raises(ValueError, match=r"parameter at \['embedding'\] \(float32\[64, 16\], "
                     r"updated in 16 slices .* another kind of state than the whole leaf's .* "
                     r"`slice_elements` >= 1024 to update it whole, or a `min_size` <= 64"):
    streamed.layer_streamed(stack(), tx, slice_elements=64).init(params)


def test_bad_input_names_what_is_wrong():
  with pytest.raises(TypeError, match="LayerStack.layer` must be callable or a non-empty tuple"):
    streamed.LayerStack(stack().embed, (), stack().head)
  with pytest.raises(TypeError, match="LayerStack.layer` must be callable or a non-empty tuple"):
    streamed.LayerStack(stack().embed, (stack().layer, "attention"), stack().head)
  model, params = stack(), params_of(jax.random.key(0))
  layered = streamed.layer_streamed(model, optax.adam(1e-3))
  odd = {**params, "layers": {**params["layers"], "norm": jnp.ones((LAYERS + 1, DIM))}}
  with pytest.raises(ValueError, match=r"\['norm'\] has \(4,\)|\['w1'\] has \(3,\)"):
    layered.init(odd)
  with pytest.raises(ValueError, match="'layers'"):
    layered.init({"embedding": params["embedding"]})
  for where in ("norm", "layers"):  # outside the layers and in them
    counted = {**params, where: {**params[where], "count": jnp.zeros(LAYERS, jnp.int32)}
               if where == "layers" else jnp.zeros((), bool)}
    with pytest.raises(TypeError, match=r"parameter at \['(layers'\]\['count|norm)'\] is "
                       r"(int32\[3\]|bool\[\]): the step differentiates every leaf"):
      layered.init(counted)
  with pytest.raises(ValueError, match="`state` must be one of"):
    streamed.layer_streamed(model, optax.adam(1e-3), state="cpu")
  with pytest.raises(TypeError, match="`stack`"):
    streamed.layer_streamed(model.loss, optax.adam(1e-3))
  with pytest.raises(TypeError, match="optax.MultiSteps, .* give AdamA"):
    streamed.layer_streamed(model, optax.MultiSteps(optax.adam(1e-3), 2))
  with pytest.raises(TypeError, match="`gather_params` must be a bool"):
    streamed.layer_streamed(model, optax.adam(1e-3), gather_params="fsdp")
  with pytest.raises(TypeError, match="`keep_part_inputs` must be a bool"):
    streamed.layer_streamed(model, optax.adam(1e-3), keep_part_inputs=1)
  with pytest.raises(TypeError, match="StreamedState"):
    layered.step(params, optax.adam(1e-3).init(params), batch_of(jax.random.key(0)))
  by_tree = optax.adamw(1e-3, mask=jax.tree.map(lambda x: x.ndim > 1, params))
  with pytest.raises(ValueError, match=r"at \['layers', 'norm'\] alone failed: .* a mask or label "
                     "tree .* cannot match it; give a function"):
    streamed.layer_streamed(model, by_tree).init(params)


@pytest.mark.parametrize("state", ["device", "host"])
def test_a_state_made_for_other_params_is_refused(state):
  """A state for 3 layers stepped with 4 would read and overwrite layer 2's moments at
  layer 3 (the index clamped); another transformation's state would be misread."""
  model, params = stack(), params_of(jax.random.key(0))
  layered = streamed.layer_streamed(model, optax.adam(1e-3), state=state)
  more = jax.tree.map(lambda x: jnp.concatenate([x, x[:1]]), params["layers"])
  batch = batch_of(jax.random.key(1))
  with pytest.raises(ValueError,
                     match=r"not the state `init` makes.* should be \w+\[4[\],].*got .*\[3[\],]"):
    jax.eval_shape(layered.step, {**params, "layers": more}, layered.init(params), batch)
  sgd = streamed.layer_streamed(model, optax.sgd(1e-3, momentum=0.9), state=state)
  with pytest.raises(ValueError, match="not the state `init` makes"):
    jax.eval_shape(layered.step, params, sgd.init(params), batch)


def test_a_layer_of_the_wrong_signature_or_return_is_refused_by_name():
  """Both made scan's carry error, which names neither the layer nor what it should be."""
  whole, params, batch = stack(), params_of(jax.random.key(0)), batch_of(jax.random.key(1))
  for layer, message in (
      (lambda p, h: h, r"`LayerStack.layer` must take \(layer_params, x, batch\)"),
      (lambda p, h, b: (h, None), r"must return the hidden state as the layer takes it, "
                                  r"float32\[4, 8, 16\]; got \("),
      (lambda p, h, b: h.astype(jnp.bfloat16), r"float32\[4, 8, 16\]; got bfloat16\[4, 8, 16\]")):
    layered = streamed.layer_streamed(streamed.LayerStack(whole.embed, layer, whole.head),
                                      optax.adam(1e-3))
    with pytest.raises(TypeError, match=message):
      layered.step(params, layered.init(params), batch)
  parts = streamed.LayerStack(whole.embed, (whole.layer, lambda p, h, b: h[..., :2]), whole.head)
  layered = streamed.layer_streamed(parts, optax.adam(1e-3))
  with pytest.raises(TypeError, match=r"`LayerStack.layer`\[-1\] must return the hidden state"):
    layered.step(params, layered.init(params), batch)


def test_a_head_that_returns_no_scalar_loss_is_refused():
  """A per-example ``[batch]`` loss would be updated as its sum's gradient; jax.grad refuses."""
  whole = stack()
  per_example = lambda rest, h, batch: optax.softmax_cross_entropy_with_integer_labels(
      rms(h, rest["norm"]) @ rest["output"], batch[1]).mean(-1)
  model = streamed.LayerStack(whole.embed, whole.layer, per_example)
  params = params_of(jax.random.key(0))
  layered = streamed.layer_streamed(model, optax.adam(1e-3))
  with pytest.raises(TypeError,
                     match=r"must return a float scalar loss .*, got (f32|float32)\[4\]"):
    layered.step(params, layered.init(params), batch_of(jax.random.key(1)))


@pytest.mark.slow
def test_llama_layer_stack_equals_adamw_on_the_model():
  """The reference LLaMA's `layer_stack` (GQA, RoPE, tied embeddings, the fused head). Adam's
  eps at 1e-4: with 1e-8 a near-zero gradient's float rounding (the fused head sums its blocks
  in another order) moves its update by a fair part of the learning rate."""
  config = lm.models.LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2,
                                 ffn_dim=48, tie_embeddings=True)
  model = lm.models.Llama(config, loss="fused")
  tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 64)
  batch = (tokens[:, :-1], tokens[:, 1:])
  params = model.init(jax.random.key(1), batch[0])["params"]
  stack = lm.models.llama.layer_stack(model)
  got, want, _ = run_both(stack, optax.adamw(1e-2, eps=1e-4), params, [batch, batch])
  assert_close(got, want, rtol=1e-4, atol=1e-5)
  want_loss = model.apply({"params": params}, *batch)
  np.testing.assert_allclose(stack.loss(params, batch), want_loss, rtol=1e-6)


@pytest.mark.slow
def test_llama_mlp_in_token_chunks_equals_adamw_on_the_whole_mlp():
  """The `stream` technique's ``mlp_chunk_tokens``: the streamed step of the model whose MLP
  runs in 4 token chunks equals AdamW on the gradient of the model whose MLP runs whole."""
  config = lm.models.LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                 ffn_dim=48)
  whole = lm.models.Llama(config, loss="fused")
  tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 64)
  batch = (tokens[:, :-1], tokens[:, 1:])
  params = whole.init(jax.random.key(1), batch[0])["params"]
  chunked = lm.models.llama.layer_stack(whole.clone(mlp_chunk_tokens=4))
  got, want, _ = run_both(chunked, optax.adamw(1e-2, eps=1e-4), params, [batch, batch],
                          twin=lm.models.llama.layer_stack(whole))
  assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_it_composes_with_lm_lowmem_and_a_remat_policy_in_the_layer():
  """The layer rewritten by `lm.lowmem` (its norm memory-sharing, exact; ReGELU2's backward,
  approximate: the twin differentiates the same rewritten layer) under a remat policy."""
  plain = stack()
  rewrite = functools.partial(lm.lowmem, activations="approx")
  layer = jax.checkpoint(rewrite(plain.layer), policy=jax.checkpoint_policies.dots_saveable)
  model = streamed.LayerStack(plain.embed, layer, plain.head)
  params = params_of(jax.random.key(7))
  got, want, _ = run_both(model, optax.adam(1e-2), params, [batch_of(jax.random.key(0))] * 2)
  assert_close(got, want)
  rewritten = rewrite(plain.layer).explain(jax.tree.map(lambda x: x[0], params["layers"]),
                                              jnp.ones((4, 8, DIM)), None)
  assert rewritten.counts == {"norm": 1, "activation": 1}
