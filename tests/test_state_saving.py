"""Every optimizer and step state the project makes round-trips through flax.serialization and
orbax, and resumes bit for bit: one parametrised test over `CASES` (a new state: one line)."""

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import lowmem_jax as lm
from lowmem_jax import optim
from lowmem_jax.optim import lowbit, masked_sparsity, offload, precision, sparse
from third_party_promotion import (JMP_LOSS_SCALE, OPTAX_APPLY_UPDATES, OPTAX_BIAS_CORRECTION,
                                   OPTAX_UPDATE_MOMENT)

# A leaf of lowbit.MIN_SIZE elements, so that the 8-bit states hold quantised moments.
PARAMS = {"w": jax.random.normal(jax.random.key(0), (64, 64)), "b": jnp.zeros(64)}


@dataclasses.dataclass(frozen=True)
class Case:
  """One state: ``init() -> (params, state)``, ``step(params, state, i) -> (params, state)``
  on the i-th batch or gradient."""
  name: str
  init: Callable[[], tuple[Any, Any]]
  step: Callable[[Any, Any, int], tuple[Any, Any]]


def _grads(params: Any, i: int) -> Any:
  key = jax.random.fold_in(jax.random.key(1), i)
  return jax.tree.map(lambda p: jax.random.normal(key, p.shape, p.dtype), params)


def optimizer(name: str, tx: optax.GradientTransformation, params: Any = PARAMS) -> Case:
  """The case of a transformation: its jitted ``update`` on the i-th gradient, applied."""
  update = jax.jit(tx.update)

  def step(params, state, i):
    updates, state = update(_grads(params, i), state, params)
    return optax.apply_updates(params, updates), state
  return Case(name, lambda: (params, tx.init(params)), step)


def loss_scaled(name: str, tx: optax.GradientTransformation) -> Case:
  """`precision.loss_scaled_step`'s state: the optimizer's and the dynamic loss scale."""
  loss = lambda params, x: jnp.mean((x @ params["w"] + params["b"][None]) ** 2)
  run = jax.jit(precision.loss_scaled_step(loss, tx))

  def step(params, state, i):
    x = jax.random.normal(jax.random.fold_in(jax.random.key(2), i), (4, 64))
    params, *state, _ = run(params, *state, x)
    return params, tuple(state)
  return Case(name, lambda: (PARAMS, (tx.init(PARAMS), precision.dynamic_loss_scale(period=2))),
              step)


def streamed(name: str, tx: optax.GradientTransformation, place: str) -> Case:
  """`optim.layer_streamed`'s state (``state=place``) on two stacked tanh layers."""
  stack = optim.LayerStack(embed=lambda rest, x: x @ rest["w"],
                           layer=lambda p, h, x: jnp.tanh(h @ p["w"]),
                           head=lambda rest, h, x: jnp.mean(h ** 2))
  params = {**PARAMS, "layers": {"w": jnp.stack([PARAMS["w"] / 8] * 2)}}
  layered = optim.layer_streamed(stack, tx, state=place)
  run = jax.jit(layered.step)

  def step(params, state, i):
    x = jax.random.normal(jax.random.fold_in(jax.random.key(4), i), (4, 64))
    params, state, _ = run(params, state, x)
    return params, state
  return Case(name, lambda: (params, layered.init(params)), step)


_SPARSE_DENSE = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32), "b": jnp.zeros(64)}
_SPARSE_PARAMS = {"w": jax.random.normal(jax.random.key(3), (1024,)), "b": jnp.zeros(64)}

CASES = [
    optimizer("adama k=1", lm.adama(1)),
    optimizer("adamaw k=2", lm.adamaw(1e-2, 2)),
    optimizer("adama k=2 8-bit", lm.adama(2, state_bits=8)),
    optimizer("scale_by_adam_8bit", lowbit.scale_by_adam_8bit()),
    optimizer("adamw_8bit", lowbit.adamw_8bit(1e-2)),
    optimizer("stochastic_rounding", optax.chain(lowbit.adamw_8bit(1e-2),
                                                 lowbit.stochastic_rounding()),
              jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS)),
    optimizer("on_kth_micro_step", optim.on_kth_micro_step(optax.adamw(1e-2), 2)),
    optimizer("offload_state", offload.offload_state(optax.adam(1e-2))),
    optimizer("sparse_storage", sparse.sparse_storage(optax.adam(1e-2), _SPARSE_DENSE,
                                                      update_every=1, prune_fraction=0.25),
              _SPARSE_PARAMS),
    optimizer("dynamic_sparsity", optax.chain(
        optax.sgd(1e-2), masked_sparsity.dynamic_sparsity(0.5, update_every=1))),
    loss_scaled("loss_scaled_step", optax.adam(1e-2)),
    streamed("layer_streamed", optax.adamw(1e-2), "device"),
    streamed("layer_streamed 8-bit, on the host", lowbit.adamw_8bit(1e-2), "host"),
]


def _flax_state_dict(state, template, _):
  return flax.serialization.from_state_dict(template, flax.serialization.to_state_dict(state))


def _flax_bytes(state, template, _):
  """NumPy arrays come back; those of a host state put back in host memory, where the step
  takes them (`test_a_host_streamed_state_restored_onto_the_device_is_refused_by_name`)."""
  restored = flax.serialization.from_bytes(template, flax.serialization.to_bytes(state))
  host = lambda t: getattr(getattr(t, "sharding", None), "memory_kind", None) == "pinned_host"
  return jax.tree.map(lambda x, t: jax.device_put(x, t.sharding) if host(t) else x,
                      restored, template)


def _orbax(state, template, directory):
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(directory / "state", state)
    checkpointer.wait_until_finished()
    return checkpointer.restore(directory / "state", template)


SAVERS = {"flax state dict": _flax_state_dict, "flax bytes": _flax_bytes, "orbax": _orbax}


def _exact(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("saver", SAVERS.values(), ids=SAVERS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@OPTAX_BIAS_CORRECTION
@OPTAX_UPDATE_MOMENT
@JMP_LOSS_SCALE
@OPTAX_APPLY_UPDATES
def test_state_round_trips_and_resumes_bit_for_bit(case, saver, tmp_path):
  params, state = case.init()
  for i in range(2):
    params, state = case.step(params, state, i)
  restored = saver(state, case.init()[1], tmp_path)
  _exact(restored, state)
  resumed = params
  for i in range(2, 4):
    params, state = case.step(params, state, i)
    resumed, restored = case.step(resumed, restored, i)
  _exact((resumed, restored), (params, state))


@pytest.mark.parametrize("tx", [lowbit.adamw_8bit(1e-2), lm.adamaw(1e-2, 2)],
                         ids=["8-bit", "adama k=2"])
@OPTAX_BIAS_CORRECTION
@OPTAX_UPDATE_MOMENT
@OPTAX_APPLY_UPDATES
def test_a_host_streamed_state_restores_through_its_abstract_target(tx, tmp_path):
  """orbax restores into `LayerStreamed.abstract` (no concrete state made): the state lands in
  host memory, typed so (a step traced anew on it, as in a new process, takes it), and the
  donating step resumes bit for bit, compiling once more at most (the step gives its new
  state a `SingleDeviceSharding`, orbax restores host memory typed so only in a mesh)."""
  layered, run, params, state, xs = _host_streamed(tx)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "state", state)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "state", layered.abstract(params))
  assert {x.sharding.memory_kind for x in jax.tree.leaves(restored)} == {"pinned_host"}
  assert {jax.typeof(x).memory_space for x in jax.tree.leaves(restored)} == {
      jax.memory.Space.Host}
  resumed = jax.tree.map(jnp.copy, params)
  for x in xs[1:]:
    params, state, _ = run(params, state, x)
  compiles = run._cache_size()
  for x in xs[1:]:
    resumed, restored, _ = run(resumed, restored, x)
  assert run._cache_size() <= compiles + 1
  _exact((resumed, restored), (params, state))


@OPTAX_BIAS_CORRECTION
@OPTAX_UPDATE_MOMENT
@OPTAX_APPLY_UPDATES
def test_a_host_streamed_state_restored_onto_the_device_is_refused_by_name(tmp_path):
  """orbax restores into `jax.eval_shape(init)` (which keeps no memory kind) on the device: the
  donating step refuses that state by name (it aborted the process: memory kinds), as it
  does NumPy arrays (a restore from bytes); moved to the host it resumes bit for bit."""
  layered, run, params, state, xs = _host_streamed(lowbit.adamw_8bit(1e-2))
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "state", state)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "state", jax.eval_shape(layered.init, params))
  assert {x.sharding.memory_kind for x in jax.tree.leaves(restored)} == {"device"}
  for on_device in (restored, jax.tree.map(np.asarray, state)):  # eval_shape's; from bytes
    with pytest.raises(ValueError, match=r"in device memory.*`state='host'`.*abstract\(params"):
      run(params, on_device, xs[1])
  restored = jax.device_put(restored, jax.memory.Space.Host)
  resumed = jax.tree.map(jnp.copy, params)
  for x in xs[1:]:
    params, state, _ = run(params, state, x)
    resumed, restored, _ = run(resumed, restored, x)
  _exact((resumed, restored), (params, state))


def _host_streamed(tx):
  """``(layered, run, params, state, xs)``: a 2-layer stack streamed with its state on the
  host under ``tx``, stepped once (``run``, donating) on ``xs[0]``."""
  stack = optim.LayerStack(embed=lambda rest, x: x @ rest["w"],
                           layer=lambda p, h, x: jnp.tanh(h @ p["w"]),
                           head=lambda rest, h, x: jnp.mean(h ** 2))
  params = jax.tree.map(jnp.copy, {**PARAMS, "layers": {"w": jnp.stack([PARAMS["w"] / 8] * 2)}})
  layered = optim.layer_streamed(stack, tx, state="host")
  run = jax.jit(layered.step, donate_argnums=(0, 1))
  xs = [jax.random.normal(jax.random.key(i), (4, 64)) for i in range(3)]
  params, state, _ = run(params, layered.init(params), xs[0])
  return layered, run, params, state, xs
