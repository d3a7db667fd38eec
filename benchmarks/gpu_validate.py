"""Truth on a real GPU: measured peaks beside the compiled figures, and the GPU tests.

For ViT-B/16 (batch 64) and LLaMA-100M (batch 4 x 2,048), baseline and
approx+ms-norm+attention (for LLaMA also with the fused loss head,
``loss="fused"``), float32 and bfloat16 compute; and for Llama-3.2-1B at
2 x 2,048 tokens in bfloat16 (`LLAMA3_CASES`) the plain step, the best step
without streaming and the layer-streamed step
(`lowmem_jax.optim.layer_streamed`, its saved layer inputs and then also its
8-bit state in pinned host memory), and that last one for Llama-3.1-8B, whose
plain step does not fit. Each case is one AdamW training step as
`lowmem_jax.app.techniques.TechniqueSet.program` builds it (parameters and
optimizer state donated), in a fresh process so that the device's peak counter
starts at zero. It records side by side:

- measured: the device's ``memory_stats()["peak_bytes_in_use"]`` after one
  real step (parameters, optimizer state, batch and the step's buffers);
- real compile: `lowmem_jax.compile.memory.stats_of` the program that ran
  (XLA's buffer assignment with autotuning, on the device), and the same
  compile with Triton GEMMs off (``xla_gpu_enable_triton_gemm=False``), as
  the deviceless targets compile: on an H100 (jax 0.11.2) that alone made the
  bfloat16 baselines 17-21% smaller, equal to the target compile;
- target compile: the same step compiled for the target made from this
  device's own config (`lowmem_jax.compile.targets.from_devices`), what a machine
  without a GPU reports; and for the shipped ``"h100"`` target;
- the peak before the step (initialisation's, which the measured peak cannot be
  below: where it is the larger, the measured figure bounds the step's from above);
- the bytes in host memory (the real compile's host arguments and temporaries);
- the step time, median of ``--repeats`` after a warm-up, as a ratio to the
  baseline of the same model, size and dtype, and for LLaMA the tokens a second.

Each finished case is appended to a JSON-lines file beside the report
(``--rows``); with ``--resume``, cases already there for the same device, jax
version, size and repeats are not run again, so a run cut off by a time limit
goes on where it stopped. It then times the LLM loss head
(`benchmarks/loss_head.py`: `losses.linear_cross_entropy` against the plain
head, the gradient of a Llama-3-sized head at 8 x 4,096 tokens in bfloat16,
issue 22's kernel decision), runs the ``gpu``-marked tests,
saves the device's target config beside the report, and writes the report
(default ``docs/gpu.md``) with the device name. ``--dry-run`` runs the same
pipeline on the CPU at tiny sizes (the compiled figures for the ``"h100"``
target, no GPU tests), which the test suite does to check this script.

    python benchmarks/gpu_validate.py                              # on a GPU machine
    python benchmarks/gpu_validate.py --dry-run --out /tmp/gpu.md  # anywhere

``--speed`` runs issue 50's rows instead (`SPEED_CASES`, the streamed sets of `plan`'s ladder,
each with the head's backward in one pass): Llama-3.2-1B's plain step with full remat, its
streamed step with the state on the device and each layer's backward whole, with XLA's update
and with the fused kernel (``fused-update``); Llama-3.1-8B's streamed steps with the state on
the host (two layers ahead, each layer's backward and MLP whole; one, each MLP whole and each
layer half's input kept; one) and on the device (each layer's backward whole; the same, its
MLP's hidden layer kept: ``mlp-hidden``), with XLA's update, then each with the kernel. Issue
50's two measured targets first (4,000 tokens/s with the state on the host, 5,500 on the
device): the fastest host row by the estimate, then the device rows, then the other host
rows (jax 0.11.2, h100: 730.9, 552.9, 519.4, 871.8 and 863.0 ms). Its report
is ``docs/gpu_speed.md`` (rows in ``docs/gpu_speed.jsonl``; append them to ``docs/gpu.jsonl``
for ``benchmarks/step_time.py`` to set each estimate beside its measurement).
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

CASES = {"vit-b16": dict(batch=64), "llama-100m": dict(batch=4, seq=2048)}
DRY_CASES = {"vit-tiny": dict(batch=2, image=32)}
TECHNIQUES = ("baseline", "approx+ms-norm+attention",
              "approx+ms-norm+attention+fused-ce")  # fused-ce: the LLaMA models only
DTYPES = ("float32", "bfloat16")
STREAMED = "all+fused-ce+8bit+bf16-params+stream:host"  # docs/benchmarks.md's Llama-3 rows
LLAMA3_TECHNIQUES = ("baseline", "all+fused-ce", STREAMED, STREAMED + "+offload-opt")
LLAMA3_CASES = ([("llama-3.2-1b", dict(batch=2, seq=2048), "bfloat16", t)
                 for t in LLAMA3_TECHNIQUES]
                + [("llama-3.1-8b", dict(batch=2, seq=2048), "bfloat16",
                    STREAMED + "+offload-opt")])
DRY_LLAMA3_CASES = [("llama-tiny", dict(batch=2, seq=64), "bfloat16", t)
                    for t in ("baseline", STREAMED + "+offload-opt")]
# --speed: issue 50's rows, the streamed sets `plan`'s ladder tries (`lowmem_jax.app.fits`),
# each with XLA's update and with the fused kernel; the 1B's plain step with full remat (the
# same FLOPs, its head's backward in one pass too) is their time ratio's baseline.
SPEED_BASELINE = "all+fused-ce+ce-one-pass+8bit+bf16-params+remat:full"
_EVERY_LEAF = "+update-slice:1073741824"  # fits' slice term
_STREAMED_1B = ("all+fused-ce+8bit+bf16-params+ce-one-pass+stream:device+whole-layer"
                f"+mlp-chunk:off{_EVERY_LEAF}")
_SET_8B = "bf16+ms-norm+attention+fused-ce+8bit+bf16-params+ce-one-pass"
SPEED_CASES = ([("llama-3.2-1b", dict(batch=2, seq=2048), "bfloat16", t)
                for t in (SPEED_BASELINE, _STREAMED_1B, _STREAMED_1B + "+fused-update")]
               + [("llama-3.1-8b", dict(batch=2, seq=2048), "bfloat16", f"{_SET_8B}+{t}{k}")
                  for k in ("", "+fused-update")
                  for t in ("stream:host+offload-opt+prefetch:2+whole-layer+mlp-chunk:off",
                            f"stream:device+whole-layer+mlp-chunk:off{_EVERY_LEAF}",
                            f"stream:device+whole-layer+mlp-hidden+mlp-chunk:off{_EVERY_LEAF}",
                            "stream:host+offload-opt+part-inputs+mlp-chunk:off",
                            "stream:host+offload-opt")])
DRY_SPEED_CASES = [("llama-tiny", dict(batch=2, seq=64), "bfloat16", t)
                   for t in (SPEED_BASELINE, _STREAMED_1B)]
MIN_CASE_SECONDS = 60  # --deadline: a case given less would not finish (the 1B's took 130 s)
DRY_DTYPES = ("bfloat16",)  # the dry run checks the pipeline: one dtype, half the processes
ROOT = pathlib.Path(__file__).resolve().parents[1]


def build(model: str, size: dict, dtype: str, techniques: str) -> tuple:
  """``(step, params, opt_state, batch)``: one case's jitted training step (parameters and
  optimizer state donated) and its first arguments, made on the default device."""
  import jax

  from lowmem_jax import app

  job = app.Job(model, dtype=dtype, target="cpu", **size)  # the target: not compiled for
  built = app.parse(techniques).program(job).run()
  wl, step = built["wl"], built["step"]
  params = wl.init(jax.random.key(0))
  opt_state = (built["streamed"] if "streamed" in built else built["tx"]).init(params)
  return step, params, opt_state, wl.batch(jax.random.key(1))


def measure(model: str, size: dict, dtype: str, techniques: str, repeats: int,
            compiles: bool = True) -> dict:
  """One case, in this process: measured, real-compile and target-compile figures; without
  ``compiles`` (``--speed``), the measured and real-compile figures only: the step compiled
  once, not also for the targets and without Triton GEMMs (an 8B case's three more compiles)."""
  import jax

  from lowmem_jax import app
  from lowmem_jax.compile import memory, targets

  step, params, opt_state, batch = build(model, size, dtype, techniques)
  on_gpu = jax.default_backend() == "gpu"
  own = targets.from_devices("this-gpu") if on_gpu and compiles else None
  peak_for = lambda target: memory.analyze(step, params, opt_state, batch, target=target).peak_bytes
  figures = {"target_own": peak_for(own) if own else None,
             "target_h100": peak_for("h100") if compiles else None}
  lowered = step.lower(params, opt_state, batch)
  compiled = lowered.compile()
  real = memory.stats_of(compiled)
  figures["real_compile"] = real.peak_bytes
  figures["host_bytes"] = real.host_argument_bytes + real.host_temp_bytes
  figures["real_no_triton_gemm"] = None
  if compiles:
    no_triton = lowered.compile(compiler_options=targets.DEVICELESS_OPTIONS) if on_gpu else compiled
    figures["real_no_triton_gemm"] = memory.stats_of(no_triton).peak_bytes
  device = jax.devices()[0]
  figures["before_step"] = (device.memory_stats() or {}).get("peak_bytes_in_use")
  params, opt_state, _ = jax.block_until_ready(compiled(params, opt_state, batch))
  figures["measured"] = (device.memory_stats() or {}).get("peak_bytes_in_use")
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    params, opt_state, _ = jax.block_until_ready(compiled(params, opt_state, batch))
    samples.append(time.perf_counter() - start)
  return {"model": model, "size": size, "dtype": dtype, "techniques": techniques,
          "repeats": repeats, "seconds": statistics.median(samples),
          "device": device.device_kind, "jax": jax.__version__,
          "compiler_options": app.parse(techniques).compiler_options(), **figures}


def case_list(cases: dict, dtypes: tuple[str, ...] = DTYPES, llama3: tuple = ()) -> list[tuple]:
  """``[(model, size, dtype, techniques)]`` of ``cases`` (``loss`` techniques for LLaMA only),
  then the cases ``llama3`` lists."""
  return [(m, s, d, t) for m, s in cases.items() for d in dtypes for t in TECHNIQUES
          if m.startswith("llama") or "fused-ce" not in t] + list(llama3)


class CaseFailed(RuntimeError):
  """A case that did not finish: why, in a line."""


def run_case(model, size, dtype, techniques, repeats, timeout=None, compiles=True) -> dict:
  """`measure` in a fresh Python process, so its peak counter starts at zero; `CaseFailed`
  where it fails or runs past ``timeout`` seconds."""
  spec = json.dumps([model, size, dtype, techniques, repeats, compiles])
  try:
    done = subprocess.run([sys.executable, __file__, "--case", spec], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout)
  except subprocess.TimeoutExpired:
    raise CaseFailed(f"stopped at its {timeout:.0f} s limit (--deadline)") from None
  if done.returncode != 0:
    print(done.stderr[-3000:], file=sys.stderr)
    last = [line.strip() for line in done.stderr.splitlines() if line.strip()][-3:]
    raise CaseFailed(" / ".join(last) or f"exited {done.returncode}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def gpu_tests() -> str:
  """The closing line of ``pytest -m gpu``."""
  # A test module that the machine's packages cannot import is an error in the closing line, not
  # the end of the run.
  done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p",
                         "no:cacheprovider", "--continue-on-collection-errors", "tests"],
                        capture_output=True, text=True, cwd=ROOT)
  lines = [line for line in done.stdout.splitlines() if line.strip()]
  return lines[-1] if lines else f"pytest exited {done.returncode} with no output"


def loss_head(dry_run: bool) -> str:
  """`benchmarks/loss_head.py`'s tables: the Llama-3-sized head in bfloat16 (tiny in a dry run)."""
  size = (["--quick"] if dry_run else
          ["--time", "32768,128256,4096", "--repeats", "5", "--chunks", "1024x8192,2048x16384"])
  done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "loss_head.py"), *size,
                         "--time-dtype", "bfloat16"], capture_output=True, text=True, cwd=ROOT)
  if done.returncode != 0:  # the cases' figures are still reported
    return f"benchmarks/loss_head.py failed:\n{done.stderr[-3000:]}"
  return done.stdout


def _gib(nbytes) -> str:
  return "n/a" if nbytes is None else f"{nbytes / 2**30:,.2f}"


def size_text(size: dict) -> str:
  """``"2 x 2048"`` (batch x tokens) or ``"64"`` (batch)."""
  return " x ".join(str(size[k]) for k in ("batch", "seq") if k in size)


def _case_of(row: dict) -> tuple:
  """A row's model, size and dtype: the rows a time ratio compares."""
  return row["model"], json.dumps(row.get("size")), row["dtype"]


def write_report(path: pathlib.Path, rows: list[dict], head: str, tests: str, config: str,
                 command: str, seconds: float, dry_run: bool, failed: tuple = ()) -> None:
  """The report: ``rows``' table, then ``failed`` (``(case, why)``: the cases that did not
  finish), the loss head, the tests."""
  device, version = rows[0]["device"], rows[0]["jax"]
  lines = [f"# lowmem-jax on a real GPU: {device}", "",
           ("**Dry run on the CPU** (tiny sizes; no GPU figures): it checks the pipeline only." if
            dry_run else f"Measured on an **{device}**."),
           f"Command: `{command}`; jax {version}, {seconds:.0f} s in all.", "",
           "GiB. *measured*: `peak_bytes_in_use` after one step (fresh process); *real compile*: "
           "XLA's buffer assignment of the program that ran; *no Triton GEMMs*: the same compile "
           "with `xla_gpu_enable_triton_gemm=False`, as the deviceless targets compile; "
           "*own-config target*: the same step "
           "compiled deviceless for this device's own config (`targets.from_devices`); *h100 "
           "target*: for the shipped `h100` config; *before step*: the peak before the step ran "
           "(initialisation's; where it equals *measured*, that bounds the step's peak from "
           "above); *host*: the real compile's arguments and temporaries in host memory. Step "
           "time: median after a warm-up, ratio to the baseline of the same model, size and "
           f"dtype (`baseline`, or `{SPEED_BASELINE}`; n/a: no baseline, as where the plain "
           "step does not fit).", "",
           "| model | size | dtype | techniques | measured | real compile | no Triton GEMMs "
           "| own-config target | h100 target | h100 target / measured | before step | host "
           "| step s | time ratio | tokens/s |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  base = {_case_of(r): r["seconds"] for r in rows
          if r["techniques"] in ("baseline", SPEED_BASELINE)}
  for r in rows:
    ratio = (f"{r['target_h100'] / r['measured']:.3f}" if r["measured"] and r["target_h100"]
             else "n/a")
    baseline = base.get(_case_of(r))
    size = r.get("size") or {}
    tokens = (f"{size['batch'] * size['seq'] / r['seconds']:,.0f}" if "seq" in size else "n/a")
    lines.append(f"| {r['model']} | {size_text(size)} | {r['dtype']} | {r['techniques']} | "
                 f"{_gib(r['measured'])} | {_gib(r['real_compile'])} | "
                 f"{_gib(r.get('real_no_triton_gemm'))} | {_gib(r['target_own'])} | "
                 f"{_gib(r['target_h100'])} | {ratio} | {_gib(r.get('before_step'))} | "
                 f"{_gib(r.get('host_bytes'))} | {r['seconds']:.4f} | "
                 f"{'n/a' if baseline is None else format(r['seconds'] / baseline, '.3f')} | "
                 f"{tokens} |")
  if failed:
    lines += ["", "Cases that did not finish:", ""]
    lines += [f"- {m} {size_text(z)} {d} `{t}`: {why}" for (m, z, d, t), why in failed]
  lines += ["", "The LLM loss head (`benchmarks/loss_head.py`, as this script runs it; memory "
            "for the target, time on this device):", "", "```", head.rstrip(), "```",
            "", f"GPU-marked tests (`pytest -m gpu`): {tests}", "",
            f"This device's target config: `{config}`.", ""]
  path.write_text("\n".join(lines))


def no_gpu(script: str, dry_run: bool) -> bool:
  """Whether ``script`` must stop, said on stderr: no GPU, and not a dry run. The process
  that asks only names the backend: it starts JAX without preallocation, leaving the GPU's
  memory to the processes that measure (the Llama-3-sized plain head needs over 30 GiB)."""
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  import jax
  if dry_run or jax.default_backend() == "gpu":
    return False
  print(f"{script}: no GPU (JAX's backend is {jax.default_backend()}); use --dry-run.",
        file=sys.stderr)
  return True


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", help="the report to write; default docs/gpu.md (docs/"
                      "gpu_speed.md with --speed), and for --dry-run gpu_dry_run.md "
                      "(gpu_speed_dry_run.md) in the temporary directory")
  parser.add_argument("--repeats", type=int, default=10, help="timed steps after the warm-up")
  parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU, no GPU tests")
  parser.add_argument("--rows", help="finished cases, JSON lines; default: the report's name "
                      "with .jsonl")
  parser.add_argument("--resume", action="store_true",
                      help="keep the finished cases in --rows of this device, jax version, size "
                      "and repeats, and run only the others")
  parser.add_argument("--models", help="comma-separated: run only these models' cases (the "
                      "report still shows the other finished cases in --rows with --resume)")
  parser.add_argument("--cases-only", action="store_true",
                      help="run the cases into --rows and stop (no loss head, tests or report): "
                      "a run split over calls, the last with --resume")
  parser.add_argument("--deadline", type=float,
                      help="seconds from the start: each case runs under what is left of them, "
                      f"none starts with under {MIN_CASE_SECONDS} s left; a case that fails or "
                      "is stopped is listed in the report and not kept in --rows")
  parser.add_argument("--speed", action="store_true",
                      help="run issue 50's speed rows instead (SPEED_CASES: the streamed sets "
                      "with and without fused-update, the 1B's full-remat step their baseline)")
  parser.add_argument("--case", help=argparse.SUPPRESS)
  return parser


def _run_cases(todo, rows, rows_path, repeats, deadline, start, speed):
  """Runs each case of ``todo`` in a process of its own, appending its row to ``rows`` and
  to ``rows_path`` as it finishes; returns the (case, why) of those that did not finish."""
  from tqdm import tqdm
  failed = []
  for case in tqdm(todo, desc="gpu_validate"):
    left = None if deadline is None else deadline - (time.perf_counter() - start)
    try:
      if left is not None and left < MIN_CASE_SECONDS:
        raise CaseFailed(f"not started: {left:.0f} s of --deadline left")
      rows.append(run_case(*case, repeats, timeout=left, compiles=not speed))
    except CaseFailed as why:
      failed.append((case, str(why)))
      print(f"gpu_validate: {case}: {why}", file=sys.stderr)
      continue
    with rows_path.open("a") as f:
      f.write(json.dumps(rows[-1]) + "\n")
  return failed


def main(argv=None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  if args.case:
    print(json.dumps(measure(*json.loads(args.case))))
    return 0
  if no_gpu("gpu_validate", args.dry_run):
    return 2
  import jax

  from lowmem_jax.compile import targets
  start = time.perf_counter()
  cases = DRY_CASES if args.dry_run else CASES
  # --speed writes a report of its own: the record's rows (docs/gpu.jsonl) are not rewritten.
  name = "gpu_speed" if args.speed else "gpu"
  out = pathlib.Path(args.out or (pathlib.Path(tempfile.gettempdir()) / f"{name}_dry_run.md"
                                  if args.dry_run else ROOT / "docs" / f"{name}.md"))
  out.parent.mkdir(parents=True, exist_ok=True)
  rows_path = pathlib.Path(args.rows) if args.rows else out.with_suffix(".jsonl")
  device, version = jax.devices()[0].device_kind, jax.__version__
  if args.speed:
    all_cases = DRY_SPEED_CASES if args.dry_run else SPEED_CASES
  else:
    all_cases = (case_list(cases, DRY_DTYPES, DRY_LLAMA3_CASES) if args.dry_run else
                 case_list(cases, DTYPES, LLAMA3_CASES))
  models = set(args.models.split(",")) if args.models else {case[0] for case in all_cases}
  unknown = models - {case[0] for case in all_cases}
  if unknown:
    parser.error(f"--models: no cases of {', '.join(sorted(unknown))}; choose from "
                 f"{', '.join(dict.fromkeys(case[0] for case in all_cases))}.")
  case_key = lambda m, s, d, t: (m, json.dumps(s), d, t, args.repeats, device, version)
  row_key = lambda r: ((r["model"], json.dumps(r.get("size")), r["dtype"], r["techniques"],
                        r.get("repeats"), r["device"], r.get("jax")))
  wanted = {case_key(*case) for case in all_cases}
  rows = ([r for r in map(json.loads, filter(str.strip, rows_path.read_text().splitlines()))
           if row_key(r) in wanted] if args.resume and rows_path.exists() else [])
  rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  done = {row_key(r) for r in rows}
  todo = [case for case in all_cases if case_key(*case) not in done and case[0] in models]
  failed = _run_cases(todo, rows, rows_path, args.repeats, args.deadline, start, args.speed)
  if args.cases_only:
    print(f"gpu_validate: {len(rows)} of {len(all_cases)} cases in {rows_path}, "
          f"{len(failed)} did not finish")
    return 1 if failed else 0
  if not rows:
    print("gpu_validate: no case finished; no report written.", file=sys.stderr)
    return 1
  order = {case_key(*case): i for i, case in enumerate(all_cases)}
  rows.sort(key=lambda r: order[row_key(r)])
  config = out.with_name(out.stem + "_target.txtpb")
  (targets.get("h100") if args.dry_run else targets.from_devices()).save(config)
  head = loss_head(args.dry_run)
  tests = "(dry run: not run)" if args.dry_run else gpu_tests()
  command = ("python benchmarks/gpu_validate.py" + (" --dry-run" if args.dry_run else "")
             + (" --speed" if args.speed else ""))
  write_report(out, rows, head, tests, config.name, command, time.perf_counter() - start,
               args.dry_run, failed)
  print(out.read_text())
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
