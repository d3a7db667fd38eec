"""benchmarks/gpu_profile.py: its trace summary, on a GPU-shaped trace; its pipeline on the CPU."""

import jax
import pytest

import gpu_profile  # benchmarks/, on sys.path in conftest.py
import gpu_validate


def _trace():
  """Two steps on a GPU as the profiler's Perfetto JSON lays them out: a device process whose
  streams carry kernels and copies, its other threads (XLA's ops) and the host's spans, which
  the summary must leave out. Microseconds."""
  meta = lambda pid, tid, kind, name: {"ph": "M", "pid": pid, "tid": tid, "name": kind,
                                       "args": {"name": name}}
  span = lambda tid, ts, dur, name, args=None: {"ph": "X", "pid": 2, "tid": tid, "ts": ts,
                                                "dur": dur, "name": name, "args": args or {}}
  copy = lambda size: {"memcpy_details": f"kind_src:pinned kind_dst:device size:{size} async:1"}
  return {"traceEvents": [
      meta(1, 0, "process_name", "/host:CPU"), meta(2, 0, "process_name", "/device:GPU:0"),
      meta(2, 7, "thread_name", "Stream #7(Compute)"), meta(2, 8, "thread_name",
                                                             "Stream #8(MemcpyH2D)"),
      meta(2, 9, "thread_name", "Stream #9(MemcpyD2H)"), meta(2, 3, "thread_name", "XLA Ops"),
      {"ph": "X", "pid": 1, "tid": 0, "ts": 0, "dur": 5000, "name": "PjitFunction(step)"},
      span(3, 0, 4000, "while.12"),  # an op's span over its kernels: not a kernel
      span(7, 0, 1000, "gemm_a"), span(7, 900, 600, "loop_fusion"),  # launched early
      span(7, 2000, 1000, "gemm_a"), span(7, 3500, 500, "loop_fusion"),
      span(8, 100, 800, "MemcpyH2D", copy(4_000_000)), span(8, 2100, 800, "MemcpyH2D",
                                                             copy(4_000_000)),
      span(9, 3000, 1000, "MemcpyD2H", {"memcpy_details": "size:2000000"}),
  ]}


def test_the_summary_counts_each_stream_once_and_the_copies_each_way():
  s = gpu_profile.summarise(_trace(), steps=2)
  assert s["device"] == "/device:GPU:0"
  # The streams' spans run from 0 to 4,000 us; the device is busy in [0, 1500) and [2000, 4000).
  assert s["seconds"] == pytest.approx(4000e-6 / 2) and s["idle_seconds"] == pytest.approx(250e-6)
  assert s["kernel_count"] == 2  # a kernel overlapping the one before in part counts
  assert s["kernels"] == [("gemm_a", 1, pytest.approx(1000e-6)),
                          ("loop_fusion", 1, pytest.approx(550e-6))]
  assert s["copies"] == {"to device": (1, pytest.approx(800e-6), 4_000_000),
                         "to host": (0.5, pytest.approx(500e-6), 1_000_000)}
  # Kernels run in [0, 1500), [2000, 3000) and [3500, 4000); the fetches lie under them, the
  # write-back [3000, 4000) half; the two ways never run at once.
  assert s["kernel_seconds"] == pytest.approx(3000e-6 / 2)
  assert s["under_kernels"] == {"to device": pytest.approx(800e-6),
                                "to host": pytest.approx(250e-6)}
  assert s["both_ways_seconds"] == 0
  # The first step, [0, 2000): one fetch on its stream; the write-back is the second step's.
  assert s["stream_copies"] == {"Stream #8(MemcpyH2D)": {"to device": 1}}


def test_copies_both_ways_at_once_are_counted_where_they_meet():
  trace = _trace()
  trace["traceEvents"][-1].update(ts=2500, dur=1500)  # the write-back from 2,500 us
  s = gpu_profile.summarise(trace, steps=2)
  assert s["both_ways_seconds"] == pytest.approx(400e-6 / 2)
  assert s["under_kernels"]["to host"] == pytest.approx(1000e-6 / 2)


def test_a_copy_of_no_size_gives_no_bytes_and_a_gpu_trace_without_its_device_is_refused():
  trace = _trace()
  trace["traceEvents"][-1]["args"] = {}
  assert gpu_profile.summarise(trace, steps=2)["copies"]["to host"][2] is None
  trace["traceEvents"] = [e for e in trace["traceEvents"] if e["pid"] != 2]  # CUPTI not loaded
  with pytest.raises(ValueError, match="no /device:... process"):
    gpu_profile.summarise(trace, steps=2)


def test_a_host_thread_s_nested_spans_count_once_and_a_trace_without_spans_is_refused():
  trace = {"traceEvents": [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
      {"ph": "M", "pid": 1, "tid": 4, "name": "thread_name", "args": {"name": "tf_XLACpu"}},
      {"ph": "X", "pid": 1, "tid": 4, "ts": 0, "dur": 100, "name": "Execute"},
      {"ph": "X", "pid": 1, "tid": 4, "ts": 10, "dur": 50, "name": "fusion.1"}]}
  s = gpu_profile.summarise(trace, steps=1, device=False)
  assert s["device"] == "/host:CPU" and s["kernels"] == [("Execute", 1, pytest.approx(1e-4))]
  trace["traceEvents"] = trace["traceEvents"][:2]
  with pytest.raises(ValueError, match="no kernel or copy"):
    gpu_profile.summarise(trace, steps=1, device=False)


@pytest.mark.slow
def test_dry_run_profiles_a_streamed_step_and_writes_the_report(tmp_path):
  out = tmp_path / "gpu_profile.md"
  assert gpu_profile.main(["--dry-run", "--out", str(out), "--traces", str(tmp_path / "t"),
                           "--steps", "2"]) == 0
  text = out.read_text()
  streamed = next(t for *_, t in gpu_validate.DRY_SPEED_CASES if "stream:" in t)
  assert f"## llama-tiny 2 x 64 bfloat16 `{streamed}`" in text
  assert "/host:CPU" in text and "| kernel | count | ms |" in text
  assert list((tmp_path / "t").rglob("perfetto_trace.json.gz"))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU it would profile")
def test_refuses_without_a_gpu(capsys):
  assert gpu_profile.main(["--out", "/nonexistent/p.md"]) == 2
  assert "use --dry-run" in capsys.readouterr().err
