"""The ``lowmem-jax`` command: where the memory of a training step goes.

    lowmem-jax report                          # ViT-B/16 at batch 64: baseline, each technique, all
    lowmem-jax report --model llama-1b --batch 8 --seq 2048 --techniques baseline,all,all+remat:full
    lowmem-jax plan --model llama-7b --batch 8 --seq 2048 --budget 24GiB
    lowmem-jax report --model llama-3.1-70b --batch 8 --seq 4096 --devices 8 \
        --techniques all+fused-ce+8bit+bf16-params+stream:device  # FSDP over 8 GPUs, per device
    lowmem-jax report --step train.py:make_step  # your own step: baseline, lowmem, lowmem+approx
    lowmem-jax plan --step train.py:make_step --budget 190MiB

A technique set joins techniques with "+"; ``--techniques`` takes a comma list
of sets, one table row each. Every figure comes from XLA's compilation of the
training step (for the reference models: AdamW, parameters and optimizer state
donated) on abstract shapes for ``--target``: by default the GPU this process
runs on, else an H100 compiled for here without one (``pip install
'lowmem-jax[target]'``), else the CPU as a labelled proxy. Nothing is
allocated, so a 7B model is reported on a laptop CPU (see docs/report.md).

``--step FILE.py:FUNCTION`` (or ``MODULE:FUNCTION``) measures a step of your
own: ``FUNCTION()`` returns ``(step, args)`` or ``(step, args, (loss_fn,
loss_args))``: the training step (jitted or not, ``nnx.jit`` too), a tuple of
its arguments (arrays or `jax.ShapeDtypeStruct` pytrees) and, optionally, the
function it differentiates with its arguments, for autodiff's residuals. Each
technique calls ``FUNCTION`` with keyword arguments, its options (listed by
``lowmem-jax report --help``), e.g. ``FUNCTION(lowmem=lm.lowmem)`` for a step
that differentiates ``lowmem(loss_fn)``: ``lm.lowmem`` of a whole step would
not do, the step's jaxpr already holds the backward pass. A technique whose
options ``FUNCTION`` does not take is not measured, and the output says so;
``plan`` walks the reference models' ladder in the step's terms and prints the
call of ``FUNCTION`` that fits.
"""

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import itertools
import json
import os
import re
import sys
import traceback
from typing import Callable

import jax
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lowmem_jax import models
from lowmem_jax.app import fits, measurement, step_options, techniques
from lowmem_jax.app.job import Job
from lowmem_jax.compile import memory, targets

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


# JAX indexes in int32 without jax_enable_x64: a batch of more positions than this fails to
# compile (a wrapped dimension) or aborts the process in XLA.
MAX_POSITIONS = 2**31 - 1


class UsageError(Exception):
  """A mistake in the command line: reported in one line, exit status 2."""


def parse_bytes(text: str) -> int:
  """``"24GiB"`` -> 25769803776; units B, KB, MB, GB, TB (powers of 10), KiB, MiB, GiB, TiB,
  one of them required."""
  m = re.fullmatch(r"\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-z]*)\s*", text)
  if m and float(m.group(1)) <= 0:
    raise UsageError(f"budget {text!r}: a budget must be positive, e.g. 24GiB.")
  if m and not m.group(2):
    raise UsageError(f"budget {text!r}: give a unit, e.g. {m.group(1)}GiB or {m.group(1)}B.")
  if not m or m.group(2).lower() not in _UNITS:
    raise UsageError(f"budget {text!r}: give a size and a unit such as 24GiB, 500MiB or 16GB "
                     "(units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB).")
  size = float(m.group(1)) * _UNITS[m.group(2).lower()]
  if not 1 <= size < 2**63:
    raise UsageError(f"budget {text!r}: give at least 1B and less than 2^63 bytes.")
  return int(size)


def load_step(spec: str) -> Callable:
  """The function ``spec`` names: ``path/to/file.py:make_step`` (the file's
  folder goes first on sys.path, as for ``python file.py``) or
  ``package.module:make_step`` (imported from sys.path); it must take no
  arguments. `UsageError` naming ``spec`` where there is none."""
  where, _, name = spec.rpartition(":")
  if not where or not name.isidentifier():
    raise UsageError(f"--step {spec}: give FILE.py:FUNCTION or MODULE:FUNCTION, e.g. "
                     "train.py:make_step.")
  if where.endswith(".py") or "/" in where or os.sep in where:
    if not os.path.isfile(where):
      raise UsageError(f"--step {spec}: no file {where}.")
    module_name = "_lowmem_jax_step_" + re.sub(r"\W", "_", os.path.basename(where)[:-3])
    module_spec = importlib.util.spec_from_file_location(module_name, where)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickle look their module up there
    folder = os.path.dirname(os.path.abspath(where))
    if folder not in sys.path:
      sys.path.insert(0, folder)  # for the modules beside it that it imports
    module_spec.loader.exec_module(module)
  else:
    try:
      module = importlib.import_module(where)
    except ModuleNotFoundError as e:
      if e.name is None or not (where == e.name or where.startswith(e.name + ".")):
        raise  # the module exists; something it imports does not
      raise UsageError(f"--step {spec}: no module named {where!r} on sys.path (install it, set "
                       "PYTHONPATH, or give FILE.py:FUNCTION).") from e
  fn = getattr(module, name, None)
  if not callable(fn):
    raise UsageError(f"--step {spec}: {where} has no function {name!r}.")
  try:
    inspect.signature(fn).bind()
  except TypeError as e:
    raise UsageError(f"--step {spec}: {name} must be callable with no arguments ({e}).") from e
  return fn


def check_positions(job: Job) -> None:
  """`UsageError` naming the options where a reference model's batch holds more positions
  (tokens, or an image model's pixels) than `MAX_POSITIONS`: before anything compiles."""
  image = not job.sequences
  positions = job.batch * (job.image_side ** 2 if image else job.seq)
  if positions > MAX_POSITIONS:
    side = f"--image {job.image_side}" if image else f"--seq {job.seq}"
    raise UsageError(f"--batch {job.batch} and {side} make {positions:,} "
                     f"{'pixels' if image else 'tokens'} a step, beyond the 2^31 - 1 positions "
                     "JAX indexes in int32 (without jax_enable_x64): lower them.")


def _check_given(given: tuple[str, ...], job: Job) -> None:
  """`UsageError` where ``given`` (the options given) holds a shape ``job``'s model does not
  take, which would be ignored: --seq of an image model, --image of a sequence model."""
  if "--seq" in given and not job.sequences:
    raise UsageError(f"--seq is for the sequence models (LLaMA, BERT); {job.model} takes "
                     "--image.")
  if "--image" in given and job.sequences:
    raise UsageError(f"--image is for the image models (ViT, WideResNet); {job.model} takes "
                     "--seq.")


def _users_line(error: BaseException) -> str | None:
  """``FILE, line N``: where ``error`` was raised in the user's code (the innermost frame
  outside lowmem_jax and Python's installation), or None where it was not."""
  if isinstance(error, SyntaxError) and error.filename:
    return f"{error.filename}, line {error.lineno}"
  installed = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # lowmem_jax
               sys.prefix, sys.base_prefix, sys.exec_prefix)
  frames = [f for f in traceback.extract_tb(error.__traceback__)
            if not f.filename.startswith((*installed, "<"))]
  return f"{frames[-1].filename}, line {frames[-1].lineno}" if frames else None


def _measure_all(job: Job, sets: list[techniques.TechniqueSet],
                 top: int | None = 10) -> list[memory.Breakdown]:
  """`measurement.measure` of each set, showing its progress."""
  breakdowns = []
  with _progress(len(sets)) as show:
    for i, s in enumerate(sets):
      show(s.label, i)
      breakdowns.append(measurement.measure(job, s, top=top))
  return breakdowns


@contextlib.contextmanager
def _progress(total: int):
  """``show(text, done)`` before each set compiles: a progress bar on a terminal, else a line
  ``[N/TOTAL] compiling TEXT`` on stderr (a line that starts ``lowmem-jax:`` is an error)."""
  console = Console(stderr=True)
  if not console.is_terminal:
    yield lambda text, done: print(f"[{done + 1}/{total}] compiling {text}", file=sys.stderr,
                                   flush=True)
    return
  with Progress(TextColumn("{task.description}"), BarColumn(),
                TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=console,
                transient=True) as progress:
    task = progress.add_task("compiling", total=total)
    yield lambda text, done: progress.update(task, description=f"compiling {text}",
                                             completed=done)


def _workload_title(args, job: Job) -> str:
  target = job.target.name
  if job.make_step is not None:
    return f"{args.step} training step (target {target}, jax {jax.__version__})"
  size = f"{job.seq} tokens" if job.sequences else f"{job.image_side}px images"
  where = (f"FSDP over {job.devices} × {target}, figures per device" if job.devices > 1
           else f"target {target}")
  return (f"{job.model} training step, batch {job.batch} of {size}, {job.dtype} compute "
          f"unless bf16, AdamW unless adama or 8bit ({where}, jax {jax.__version__})")


def _size(nbytes: float) -> str:
  return (f"{nbytes / 2**30:,.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"
          if nbytes >= 2**20 else f"{nbytes / 2**10:,.1f} KiB")


def _summary(rows: list[dict], title: str, job: Job, split: str | None = None) -> Table:
  """The rows' table; ``split``: which rows' breakdowns follow it ("the last row"), if any."""
  unit, scale = ("GiB", 2**30) if max(r["peak_bytes"] for r in rows) >= 2**30 else ("MiB", 2**20)
  host = any(r["host_bytes"] for r in rows)
  shared = any(r["collective_bytes"] for r in rows)
  timed = any(r["step_s"] for r in rows)
  items = (None if job.make_step is not None else job.batch * job.seq if job.sequences
           else job.batch)
  unit_rate = "tokens/s" if job.sequences else "images/s"
  table = Table(title=title, caption="Live at the compiled peak (XLA buffer assignment); "
                "other: the batch, updates and XLA's temporaries"
                + ("" if split is None else f" (split below for {split})")
                + "; gradients and updates are estimated; 0 (none live): no gradient buffer "
                "is live at the peak, as where XLA fuses each gradient into its update; none "
                "found: no argument of the step is parameters or optimizer state (found by "
                "name, params and opt_state, or by type); peak: XLA's memory analysis; × less "
                "and saved: the reference peak over this row's, and the reference peak "
                "less this row's (negative: more), against the baseline (else the first row); "
                "extra FLOPs: likewise, each loop's body counted as many times as the loop runs "
                "(micro-batches, chunks), n/a where a loop runs a number of times not known "
                "when compiling"
                + ("; host: what lives in host memory (offloaded state, saved inputs), beside "
                   "the device's peak" if host else "")
                + ("; step ms: the estimated step time (lowmem_jax.compile.memory.step_time: "
                   "the compiled program's kernels at the target's speeds, as XLA scheduled "
                   f"them), {f'{unit_rate} at that time, ' if items else ''}MFU: the "
                   "baseline's FLOPs over it at the target's bfloat16 peak, bound: what most of "
                   "the time goes to" if timed else "")
                + ("; collectives: the bytes a device's all-gathers, reduce-scatters, "
                   "all-reduces, all-to-alls and collective-permutes produce in a step (each "
                   "loop's body as many times as it runs), floor: their time at the target's "
                   "interconnect bandwidth one way" if shared else ""))
  for column in ("techniques", f"params {unit}", f"optimizer {unit}", f"gradients {unit}",
                 f"activations {unit}", f"other {unit}", f"peak {unit}",
                 *([f"host {unit}"] if host else []), "× less", f"saved {unit}", "extra FLOPs",
                 *(["collectives GiB", "floor ms"] if shared else []),
                 *(["step ms", *([unit_rate] if items else []), "MFU", "bound"] if timed else [])):
    table.add_column(column, justify="left" if column == "techniques" else "right")
  for r in rows:
    sizes = ["none found" if r[k] is None else "0 (none live)" if k == "gradients" and not r[k]
             else f"{r[k] / scale:,.2f}"
             for k in ("parameters", "optimizer_state", "gradients", "activations", "other",
                       "peak_bytes")]
    flops = "n/a" if r["extra_flops"] is None else f"{100 * r['extra_flops']:+.1f}%"
    hosted = [f"{r['host_bytes'] / scale:,.2f}"] if host else []
    moved = [] if not shared else ["n/a", "n/a"] if r["collective_bytes"] is None else [
        f"{r['collective_bytes'] / 2**30:,.2f}",
        "n/a" if r["transfer_floor_s"] is None else f"{1e3 * r['transfer_floor_s']:,.1f}"]
    seconds = r["step_s"]
    timing = [] if not timed else ["n/a"] * (3 + bool(items)) if not seconds else [
        f"{1e3 * seconds:,.1f}", *([f"{items / seconds:,.0f}"] if items else []),
        "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.0f}%", r["bound"]]
    table.add_row(r["techniques"], *sizes, *hosted, f"{r['reduction']:.2f}",
                  f"{r['peak_saved_bytes'] / scale:,.2f}", flops, *moved, *timing)
  return table


def report(args, job: Job, console: Console) -> int:
  texts = args.techniques.split(",") if args.techniques is not None else job.default_sets()
  sets = [techniques.parse(t, step=job.make_step is not None) for t in texts]
  left_out = [] if job.make_step is None or args.techniques is not None else _left_out(
      job, [term for t in step_options.STEP_DEFAULT.split(",")
            for term in job.without_missing(t)[1]])
  for s in sets:
    measurement.check(job, s)
  if args.plot:
    try:
      os.makedirs(args.plot, exist_ok=True)
    except OSError as e:
      raise UsageError(f"--plot {args.plot}: {e.strerror}.") from e
  breakdowns = _measure_all(job, sets, top=args.top)
  base = next((b for b in breakdowns if b.label == "baseline"), breakdowns[0])
  rows = [measurement.row(b, base, s) for b, s in zip(breakdowns, sets)]
  if args.plot:
    try:
      breakdowns[0].plot(os.path.join(args.plot, "components.png"), *breakdowns[1:])
      breakdowns[0].plot_live_bytes(os.path.join(args.plot, "live_bytes.png"), *breakdowns[1:])
    except (ImportError, OSError) as e:
      raise UsageError(f"--plot: {e}") from e
  target = job.target
  if args.json:
    workload = ({"step": args.step} if job.make_step is not None else
                {"model": job.model, "batch": job.batch,  # the shape the model takes, else None
                 "seq": job.seq if job.sequences else None,
                 "image": None if job.sequences else job.image_side,
                 "dtype": job.dtype, "devices": job.devices})
    out = {**workload, "target": target.name, "device_kind": target.device_kind,
           "target_note": target.note, "jax": jax.__version__,
           **({"left_out": left_out[0]} if left_out else {}),
           "rows": [{**r, "breakdown": b.to_dict()} for r, b in zip(rows, breakdowns)]}
    console.print_json(json.dumps(out))
    return 0
  console.print(_summary(rows, _workload_title(args, job), job,
                         "each row" if args.details else "the last row"))
  if left_out:
    console.print(left_out[1], highlight=False, soft_wrap=True)
  if target.platform == "cpu" and job.make_step is None and (
      job.dtype != "float32" or any("bf16" in s for s in sets)):
    console.print("On CPU, XLA computes 16-bit dots in float32 and keeps float32 copies of "
                  "16-bit arrays as temporaries, which an accelerator does not: compare the "
                  "techniques in float32 here.", highlight=False)
  for b in breakdowns if args.details else breakdowns[-1:]:
    console.print(str(b), highlight=False)  # it begins with the target's note
  if args.plot:
    console.print(f"plots: {args.plot}/components.png, {args.plot}/live_bytes.png")
  return 0


def _left_out(job: Job, terms: list[str]) -> tuple[list[str], str] | tuple[()]:
  """``(techniques, one line saying so)`` of the techniques ``terms`` names that were left
  out because ``make_step`` takes not their options; ``()`` where none was."""
  names = list(dict.fromkeys(t.partition(":")[0] for t in terms))
  if not names:
    return ()
  name = getattr(job.make_step, "__name__", "make_step")
  missing = job.missing_keywords(techniques.TechniqueSet("+".join(names), tuple(
      (n, True) for n in names)))
  return names, (f"left out: {', '.join(names)} ({name} takes no {', '.join(missing)} "
                 "argument; see lowmem-jax report --help)")


def plan(args, job: Job, console: Console) -> int:
  budget = parse_bytes(args.budget)
  sets, _ = fits.ladder_of(job)
  with _progress(len(sets)) as show:
    fit = fits.cheapest_fit(job, budget, lambda text: show(text, sets.index(text)),
                            objective=args.objective)
  if not fit.tried and fit.fixed_bytes > budget:
    print(f"lowmem-jax: nothing fits {_size(budget)}: the parameters and optimizer state on "
          f"the device alone take {_size(fit.fixed_bytes)} at the least (8-bit moments, "
          "bfloat16 parameters, the state on the host).", file=sys.stderr)
    return 1
  for text, nbytes in fit.skipped:
    console.print(f"skipped without compiling: {text} (its arguments on the device alone take "
                  f"{_size(nbytes)})", highlight=False)
  for text in fit.unplanned:
    console.print(f"no remat policy fits {_size(budget)}: {text} (its policies compiled, "
                  "not in the table)", highlight=False)
  left_out = _left_out(job, list(fit.not_taken))
  if left_out:
    console.print(left_out[1], highlight=False, soft_wrap=True)
  if not fit.tried:
    print(f"lowmem-jax: nothing fits {_size(budget)}: the sets whose arguments fit it take "
          "remat:plan, and no remat policy fits.", file=sys.stderr)
    return 1
  if fit.fits is None:
    smallest = min((b for b, _ in fit.tried), key=lambda b: b.stats.peak_bytes)
    lower = "Lower the step's batch" if job.make_step is not None else "Lower --batch or --seq"
    print(f"lowmem-jax: nothing fits {_size(budget)}: the smallest compiled peak is "
          f"{_size(smallest.stats.peak_bytes)}, with {smallest.label}. {lower}.",
          file=sys.stderr)
    return 1
  base = fit.tried[0][0]
  console.print(_summary([measurement.row(b, base, s) for b, s in fit.tried],
                         f"{_workload_title(args, job)}: tried, cheapest first", job))
  console.print(job.target.note, highlight=False)
  chosen = next(b for b, s in fit.tried if s is fit.fits)
  console.print(f"Fits {_size(budget)}: {fit.fits.label} ({_size(chosen.stats.peak_bytes)} "
                f"compiled peak{_timed(chosen)}). {_why(fit, chosen)}In Python:",
                highlight=False)
  if not fit.fits.exact:
    console.print(f"No exact set fits {_size(budget)}; this one is approximate: " + "; ".join(
        f"{t}, {techniques.TECHNIQUES[t].summary}" for t in fit.fits.approximate) + ".",
        highlight=False, soft_wrap=True)
  console.print(fit.fits.python(job), highlight=False, markup=False, soft_wrap=True)
  return 0


def _timed(b: memory.Breakdown) -> str:
  return f", {1e3 * b.step_time.seconds:,.1f} ms a step estimated" if b.step_time else ""


def _why(fit: fits.Fit, chosen: memory.Breakdown) -> str:
  """A sentence on why ``plan`` picked ``chosen`` of the sets that fit."""
  fitting = fit.fitting
  if fit.objective == "memory":
    return "The first in the ladder that fits (--objective memory). "
  if chosen.step_time is None:
    return (f"No step-time estimate for target {chosen.target.name}: the first of "
            f"{len(fitting)} that fit. ")
  first = fitting[0][0]
  if first is chosen:
    return (f"The fastest of {len(fitting)} sets that fit, and the first that fits "
            "(--objective memory would pick it too). ")
  return (f"The fastest of {len(fitting)} sets that fit by the estimated step time; the first "
          f"that fits, {first.label}, takes {_size(first.stats.peak_bytes)}{_timed(first)}. ")


def _target(text: str | None) -> targets.Target:
  """The `targets.Target` of ``--target``: a name, a config file, or None for the default."""
  try:
    if text is not None and text.endswith(".txtpb"):
      return targets.load(text)
    target = targets.resolve(text)
    if target.deviceless:
      target.devices()  # fails here, in one line, where the target packages are missing
    return target
  except (ValueError, OSError, targets.TargetUnavailable) as e:
    raise UsageError(f"--target {text}: {e}") from e


def _job(args, target: targets.Target) -> Job:
  """The `Job` of the options; its checks' errors name the option (``--batch``)."""
  step = load_step(args.step) if args.step is not None else None
  try:
    return Job(args.model, args.batch, args.seq, args.image, args.dtype, target, step,
               args.devices)
  except techniques.TechniqueError as e:
    if e.field is None:
      raise
    # The fields by their options: "batch 3 ... devices=2" reads "--batch 3 ... --devices 2".
    raise UsageError(re.sub(r"(?<![-\w])(model|batch|seq|image|dtype|devices)(=| (?=\d|must))",
                            r"--\1 ", str(e))) from e


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    raise UsageError(message)


class _Given(argparse.Action):
  """Stores the value and records the option in ``given``: a default is not given."""

  def __call__(self, parser, namespace, values, option_string=None):
    setattr(namespace, self.dest, values)
    namespace.given = (*namespace.given, option_string)


def _parser() -> argparse.ArgumentParser:
  parser = _Parser(prog="lowmem-jax", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
  described = "\n".join(t.help() for t in techniques.TECHNIQUES.values())
  rep = sub.add_parser("report", help="memory of a training step (a reference model's or yours: "
                       "--step), per technique set",
                       description="techniques (those not marked [approximate] train as the "
                       "plain step does, up to rounding; plan tries them first):\n"
                       f"{described}\n\nwith --step: "
                       f"{', '.join(step_options.STEP_TECHNIQUES)} (default "
                       f"{step_options.STEP_DEFAULT}, each where make_step takes its options). "
                       "Each technique calls make_step with its options, these keyword "
                       "arguments, which make_step must give the defaults shown; one it does "
                       f"not take leaves its techniques unmeasured:\n{step_options.step_help()}",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
  pl = sub.add_parser("plan", help="the cheapest technique set whose step fits a memory budget",
                      description="Tries the exact sets (training as the plain step's up "
                      "to rounding) and, only where none fits, the approximate ones (approx: "
                      f"ReGELU2/ReSiLU2), cheapest first: {', '.join(fits.ladder(8))}, "
                      "...; with --step: "
                      f"{', '.join(fits.ladder(None, step=True))} (see lowmem-jax report "
                      "--help for make_step's options)")
  for p in (rep, pl):
    p.set_defaults(given=())
    # The plan's ladder is the transformers' (ms-norm, attention).
    p.add_argument("--model", default="vit-b16", action=_Given,
                   choices=models.NAMES if p is rep else
                   [n for n in models.NAMES if n not in models.WRN_CONFIGS])
    p.add_argument("--batch", type=int, default=64, action=_Given,
                   help="examples per step (default 64)")
    p.add_argument("--seq", type=int, default=512, action=_Given,
                   help="tokens per example (LLaMA, BERT; default 512)")
    p.add_argument("--image", type=int, default=None, action=_Given,
                   help="image side in pixels (ViT: default 224; wrn-28-2: default 32)")
    if p is pl:
      p.add_argument("--objective", default="time", choices=fits.OBJECTIVES,
                     help="of the sets that fit, pick the fastest by the estimated step time "
                     "(time, the default: every exact set is compiled), or the first in the ladder "
                     "(memory: up to the first that fits)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   action=_Given,
                   help="compute dtype without the bf16 technique; parameters stay float32")
    p.add_argument("--step", metavar="SPEC",
                   help="your own step instead of --model: FILE.py:FUNCTION or "
                        "MODULE:FUNCTION, where "
                        "FUNCTION() returns (step, args) or (step, args, (loss_fn, loss_args)); "
                        "each technique calls FUNCTION with its options, e.g. FUNCTION(lowmem="
                        "...) for lowmem (see lowmem-jax report --help)")
    p.add_argument("--verbose", action="store_true",
                   help="an error raised in your step (--step) with its traceback, not in one line")
    p.add_argument("--devices", type=int, default=1, action=_Given,
                   help="GPUs of the target the step runs on (default 1): parameters and "
                        "optimizer state FSDP-sharded over them, the batch split; every figure "
                        "is one device's")
    p.add_argument("--target", default=None, metavar="NAME",
                   help=f"what to compile for: {', '.join(targets.names())}, attached (this "
                        "process's devices) or a config file (.txtpb); default: this process's "
                        "GPU, else h100 where the target packages are installed, else cpu")
  rep.add_argument("--techniques",
                   help=f"comma list of technique sets (default {techniques.DEFAULT}; with --step "
                        f"{step_options.STEP_DEFAULT})")
  rep.add_argument("--top", type=int, default=10, help="largest live buffers to list (default 10)")
  rep.add_argument("--details", action="store_true",
                   help="the full breakdown of every technique set, not only the last")
  rep.add_argument("--json", action="store_true", help="print JSON instead of tables")
  rep.add_argument("--plot", metavar="DIR",
                   help="write DIR/components.png and DIR/live_bytes.png (needs matplotlib)")
  pl.add_argument("--budget", required=True, help="memory for the step, e.g. 24GiB, 80GB")
  return parser


def main(argv=None, *, quiet_plugin_load: Callable[[], contextlib.AbstractContextManager] =
         contextlib.nullcontext) -> int:
  """Runs ``lowmem-jax``; returns the exit status (2 for a usage mistake or an error raised
  in the user's step, said in one line, 1 when nothing fits the budget).

  ``quiet_plugin_load`` makes the context the GPU target's plugin loads in: the console
  script (`lowmem_jax_cli.main`) gives its filter of CUDA's notes."""
  console = Console(width=None if sys.stdout.isatty() else 200, markup=False)
  argv = sys.argv[1:] if argv is None else list(argv)
  args = None
  try:
    for flag, value in itertools.pairwise(argv):
      if flag == "--budget" and value.startswith("-"):  # argparse would take it for an option
        parse_bytes(value)
    args = _parser().parse_args(argv)
    if getattr(args, "top", 0) < 0:
      raise UsageError(f"--top must be >= 0, got {args.top}.")
    if args.step is not None and args.given:
      raise UsageError(f"{args.given[0]} is for the reference models; --step {args.step} gives its "
                       "own step and shapes.")
    with quiet_plugin_load():  # the GPU target's plugin loads here
      target = _target(args.target)
    job = _job(args, target)
    if job.make_step is None:
      _check_given(args.given, job)
      check_positions(job)
    return (report if args.command == "report" else plan)(args, job, console)
  except UsageError as e:
    print(f"lowmem-jax: error: {e}", file=sys.stderr)
    return 2
  except techniques.TechniqueError as e:
    step = f"--step {args.step}: " if args.step is not None else ""
    print(f"lowmem-jax: error: {step}{e}", file=sys.stderr)
    return 2
  except Exception as e:
    # A step of the user's: an error raised in its code, or tracing it on its arguments
    # (`measurement.StepError`), in one line; any other is the library's own.
    traced = isinstance(e, measurement.StepError)
    where = (_users_line(e.__cause__ if traced else e) if args is not None
             and args.step is not None else None)
    if (where is None and not traced) or args.verbose:
      raise
    message = str(e) if traced else f"{type(e).__name__}: {str(e).strip().partition(chr(10))[0]}"
    print(f"lowmem-jax: error: --step {args.step}: {message} ("
          f"{'' if where is None else f'{where}; '}--verbose for the traceback)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
