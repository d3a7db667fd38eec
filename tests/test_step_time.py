"""The step-time estimate (lowmem_jax.compile.memory.step_time): FLOPs read from the compiled
program, bytes of slices and in-place updates, loops by trip count, and overlap only where the
schedule has it."""

import jax
import jax.numpy as jnp
import pytest
from third_party_promotion import FLAX_NORM, OPTAX_BIAS_CORRECTION, OPTAX_UPDATE_MOMENT

import lowmem_jax as lm
from lowmem_jax import _hlo, _jax, app
from lowmem_jax.compile.memory import host_transfers, step_time, streams

H100 = lm.targets.get("h100")
NEEDS_TARGET = pytest.mark.skipif(lm.targets.available() is not None,
                                  reason=f"compile-only GPU targets: {lm.targets.available()}")

# A 4 MiB fetch from host memory and an 8 MiB kernel that does not need it; the kernel is
# scheduled between the fetch's start and done (HIDDEN) or after the done (EXPOSED).
_MODULE = """HloModule m, is_scheduled=true

ENTRY %main (p0: f32[1048576], p1: f32[2097152]) -> f32[1048576] {{
  %p0 = f32[1048576]{{0:S(5)}} parameter(0)
  %p1 = f32[2097152]{{0}} parameter(1)
  %copy-start = (f32[1048576]{{0}}, f32[1048576]{{0:S(5)}}, u32[]) copy-start(%p0)
{between}
  %copy-done = f32[1048576]{{0}} copy-done(%copy-start)
{after}
  ROOT %add = f32[1048576]{{0}} add(%copy-done, %copy-done)
}}
"""
_KERNEL = "  %e = f32[2097152]{0} exponential(%p1)"
HIDDEN = _MODULE.format(between=_KERNEL, after="")
EXPOSED = _MODULE.format(between="", after=_KERNEL)


def test_a_transfer_hides_only_under_the_kernels_between_its_start_and_done():
  hidden, exposed = step_time.estimate(HIDDEN, H100), step_time.estimate(EXPOSED, H100)
  c = step_time.CALIBRATION
  fetch = 4 * 2**20 / (c.copy_link_efficiency * H100.host_link_bytes_per_s) + c.launch_s
  kernel = 16 * 2**20 / (c.hbm_efficiency * H100.memory_bytes_per_s) + c.launch_s
  add = 12 * 2**20 / (c.hbm_efficiency * H100.memory_bytes_per_s) + c.launch_s
  assert exposed.seconds == pytest.approx(fetch + kernel + add)
  assert hidden.seconds == pytest.approx(max(fetch, kernel) + add)
  assert hidden.to_device_bytes == exposed.to_device_bytes == 4 * 2**20
  assert exposed.seconds_by_bound["host link"] == pytest.approx(fetch)  # the wait at its done
  assert hidden.bound == exposed.bound == "host link"
  assert sum(hidden.seconds_by_bound.values()) == pytest.approx(hidden.seconds)


def test_a_concatenation_visits_every_operand_from_each_element_of_its_largest():
  """XLA's GPU concatenation runs a thread an element of its largest operand, each visiting
  every operand: 64 small operands beside a 16 MiB one cost 65 visits an element of the large
  one, ALU-bound, many times the bytes' HBM time; as 4-byte words, a quarter of the bytes'."""
  def packed(dtype: str, n: int) -> str:
    params = ", ".join([f"{dtype}[{n}]"] + [f"{dtype}[4]"] * 64)
    body = "\n".join(f"  %p{k} = {dtype}[{n if k == 0 else 4}]{{0}} parameter({k})"
                      for k in range(65))
    operands = ", ".join(f"%p{k}" for k in range(65))
    total = n + 64 * 4
    return f"""HloModule m, is_scheduled=true

%cat ({params}) -> {dtype}[{total}] {{
{body}
  ROOT %c = {dtype}[{total}]{{0}} concatenate({operands}), dimensions={{0}}
}}

ENTRY %main ({params}) -> {dtype}[{total}] {{
{body}
  ROOT %f = {dtype}[{total}]{{0}} fusion({operands}), kind=kLoop, calls=%cat
}}
"""
  c = step_time.CALIBRATION
  visits = lambda elements: elements * 65 * c.concat_visit_ops / H100.lane_ops_per_s["int"]
  seconds = {}
  for dtype, n in (("u8", 2**24), ("u32", 2**22)):
    got = step_time.estimate(packed(dtype, n), H100)
    assert got.bound == "ALU" and got.lane_ops["int"] == n * 65 * c.concat_visit_ops
    assert got.seconds == pytest.approx(visits(n) + c.launch_s)
    seconds[dtype] = got.seconds - c.launch_s
  assert seconds["u8"] == pytest.approx(4 * seconds["u32"])
  assert seconds["u32"] > 10 * 2 * 2**24 / (c.hbm_efficiency * H100.memory_bytes_per_s)


# A 4 MiB row of a host stack brought to the device by an asynchronous fusion at a loop
# counter's offset: a memcpy (jax 0.10's XLA: kind=kCustom, the offset from the induction
# variable) or a kernel reading pinned memory (kind=kLoop), with an 8 MiB kernel under it.
_ASYNC_FUSION = """HloModule m, is_scheduled=true

%row (p0: f32[8,1048576], p1: s32[]) -> f32[1,1048576] {{
  %p0 = f32[8,1048576]{{1,0:S(5)}} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = f32[1,1048576]{{1,0}} dynamic-slice(%p0, %p1, %zero), dynamic_slice_sizes={{1,1048576}}{config}
  ROOT %copy = f32[1,1048576]{{1,0}} copy(%ds)
}}

%row_alone (p0: f32[8,1048576], p1: s32[]) -> f32[1,1048576] {{
  %p0 = f32[8,1048576]{{1,0:S(5)}} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = f32[1,1048576]{{1,0}} dynamic-slice(%p0, %p1, %zero), dynamic_slice_sizes={{1,1048576}}{config}
}}

ENTRY %main (p0: f32[8,1048576], p1: f32[2097152], i: s32[]) -> f32[1,1048576] {{
  %p0 = f32[8,1048576]{{1,0:S(5)}} parameter(0)
  %p1 = f32[2097152]{{0}} parameter(1)
  %i = s32[] parameter(2)
  %start = ((f32[8,1048576]{{1,0:S(5)}}, s32[]), f32[1,1048576]{{1,0}}, u32[]) fusion-start(%p0, %i), kind={kind}, calls=%{row}
  %e = f32[2097152]{{0}} exponential(%p1)
  %done = f32[1,1048576]{{1,0}} fusion-done(%start)
  ROOT %add = f32[1,1048576]{{1,0}} add(%done, %done)
}}
"""
_LOOP_OFFSET = (', backend_config={"dynamic_slice_config":{"loop_index":"0","byte_offset":"0",'
                '"byte_stride":"4194304"}}')


def test_an_asynchronous_fusion_moves_its_slice_under_the_kernels_after_its_start():
  module = lambda kind, config, row="row": _ASYNC_FUSION.format(kind=kind, config=config, row=row)
  memcpy = step_time.estimate(module("kCustom", _LOOP_OFFSET), H100)
  kernel = step_time.estimate(module("kLoop", ""), H100)
  c = step_time.CALIBRATION
  row = 4 * 2**20
  dma = row / (c.copy_link_efficiency * H100.host_link_bytes_per_s) + c.launch_s
  sm = row / (c.kernel_link_efficiency * H100.host_link_bytes_per_s) + c.launch_s
  under = 16 * 2**20 / (c.hbm_efficiency * H100.memory_bytes_per_s) + c.launch_s
  add = 12 * 2**20 / (c.hbm_efficiency * H100.memory_bytes_per_s) + c.launch_s
  assert memcpy.seconds == pytest.approx(max(dma, under) + add)
  assert kernel.seconds == pytest.approx(max(sm, under) + add)
  assert memcpy.to_device_bytes == kernel.to_device_bytes == row  # the row, not the stack
  assert host_transfers.loop_host_transfers(module("kCustom", _LOOP_OFFSET)) == {}
  # jax 0.12's XLA keeps a loop fusion whose whole body is the annotated slice, and copies it
  # (its thunk emitter's dynamic-slice copy); a loop fusion that computes on the slice, or
  # whose slice carries no offset config, stays a kernel.
  alone = step_time.estimate(module("kLoop", _LOOP_OFFSET, "row_alone"), H100)
  assert alone.seconds == pytest.approx(memcpy.seconds)
  assert step_time.estimate(module("kLoop", _LOOP_OFFSET), H100).seconds == pytest.approx(
      kernel.seconds)
  assert step_time.estimate(module("kLoop", "", "row_alone"), H100).seconds == pytest.approx(
      kernel.seconds)


# A block of 8,192 rows sliced out of a 128 MiB table kept transposed (layout {0,1}), as newer
# XLA (jax 0.12) slices a tied embedding's vocabulary blocks: through a bitcast to the
# row-major view of its transpose, then the slice.
_BITCAST_SLICE = """HloModule m, is_scheduled=true

%block (p0: bf16[2048,32768], p1: s32[]) -> bf16[8192,2048] {{
  %p0 = bf16[2048,32768]{{0,1}} parameter(0)
  %rows = bf16[32768,2048]{{1,0}} bitcast(%p0){extra}
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = bf16[8192,2048]{{1,0}} dynamic-slice({sliced}, %p1, %zero), dynamic_slice_sizes={{8192,2048}}
}}

ENTRY %main (p0: bf16[2048,32768], i: s32[]) -> bf16[8192,2048] {{
  %p0 = bf16[2048,32768]{{0,1}} parameter(0)
  %i = s32[] parameter(1)
  ROOT %f = bf16[8192,2048]{{1,0}} fusion(%p0, %i), kind=kLoop, calls=%block
}}
"""


def test_an_arrays_host_memory_is_read_past_its_tiling_and_element_size():
  """``S(5)`` marks host memory wherever the layout puts it: after the dims, after a tiling,
  after an int4 array's element size (XLA prints ``s4[64,128]{1,0:E(4)}``)."""
  shape = "(s4[16]{0:E(4)S(5)}, f32[8,128]{1,0:T(8,128)S(5)}, f32[]{:S(5)}, bf16[2]{0}, token[])"
  arrays = _hlo.arrays(shape)
  assert [a.in_host_memory for a in arrays] == [True, True, True, False, False]
  assert [a.bytes for a in arrays] == [8, 4096, 4, 4, 0]
  assert _hlo.operand_shape({"t": _hlo.Instruction("tuple", (), "", shape)}, "t#3") == "bf16[2]{0}"
  assert _hlo.in_host_memory(shape) and not _hlo.in_host_memory("bf16[2]{0}")


def test_a_slice_through_a_bitcast_reads_the_slice_not_the_array():
  block = 8192 * 2048 * 2
  sliced = step_time.estimate(_BITCAST_SLICE.format(extra="", sliced="%rows"), H100)
  assert sliced.device_bytes == 2 * block + 4  # the block read and written; the offset
  # Negated whole before its slice, the table is read whole.
  negated = _BITCAST_SLICE.format(
      extra="\n  %n = bf16[32768,2048]{1,0} negate(%rows)", sliced="%n")
  assert step_time.estimate(negated, H100).device_bytes == 4 * block + block + 4


def test_the_cpu_has_no_estimate():
  assert step_time.estimate(HIDDEN, lm.targets.get("cpu")) is None


def test_tensor_efficiency_grows_with_the_gemm():
  # XLA's measured sm_90 table: bfloat16 GEMMs at 26% of the peak at 1024³, 79% at 4096³.
  assert step_time.tensor_efficiency(2 * 1024**3) == pytest.approx(0.26, abs=0.01)
  assert step_time.tensor_efficiency(2 * 4096**3) == pytest.approx(0.79, abs=0.02)


def _estimate(fn, *args):
  compiled = H100.compile(fn, *args)
  return step_time.estimate(compiled.as_text(), H100)


@NEEDS_TARGET
def test_gemm_flops_and_loops_by_trip_count():
  a = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)
  b = jax.ShapeDtypeStruct((512, 2048), jnp.bfloat16)
  once = _estimate(lambda a, b: a @ b, a, b)
  assert once.tensor_flops == 2 * 1024 * 512 * 2048
  assert once.bound in step_time.BOUNDS

  def seven(a, b):
    return jax.lax.fori_loop(0, 7, lambda i, x: jnp.tanh(x @ b[:, :512]), a)
  looped = _estimate(seven, a, b)
  assert looped.tensor_flops == 7 * 2 * 1024 * 512 * 512
  assert looped.kernels >= 7 * 2


@NEEDS_TARGET
def test_a_slice_of_a_stack_reads_the_slice():
  stack = jax.ShapeDtypeStruct((64, 1024, 1024), jnp.float32)
  i = jax.ShapeDtypeStruct((), jnp.int32)
  one = _estimate(lambda s, i: jnp.sin(jax.lax.dynamic_index_in_dim(s, i, keepdims=False)),
                  stack, i)
  whole = _estimate(lambda s: jnp.sin(s), stack)
  assert one.seconds < whole.seconds / 16


@NEEDS_TARGET
def test_the_report_gives_the_time_beside_the_memory():
  x = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
  b = lm.memory.report(lambda x: jnp.tanh(x @ x), x, target="h100")
  assert b.step_time is not None and b.step_time.seconds > 0
  assert "estimated step time" in str(b)
  assert b.to_dict()["step_time"]["seconds"] == b.step_time.seconds
  assert lm.memory.report(lambda x: jnp.tanh(x @ x), x, target="cpu").step_time is None


def _host_rows_loop(use_at_once: bool):
  """A loop over 8 rows kept in host memory, each brought to the device: used by the next
  kernel (nothing to run under the transfer) or only in the next trip, with a matmul between."""
  def loop(rows, x):
    rows = jax.device_put(rows, jax.memory.Space.Host)

    def body(i, carry):
      x, ahead = carry
      fetched = jax.device_put(rows[(i + 1) % 8], jax.memory.Space.Device)
      if use_at_once:
        return jnp.tanh(x @ x + fetched[:1024].reshape(1, 1024)), ahead
      return jnp.tanh(x @ x + ahead[:1024].reshape(1, 1024)), fetched
    return jax.lax.fori_loop(0, 8, body, (x, jax.device_put(rows[0], jax.memory.Space.Device)))
  rows = jax.ShapeDtypeStruct((8, 1 << 20), jnp.bfloat16)
  return H100.compile(loop, rows, jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)).as_text()


@pytest.mark.slow
@NEEDS_TARGET
@FLAX_NORM
@OPTAX_BIAS_CORRECTION
@OPTAX_UPDATE_MOMENT
def test_a_host_row_at_a_loop_counters_offset_moves_as_xla_moves_such_rows():
  """The streamed step counts its slices in its loop's carry, so the host rows' offsets are
  linear functions of the induction variable (clamped at the ends): where XLA runs such a row
  as a memcpy (the copy engines: jax 0.10's and 0.12's XLA), every host transfer of the step's
  loop bodies is one."""
  def loop(rows, x):
    rows = jax.device_put(rows, jax.memory.Space.Host)
    fetch = lambda i: jax.device_put(jax.lax.dynamic_slice(  # row 8 clamped to row 7
        rows, (i, 0), (1, 1 << 20), allow_negative_indices=False)[0], jax.memory.Space.Device)
    body = lambda i, c: (jnp.tanh(c[0] @ c[0] + c[1][:1024].reshape(1, 1024)), fetch(i + 1))
    return jax.lax.fori_loop(0, 8, body, (x, fetch(0)))[0]
  probe = H100.compile(loop, jax.ShapeDtypeStruct((8, 1 << 20), jnp.bfloat16),
                       jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)).as_text()
  xla_makes_memcpys = all(host_transfers.loop_host_transfers(probe).values())
  job = app.Job("llama-tiny", batch=2, seq=64, target="h100")
  built, params, opt_state, batch = app.arguments(
      job, app.parse("all+fused-ce+8bit+bf16-params+stream:host+offload-opt"))
  with job.compiling():
    text = job.target.compile(built["step"], params, opt_state, batch).as_text()
  transfers = host_transfers.loop_host_transfers(text)
  assert len(transfers) >= 4  # the saved input written, read back; the state read, written
  assert set(transfers.values()) == {xla_makes_memcpys}, transfers


@NEEDS_TARGET
def test_a_host_transfer_with_no_kernel_under_it_is_found():
  assert len(host_transfers.exposed_host_transfers(_host_rows_loop(use_at_once=True))) == 1
  assert host_transfers.exposed_host_transfers(_host_rows_loop(use_at_once=False)) == []


@NEEDS_TARGET
def test_a_loop_that_only_moves_a_row_is_not_looked_at():
  """A row brought over in halves, a loop of two trips with nothing to run under them (as
  `lowmem_jax.optim.slicing` brings the first rows over): not exposed, there is nothing to
  hide under; the same loop with a matmul is looked at."""
  def halves(rows, x, matmul):
    rows = jax.device_put(rows, jax.memory.Space.Host).reshape(16, 1 << 19)
    def body(h, out):
      half = jax.device_put(rows[h + 2][None], jax.memory.Space.Device)
      x = out[1] @ (out[1] + half[:, :1024]) if matmul else out[1]  # the half used at once
      return jax.lax.dynamic_update_slice(out[0], half, (h, 0)), x
    out = jax.lax.fori_loop(0, 2, body, (jnp.zeros((2, 1 << 19), jnp.bfloat16), x))
    return out[0].sum() + out[1].sum()
  shapes = (jax.ShapeDtypeStruct((8, 1 << 20), jnp.bfloat16),
            jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16))
  moved = H100.compile(lambda r, x: halves(r, x, False), *shapes).as_text()
  assert host_transfers.loop_host_transfers(moved)
  assert host_transfers.exposed_host_transfers(moved) == []
  computed = H100.compile(lambda r, x: halves(r, x, True), *shapes).as_text()
  assert len(host_transfers.exposed_host_transfers(computed)) == 1


@NEEDS_TARGET
@pytest.mark.slow
@FLAX_NORM
@OPTAX_BIAS_CORRECTION
@pytest.mark.parametrize("prefetch", ["", "+prefetch:2"])
def test_the_streamed_step_hides_every_host_transfer_and_copies_nothing_host_to_host(prefetch):
  """Llama with its state and saved inputs in host memory, compiled for the h100: in every
  loop body each host transfer has a kernel between its start and done (one transfer a layer
  each way, `lowmem_jax.optim.packed_rows.PackedRows`; with two layers ahead, in two banks),
  in one bank, in the layers' backward, a GEMM (the write starts at the layer's fence,
  `lowmem_jax.optim.slicing.scan_slices`, not after its last update; in two, the tiny
  model's two layers are one trip, no loop), and the new state is written where it lies,
  not copied host to host at the end."""
  job = app.Job("llama-tiny", batch=2, seq=64, target="h100")
  techniques = app.parse("all+fused-ce+8bit+bf16-params+stream:host+offload-opt" + prefetch)
  built, params, opt_state, batch = app.arguments(job, techniques)
  with job.compiling():
    text = job.target.compile(built["step"], params, opt_state, batch).as_text()
  assert host_transfers.exposed_host_transfers(text) == []
  cover = host_transfers.host_transfer_cover(text)
  calls = lambda body: sum(c for name, (_, c) in cover.items() if name.startswith(body + "/"))
  layers = max({name.split("/")[0] for name in cover}, key=calls)  # the layers' backward
  under = {name: c for name, (_, c) in cover.items() if name.startswith(layers + "/")}
  if not prefetch:  # the row each way, the saved input
    assert len(under) == 3 and all(under.values()), under
  estimate = step_time.estimate(text, job.target)
  assert estimate.to_device_bytes > 0 and estimate.to_host_bytes > 0
  assert estimate.host_copy_bytes == 0
  computations, roots, entry = _hlo.computations(text)
  moved = {(c, n) for c, instructions in computations.items() for n, i in instructions.items()
           if i.op.endswith("-start") and _hlo.in_host_memory(i.shape)}
  given = streams.assign(computations, roots, entry, _jax.OWN_HOST_TRANSFER_STREAMS)
  shared = {given[k] for k in moved} & {s for k, s in given.items() if k not in moved}
  assert moved and not shared  # no weight copy waits behind a row on a stream (jaxlib 0.11)


@NEEDS_TARGET
@pytest.mark.slow
@FLAX_NORM
@OPTAX_BIAS_CORRECTION
def test_no_host_read_in_the_8bs_layers_waits_for_the_loop_counters_increment():
  """Llama-3.1-8B with its state on the host, its MLP whole, compiled for the rtx4090: no host
  transfer starts from a value XLA orders after other instructions (``control-predecessors``).
  The next row's slice index, written ``index(k + 1)``, shared its k + 1 with the loop
  counter's increment, which XLA orders after every GEMM that reads k: the read then started
  11 ms of GEMMs before it was needed, where it takes 17.6 ms (`slicing._HostTrips.later`)."""
  job = app.Job("llama-3.1-8b", batch=2, seq=2048, dtype="bfloat16", target="rtx4090")
  techniques = app.parse("bf16+ms-norm+attention+fused-ce+8bit+bf16-params+stream:host+"
                         "offload-opt+mlp-chunk:off")
  built, params, opt_state, batch = app.arguments(job, techniques)
  with job.compiling():
    text = job.target.compile(built["step"], params, opt_state, batch).as_text()
  assert len(host_transfers.loop_host_transfers(text)) >= 3
  assert host_transfers.ordered_host_transfers(text) == []
