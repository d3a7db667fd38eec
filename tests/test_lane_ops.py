"""A kernel's vector ALU work (lowmem_jax._lane_ops): elementwise operations by
pipe, read from XLA's fusions and from a Pallas kernel's jaxpr, and what the step-time estimate
charges for them."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.extend.random import threefry2x32_p

import lowmem_jax as lm
from lowmem_jax import _lane_ops as lane_ops
from lowmem_jax import _hlo
from lowmem_jax.compile.memory import step_time
from pallas_kernels import _blocks, adam8bit

H100 = lm.targets.get("h100")
NEEDS_TARGET = pytest.mark.skipif(lm.targets.available() is not None,
                                  reason=f"compile-only GPU targets: {lm.targets.available()}")


def test_each_op_runs_on_its_pipe_and_data_movement_is_free():
  assert lane_ops.of_op("add", "f32[8,4]{1,0}") == {"fp": 32}
  assert lane_ops.of_op("multiply", "bf16[8]{0}") == {"fp": 8}
  assert lane_ops.of_op("add", "u32[8]{0}") == {"int": 8}
  assert lane_ops.of_op("xor", "u32[8]{0}") == {"int": 8}
  assert lane_ops.of_op("compare", "pred[8]{0}") == {"int": 8}
  assert lane_ops.of_op("exponential", "f32[8]{0}") == {"special": 8}
  assert lane_ops.of_op("divide", "f32[8]{0}") == {"special": 8}
  assert lane_ops.of_op("divide", "s32[8]{0}") == {"int": 8}
  for op in ("broadcast", "bitcast", "dynamic-slice", "iota", "parameter", "copy-start",
             "sort", "scatter", "dot", "all-reduce"):
    assert lane_ops.of_op(op, "f32[8]{0}") == {}


def test_a_conversion_is_free_an_integer_shift_or_the_guides_slow_row():
  assert lane_ops.of_op("convert", "s32[8]{0}", "u32[8]{0}") == {}
  assert lane_ops.of_op("convert", "s32[8]{0}", "u8[8]{0}") == {"int": 8}
  assert lane_ops.of_op("convert", "f32[8]{0}", "bf16[8]{0}") == {"int": 8}
  assert lane_ops.of_op("convert", "bf16[8]{0}", "f32[8]{0}") == {"special": 8}
  assert lane_ops.of_op("convert", "f32[8]{0}", "s32[8]{0}") == {"special": 8}
  assert lane_ops.of_op("convert", "f32[8]{0}", "f32[8]{0}") == {}
  assert lane_ops.of_op("convert", "pred[8]{0}", "u8[8]{0}") == {"int": 8}


def test_a_convert_of_a_tuples_element_reads_that_elements_type():
  """A fused ``convert`` of ``t#1`` (newer XLA's text for a tuple's element) converts t's
  second array, u8 here: an integer widening, not the first array's f32."""
  instructions = _hlo.computations("""HloModule m

ENTRY %e (p: (f32[8], u8[8])) -> s32[8] {
  %p = (f32[8]{0}, u8[8]{0}) parameter(0)
  ROOT %c = s32[8]{0} convert(%p#1)
}""")[0]["e"]
  assert lane_ops.of_computation(instructions, {}) == {"int": 8}


def test_a_kernel_step_with_no_output_is_not_counted():
  def kernel(x_ref, o_ref):
    pl.debug_print("a step with no output")
    o_ref[...] = x_ref[...] * 2.0

  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                        interpret=True)
  assert _blocks.lane_ops(call, jnp.ones(8)) == {"fp_ops": "8"}


def test_a_rotation_is_one_operation_only_where_its_shifts_make_the_width():
  x = jnp.arange(8, dtype=jnp.uint32)
  rotate = lambda x: (x << jnp.uint32(13)) | (x >> jnp.uint32(19))
  not_rotate = lambda x: (x << jnp.uint32(13)) | (x >> jnp.uint32(18))
  assert lane_ops.of_jaxpr(jax.make_jaxpr(rotate)(x).jaxpr) == {"int": 8}
  assert lane_ops.of_jaxpr(jax.make_jaxpr(not_rotate)(x).jaxpr) == {"int": 24}


def test_the_rates_are_the_cuda_guides_a_clock_an_sm():
  """The h100: 132 SMs at 1.98 GHz, 128 float lanes an SM, 64 integer, 16 special."""
  rates = H100.lane_ops_per_s
  assert rates["fp"] == pytest.approx(132 * 128 * 1.98e9, rel=1e-3)
  assert rates["int"] == pytest.approx(132 * 64 * 1.98e9, rel=1e-3)
  assert rates["special"] == pytest.approx(132 * 16 * 1.98e9, rel=1e-3)
  assert lm.targets.get("a100-80gb").lane_ops_per_s["fp"] == pytest.approx(108 * 64 * 1.41e9)
  assert lm.targets.get("cpu").lane_ops_per_s is None


def test_threefry_is_77_integer_operations_a_pair_its_rotations_funnel_shifts():
  """Threefry-2x32 under a scalar key: the key added (2), 20 rounds of an add, a rotation and
  a xor each (60), five key injections of three adds each (15): 77 an element; the key's
  parity, two more, on a scalar."""
  counter = jnp.zeros((16,), jnp.uint32)
  jaxpr = jax.make_jaxpr(adam8bit.threefry2x32)(counter[0], counter[0], counter, counter).jaxpr
  assert lane_ops.of_jaxpr(jaxpr) == {"int": 77 * 16 + 2}


@NEEDS_TARGET
def test_xlas_threefry_fusion_is_counted_with_its_rotations_as_one_and_is_alu_bound():
  """One word of Threefry over 2^20 counters, compiled for the h100: XLA keeps 74 of the 77
  operations an element (the unused word's last ones go), and the kernel takes longer on the
  integer pipe than moving its 8 bytes an element."""
  n = 1 << 20
  words = lambda k, x: threefry2x32_p.bind(k[0], k[1], x, x + jnp.uint32(1))[0]
  text = H100.compile(words, jax.ShapeDtypeStruct((2,), jnp.uint32),
                      jax.ShapeDtypeStruct((n,), jnp.uint32)).as_text()
  computations, _, entry = _hlo.computations(text)
  counts = lane_ops.Counts()
  for i in computations[entry].values():
    for c in _hlo.called(i) if i.op == "fusion" else []:
      counts += lane_ops.of_computation(computations[c], computations)
  assert 70 * n <= counts["int"] <= 77 * n and counts["fp"] == counts["special"] == 0
  estimate = step_time.estimate(text, H100)
  assert estimate.bound == "ALU"
  alu = estimate.seconds_by_bound["ALU"]
  assert alu == pytest.approx(counts["int"] / H100.lane_ops_per_s["int"], rel=1e-6)
  assert alu > 8 * n / H100.memory_bytes_per_s


def test_a_loop_or_a_dot_inside_a_kernel_is_refused_not_counted_once_or_as_integer_work():
  def looped(x):
    return jax.lax.fori_loop(0, 4, lambda _, y: y + 1, x)

  with pytest.raises(ValueError, match="scan|while"):
    lane_ops.of_jaxpr(jax.make_jaxpr(looped)(jnp.zeros((4,), jnp.int32)).jaxpr)
  with pytest.raises(ValueError, match="dot_general"):
    lane_ops.of_jaxpr(jax.make_jaxpr(jnp.dot)(jnp.ones((4, 4)), jnp.ones((4, 4))).jaxpr)


def test_jaxpr_primitives_run_on_their_pipes():
  x = jnp.ones((8,), jnp.float32)
  count = lambda f: lane_ops.of_jaxpr(jax.make_jaxpr(f)(x).jaxpr)
  assert count(jnp.square) == {"fp": 8}
  assert count(jnp.sin) == {"special": 8}
  assert count(lambda x: jnp.stack([x, x], -1).reshape(-1)) == {}
  assert count(jnp.sum) == {"fp": 8}
