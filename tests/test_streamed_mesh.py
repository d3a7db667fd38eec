"""The layer-streamed step over a mesh of 8 CPU devices: FSDP's parameters, the state made on
their mesh and split as they are (`lowmem_jax._sharding`), the same step as on one device."""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from third_party_promotion import OPTAX_BIAS_CORRECTION

import lowmem_jax as lm
from lowmem_jax import _sharding
from lowmem_jax.optim import packed_rows, streamed
from test_streamed import DIM, assert_close, batch_of, params_of, stack

pytestmark = OPTAX_BIAS_CORRECTION


@pytest.mark.slow
def test_fsdp_over_8_devices_equals_one_device():
  """Parameters and state sharded along their last axis over an 8-device mesh (the layers'
  axis unsharded), the batch along its first: the same step as on one device."""
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  model, params = stack(), params_of(jax.random.key(6))
  tx = optax.adamw(1e-2, weight_decay=0.1)
  layered = streamed.layer_streamed(model, tx, slice_elements=256)
  batch = batch_of(jax.random.key(0), n=8)
  one, one_state, _ = jax.jit(layered.step)(params, layered.init(params), batch)

  sharded = jax.tree.map(functools.partial(_fsdp, mesh), params)
  state = jax.tree.map(functools.partial(_fsdp, mesh), layered.init(sharded))
  data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  got, got_state, _ = jax.jit(layered.step)(sharded, state, jax.device_put(batch, data))
  assert got["layers"]["w1"].sharding.spec[-1] == "fsdp"
  assert_close(got, one)
  assert_close(got_state, one_state, atol=1e-6)


def _fsdp(mesh, x, rows=False):
  """``x`` on ``mesh``, split along its last axis where 8 divides it (``rows``: its first axis
  that 8 divides)."""
  spec = [None] * x.ndim
  axis = (next((a for a in range(x.ndim) if x.shape[a] % 8 == 0), None) if rows else
          -1 if x.ndim and x.shape[-1] % 8 == 0 else None)
  if axis is not None:
    spec[axis] = "fsdp"
  while spec and spec[-1] is None:  # P("fsdp"), as XLA gives the new params, not P("fsdp", None)
    spec.pop()
  return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))


def test_a_state_leaf_is_split_as_its_parameter_also_in_slices():
  """`_sharding.split_as`: a leaf's axes split as its parameter's where they are of one size
  (block scales' ``[..., 1]`` whole); a leaf in slices ``[n, len / n, ...]`` of an axis split
  over 8 devices split along ``n`` where 8 divides it (each device its rows' slices), else
  along ``len / n``; in a stack of layers (``lead=1``) after the layer axis; the memory kind
  kept."""
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  spec = jax.sharding.PartitionSpec
  put = lambda x, *axes: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec(*axes)))
  split = lambda x, param, lead=0: _sharding.split_as(x, param, lead).sharding.spec
  by_column, by_row = put(jnp.ones((16, 64)), None, "fsdp"), put(jnp.ones((16, 64)), "fsdp")
  assert split(jnp.zeros((16, 64)), by_row) == spec("fsdp")
  assert split(jnp.zeros((16, 1)), by_column) == spec()  # a block scale
  assert split(jnp.zeros((2, 8, 64)), by_column) == spec(None, None, "fsdp")
  assert split(jnp.zeros((2, 8, 1)), by_column) == spec()
  assert split(jnp.zeros((2, 8, 64)), by_row) == spec(None, "fsdp")  # 2 slices: their rows
  assert split(jnp.zeros((8, 2, 64)), by_row) == spec("fsdp")  # 8 slices: a device's each
  assert split(jnp.zeros((2, 8, 1)), by_row) == spec(None, "fsdp")
  assert split(jnp.zeros((3,)), by_row) == spec()  # a count
  layers = put(jnp.ones((3, 16, 64)), None, "fsdp")
  assert split(jnp.zeros((3, 2, 8, 64)), layers, lead=1) == spec(None, None, "fsdp")
  by_layer = put(jnp.ones((8, 4, 4)), "fsdp")
  assert split(jnp.zeros((8, 2, 2, 4)), by_layer, lead=1) == spec("fsdp")
  on_host = jax.device_put(jnp.zeros((2, 8, 64)), jax.sharding.NamedSharding(
      mesh, spec(), memory_kind="pinned_host"))
  assert _sharding.split_as(on_host, by_column).sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("place, rows", [("device", False), ("host", False), ("device", True)])
def test_init_of_params_sharded_over_a_mesh_makes_the_state_on_it(place, rows):
  """``init`` of params sharded over 8 devices, no mesh set: the state lies on the 8 (on one,
  the step refused it beside the params), each moment split as its parameter, the step's new
  state as its old (a second call compiles nothing), and the step equals the one-device
  step."""
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  params = params_of(jax.random.key(6))
  sharded = jax.tree.map(functools.partial(_fsdp, mesh, rows=rows), params)
  assert _sharding.mesh_of(sharded) is mesh and _sharding.mesh_of(params) is None
  with jax.set_mesh(mesh):
    assert _sharding.mesh_of(sharded) is None  # set for tracing: the caller's
  explicit = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
  assert _sharding.mesh_of(jax.tree.map(functools.partial(_fsdp, explicit), params)) is None
  layered = streamed.layer_streamed(stack(), optax.adamw(1e-2), slice_elements=256,
                                    state=place)
  # Traced, the arrays closed over are concrete, and jax.set_mesh is refused there.
  traced = []
  jax.eval_shape(lambda: traced.append(_sharding.mesh_of(sharded)))
  assert traced == [None]
  jax.eval_shape(lambda: layered.init(sharded))
  batch = batch_of(jax.random.key(0), n=8)
  one, one_state, _ = jax.jit(layered.step)(params, layered.init(params), batch)
  state = layered.init(sharded)
  assert all(x.sharding.device_set == set(mesh.devices.flat) for x in jax.tree.leaves(state))
  # Each moment split as its parameter (ZeRO), as the step writes it: no second compile.
  mu = state.rest["norm"][0].mu["norm"]  # [DIM], split as the norm's scale (_fsdp)
  assert mu.addressable_shards[0].data.size == DIM // 8
  if place == "device":  # [4 slices, 16 rows, DIM] of [VOCAB, DIM], its rows or columns split
    mu = state.rest["embedding"][0].mu["embedding"]
    assert mu.addressable_shards[0].data.size == mu.size // 8
  data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  got, got_state, _ = jax.jit(layered.step)(sharded, state, jax.device_put(batch, data))
  assert jax.tree.map(lambda x: x.sharding, got_state) == jax.tree.map(lambda x: x.sharding,
                                                                       state)
  assert_close(got, one)
  packed = lambda x: isinstance(x, packed_rows.PackedRows)
  trees = lambda state: jax.tree.map(lambda x: x.unstacked() if packed(x) else x, state,
                                     is_leaf=packed)  # a host state's rows as their trees
  assert_close(trees(got_state), trees(one_state), atol=1e-6)


@pytest.mark.slow
def test_llama_under_a_mesh_gathers_each_layer_and_equals_one_device():
  """Traced under `jax.set_mesh` (as the CLI's --devices compiles) with ``gather_params``,
  each layer's parameters are gathered where used, the MLP's token chunks and the fused
  head's token blocks run position-major: the same step as on one device, and fewer
  collectives than without the mesh."""
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  config = lm.models.LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                 ffn_dim=48)
  model = lm.models.Llama(config, loss="fused", mlp_chunk_tokens=16)
  tokens = jax.random.randint(jax.random.key(0), (8, 9), 0, 64)
  batch = (tokens[:, :-1], tokens[:, 1:])
  params = model.init(jax.random.key(1), batch[0])["params"]
  layered = streamed.layer_streamed(lm.models.llama.layer_stack(model),
                                    optax.adamw(1e-2, eps=1e-4), gather_params=True)
  one, one_state, _ = jax.jit(layered.step)(params, layered.init(params), batch)
  sharded = jax.tree.map(functools.partial(_fsdp, mesh), params)
  state = jax.tree.map(functools.partial(_fsdp, mesh), layered.init(sharded))
  data = jax.device_put(batch,
                        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp")))
  step = jax.jit(layered.step)
  with jax.set_mesh(mesh):
    got, got_state, _ = step(sharded, state, data)
    in_mesh = lm.memory.collective_bytes(step.lower(sharded, state, data).compile().as_text())
  assert_close(got, one, rtol=1e-4, atol=1e-5)
  assert_close(got_state, one_state, rtol=1e-4, atol=1e-5)
  outside = lm.memory.collective_bytes(step.lower(sharded, state, data).compile().as_text())
  assert in_mesh < outside
