"""The step-time estimate beside every real GPU measurement on record.

For each row of ``docs/gpu.jsonl`` (a training step measured on a real GPU by
``benchmarks/gpu_validate.py``: the median of its repeats), the same step is compiled here for
the shipped target of that GPU (`targets.shipped_for`: ``h100`` for an H100 SXM, ``h200`` for
an H200) and its time estimated from the optimized program
(`lowmem_jax.compile.memory.step_time`). Prints a Markdown table: measured,
estimated, their ratio, what bounds the step; and the largest ratio off 1. The estimate's
constants (`step_time.CALIBRATION`) were fit to these rows (``docs/benchmarks.md`` says which),
so this shows how well the model holds, not an independent check. ``--quick`` estimates two
small rows (LLaMA-100M, bfloat16: the baseline and the exact rewrites). A row whose step took
cuDNN's attention is not estimated where cuDNN cannot compile here (jax 0.12.1 without a GPU):
the table says why.

    python benchmarks/step_time.py            # every row, a few minutes
    python benchmarks/step_time.py --quick
"""

import argparse
import json
import pathlib

from _quick import parse_args

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICK = {"rows": "7,8"}
EARLIER_OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": True}
"""The XLA options a host-streamed row on record without ``compiler_options`` ran with (the
rows before 2026-12-06; `targets.HOST_TRANSFER_OPTIONS` then)."""


def estimate(row: dict) -> dict:
  """The row's step compiled for its GPU's target with the XLA options it ran with: the
  estimate beside the measurement."""
  from lowmem_jax import app
  from lowmem_jax.compile import targets
  from lowmem_jax.ops import dispatch

  target = targets.shipped_for(row["device"])
  if target is None:
    raise ValueError(f"no shipped target for the row's device {row['device']!r}: save its "
                     "config (`targets.from_devices().save`) and add it to the shipped targets")
  techniques = app.parse(row["techniques"])
  options = row.get("compiler_options", EARLIER_OPTIONS if techniques.compiler_options() else {})
  job = app.Job(row["model"], dtype=row["dtype"], target=target, compiler_options=options,
                **row["size"])
  with dispatch.recording_cudnn_refusals() as refused:
    b = app.measure(job, techniques)
  if refused:
    raise targets.TargetUnavailable(f"measured with cuDNN's attention, which does not compile "
                                    f"for {target} here: {refused[0]}")
  if b.step_time is None:
    raise RuntimeError(f"no estimate for {row['techniques']} on target {job.target.name}")
  return {"row": row, "seconds": b.step_time.seconds, "bound": b.step_time.bound,
          "ratio": b.step_time.seconds / row["seconds"]}


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", default=None,
                      help="comma-separated row numbers of docs/gpu.jsonl (from 0; default all)")
  parser.add_argument("--quick", action="store_true", help=f"rows {QUICK['rows']} only")
  args = parse_args(parser, argv, QUICK)
  rows = [json.loads(line) for line in (ROOT / "docs" / "gpu.jsonl").read_text().splitlines()]
  numbers = range(len(rows)) if args.rows is None else [int(n) for n in args.rows.split(",")]
  import jax
  from lowmem_jax.compile import targets
  print(f"jax {jax.__version__}\n")
  print("| # | model | size | dtype | techniques | measured ms | estimated ms | × | bound |")
  print("|---|---|---|---|---|---:|---:|---:|---|")
  found = []
  for n in numbers:
    r = rows[n]
    size = " × ".join(str(v) for v in r["size"].values())
    try:
      e = estimate(r)
    except targets.TargetUnavailable as why:
      print(f"| {n} | {r['model']} | {size} | {r['dtype']} | {r['techniques']} | "
            f"{1e3 * r['seconds']:,.1f} | not estimated: {why} | | |", flush=True)
      continue
    found.append(e)
    print(f"| {n} | {r['model']} | {size} | {r['dtype']} | {r['techniques']} | "
          f"{1e3 * r['seconds']:,.1f} | {1e3 * e['seconds']:,.1f} | {e['ratio']:.2f} | "
          f"{e['bound']} |", flush=True)
  if not found:
    return found
  worst = max(found, key=lambda e: abs(e["ratio"] - 1))
  print(f"\nestimate / measured from {min(e['ratio'] for e in found):.2f} to "
        f"{max(e['ratio'] for e in found):.2f}; farthest: {worst['row']['techniques']} "
        f"({worst['row']['model']}, {worst['row']['dtype']})")
  return found


if __name__ == "__main__":
  main()
