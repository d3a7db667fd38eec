"""XLA's execution stream assignment replayed (lowmem_jax.compile.memory.streams), and what it
does to the step-time estimate: a slice copy that takes its turn on a host transfer's stream
waits behind the transfer."""

import pytest

import lowmem_jax as lm
from lowmem_jax import _hlo
from lowmem_jax.compile.memory import step_time, streams

H100 = lm.targets.get("h100")

# A 16 MiB fetch from host memory, then four 4 MiB copies on the device, the fourth's done
# before a 256 MiB kernel. The fetch and the copies are starts in this post order: h, d1, d2, d3,
# d4.
_MODULE = """HloModule m, is_scheduled=true

ENTRY %main (p0: f32[4194304], p1: f32[1048576], p2: f32[67108864]) -> () {
  %p0 = f32[4194304]{0:S(5)} parameter(0)
  %p1 = f32[1048576]{0} parameter(1)
  %p2 = f32[67108864]{0} parameter(2)
  %h = (f32[4194304]{0}, f32[4194304]{0:S(5)}, u32[]) copy-start(%p0)
  %d1 = (f32[1048576]{0}, f32[1048576]{0}, u32[]) copy-start(%p1)
  %d2 = (f32[1048576]{0}, f32[1048576]{0}, u32[]) copy-start(%p1)
  %d3 = (f32[1048576]{0}, f32[1048576]{0}, u32[]) copy-start(%p1)
  %d4 = (f32[1048576]{0}, f32[1048576]{0}, u32[]) copy-start(%p1)
  %d4-done = f32[1048576]{0} copy-done(%d4)
  %use = f32[1048576]{0} exponential(%d4-done)
  %big = f32[67108864]{0} exponential(%p2)
  %d1-done = f32[1048576]{0} copy-done(%d1)
  %d2-done = f32[1048576]{0} copy-done(%d2)
  %d3-done = f32[1048576]{0} copy-done(%d3)
  %h-done = f32[4194304]{0} copy-done(%h)
  %sum = f32[1048576]{0} add(%d1-done, %d2-done)
  %sum2 = f32[1048576]{0} add(%sum, %d3-done)
  %sum3 = f32[1048576]{0} add(%sum2, %use)
  ROOT %out = (f32[4194304]{0}, f32[1048576]{0}, f32[67108864]{0}) tuple(%h-done, %sum3, %big)
}
"""


def _assign(text: str, own_host: bool) -> dict:
  computations, roots, entry = _hlo.computations(text)
  return streams.assign(computations, roots, entry, own_host)


def test_starts_take_the_compute_streams_in_turn_in_post_order():
  order = streams.post_order(_hlo.computations(_MODULE)[0]["main"])
  assert [name for name in order if name in ("h", "d1", "d2", "d3", "d4")] == [
      "h", "d1", "d2", "d3", "d4"]
  turns = {name: s for (_, name), s in _assign(_MODULE, own_host=False).items()}
  assert turns == {"h": "compute 0", "d1": "compute 1", "d2": "compute 2", "d3": "compute 3",
                   "d4": "compute 0"}
  own = {name: s for (_, name), s in _assign(_MODULE, own_host=True).items()}
  assert own == {"h": streams.TO_DEVICE, "d1": "compute 0", "d2": "compute 1",
                 "d3": "compute 2", "d4": "compute 3"}


def test_a_copy_on_a_host_transfers_stream_waits_for_it():
  shared = step_time.estimate(_MODULE, H100, own_host_streams=False)
  own = step_time.estimate(_MODULE, H100, own_host_streams=True)
  c = step_time.CALIBRATION
  fetch = 16 * 2**20 / (c.copy_link_efficiency * H100.host_link_bytes_per_s) + c.launch_s
  big = 512 * 2**20 / (c.hbm_efficiency * H100.memory_bytes_per_s) + c.launch_s
  assert shared.seconds > fetch + big  # the fourth copy waits for the fetch, the kernel for it
  assert own.seconds < fetch + big / 4  # the kernel runs under the fetch
  assert shared.seconds_by_bound["host link"] >= fetch
  assert shared.seconds == pytest.approx(sum(shared.seconds_by_bound.values()))


def test_post_order_puts_control_predecessors_before_operands():
  text = """HloModule m

ENTRY %main (p: f32[4]) -> (f32[4], f32[4]) {
  %p = f32[4]{0} parameter(0)
  %a = f32[4]{0} negate(%p)
  %b = f32[4]{0} exponential(%p)
  %c = f32[4]{0} add(%a, %p), control-predecessors={%b}
  %d = f32[4]{0} negate(%b)
  ROOT %out = (f32[4]{0}, f32[4]{0}) tuple(%c, %d)
}
"""
  assert streams.post_order(_hlo.computations(text)[0]["main"]) == ["p", "b", "a", "c", "d",
                                                                    "out"]


def test_a_collective_takes_no_compute_stream_and_two_fetches_share_the_link():
  text = """HloModule m, is_scheduled=true

ENTRY %main (p0: f32[1048576], p1: f32[1048576], p2: f32[4]) -> () {
  %p0 = f32[1048576]{0:S(5)} parameter(0)
  %p1 = f32[1048576]{0:S(5)} parameter(1)
  %p2 = f32[4]{0} parameter(2)
  %ag = (f32[4]{0}, f32[32]{0}) all-gather-start(%p2), replica_groups={}, dimensions={0}
  %h1 = (f32[1048576]{0}, f32[1048576]{0:S(5)}, u32[]) copy-start(%p0)
  %h2 = (f32[1048576]{0}, f32[1048576]{0:S(5)}, u32[]) copy-start(%p1)
  %agd = f32[32]{0} all-gather-done(%ag)
  %h1d = f32[1048576]{0} copy-done(%h1)
  %h2d = f32[1048576]{0} copy-done(%h2)
  ROOT %out = (f32[32]{0}, f32[1048576]{0}, f32[1048576]{0}) tuple(%agd, %h1d, %h2d)
}
"""
  assert _assign(text, own_host=False) == {("main", "ag"): streams.COMMUNICATION,
                                           ("main", "h1"): "compute 0",
                                           ("main", "h2"): "compute 1"}
  c = step_time.CALIBRATION
  fetch = 4 * 2**20 / (c.copy_link_efficiency * H100.host_link_bytes_per_s) + c.launch_s
  for own in (False, True):  # on two streams or on one, the link moves one fetch at a time
    assert step_time.estimate(text, H100, own_host_streams=own).seconds == pytest.approx(
        2 * fetch)


def test_a_wait_behind_a_copy_behind_a_host_fetch_counts_to_the_host_link():
  copies = [f"d{k}" for k in range(1, 9)]  # d4 and d8 take the fetch's stream, d8 after d4
  starts = "\n".join(f"  %{d} = (F, F, u32[]) copy-start(%p1)" for d in copies)
  dones = "\n".join(f"  %{d}-done = F copy-done(%{d})" for d in reversed(copies))
  text = f"""HloModule m, is_scheduled=true

ENTRY %main (p0: f32[4194304], p1: f32[1048576]) -> () {{
  %p0 = f32[4194304]{{0:S(5)}} parameter(0)
  %p1 = F parameter(1)
  %h = (f32[4194304]{{0}}, f32[4194304]{{0:S(5)}}, u32[]) copy-start(%p0)
{starts}
{dones}
  %h-done = f32[4194304]{{0}} copy-done(%h)
  ROOT %out = (f32[4194304]{{0}}, {", ".join(["F"] * 8)}) tuple(%h-done, {", ".join(
      f"%{d}-done" for d in copies)})
}}
""".replace("F", "f32[1048576]{0}")
  assert _assign(text, own_host=False)["main", "d8"] == "compute 0"
  shared = step_time.estimate(text, H100, own_host_streams=False)
  c = step_time.CALIBRATION
  fetch = 16 * 2**20 / (c.copy_link_efficiency * H100.host_link_bytes_per_s) + c.launch_s
  assert shared.seconds_by_bound["host link"] >= fetch  # d8's done: held by d4, held by the fetch
  assert shared.seconds_by_bound["HBM"] < fetch / 10


# A loop body that writes a row into a host stack and reads one, each as XLA's text has it: an
# async-start of a computation whose root is a loop fusion of the update or the slice.
_LOOP = """HloModule m, is_scheduled=true

%get_fused (p0: ROWS, p1: s32[]) -> f32[1,1024] {
  %p0 = ROWS parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = f32[1,1024]{1,0} dynamic-slice(%p0, %p1, %zero), dynamic_slice_sizes={1,1024}
}

%getw (p0: ROWS, p1: s32[]) -> f32[1,1024] {
  %p0 = ROWS parameter(0)
  %p1 = s32[] parameter(1)
  ROOT %f = f32[1,1024]{1,0} fusion(%p0, %p1), kind=KIND, calls=%get_fused
}

%put_fused (p0: ROWS, p1: f32[1,1024], p2: s32[]) -> ROWS {
  %p0 = ROWS parameter(0)
  %p1 = f32[1,1024]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = ROWS dynamic-update-slice(%p0, %p1, %p2, %zero)
}

%putw (p0: ROWS, p1: f32[1,1024], p2: s32[]) -> ROWS {
  %p0 = ROWS parameter(0)
  %p1 = f32[1,1024]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  ROOT %f = ROWS fusion(%p0, %p1, %p2), kind=kLoop, calls=%put_fused
}

%body (t: (s32[], ROWS, f32[1,1024])) -> (s32[], ROWS, f32[1,1024]) {
  %t = (s32[], ROWS, f32[1,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %rows = ROWS get-tuple-element(%t), index=1
  %row = f32[1,1024]{1,0} get-tuple-element(%t), index=2
  %one = s32[] constant(1)
  %put = ((ROWS, f32[1,1024]{1,0}, s32[]), ROWS, u32[]) async-start(%rows, %row, %i), calls=%putw
  %get = ((ROWS, s32[]), f32[1,1024]{1,0}, u32[]) async-start(%rows, %i), calls=%getw
  %got = f32[1,1024]{1,0} async-done(%get)
  %put-done = ROWS async-done(%put)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], ROWS, f32[1,1024]{1,0}) tuple(%next, %put-done, %got)
}

%cond (t: (s32[], ROWS, f32[1,1024])) -> pred[] {
  %t = (s32[], ROWS, f32[1,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(8)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (rows: ROWS, row: f32[1,1024]) -> (s32[], ROWS, f32[1,1024]) {
  %rows = ROWS parameter(0)
  %row = f32[1,1024]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], ROWS, f32[1,1024]{1,0}) tuple(%zero, %rows, %row)
  ROOT %loop = (s32[], ROWS, f32[1,1024]{1,0}) while(%init), condition=%cond, body=%body
}
""".replace("ROWS", "f32[8,1024]{1,0:S(5)}")


def test_a_loop_bodys_host_update_and_slice_in_either_layout():
  loop = _LOOP.replace("KIND", "kLoop")
  assert _assign(loop, own_host=False) == {("body", "put"): "compute 0",
                                           ("body", "get"): "compute 1"}
  assert _assign(loop, own_host=True) == {("body", "put"): streams.TO_HOST,
                                          ("body", "get"): streams.TO_DEVICE}
  # XLA looks into a loop fusion for the slice, not into a custom one.
  assert _assign(_LOOP.replace("KIND", "kCustom"), own_host=True) == {
      ("body", "put"): streams.TO_HOST, ("body", "get"): "compute 0"}


def test_collectives_of_two_kinds_take_turns_on_the_one_communication_stream():
  text = """HloModule m, is_scheduled=true

ENTRY %main (p0: f32[1048576], p1: f32[8388608]) -> () {
  %p0 = f32[1048576]{0} parameter(0)
  %p1 = f32[8388608]{0} parameter(1)
  %all-gather-start.1 = (f32[1048576]{0}, f32[8388608]{0}) all-gather-start(%p0), dimensions={0}
  %all-reduce-start.2 = f32[8388608]{0} all-reduce-start(%p1), replica_groups={}, to_apply=%add
  %agd = f32[8388608]{0} all-gather-done(%all-gather-start.1)
  %ard = f32[8388608]{0} all-reduce-done(%all-reduce-start.2)
  ROOT %out = (f32[8388608]{0}, f32[8388608]{0}) tuple(%agd, %ard)
}
"""
  assert set(_assign(text, own_host=False).values()) == {streams.COMMUNICATION}
  c = step_time.CALIBRATION
  each = 32 * 2**20 / H100.interconnect_bytes_per_s + c.launch_s
  assert step_time.estimate(text, H100).seconds == pytest.approx(2 * each)
