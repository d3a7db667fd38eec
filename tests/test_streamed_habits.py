"""The layer-streamed step as a user's habits meet it: a batch whose loss is not finite (skipped
and counted, as optax.apply_if_finite), a gradient that is not finite (its leaf and what comes
after it in the backward kept), a learning rate changed mid-run (`with_hyperparams`, as optax's
tree_set), a statistic of a whole leaf over a leaf updated in slices (refused). The model and
its twins: tests/test_streamed.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax import tree_utils as otu
from test_streamed import VOCAB, assert_close, batch_of, params_of, plain_step, stack
from third_party_promotion import OPTAX_BIAS_CORRECTION

import lowmem_jax as lm
from lowmem_jax.ops.token_chunks import slices
from lowmem_jax.optim import streamed

pytestmark = OPTAX_BIAS_CORRECTION


def _same(a, b):
  """Bit for bit: the same tree, dtypes and values."""
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _bad_batches():
  """Batches whose loss is not finite: an id past the table (read as NaN rows), a label past
  the logits (read as NaN), a NaN and an infinite target of a float head."""
  tokens, labels = batch_of(jax.random.key(9))
  return {"id out of range": (tokens.at[1, 2].set(VOCAB + 3), labels),
          "label out of range": (tokens, labels.at[0, 0].set(VOCAB)),
          "NaN target": (tokens, labels, jnp.nan),
          "inf target": (tokens, labels, jnp.inf)}


def _with_target(model: streamed.LayerStack) -> streamed.LayerStack:
  """``model`` whose batch may carry a float target added to the loss times zero (a NaN or
  infinite one makes it NaN), as a regression target would."""
  def head(rest, h, batch):
    loss = model.head(rest, h, batch[:2])
    return loss if len(batch) == 2 else loss + 0.0 * jnp.mean(h) * batch[2]
  return streamed.LayerStack(model.embed, model.layer, head)


@pytest.mark.slow
@pytest.mark.parametrize("state", ["device", "host"])
@pytest.mark.parametrize("bad", list(_bad_batches()))
def test_a_non_finite_loss_skips_the_step_and_counts_it(bad, state):
  """Every parameter and state kept bit for bit (as optax.apply_if_finite keeps them), the
  step counted."""
  model, params = _with_target(stack()), params_of(jax.random.key(3))
  layered = streamed.layer_streamed(model, lm.lowbit.adamw_8bit(1e-2, min_size=16),
                                    state=state, slice_elements=128)
  step = jax.jit(layered.step)
  params, opt_state, metrics = step(params, layered.init(params), batch_of(jax.random.key(0)))
  assert bool(metrics["finite"]) and int(opt_state.total_notfinite) == 0
  after, after_state, metrics = step(params, opt_state, _bad_batches()[bad])
  assert not np.isfinite(metrics["loss"]) and not bool(metrics["finite"])
  assert int(after_state.total_notfinite) == 1
  _same((after, after_state._replace(total_notfinite=0)), (params, opt_state))


def _sqrt_stack(in_head: bool = False) -> streamed.LayerStack:
  """A model whose layer (or head) scales by sqrt(|s|): at s = 0 its loss and input gradient
  are finite, the gradient of s is not (0 * inf)."""
  whole = stack()
  root = lambda s: jnp.sqrt(jnp.abs(s))[None, None]
  if in_head:
    return streamed.LayerStack(
        whole.embed, lambda p, h, b: h + jnp.tanh(h @ p["w"]),
        lambda rest, h, b: whole.head(rest, h * (1 + root(rest["s"])), b))
  return streamed.LayerStack(whole.embed, lambda p, h, b: h + jnp.tanh(h @ p["w"]) * root(p["s"]),
                             whole.head)


def _sqrt_params(key, zero_at):
  """`_sqrt_stack`'s params, ``s`` zero at ``zero_at`` (an index into the layers' ``s``, or
  ``"head"``)."""
  k = jax.random.split(key, 2)
  s = jnp.ones((3, 16))
  params = {**{n: x for n, x in params_of(k[0]).items() if n != "layers"},
            "layers": {"w": jax.random.normal(k[1], (3, 16, 16)) / 4,
                       "s": s if zero_at == "head" else s.at[zero_at].set(0.0)}}
  if zero_at == "head":
    params["s"] = jnp.ones(16).at[3].set(0.0)
  return params


@pytest.mark.parametrize("state,slice_elements", [("device", 2 ** 24), ("host", 2 ** 24),
                                                  ("device", 64), ("host", 8)],
                         ids=["device", "host", "device-sliced", "host-sliced-finely"])
def test_a_non_finite_gradient_stops_the_update_where_the_backward_meets_it(state,
                                                                            slice_elements):
  """Layer 1's gradient of ``s`` is NaN at one element under a finite loss: the head, layer 2
  and layer 1's ``w`` (before it in the backward, or beside it) take the whole-gradient
  update; layer 1's ``s`` (its slice holding the NaN, where it is updated in slices), layer 0
  and the embedding keep their values and states."""
  model, params = _sqrt_stack(), _sqrt_params(jax.random.key(4), (1, 3))
  tx = optax.adamw(1e-2)
  batch = batch_of(jax.random.key(5))
  layered = streamed.layer_streamed(model, tx, state=state, slice_elements=slice_elements)
  start = layered.init(params)
  got, opt_state, metrics = jax.jit(layered.step)(params, start, batch)
  want = plain_step(model, tx)(params, tx.init(params), batch)[0]
  assert np.isfinite(metrics["loss"]) and not bool(metrics["finite"])
  assert int(opt_state.total_notfinite) == 1
  assert not np.all(np.isfinite(want["layers"]["s"][1]))  # the whole gradient's NaN
  assert_close({n: got[n] for n in ("output", "norm")}, {n: want[n] for n in ("output", "norm")})
  assert_close(jax.tree.map(lambda x: x[2], got["layers"]),
               jax.tree.map(lambda x: x[2], want["layers"]))
  assert_close(got["layers"]["w"][1], want["layers"]["w"][1])
  assert not np.allclose(got["layers"]["w"][1:], params["layers"]["w"][1:])
  part = 16 // slices((16,), slice_elements)  # s[1]'s slice holding the NaN: its first
  assert_close(got["layers"]["s"][1, part:], want["layers"]["s"][1, part:])
  _same((got["embedding"], got["layers"]["s"][1, :part],
         jax.tree.map(lambda x: x[0], got["layers"])),
        (params["embedding"], params["layers"]["s"][1, :part],
         jax.tree.map(lambda x: x[0], params["layers"])))
  _same(jax.tree.map(lambda x: x[0], opt_state.layers["s"] if state == "device" else
                     opt_state.layers.unstacked()["s"]),
        jax.tree.map(lambda x: x[0], start.layers["s"] if state == "device" else
                     start.layers.unstacked()["s"]))
  _same(opt_state.rest["embedding"], start.rest["embedding"])
  if (state, slice_elements) == ("device", 2 ** 24):  # each leaf's counts, picked after the
    # layers' loop from a row of flags a layer: layer 1's w stepped, its s kept
    assert {n: opt_state.layers[n][0].count.tolist() for n in ("s", "w")} == {
        "s": [0, 0, 1], "w": [0, 1, 1]}


@pytest.mark.parametrize("slice_elements", [2 ** 24, pytest.param(64, marks=pytest.mark.slow)],
                         ids=["whole", "sliced"])
def test_a_non_finite_gradient_stops_the_fused_kernels_where_the_chain_stops(slice_elements):
  """``update_impl="pallas_interpret"`` (each leaf's update one kernel, its count and key
  written by it, their words made before the layers' loop) against the chain, bit for bit,
  at the step whose layer 1 gradient of ``s`` is NaN: the same leaves kept, the same counts."""
  model = _sqrt_stack()
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                        _sqrt_params(jax.random.key(4), (1, 3)))
  tx = lm.lowbit.adamw_8bit(1e-2, block=8, min_size=8, seed=3, bfloat16_params=True)
  exact = {"xla_allow_excess_precision": False}
  out = {}
  for impl in ("pallas_interpret", "xla"):
    layered = streamed.layer_streamed(model, tx, slice_elements=slice_elements,
                                      update_impl=impl)
    args = (params, layered.init(params), batch_of(jax.random.key(5)))
    out[impl] = jax.jit(layered.step, compiler_options=exact)(*args)
    assert ("pallas_call" in str(jax.make_jaxpr(layered.step)(*args))) == (impl != "xla")
  assert not bool(out["xla"][2]["finite"]) and int(out["xla"][1].total_notfinite) == 1
  _same(out["pallas_interpret"][:2], out["xla"][:2])
  counts = out["xla"][1].layers["s"][0][0].count
  assert counts.ravel()[0] == 0 and counts.ravel()[-1] == 1  # layer 0 kept, layer 2 stepped


def test_a_non_finite_head_gradient_keeps_the_layers_and_the_embedding():
  """The head's ``s`` has a NaN gradient: it is kept, and so is everything after it in the
  backward (every layer, the embedding); the output kernel, beside it, takes its update."""
  model, params = _sqrt_stack(in_head=True), _sqrt_params(jax.random.key(6), "head")
  tx = optax.adamw(1e-2)
  batch = batch_of(jax.random.key(5))
  layered = streamed.layer_streamed(model, tx)
  got, _, metrics = jax.jit(layered.step)(params, layered.init(params), batch)
  want = plain_step(model, tx)(params, tx.init(params), batch)[0]
  assert not bool(metrics["finite"])
  assert_close(got["output"], want["output"])
  _same({n: got[n] for n in ("s", "layers", "embedding")},
        {n: params[n] for n in ("s", "layers", "embedding")})


@pytest.mark.parametrize("state,slice_elements", [("device", 2 ** 24), ("host", 128)],
                         ids=["device", "host-sliced"])
@pytest.mark.slow
def test_a_learning_rate_set_mid_run_reaches_every_leaf(state, slice_elements):
  """`with_hyperparams` on the streamed state does what optax's ``tree_set`` does on the
  whole tree's: the next steps take the new learning rate, the state kept where it lives."""
  tx = optax.inject_hyperparams(lm.lowbit.adamw_8bit, static_args=("block", "min_size", "seed"))(
      learning_rate=1e-2, min_size=16)
  model, params = stack(), params_of(jax.random.key(8))
  batches = [batch_of(jax.random.key(i)) for i in range(3)]
  layered = streamed.layer_streamed(model, tx, state=state, slice_elements=slice_elements)
  step, plain = jax.jit(layered.step), jax.jit(plain_step(model, tx))
  got, got_state, _ = step(params, layered.init(params), batches[0])
  want, want_state, _ = plain(params, tx.init(params), batches[0])
  got_state = lm.optim.with_hyperparams(got_state, learning_rate=3e-3)
  want_state = otu.tree_set(want_state, learning_rate=jnp.asarray(3e-3))
  for batch in batches[1:]:
    got, got_state, _ = step(got, got_state, batch)
    want, want_state, _ = plain(want, want_state, batch)
  assert_close(got, want)
  if state == "host":
    assert {x.sharding.memory_kind for x in jax.tree.leaves(got_state)} == {"pinned_host"}
  with pytest.raises(KeyError, match=r"\['lr'\]; they have \['b1', 'b2', .*'learning_rate'"):
    lm.optim.with_hyperparams(got_state, lr=1e-4)


def test_a_statistic_of_the_whole_leaf_over_a_sliced_leaf_is_refused():
  """lamb's trust ratio per slice would differ from optax's on the leaf: refused, naming the
  leaf; updated whole (``slice_elements`` past its size), it is taken per layer."""
  model, params = stack(), params_of(jax.random.key(5))
  with pytest.raises(ValueError, match=r"at \['embedding'\] \(float32\[64, 16\], updated in "
                     r"8 slices .* reads across its slices .* `slice_elements` >= 1024"):
    streamed.layer_streamed(model, optax.lamb(1e-3), slice_elements=128).init(params)
  streamed.layer_streamed(model, optax.lamb(1e-3), slice_elements=2048).init(params)


@pytest.mark.parametrize("state", ["device", "host"])
def test_the_step_compiles_once_where_its_first_arguments_are_committed(state):
  """A step that moves arrays between memories returns committed arrays (XLA placed them), and
  `jax.jit` keys its cache on committedness: arguments fresh from ``init`` (uncommitted) make
  the second step compile again; committed first (`lowmem_jax.optim.offload.committed`), one
  compile."""
  batch = batch_of(jax.random.key(1))
  for first, compiles in ((lambda tree: tree, 2), (lm.offload.committed, 1)):
    streamer = lm.optim.layer_streamed(stack(), optax.adamw(1e-3), state=state)
    step = jax.jit(streamer.step, donate_argnums=(0, 1))
    params = params_of(jax.random.key(0))
    params, opt_state = first((params, streamer.init(params)))
    for _ in range(3):
      params, opt_state, _ = step(params, opt_state, batch)
    assert step._cache_size() == compiles


def test_committed_keeps_each_array_where_it_lies_and_commits_numpy_leaves():
  host = jax.device_put(jnp.ones(3), jax.sharding.SingleDeviceSharding(
      jax.devices()[0], memory_kind="pinned_host"))
  tree = {"host": host, "device": jnp.zeros(2), "numpy": np.ones(2, np.float32), "int": 3,
          "none": None}
  out = lm.offload.committed(tree)
  assert out["none"] is None and all(x.committed for x in jax.tree.leaves(out))
  assert out["host"].sharding.memory_kind == "pinned_host"
  assert out["device"].sharding.memory_kind == "device"
  _same(out, jax.tree.map(jnp.asarray, tree))
