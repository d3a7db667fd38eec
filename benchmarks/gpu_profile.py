"""Where a streamed step's time goes on a real GPU: a profile of each case, summarised.

Issue 50's profile of the Llama-3.2-1B and Llama-3.1-8B layer-streamed steps (`CASES`): each
case's step, as ``benchmarks/gpu_validate.py`` builds it, in a fresh process, warmed up, then
``--steps`` steps under `jax.profiler.trace`. The trace (the Perfetto JSON the profiler writes
beside its XPlane) is summarised for the device: a step's wall time; the idle time, when no
kernel or copy runs on any of its streams; the kernels that took the most time; the copies
each way, with their bytes and rate where the trace gives the bytes (CUPTI's
``memcpy_details``: ``size:N``; *on device*: device-to-device copies and XLA's copy kernels),
and how much of the host transfers ran under a kernel or both ways at once (what the step-time
estimate assumes of the overlap XLA scheduled).
Written as Markdown (``--out``; default ``docs/gpu_profile.md``) for ``docs/gpu.md``; the
traces stay in ``--traces``.

A GPU's device is the trace's ``/device:GPU:0`` process, its streams the threads named
``Stream ...``. ``--dry-run`` profiles a tiny Llama on the CPU, whose trace has no device
process: the host's XLA threads stand in for the streams (every thread but Python's), which
checks the pipeline only.

    python benchmarks/gpu_profile.py --deadline 300          # on a GPU machine
    python benchmarks/gpu_profile.py --dry-run --out /tmp/gpu_profile.md
"""

import argparse
import collections
import gzip
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import gpu_validate

# The streamed rows of gpu_validate's --speed with XLA's update, the default (session 40
# profiled those with the fused update: docs/gpu_profile.md), the host-state rows first: their
# transfers' overlap is what the step-time estimate misses. The dry run's streamed row.
CASES = sorted((c for c in gpu_validate.SPEED_CASES
                if "stream:" in c[3] and "fused-update" not in c[3]),
               key=lambda c: "stream:host" not in c[3])
DRY_CASES = [c for c in gpu_validate.DRY_SPEED_CASES if "stream:" in c[3]]
TOP = 15  # kernels listed a case
_COPY = re.compile(r"memcpy|memset|copy", re.I)
_TO_DEVICE, _TO_HOST = re.compile(r"H2D|HtoD", re.I), re.compile(r"D2H|DtoH", re.I)
_SIZE = re.compile(r"\bsize:\s*(\d+)")


def summarise(trace: dict, steps: int, device: bool = True) -> dict:
  """A Perfetto/Chrome trace (``{"traceEvents": [...]}``) of ``steps`` steps, summarised for
  its device (see the module's docstring; ``device=False``: the host's, for the dry run): a
  step's seconds, idle seconds and seconds some kernel runs (``kernel_seconds``), ``kernels``
  (name, count, seconds), ``copies`` by direction (count, seconds, bytes or None where a
  copy's size is not in the trace), ``under_kernels`` (the seconds some copy to the device,
  or to the host, runs while a kernel runs: the transfer time compute hides; a copy on the
  device is no kernel here) and ``both_ways_seconds`` (copies to the device and to the host
  at once), each a step's mean; ``stream_copies``, each stream's copies by direction in the
  first step (XLA takes its streams from a pool each run; `lowmem_jax.compile.memory.streams`
  says which starts share one). A ValueError where the trace has no such device (on a GPU:
  CUPTI not loaded) or no span on its streams."""
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  prefix = "/device:" if device else "/host:"
  found = sorted((name != "/device:GPU:0", pid) for pid, name in names.items()
                 if name.startswith(prefix))
  if not found:
    raise ValueError(f"the trace has no {prefix}... process (processes: {sorted(names.values())})")
  pid = found[0][1]
  streams = {key for key, name in threads.items() if key[0] == pid and (
      name.startswith("Stream") if device else name != "python")}
  spans = _outermost([e for e in events
                      if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams])
  if not spans:
    raise ValueError(f"the trace has no kernel or copy on {names[pid]}'s streams")
  start = min(e["ts"] for e in spans)
  wall = max(e["ts"] + e["dur"] for e in spans) - start
  busy = _length(_union(spans))
  kernels = collections.defaultdict(lambda: [0, 0.0])
  copies = collections.defaultdict(lambda: [0, 0.0, 0, True])  # count, s, bytes, all sized
  ways = collections.defaultdict(list)  # spans by "kernel" or a copy's direction
  stream_copies = collections.defaultdict(collections.Counter)  # the first step's, a stream
  for e in spans:
    name = e["name"]
    way = "kernel" if not _COPY.search(name) else (
        "to device" if _TO_DEVICE.search(name) else "to host" if _TO_HOST.search(name)
        else "on device")
    ways[way].append(e)
    if way != "kernel" and e["ts"] < start + wall / steps:
      stream_copies[threads[e["pid"], e["tid"]]][way] += 1
    if way != "kernel":
      size = _SIZE.search(" ".join(str(v) for v in (e.get("args") or {}).values()))
      c = copies[way]
      c[:] = c[0] + 1, c[1] + e["dur"] / 1e6, c[2] + int(size.group(1) if size else 0), (
          c[3] and size is not None)
    else:
      k = kernels[name]
      k[0], k[1] = k[0] + 1, k[1] + e["dur"] / 1e6
  top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:TOP]
  union = {way: _union(found) for way, found in ways.items()}
  under = lambda way, other: _length(_intersection(union.get(way, []), union.get(other, [])))
  return {"device": names[pid], "steps": steps, "seconds": wall / 1e6 / steps,
          "idle_seconds": (wall - busy) / 1e6 / steps,
          "kernel_seconds": _length(union.get("kernel", [])) / 1e6 / steps,
          "under_kernels": {way: under(way, "kernel") / 1e6 / steps
                            for way in ("to device", "to host") if way in union},
          "both_ways_seconds": under("to device", "to host") / 1e6 / steps,
          "stream_copies": {name: dict(c) for name, c in sorted(stream_copies.items())},
          "kernel_count": sum(k[0] for k in kernels.values()) / steps,
          "kernels": [(name, n / steps, s / steps) for name, (n, s) in top],
          "copies": {way: (n / steps, s / steps, b / steps if sized else None)
                     for way, (n, s, b, sized) in sorted(copies.items())}}


def _union(spans: list[dict]) -> list[tuple[float, float]]:
  """The time ``spans`` cover: sorted, disjoint ``(start, end)`` intervals, microseconds."""
  merged = []
  for e in sorted(spans, key=lambda e: e["ts"]):
    if merged and e["ts"] <= merged[-1][1]:
      merged[-1] = merged[-1][0], max(merged[-1][1], e["ts"] + e["dur"])
    else:
      merged.append((e["ts"], e["ts"] + e["dur"]))
  return merged


def _intersection(a: list, b: list) -> list[tuple[float, float]]:
  """The time two `_union` s share, as one."""
  shared, i, j = [], 0, 0
  while i < len(a) and j < len(b):
    start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
    if start < end:
      shared.append((start, end))
    i, j = (i + 1, j) if a[i][1] < b[j][1] else (i, j + 1)
  return shared


def _length(intervals: list) -> float:
  """The time `_union` s' intervals cover, microseconds."""
  return sum(end - start for start, end in intervals)


def _outermost(spans: list[dict]) -> list[dict]:
  """The spans no other span of their thread holds whole: a host thread's annotations nest;
  a stream's kernels may overlap in part (a CUDA graph's branches, early launches), and
  each counts."""
  kept, ends = [], {}
  for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
    thread = e["pid"], e["tid"]
    if e["ts"] + e["dur"] > ends.get(thread, float("-inf")):
      kept.append(e)
      ends[thread] = max(ends.get(thread, float("-inf")), e["ts"] + e["dur"])
  return kept


def profile(model: str, size: dict, dtype: str, techniques: str, steps: int,
            traces: str) -> dict:
  """One case, in this process: ``steps`` steps after a warm-up under `jax.profiler.trace`
  into ``traces``, `summarise` d."""
  import jax

  step, params, opt_state, batch = gpu_validate.build(model, size, dtype, techniques)
  step = step.lower(params, opt_state, batch).compile()  # compiled once, as gpu_validate's
  params, opt_state, _ = jax.block_until_ready(step(params, opt_state, batch))
  with jax.profiler.trace(traces, create_perfetto_trace=True):
    for _ in range(steps):
      params, opt_state, _ = jax.block_until_ready(step(params, opt_state, batch))
  newest = max(pathlib.Path(traces).rglob("perfetto_trace.json.gz"),
               key=lambda p: p.stat().st_mtime)
  with gzip.open(newest) as f:
    summary = summarise(json.load(f), steps, device=jax.default_backend() == "gpu")
  return {"model": model, "size": size, "dtype": dtype, "techniques": techniques,
          "jax": jax.__version__, "trace": str(newest), **summary}


def markdown(rows: list[dict], failed: list, command: str) -> str:
  """The report: each case's summary, then the cases that did not finish."""
  lines = ["# Where the streamed steps' time goes: profiles", "",
           f"Command: `{command}`. Per step, from `jax.profiler.trace` (see the script's "
           "docstring for what counts as a stream, a kernel and a copy).", ""]
  for r in rows:
    lines += [f"## {r['model']} {gpu_validate.size_text(r['size'])} {r['dtype']} "
              f"`{r['techniques']}`", "",
              f"{r['device']}, jax {r['jax']}: **{1e3 * r['seconds']:,.1f} ms a step**, "
              f"{1e3 * r['idle_seconds']:,.1f} ms of it idle (no kernel or copy running), "
              f"{r['kernel_count']:,.0f} kernels (means of {r['steps']} steps), some kernel "
              f"running {1e3 * r['kernel_seconds']:,.1f} ms of it; copies to the device and "
              f"to the host both running {1e3 * r['both_ways_seconds']:,.1f} ms.", "",
              "| copies | count | ms | GiB | GB/s | ms under a kernel |",
              "|---|---:|---:|---:|---:|---:|"]
    for way, (n, s, b) in r["copies"].items():
      rate = f"{b / s / 1e9:,.1f}" if b and s else "n/a"
      hidden = r["under_kernels"].get(way)
      lines.append(f"| {way} | {n:,.1f} | {1e3 * s:,.1f} | "
                   f"{'n/a' if b is None else format(b / 2**30, ',.2f')} | {rate} | "
                   f"{'n/a' if hidden is None else format(1e3 * hidden, ',.1f')} |")
    lines += ["", "| stream (the first step) | to device | to host | on device |",
              "|---|---:|---:|---:|"]
    lines += [f"| {name} | {c.get('to device', 0)} | {c.get('to host', 0)} | "
              f"{c.get('on device', 0)} |" for name, c in r["stream_copies"].items()]
    lines += ["", "| kernel | count | ms | share of the step |", "|---|---:|---:|---:|"]
    lines += [f"| `{name[:90]}` | {n:,.1f} | {1e3 * s:,.2f} | {s / r['seconds']:.1%} |"
              for name, n, s in r["kernels"]]
    lines.append("")
  if failed:
    lines += ["Cases that did not finish:", ""]
    lines += [f"- {m} {gpu_validate.size_text(z)} {d} `{t}`: {why}" for (m, z, d, t), why in failed]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", help="the report; default docs/gpu_profile.md, and for "
                      "--dry-run gpu_profile_dry_run.md in the temporary directory")
  parser.add_argument("--traces", help="where the traces go; default a temporary directory")
  parser.add_argument("--steps", type=int, default=3, help="profiled steps after the warm-up")
  parser.add_argument("--dry-run", action="store_true", help="a tiny Llama on the CPU")
  parser.add_argument("--models", help="comma-separated: only these models' cases")
  parser.add_argument("--deadline", type=float, help="seconds from the start: each case runs "
                      "under what is left of them; one that fails or is stopped is listed")
  parser.add_argument("--case", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  start = time.perf_counter()  # --deadline counts from here, JAX's start included
  traces = args.traces or tempfile.mkdtemp(prefix="gpu_profile_")
  if args.case:
    print(json.dumps(profile(*json.loads(args.case), args.steps, traces)))
    return 0
  if gpu_validate.no_gpu("gpu_profile", args.dry_run):
    return 2
  root = pathlib.Path(__file__).resolve().parents[1]
  out = pathlib.Path(args.out or (pathlib.Path(tempfile.gettempdir()) / "gpu_profile_dry_run.md"
                                  if args.dry_run else root / "docs" / "gpu_profile.md"))
  cases = DRY_CASES if args.dry_run else CASES
  if args.models:
    unknown = set(args.models.split(",")) - {c[0] for c in cases}
    if unknown:
      parser.error(f"--models: no cases of {', '.join(sorted(unknown))}; choose from "
                   f"{', '.join(dict.fromkeys(c[0] for c in cases))}.")
    cases = [c for c in cases if c[0] in args.models.split(",")]
  rows, failed = [], []
  command = "python benchmarks/gpu_profile.py" + (" --dry-run" if args.dry_run else "")
  out.parent.mkdir(parents=True, exist_ok=True)
  for case in cases:
    left = None if args.deadline is None else args.deadline - (time.perf_counter() - start)
    try:
      if left is not None and left < gpu_validate.MIN_CASE_SECONDS:
        raise gpu_validate.CaseFailed(f"not started: {left:.0f} s of --deadline left")
      done = subprocess.run([sys.executable, __file__, "--case", json.dumps(case), "--steps",
                             str(args.steps), "--traces", traces], capture_output=True,
                            text=True, cwd=root, timeout=left)
      if done.returncode:
        last = [line for line in done.stderr.splitlines() if line.strip()][-2:]
        raise gpu_validate.CaseFailed(" / ".join(last) or f"exited {done.returncode}")
      try:
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
      except (IndexError, ValueError):
        raise gpu_validate.CaseFailed("exited 0 without its summary") from None
    except subprocess.TimeoutExpired:
      failed.append((case, f"stopped at its {left:.0f} s limit (--deadline)"))
    except gpu_validate.CaseFailed as why:
      failed.append((case, str(why)))
    print(f"gpu_profile: {case[0]} `{case[3]}`: "
          f"{failed[-1][1] if failed and failed[-1][0] == case else 'done'}", file=sys.stderr)
    out.write_text(markdown(rows, failed, command))  # after each case: a call cut off keeps it
  print(f"gpu_profile: {len(rows)} of {len(cases)} cases in {out}; traces in {traces}")
  return 1 if failed or not rows else 0


if __name__ == "__main__":
  sys.exit(main())
