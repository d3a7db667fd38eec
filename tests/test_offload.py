"""Optimizer state in host memory: the same updates, the state on the host, and the
device/host split of a deviceless h100 compile."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowmem_jax as lm
import offload_memory  # benchmarks/, on sys.path in conftest.py
from lowmem_jax.compile import targets
from lowmem_jax.optim import offload
from third_party_promotion import OPTAX_BIAS_CORRECTION


@OPTAX_BIAS_CORRECTION
@pytest.mark.parametrize("inner", [
    optax.adamw(1e-2, weight_decay=0.1),
    optax.chain(lm.lowbit.scale_by_adam_8bit(block=16, min_size=16, seed=2),
                optax.scale_by_learning_rate(1e-2)),
], ids=["adamw", "8-bit rounded stochastically, the whole tree's bits"])
def test_offload_gives_the_inner_updates_with_the_state_on_the_host(inner):
  keys = jax.random.split(jax.random.key(0), 4)
  params = {"w": jax.random.normal(keys[0], (32, 16)), "v": jax.random.normal(keys[3], (32, 16)),
            "b": jnp.zeros(16), "s": jax.random.normal(keys[1], ())}
  grads = [jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.fold_in(keys[2], i),
                                                          p.shape), params) for i in range(3)]
  tx = offload.offload_state(inner)
  state = tx.init(params)
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state)} == {"pinned_host"}
  step, reference = jax.jit(offload_memory.step(tx)), jax.jit(offload_memory.step(inner))
  got, want, ref_state = params, params, inner.init(params)
  for g in grads:
    got, state = step(got, state, g)
    want, ref_state = reference(want, ref_state, g)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8), got,
               want)  # fusions differ
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state)} == {"pinned_host"}
  assert {x.sharding.memory_kind for x in jax.tree.leaves(got)} == {"device"}


def test_each_leafs_state_goes_to_the_host_as_it_is_made():
  """When a leaf's state is made, no earlier leaf's is left on the device."""
  params = {name: jnp.ones((64, 64)) for name in "abcd"}
  adam, made = optax.adam(1e-2), []

  def init(p):
    made.append(sum(x.nbytes for x in jax.live_arrays() if x.sharding.memory_kind == "device"))
    return adam.init(p)

  offload.offload_state(optax.GradientTransformation(init, adam.update)).init(params)
  assert len(made) == 4 and max(made) == min(made), made


@OPTAX_BIAS_CORRECTION
def test_h100_compile_keeps_the_state_on_the_host_and_the_device_under_its_memory():
  """28 float32 leaves of 1 GiB with Adam: parameters and gradient take 56 GiB of the
  H100's 80; the moments (56 GiB) fit only in host memory, with the leaves in transit."""
  target = targets.get("h100")
  params = {f"w{i}": jax.ShapeDtypeStruct((16384, 16384), jnp.float32) for i in range(28)}
  peaks = {}
  for name, tx in (("plain", optax.adam(1e-3)), ("offload", offload.offload_state(optax.adam(1e-3)))):
    state = offload.abstract_state(tx, params)
    compiled = target.compile(jax.jit(offload_memory.step(tx), donate_argnums=(0, 1)), params, state, params)
    stats = lm.memory.stats_of(compiled)
    peaks[name] = stats.peak_bytes
    if name == "offload":
      assert isinstance(compiled, targets.HostArgumentsCompiled)
      assert stats.host_argument_bytes >= lm.memory.tree_bytes(state) > 0
      assert stats.argument_bytes == 2 * lm.memory.tree_bytes(params)
      assert "S(5)" in compiled.as_text()  # XLA's host memory space
  assert peaks["offload"] < target.memory_bytes < peaks["plain"], peaks


def test_bad_arguments():
  with pytest.raises(TypeError, match="inner"):
    offload.offload_state(lambda x: x)
  tx = offload.offload_state(optax.adam(1e-3))
  state = tx.init({"a": jnp.ones(2), "b": jnp.ones(2)})
  with pytest.raises(ValueError, match="leaves"):
    tx.update({"a": jnp.ones(2)}, state)
