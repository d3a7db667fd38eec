"""The ``lowmem-jax`` command: where the memory of a reference model's training step goes.

    lowmem-jax report                          # ViT-B/16 at batch 64: baseline, each technique, all
    lowmem-jax report --model llama-1b --batch 8 --seq 2048 --techniques baseline,all,all+remat:full
    lowmem-jax plan --model llama-7b --batch 8 --seq 2048 --budget 24GiB

A technique set joins techniques with "+"; ``--techniques`` takes a comma list
of sets, one table row each. Every figure comes from XLA's compilation of the
training step (AdamW, parameters and optimizer state donated) on abstract
shapes for ``--target``: by default the GPU this process runs on, else an H100
compiled for here without one (``pip install 'lowmem-jax[target]'``), else the
CPU as a labelled proxy. Nothing is allocated, so a 7B model is reported on a
laptop CPU (see docs/report.md).
"""

import argparse
import dataclasses
import json
import os
import re
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lowmem_jax import memory, models, optim, planner, policies, targets

TECHNIQUES = {
    "baseline": "plain JAX/Flax: exact GELU/SiLU, LayerNorm/RMSNorm, attention keeping its "
                "probabilities, AdamW",
    "approx": "ReGELU2/ReSiLU2: 2-bit activation residuals (an approximate gradient)",
    "ms-norm": "memory-sharing norms: the norm keeps only its output and 1/sigma",
    "attention": "attention that keeps no L×L residual (lowmem_jax.attention)",
    "bf16": "bfloat16 compute; parameters and optimizer state stay float32",
    "remat:<policy>": "nn.remat of every block with lowmem_jax.policies.<policy>, one of "
                      + ", ".join(policies.READY_MADE),
    "adama:<k>": "AdamA over k micro-batches of the batch (lowmem_jax.adamaw, microbatch_step)",
    "all": "approx+ms-norm+attention+bf16",
}
DEFAULT_TECHNIQUES = "baseline,approx,ms-norm,attention,approx+ms-norm+attention,bf16,all"
LEARNING_RATE = 1e-3
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class UsageError(Exception):
  """A mistake in the command line: reported in one line, exit status 2."""


@dataclasses.dataclass(frozen=True)
class Setting:
  """One technique set: the reference model's switches and the optimizer."""
  label: str
  approx: bool = False
  ms_norm: bool = False
  attention: bool = False
  bf16: bool = False
  remat: Callable | None = None
  adama: int = 1

  def workload(self, args) -> models.Workload:
    return models.workload(
        args.model, batch=args.batch, seq=args.seq, image=args.image,
        dtype=jnp.bfloat16 if self.bf16 else jnp.dtype(args.dtype),
        activation="approx" if self.approx else "exact", norm="ms" if self.ms_norm else "plain",
        attention="recompute" if self.attention else "plain",
        remat=self.remat is not None, remat_policy=self.remat)

  def optimizer(self) -> optax.GradientTransformation:
    if self.adama > 1:
      return optim.adamaw(LEARNING_RATE, self.adama)
    return optax.adamw(LEARNING_RATE)

  def python(self, args) -> str:
    """The lines that build this training step."""
    switches = [f"batch={args.batch}"]
    if args.model in models.VIT_CONFIGS:
      switches.append(f"image={args.image}")
    else:
      switches.append(f"seq={args.seq}")
    dtype = "bfloat16" if self.bf16 else args.dtype
    switches.append(f"dtype=jnp.{dtype}")
    if self.approx:
      switches.append('activation="approx"')
    if self.ms_norm:
      switches.append('norm="ms"')
    if self.attention:
      switches.append('attention="recompute"')
    if self.remat is not None:
      switches.append(f"remat=True, remat_policy=lm.policies.{policies.describe(self.remat)}")
    tx = (f"lm.adamaw({LEARNING_RATE}, k={self.adama})" if self.adama > 1
          else f"optax.adamw({LEARNING_RATE})")
    k = f", k={self.adama}" if self.adama > 1 else ""
    return "\n".join([
        "import jax, jax.numpy as jnp, optax, lowmem_jax as lm",
        f'wl = lm.models.workload("{args.model}", {", ".join(switches)})',
        f"tx = {tx}",
        f"step = jax.jit(wl.train_step(tx{k}), donate_argnums=(0, 1))",
    ])


def parse_setting(text: str) -> Setting:
  """A `Setting` from ``"all+remat:full+adama:4"``; `UsageError` on a mistake."""
  fields = {}
  for term in text.strip().split("+"):
    name, _, value = term.strip().partition(":")
    if name == "baseline" and not value:
      continue
    if name == "all" and not value:
      fields.update(approx=True, ms_norm=True, attention=True, bf16=True)
    elif name in ("approx", "ms-norm", "attention", "bf16") and not value:
      fields[name.replace("-", "_")] = True
    elif name == "remat":
      if value not in policies.READY_MADE:
        raise UsageError(f"remat:{value}: the policy must be one of {', '.join(policies.READY_MADE)}.")
      fields["remat"] = policies.READY_MADE[value]
    elif name == "adama":
      if not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
        raise UsageError(f"adama:{value}: k must be a positive integer, e.g. adama:4.")
      fields["adama"] = int(value)
    else:
      raise UsageError(f"unknown technique {term.strip()!r} in {text!r}; choose from "
                       f"{', '.join(TECHNIQUES)}.")
  return Setting(label=text.strip(), **fields)


def parse_bytes(text: str) -> int:
  """``"24GiB"`` -> 25769803776; units B, KB, MB, GB, TB (powers of 10), KiB, MiB, GiB, TiB."""
  m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
  if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
    raise UsageError(f"budget {text!r}: give a positive size such as 24GiB, 500MiB or 16GB.")
  return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def measure(args, setting: Setting, top: int | None = 10) -> memory.Breakdown:
  """The `memory.Breakdown` of ``setting``'s training step, with its residuals."""
  wl = setting.workload(args)
  k = setting.adama
  if args.batch % k:
    raise UsageError(f"adama:{k}: the batch ({args.batch}) must split into {k} equal micro-batches.")
  tx = setting.optimizer()
  params = wl.abstract_params()
  batch = (wl.inputs, wl.labels)
  micro = [jax.ShapeDtypeStruct((x.shape[0] // k, *x.shape[1:]), x.dtype) for x in batch]
  step = jax.jit(wl.train_step(tx, k), donate_argnums=(0, 1))
  return memory.report(step, params, jax.eval_shape(tx.init, params), batch,
                       loss_fn=wl.loss, loss_args=(params, *micro), label=setting.label, top=top,
                       target=args.target)


def row(b: memory.Breakdown, base: memory.Breakdown, setting: Setting) -> dict:
  """The summary figures of one technique set against ``base``."""
  at = b.at_peak
  return {
      "techniques": b.label,
      "parameters": at["parameters"],
      "optimizer_state": at["optimizer state"],
      "gradients": at["gradients"],
      "activations": at["activations"],
      "other": at["inputs"] + at["updates"] + at["temporaries"],
      "live_peak_bytes": b.live_peak_bytes,
      "peak_bytes": b.stats.peak_bytes,
      "reduction": base.stats.peak_bytes / b.stats.peak_bytes,
      # XLA's cost analysis counts a loop body once: a micro-batch scan's FLOPs are per micro-batch.
      "extra_flops": (b.flops - base.flops) / base.flops if setting.adama == 1 else None,
      "saved_activation_bytes": b.saved.activation_bytes,
  }


def _progress(console: Console) -> Progress:
  return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal)


def _workload_title(args) -> str:
  size = f"{args.image}px images" if args.model in models.VIT_CONFIGS else f"{args.seq} tokens"
  return (f"{args.model} training step, batch {args.batch} of {size}, {args.dtype} compute "
          f"unless bf16, AdamW (target {args.target.name}, jax {jax.__version__})")


def _size(nbytes: float) -> str:
  return f"{nbytes / 2**30:,.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


def _summary(rows: list[dict], title: str) -> Table:
  unit, scale = ("GiB", 2**30) if max(r["peak_bytes"] for r in rows) >= 2**30 else ("MiB", 2**20)
  table = Table(title=title, caption=f"{unit} live at the compiled peak (XLA buffer assignment); "
                "gradients and other (updates) are estimated; peak: XLA's memory analysis; saved: "
                "autodiff's residuals of the loss; extra FLOPs: n/a for a micro-batch loop, whose "
                "body XLA counts once")
  for column in ("techniques", "params", "optimizer", "gradients", "activations", "other",
                 "peak", "× less", "extra FLOPs", "saved"):
    table.add_column(column, justify="left" if column == "techniques" else "right")
  for r in rows:
    sizes = [f"{r[k] / scale:,.2f}" for k in ("parameters", "optimizer_state", "gradients",
                                              "activations", "other", "peak_bytes")]
    flops = "n/a" if r["extra_flops"] is None else f"{100 * r['extra_flops']:+.1f}%"
    table.add_row(r["techniques"], *sizes, f"{r['reduction']:.2f}", flops,
                  f"{r['saved_activation_bytes'] / scale:,.2f}")
  return table


def report(args, console: Console) -> int:
  settings = [parse_setting(t) for t in args.techniques.split(",")]
  if args.plot:
    try:
      os.makedirs(args.plot, exist_ok=True)
    except OSError as e:
      raise UsageError(f"--plot {args.plot}: {e.strerror}.") from e
  breakdowns = []
  with _progress(Console(stderr=True)) as progress:
    task = progress.add_task("compiling", total=len(settings))
    for s in settings:
      progress.update(task, description=f"compiling {s.label}")
      breakdowns.append(measure(args, s, top=args.top))
      progress.advance(task)
  base = next((b for b in breakdowns if b.label == "baseline"), breakdowns[0])
  rows = [row(b, base, s) for b, s in zip(breakdowns, settings)]
  if args.plot:
    try:
      breakdowns[0].plot(os.path.join(args.plot, "components.png"), *breakdowns[1:])
      breakdowns[0].plot_live_bytes(os.path.join(args.plot, "live_bytes.png"), *breakdowns[1:])
    except (ImportError, OSError) as e:
      raise UsageError(f"--plot: {e}") from e
  if args.json:
    out = {"model": args.model, "batch": args.batch, "seq": args.seq, "image": args.image,
           "dtype": args.dtype, "target": args.target.name,
           "device_kind": args.target.device_kind, "target_note": args.target.note,
           "jax": jax.__version__,
           "rows": [{**r, "breakdown": b.to_dict()} for r, b in zip(rows, breakdowns)]}
    console.print_json(json.dumps(out))
    return 0
  console.print(_summary(rows, _workload_title(args)))
  console.print(args.target.note, highlight=False)
  if args.target.platform == "cpu" and (args.dtype != "float32" or any(s.bf16 for s in settings)):
    console.print("On CPU, XLA computes 16-bit dots in float32 and keeps float32 copies of "
                  "16-bit arrays as temporaries, which an accelerator does not: compare the "
                  "techniques in float32 here.", highlight=False)
  for b in breakdowns if args.details else breakdowns[-1:]:
    console.print(str(b), highlight=False)
  if args.plot:
    console.print(f"plots: {args.plot}/components.png, {args.plot}/live_bytes.png")
  return 0


def ladder(batch: int) -> list[str]:
  """Technique sets `plan` tries, cheapest first: exact techniques, then an
  approximate gradient, then recompute (``remat:plan``: `lowmem_jax.plan`'s
  policy), then micro-batches with full remat."""
  sets = ["baseline", "bf16", "bf16+ms-norm+attention", "all", "all+remat:plan"]
  k = 2
  while k <= batch:
    if batch % k == 0:
      sets.append(f"all+remat:full+adama:{k}")
    k *= 2
  return sets


def plan(args, console: Console) -> int:
  budget = parse_bytes(args.budget)
  wl = parse_setting("baseline").workload(args)
  params = wl.abstract_params()
  fixed = memory.tree_bytes((params, jax.eval_shape(optax.adamw(LEARNING_RATE).init, params)))
  if fixed > budget:
    print(f"lowmem-jax: nothing fits {_size(budget)}: the float32 parameters and AdamW state "
          f"alone take {_size(fixed)}.", file=sys.stderr)
    return 1
  tried = []
  with _progress(Console(stderr=True)) as progress:
    sets = ladder(args.batch)
    task = progress.add_task("compiling", total=len(sets))
    for text in sets:
      progress.update(task, description=f"compiling {text}")
      setting = _planned(args, text, budget)
      if setting is not None:
        b = measure(args, setting)
        tried.append((b, setting))
        if b.stats.peak_bytes <= budget:
          break
      progress.advance(task)
    else:
      smallest, _ = min(tried, key=lambda t: t[0].stats.peak_bytes)
      print(f"lowmem-jax: nothing fits {_size(budget)}: the smallest compiled peak is "
            f"{_size(smallest.stats.peak_bytes)}, with {smallest.label}. Lower --batch or --seq.",
            file=sys.stderr)
      return 1
  rows = [row(t, tried[0][0], s) for t, s in tried]
  console.print(_summary(rows, f"{_workload_title(args)}: tried, cheapest first"))
  console.print(args.target.note, highlight=False)
  console.print(f"Fits {_size(budget)}: {setting.label} ({_size(b.stats.peak_bytes)} "
                "compiled peak). In Python:", highlight=False)
  console.print(setting.python(args), highlight=False, markup=False)
  return 0


def _planned(args, text: str, budget: int) -> Setting | None:
  """The setting ``text``; for ``remat:plan`` the policy `lowmem_jax.plan` picks,
  or None where no policy fits."""
  if "remat:plan" not in text:
    return parse_setting(text)
  setting = parse_setting(text.replace("+remat:plan", ""))
  wl = setting.workload(args)
  params = wl.abstract_params()
  tx = setting.optimizer()
  batch = (wl.inputs, wl.labels)

  def step(params, opt_state, batch, *, policy):
    return wl.with_policy(policy).train_step(tx)(params, opt_state, batch)
  try:
    chosen = planner.plan(step, params, jax.eval_shape(tx.init, params), batch, budget=budget,
                          donate_argnums=(0, 1), target=args.target)
  except planner.BudgetError:
    return None
  return dataclasses.replace(setting, label=f"{setting.label}+remat:{policies.describe(chosen.policy)}",
                             remat=chosen.policy)


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


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
  parser = _Parser(prog="lowmem-jax", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
  techniques = "\n".join(f"  {name:<15} {text}" for name, text in TECHNIQUES.items())
  rep = sub.add_parser("report", help="memory of a reference model's training step, per technique set",
                       description=f"techniques:\n{techniques}",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
  pl = sub.add_parser("plan", help="the cheapest technique set whose step fits a memory budget",
                      description=f"Tries, cheapest first: {', '.join(ladder(8))}, ...")
  for p in (rep, pl):
    # The techniques and the plan's ladder are the transformers' (ms-norm, attention).
    p.add_argument("--model", default="vit-b16",
                   choices=[n for n in models.NAMES if n not in models.WRN_CONFIGS])
    p.add_argument("--batch", type=int, default=64, help="examples per step (default 64)")
    p.add_argument("--seq", type=int, default=512, help="tokens per example (LLaMA; default 512)")
    p.add_argument("--image", type=int, default=224, help="image side in pixels (ViT; default 224)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="compute dtype without the bf16 technique; parameters stay float32")
    p.add_argument("--target", default=None, metavar="NAME",
                   help=f"what to compile for: {', '.join(targets.names())}, attached (this "
                        "process's devices) or a config file (.txtpb); default: this process's "
                        "GPU, else h100 where the target packages are installed, else cpu")
  rep.add_argument("--techniques", default=DEFAULT_TECHNIQUES,
                   help=f"comma list of technique sets (default {DEFAULT_TECHNIQUES})")
  rep.add_argument("--top", type=int, default=10, help="largest live buffers to list (default 10)")
  rep.add_argument("--details", action="store_true",
                   help="the full breakdown of every technique set, not only the last")
  rep.add_argument("--json", action="store_true", help="print JSON instead of tables")
  rep.add_argument("--plot", metavar="DIR",
                   help="write DIR/components.png and DIR/live_bytes.png (needs matplotlib)")
  pl.add_argument("--budget", required=True, help="memory for the step, e.g. 24GiB, 80GB")
  return parser


def main(argv=None) -> int:
  """Runs ``lowmem-jax``; returns the exit status (2 for a usage mistake, 1 when
  nothing fits the budget)."""
  console = Console(width=None if sys.stdout.isatty() else 200)
  try:
    args = _parser().parse_args(argv)
    for name in ("batch", "seq", "image"):
      if getattr(args, name) < 1:
        raise UsageError(f"--{name} must be >= 1, got {getattr(args, name)}.")
    if getattr(args, "top", 0) < 0:
      raise UsageError(f"--top must be >= 0, got {args.top}.")
    args.target = _target(args.target)
    return (report if args.command == "report" else plan)(args, console)
  except UsageError as e:
    print(f"lowmem-jax: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
