"""`lowmem_jax.optim.fused_update`: the layer-streamed step's 8-bit AdamW update as one Pallas
kernel (``update_impl``), bit for bit the optax chain's step, and the leaves and settings it
refuses or leaves to the chain."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from test_streamed import batch_of, params_of, stack, stack_in_parts
from third_party_promotion import OPTAX_APPLY_UPDATES, OPTAX_BIAS_CORRECTION

import lowmem_jax as lm
from lowmem_jax.optim import fused_update, streamed

pytestmark = OPTAX_BIAS_CORRECTION


@pytest.mark.slow
@OPTAX_APPLY_UPDATES
@pytest.mark.parametrize("slice_elements,parts,state", [
    (2 ** 24, False, "device"), (128, True, "device"), (128, False, "host")],
    ids=["whole", "sliced-parts", "sliced-host"])
def test_the_fused_update_kernel_is_the_chains_step_bit_for_bit(slice_elements, parts, state):
  """``update_impl="pallas_interpret"``: each leaf's (or slice's) update as the kernel
  (``pallas_kernels.adam8bit``), against the chain, a step from the state two steps of the
  chain made, both compiled with XLA's excess precision off (by default XLA keeps some
  bfloat16 results in float32 where it fuses them: a shared leaf's summed gradient, an
  update, each program where its own fusions fall, and the two then differ by a bfloat16
  unit in under 1% of the parameters)."""
  tx = lm.lowbit.adamw_8bit(1e-2, block=16, min_size=16, seed=3, bfloat16_params=True)
  model = stack_in_parts() if parts else stack()
  params = params_of(jax.random.key(4), dtype=jnp.bfloat16)
  steps = {impl: streamed.layer_streamed(model, tx, slice_elements=slice_elements, state=state,
                                         update_impl=impl) for impl in ("pallas_interpret", "xla")}
  exact = {"xla_allow_excess_precision": False}
  xla = jax.jit(steps["xla"].step, compiler_options=exact)
  opt_state = steps["xla"].init(params)
  for i in range(2):
    params, opt_state, _ = xla(params, opt_state, batch_of(jax.random.key(i)))
  got, want = (jax.jit(steps[impl].step, compiler_options=exact)(
      params, jax.tree.map(jnp.copy, opt_state), batch_of(jax.random.key(2)))[:2]
               for impl in ("pallas_interpret", "xla"))
  chex.assert_trees_all_equal(got, want)
  jaxpr = jax.make_jaxpr(steps["pallas_interpret"].step)(params, opt_state, batch_of(
      jax.random.key(2)))
  assert "pallas_call" in str(jaxpr)  # the kernel ran


def test_a_leaf_the_fused_kernel_cannot_take_runs_the_chain():
  """`fused_update.takes`: blocks that are not a power of two, or a part not whole blocks
  along its last axis, leave the leaf to the chain rather than fail in the kernel."""
  p = jnp.zeros((16, 768), jnp.bfloat16)
  fused = lambda block: lm.lowbit.adamw_8bit(1e-2, block=block, min_size=16,
                                             bfloat16_params=True).fused
  assert fused_update.takes(fused(256), p, p.shape)
  assert not fused_update.takes(fused(384), p, p.shape)
  assert not fused_update.takes(fused(512), p, p.shape)
  assert not fused_update.takes(fused(256), p.astype(jnp.float32), p.shape)


def test_a_fused_update_of_another_transformation_is_refused_by_name():
  with pytest.raises(ValueError, match="`update_impl`='pallas_interpret' runs"):
    streamed.layer_streamed(stack(), optax.adamw(1e-2), update_impl="pallas_interpret")
  with pytest.raises(ValueError, match="`update_impl` must be one of"):
    streamed.layer_streamed(stack(), optax.adamw(1e-2), update_impl="cuda")
  fused = lm.lowbit.adamw_8bit(1e-2, bfloat16_params=True)
  with pytest.raises(ValueError, match="sharded with `gather_params` need update_impl='xla'"):
    streamed.layer_streamed(stack(), fused, update_impl="pallas", gather_params=True)
  layered = streamed.layer_streamed(stack(), lm.lowbit.adamw_8bit(
      1e-2, block=16, min_size=16, bfloat16_params=True), update_impl="pallas_interpret")
  params = params_of(jax.random.key(0), dtype=jnp.bfloat16)
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="under a mesh .* update_impl='xla'"):
    jax.eval_shape(layered.step, params, layered.init(params), batch_of(jax.random.key(1)))
