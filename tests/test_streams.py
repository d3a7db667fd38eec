"""XLA's execution stream assignment replayed (lowmem_jax.compile.memory.streams), and what it
does to the step-time estimate: a slice copy that takes its turn on a host transfer's stream
waits behind the transfer."""

import jaxlib.version
import pytest

import lowmem_jax as lm
from lowmem_jax.compile.memory import _hlo, step_time, streams

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
  shape = lambda computation, name: computations[computation][name].shape
  return streams.assign(computations, roots, entry, own_host, shape)


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

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %a = f32[4]{0} negate(%p)
  %b = f32[4]{0} exponential(%p)
  ROOT %c = f32[4]{0} add(%a, %p), control-predecessors={%b}
}
"""
  assert streams.post_order(_hlo.computations(text)[0]["main"]) == ["p", "b", "a", "c"]


_LOOP = """HloModule m, is_scheduled=true

%body (t: (s32[], f32[8,1024], f32[1024])) -> (s32[], f32[8,1024], f32[1024]) {
  %t = (s32[], f32[8,1024]{1,0:S(5)}, f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %rows = f32[8,1024]{1,0:S(5)} get-tuple-element(%t), index=1
  %x = f32[1024]{0} get-tuple-element(%t), index=2
  %zero = s32[] constant(0)
  %one = s32[] constant(1)
  %row = f32[1,1024]{1,0:S(5)} bitcast(%x)
  %put = ((ROWS, f32[1,1024]{1,0:S(5)}, s32[], s32[]), ROWS, u32[]) PUT(%rows, %row, %i, %zero)
  %get = ((ROWS, s32[], s32[]), f32[1,1024]{1,0}, u32[]) GET(%rows, %i, %zero), SIZES
  %got = f32[1,1024]{1,0} dynamic-slice-done(%get)
  %put-done = f32[8,1024]{1,0:S(5)} dynamic-update-slice-done(%put)
  %next = s32[] add(%i, %one)
  %y = f32[1024]{0} bitcast(%got)
  ROOT %out = (s32[], f32[8,1024]{1,0:S(5)}, f32[1024]{0}) tuple(%next, %put-done, %y)
}

%cond (t: (s32[], f32[8,1024], f32[1024])) -> pred[] {
  %t = (s32[], f32[8,1024]{1,0:S(5)}, f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(8)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (rows: f32[8,1024], x: f32[1024]) -> (s32[], f32[8,1024], f32[1024]) {
  %rows = f32[8,1024]{1,0:S(5)} parameter(0)
  %x = f32[1024]{0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,1024]{1,0:S(5)}, f32[1024]{0}) tuple(%zero, %rows, %x)
  ROOT %loop = (s32[], ROWS, f32[1024]{0}) while(%init), condition=%cond, body=%body
}
""".replace("ROWS", "f32[8,1024]{1,0:S(5)}").replace("PUT", "dynamic-update-slice-start").replace(
    "GET", "dynamic-slice-start").replace("SIZES", "dynamic_slice_sizes={1,1024}")


def test_a_loop_bodys_host_slices_and_updates_in_either_layout():
  assert _assign(_LOOP, own_host=False) == {("body", "put"): "compute 0",
                                            ("body", "get"): "compute 1"}
  assert _assign(_LOOP, own_host=True) == {("body", "put"): streams.TO_HOST,
                                           ("body", "get"): streams.TO_DEVICE}


def test_the_installed_xla_decides_the_layout():
  assert streams.own_host_streams() == (jaxlib.version.__version_info__ >= (0, 12))
