"""The ``lowmem-jax`` command: where the memory of a training step goes.

    lowmem-jax report                          # ViT-B/16 at batch 64: baseline, each technique, all
    lowmem-jax report --model llama-1b --batch 8 --seq 2048 --techniques baseline,all,all+remat:full
    lowmem-jax plan --model llama-7b --batch 8 --seq 2048 --budget 24GiB
    lowmem-jax report --step train.py:make_step  # your own step: baseline and lowmem

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
function it differentiates with its arguments, for autodiff's residuals. Its
techniques are ``baseline`` and ``lowmem``: for ``lowmem`` the CLI calls
``FUNCTION(lowmem=lm.lowmem)``, and the step differentiates ``lowmem(loss_fn)``
(a ``lowmem`` argument defaulting to ``lambda f: f``). ``lm.lowmem`` of a
whole step would not do: the step's jaxpr already holds the backward pass.
"""

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lowmem_jax import (lowbit, memory, models, offload, optim, planner, policies, targets,
                        transform)

TECHNIQUES = {
    "baseline": "plain JAX/Flax: exact GELU/SiLU, LayerNorm/RMSNorm, attention keeping its "
                "probabilities, AdamW",
    "approx": "ReGELU2/ReSiLU2: 2-bit activation residuals (an approximate gradient); for "
              "wrn-28-2, ReLU keeping a 1-bit mask (exact)",
    "ms-norm": "memory-sharing norms: the norm keeps only its output and 1/sigma",
    "attention": "attention that keeps no L×L residual (lowmem_jax.attention)",
    "bf16": "bfloat16 compute; parameters and optimizer state stay float32",
    "remat:<policy>": "nn.remat of every block with lowmem_jax.policies.<policy>, one of "
                      + ", ".join(policies.READY_MADE),
    "adama:<k>": "AdamA over k micro-batches of the batch, each micro-batch gradient folded into "
                 "the moments in its backward rule (lowmem_jax.adamaw, microbatch_step("
                 "fold_in_backward=True)); with 8bit, folded in the scan body",
    "8bit": "optimizer moments block-wise in 8 bits (lowmem_jax.scale_by_adam_8bit; with adama, "
            "adamaw(state_bits=8))",
    "bf16-params": "bfloat16 parameters with no float32 copy, each update rounded "
                   "stochastically (lowmem_jax.lowbit.stochastic_rounding); with 8bit",
    "offload-opt": "optimizer state in host memory, brought to the device leaf by leaf "
                   "(lowmem_jax.offload)",
    "conv:<pooled|int8>": "wrn-28-2: convolutions that keep their input 2x2-pooled or in int8 "
                          "(lowmem_jax.compress)",
    "fused-ce": "LLaMA: the head's cross-entropy block by block, no [tokens, vocab] logits "
                "(lowmem_jax.losses.linear_cross_entropy)",
    "all": "approx+ms-norm+attention+bf16",
    "lowmem": "--step only: the step differentiates lm.lowmem(loss_fn) (make_step(lowmem=lm.lowmem)): "
              "GELU/SiLU, norms and attention rewritten",
}
DEFAULT_TECHNIQUES = "baseline,approx,ms-norm,attention,approx+ms-norm+attention,bf16,all"
LANGUAGE_MODEL_TECHNIQUES = ",fused-ce,all+fused-ce"
"""Added to the default techniques for the language models (``fused-ce``)."""
CONV_NET_TECHNIQUES = "baseline,approx,conv:pooled,conv:int8,bf16,approx+conv:int8+bf16"
"""The default techniques for the WideResNet (batch norm, no attention)."""
STEP_TECHNIQUES = ("baseline", "lowmem")
"""The techniques of a user's step (``--step``); the others change a reference model."""
LEARNING_RATE = 1e-3
WEIGHT_DECAY = 1e-4  # optax.adamw's default
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class UsageError(Exception):
  """A mistake in the command line: reported in one line, exit status 2."""


@dataclasses.dataclass(frozen=True)
class Setting:
  """One technique set: the reference model's switches and the optimizer, or
  for a user's step whether it differentiates ``lm.lowmem(loss_fn)``."""
  label: str
  approx: bool = False
  ms_norm: bool = False
  attention: bool = False
  bf16: bool = False
  remat: Callable | None = None
  adama: int = 1
  lowmem: bool = False
  fused_ce: bool = False
  state_bits: int | None = None
  bf16_params: bool = False
  offload_opt: bool = False
  conv: str = "plain"

  def workload(self, args) -> models.Workload:
    if self.fused_ce and not _language_model(args):
      raise UsageError(f"fused-ce in {self.label!r} applies to the LLaMA models (a language "
                       f"model's vocabulary-sized head), not --model {args.model}.")
    if _conv_net(args) and (self.ms_norm or self.attention):
      raise UsageError(f"{self.label!r}: {args.model} has batch norm and no attention; its "
                       f"techniques are {CONV_NET_TECHNIQUES.replace(',', ', ')}.")
    if self.bf16_params and self.state_bits is None:
      raise UsageError(f"{self.label!r}: bf16-params needs 8bit: Adam keeps its moments in the "
                       "parameters' dtype, and a bfloat16 second moment rounded to nearest "
                       "stalls; 8bit keeps them in 8 bits, rounded stochastically.")
    if self.offload_opt and self.adama > 1:
      raise UsageError(f"{self.label!r}: offload-opt does not take adama (AdamA's moments would "
                       "cross to the device every micro-batch); use 8bit for its moments.")
    if self.conv != "plain" and not _conv_net(args):
      raise UsageError(f"conv:{self.conv} in {self.label!r} applies to wrn-28-2, not --model "
                       f"{args.model}.")
    return models.workload(
        args.model, batch=args.batch, seq=args.seq, image=args.image,
        dtype=jnp.bfloat16 if self.bf16 else jnp.dtype(args.dtype),
        param_dtype=jnp.bfloat16 if self.bf16_params else jnp.float32, conv=self.conv,
        activation="approx" if self.approx else "exact", norm="ms" if self.ms_norm else "plain",
        attention="recompute" if self.attention else "plain",
        loss="fused" if self.fused_ce else "plain",
        remat=self.remat is not None, remat_policy=self.remat)

  @property
  def fold_in_backward(self) -> bool:
    """AdamA folds in the backward, except with 8-bit moments (folded in the scan body)."""
    return self.adama > 1 and self.state_bits is None

  def optimizer(self) -> optax.GradientTransformation:
    if self.adama > 1:
      tx = optim.adamaw(LEARNING_RATE, self.adama, state_bits=self.state_bits)
    elif self.state_bits == 8:
      tx = optax.chain(lowbit.scale_by_adam_8bit(), optax.add_decayed_weights(WEIGHT_DECAY),
                       optax.scale_by_learning_rate(LEARNING_RATE))
    else:
      tx = optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    if self.offload_opt:
      tx = offload.offload(tx)
    if self.bf16_params:
      tx = optax.chain(tx, lowbit.stochastic_rounding())
    return tx

  def python(self, args) -> str:
    """The lines that build this training step."""
    switches = [f"batch={args.batch}"]
    if args.model in models.VIT_CONFIGS or _conv_net(args):
      switches.append(f"image={args.image}")
    else:
      switches.append(f"seq={args.seq}")
    dtype = "bfloat16" if self.bf16 else args.dtype
    switches.append(f"dtype=jnp.{dtype}")
    if self.bf16_params:
      switches.append("param_dtype=jnp.bfloat16")
    if self.conv != "plain":
      switches.append(f'conv="{self.conv}"')
    if self.approx:
      switches.append('activation="approx"')
    if self.ms_norm:
      switches.append('norm="ms"')
    if self.attention:
      switches.append('attention="recompute"')
    if self.fused_ce:
      switches.append('loss="fused"')
    if self.remat is not None:
      switches.append(f"remat=True, remat_policy=lm.policies.{policies.describe(self.remat)}")
    bits = ", state_bits=8" if self.state_bits == 8 else ""
    if self.adama > 1:
      tx = f"lm.adamaw({LEARNING_RATE}, k={self.adama}{bits})"
    elif self.state_bits == 8:
      tx = (f"optax.chain(lm.scale_by_adam_8bit(), optax.add_decayed_weights({WEIGHT_DECAY}), "
            f"optax.scale_by_learning_rate({LEARNING_RATE}))")
    else:
      tx = f"optax.adamw({LEARNING_RATE}, weight_decay={WEIGHT_DECAY})"
    if self.offload_opt:
      tx = f"lm.offload.offload({tx})"
    if self.bf16_params:
      tx = f"optax.chain({tx}, lm.lowbit.stochastic_rounding())"
    k = f", k={self.adama}" if self.adama > 1 else ""
    fold = ", fold_in_backward=True" if self.fold_in_backward else ""
    return "\n".join([
        "import jax, jax.numpy as jnp, optax, lowmem_jax as lm",
        f'wl = lm.models.workload("{args.model}", {", ".join(switches)})',
        f"tx = {tx}",
        f"step = jax.jit(wl.train_step(tx{k}{fold}), donate_argnums=(0, 1))",
        "params = wl.init(jax.random.key(0))",
        "opt_state = tx.init(params)",
    ])


def parse_setting(text: str, step: bool = False) -> Setting:
  """A `Setting` from ``"all+remat:full+adama:4"``, or for a user's step
  (``step``) from ``"baseline"`` or ``"lowmem"``; `UsageError` on a mistake."""
  fields = {}
  for term in text.strip().split("+"):
    name, _, value = term.strip().partition(":")
    if step and term.strip() not in STEP_TECHNIQUES:
      what = ("applies only to the reference models (--model)"
              if name in ("remat", "adama", "conv") or (name in TECHNIQUES and not value)
              else "is unknown")
      raise UsageError(f"technique {term.strip()!r} in {text!r} {what}; with --step, choose from "
                       f"{', '.join(STEP_TECHNIQUES)}.")
    if name == "baseline" and not value:
      continue
    if name == "lowmem" and not value:
      if not step:
        raise UsageError(f"technique 'lowmem' in {text!r} applies only to --step (a step of your "
                         "own); a reference model takes approx, ms-norm, attention or all.")
      fields["lowmem"] = True
      continue
    if name == "all" and not value:
      fields.update(approx=True, ms_norm=True, attention=True, bf16=True)
    elif name in ("approx", "ms-norm", "attention", "bf16", "fused-ce", "bf16-params",
                  "offload-opt") and not value:
      fields[name.replace("-", "_")] = True
    elif name == "8bit" and not value:
      fields["state_bits"] = 8
    elif name == "conv":
      if value not in ("pooled", "int8"):
        raise UsageError(f"conv:{value}: the convolution must be pooled or int8.")
      fields["conv"] = value
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
  """``"24GiB"`` -> 25769803776; units B, KB, MB, GB, TB (powers of 10), KiB, MiB, GiB, TiB,
  one of them required."""
  m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
  if m and not m.group(2):
    raise UsageError(f"budget {text!r}: give a unit, e.g. {m.group(1)}GiB or {m.group(1)}B.")
  if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
    raise UsageError(f"budget {text!r}: give a positive size such as 24GiB, 500MiB or 16GB.")
  return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


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


def takes_lowmem(make_step: Callable) -> bool:
  """Whether ``make_step`` takes the ``lowmem`` argument that the lowmem technique passes."""
  try:
    inspect.signature(make_step).bind(lowmem=transform.lowmem)
  except TypeError:
    return False
  return True


def _what(x: Any) -> str:
  return f"a {type(x).__name__} of {len(x)}" if isinstance(x, (tuple, list)) else f"a {type(x).__name__}"


def user_step(args, setting: Setting) -> tuple[Callable, tuple, Callable | None, tuple]:
  """``(step, step_args, loss_fn, loss_args)`` of ``--step`` for ``setting``
  (``loss_fn`` None where make_step gives none)."""
  name = args.step.rpartition(":")[2]
  made = args.make_step(lowmem=transform.lowmem) if setting.lowmem else args.make_step()
  said = f"--step {args.step}: {name}() returned"
  if not isinstance(made, (tuple, list)) or len(made) not in (2, 3):
    raise UsageError(f"{said} {_what(made)}; expected (step, args) or "
                     "(step, args, (loss_fn, loss_args)).")
  step, step_args, *loss = made
  if not callable(step):
    raise UsageError(f"{said} {_what(step)} as its step; expected a function.")
  if not isinstance(step_args, (tuple, list)):
    raise UsageError(f"{said} {_what(step_args)} as the step's args; expected a tuple of its "
                     "arguments (arrays or jax.ShapeDtypeStruct pytrees).")
  if not loss:
    return step, tuple(step_args), None, ()
  if not (isinstance(loss[0], (tuple, list)) and len(loss[0]) == 2 and callable(loss[0][0])
          and isinstance(loss[0][1], (tuple, list))):
    raise UsageError(f"{said} {_what(loss[0])} as its third element; expected (loss_fn, loss_args), "
                     "loss_args a tuple.")
  return step, tuple(step_args), loss[0][0], tuple(loss[0][1])


def measure(args, setting: Setting, top: int | None = 10) -> memory.Breakdown:
  """The `memory.Breakdown` of ``setting``'s training step, with its residuals."""
  if args.step is not None:
    step, step_args, loss_fn, loss_args = user_step(args, setting)
    return memory.report(step, *step_args, loss_fn=loss_fn, loss_args=loss_args, label=setting.label,
                         top=top, target=args.target)
  wl = setting.workload(args)
  k = setting.adama
  if args.batch % k:
    raise UsageError(f"adama:{k}: the batch ({args.batch}) must split into {k} equal micro-batches.")
  tx = setting.optimizer()
  params = wl.abstract_params()
  batch = (wl.inputs, wl.labels)
  micro = [jax.ShapeDtypeStruct((x.shape[0] // k, *x.shape[1:]), x.dtype) for x in batch]
  step = jax.jit(wl.train_step(tx, k, fold_in_backward=setting.fold_in_backward),
                 donate_argnums=(0, 1))
  return memory.report(step, params, offload.abstract_state(tx, params), batch,
                       loss_fn=wl.loss, loss_args=(params, *micro), label=setting.label, top=top,
                       target=args.target)


def _measure_all(args, settings: list[Setting], top: int | None = 10) -> list[memory.Breakdown]:
  """`measure` of each setting, with a progress bar."""
  breakdowns = []
  with _progress(Console(stderr=True)) as progress:
    task = progress.add_task("compiling", total=len(settings))
    for s in settings:
      progress.update(task, description=f"compiling {s.label}")
      breakdowns.append(measure(args, s, top=top))
      progress.advance(task)
  return breakdowns


def _language_model(args) -> bool:
  """Whether ``--model`` is a language model, whose head ``fused-ce`` rewrites."""
  return args.model in models.llama.CONFIGS


def _conv_net(args) -> bool:
  """Whether ``--model`` is the WideResNet, whose techniques are the conv ones."""
  return args.model in models.WRN_CONFIGS


def _step_techniques(args) -> tuple[str, ...]:
  """The techniques ``--step``'s function allows: lowmem only where it takes ``lowmem``."""
  return STEP_TECHNIQUES if takes_lowmem(args.make_step) else STEP_TECHNIQUES[:1]


def row(b: memory.Breakdown, base: memory.Breakdown, setting: Setting) -> dict:
  """The summary figures of one technique set against ``base``."""
  at = b.at_peak
  found = b.argument_components
  return {
      "techniques": b.label,
      # None: no argument is a parameter (or optimizer state); see memory.COMPONENTS.
      "parameters": at["parameters"] if "parameters" in found else None,
      "optimizer_state": at["optimizer state"] if "optimizer state" in found else None,
      "gradients": at["gradients"],
      "activations": at["activations"],
      "other": at["inputs"] + at["updates"] + at["temporaries"],
      "live_peak_bytes": b.live_peak_bytes,
      "peak_bytes": b.stats.peak_bytes,
      "reduction": base.stats.peak_bytes / b.stats.peak_bytes,
      # XLA's cost analysis counts a loop body once: a micro-batch scan's FLOPs are per
      # micro-batch, fused-ce's per block of logits.
      "extra_flops": ((b.flops - base.flops) / base.flops
                      if setting.adama == 1 and not setting.fused_ce else None),
      "saved_activation_bytes": b.saved.activation_bytes if b.saved else None,
  }


def _progress(console: Console) -> Progress:
  return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal)


def _workload_title(args) -> str:
  if args.step is not None:
    return f"{args.step} training step (target {args.target.name}, jax {jax.__version__})"
  size = (f"{args.image}px images" if args.model in models.VIT_CONFIGS or _conv_net(args)
          else f"{args.seq} tokens")
  return (f"{args.model} training step, batch {args.batch} of {size}, {args.dtype} compute "
          f"unless bf16, AdamW unless adama or 8bit (target {args.target.name}, "
          f"jax {jax.__version__})")


def _size(nbytes: float) -> str:
  return f"{nbytes / 2**30:,.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


def _summary(rows: list[dict], title: str) -> Table:
  unit, scale = ("GiB", 2**30) if max(r["peak_bytes"] for r in rows) >= 2**30 else ("MiB", 2**20)
  table = Table(title=title, caption="Live at the compiled peak (XLA buffer assignment); "
                "gradients and other (updates) are estimated; 0 (none live): no gradient buffer "
                "is live at the peak, as where XLA fuses each gradient into its update; peak: "
                "XLA's memory analysis; saved: autodiff's residuals of the loss (- without one); "
                "extra FLOPs: n/a for loops (micro-batches, fused-ce), whose body XLA counts once; "
                "none found: no argument is one")
  for column in ("techniques", f"params {unit}", f"optimizer {unit}", f"gradients {unit}",
                 f"activations {unit}", f"other {unit}", f"peak {unit}", "× less", "extra FLOPs",
                 f"saved {unit}"):
    table.add_column(column, justify="left" if column == "techniques" else "right")
  for r in rows:
    sizes = ["none found" if r[k] is None else "0 (none live)" if k == "gradients" and not r[k]
             else f"{r[k] / scale:,.2f}"
             for k in ("parameters", "optimizer_state", "gradients", "activations", "other",
                       "peak_bytes")]
    flops = "n/a" if r["extra_flops"] is None else f"{100 * r['extra_flops']:+.1f}%"
    saved = r["saved_activation_bytes"]
    table.add_row(r["techniques"], *sizes, f"{r['reduction']:.2f}", flops,
                  "-" if saved is None else f"{saved / scale:,.2f}")
  return table


def report(args, console: Console) -> int:
  techniques = args.techniques
  if techniques is None:
    techniques = (",".join(_step_techniques(args)) if args.step is not None
                  else DEFAULT_TECHNIQUES + LANGUAGE_MODEL_TECHNIQUES
                  if _language_model(args) else CONV_NET_TECHNIQUES if _conv_net(args)
                  else DEFAULT_TECHNIQUES)
  settings = [parse_setting(t, step=args.step is not None) for t in techniques.split(",")]
  if any(s.lowmem for s in settings) and not takes_lowmem(args.make_step):
    name = args.step.rpartition(":")[2]
    raise UsageError(f"--step {args.step}: lowmem calls {name}(lowmem=lm.lowmem), and {name} takes "
                     f"no lowmem argument: define {name}(lowmem=lambda f: f) and differentiate "
                     "lowmem(loss_fn) in the step.")
  if args.plot:
    try:
      os.makedirs(args.plot, exist_ok=True)
    except OSError as e:
      raise UsageError(f"--plot {args.plot}: {e.strerror}.") from e
  breakdowns = _measure_all(args, settings, top=args.top)
  base = next((b for b in breakdowns if b.label == "baseline"), breakdowns[0])
  rows = [row(b, base, s) for b, s in zip(breakdowns, settings)]
  if args.plot:
    try:
      breakdowns[0].plot(os.path.join(args.plot, "components.png"), *breakdowns[1:])
      breakdowns[0].plot_live_bytes(os.path.join(args.plot, "live_bytes.png"), *breakdowns[1:])
    except (ImportError, OSError) as e:
      raise UsageError(f"--plot: {e}") from e
  if args.json:
    workload = ({"step": args.step} if args.step is not None else
                {"model": args.model, "batch": args.batch, "seq": args.seq, "image": args.image,
                 "dtype": args.dtype})
    out = {**workload, "target": args.target.name,
           "device_kind": args.target.device_kind, "target_note": args.target.note,
           "jax": jax.__version__,
           "rows": [{**r, "breakdown": b.to_dict()} for r, b in zip(rows, breakdowns)]}
    console.print_json(json.dumps(out))
    return 0
  console.print(_summary(rows, _workload_title(args)))
  console.print(args.target.note, highlight=False)
  if args.target.platform == "cpu" and args.step is None and (
      args.dtype != "float32" or any(s.bf16 for s in settings)):
    console.print("On CPU, XLA computes 16-bit dots in float32 and keeps float32 copies of "
                  "16-bit arrays as temporaries, which an accelerator does not: compare the "
                  "techniques in float32 here.", highlight=False)
  for b in breakdowns if args.details else breakdowns[-1:]:
    console.print(str(b), highlight=False)
  if args.plot:
    console.print(f"plots: {args.plot}/components.png, {args.plot}/live_bytes.png")
  return 0


def ladder(batch: int, language_model: bool = False) -> list[str]:
  """Technique sets `plan` tries, cheapest first: exact techniques, then an
  approximate gradient, then recompute (``remat:plan``: `lowmem_jax.plan`'s
  policy), then micro-batches with full remat. A language model's sets all
  take ``fused-ce`` (exact, and the largest single saving), after it alone."""
  sets = ["bf16", "bf16+ms-norm+attention", "all", "all+remat:plan"]
  k = 2
  while k <= batch:
    if batch % k == 0:
      sets.append(f"all+remat:full+adama:{k}")
    k *= 2
  if language_model:
    return ["baseline", "fused-ce"] + [s.replace("all", "all+fused-ce") if s.startswith("all")
                                       else f"{s}+fused-ce" for s in sets]
  return ["baseline"] + sets


def plan(args, console: Console) -> int:
  budget = parse_bytes(args.budget)
  if args.step is not None:
    return _plan_step(args, budget, console)
  wl = parse_setting("baseline").workload(args)
  params = wl.abstract_params()
  fixed = memory.tree_bytes((params, jax.eval_shape(optax.adamw(LEARNING_RATE).init, params)))
  if fixed > budget:
    print(f"lowmem-jax: nothing fits {_size(budget)}: the float32 parameters and AdamW state "
          f"alone take {_size(fixed)}.", file=sys.stderr)
    return 1
  tried = []
  with _progress(Console(stderr=True)) as progress:
    sets = ladder(args.batch, _language_model(args))
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


def _plan_step(args, budget: int, console: Console) -> int:
  """`plan` for ``--step``: whether its baseline and its lowmem step fit ``budget``."""
  texts = _step_techniques(args)
  settings = [parse_setting(text, step=True) for text in texts]
  measured = list(zip(_measure_all(args, settings), settings))
  base = measured[0][0]
  console.print(_summary([row(b, base, s) for b, s in measured],
                         f"{_workload_title(args)}: against {_size(budget)}"))
  console.print(args.target.note, highlight=False)
  for b, _ in measured:
    peak = b.stats.peak_bytes
    verdict = (f"fits with {_size(budget - peak)} to spare" if peak <= budget
               else f"over by {_size(peak - budget)}")
    console.print(f"{b.label}: {_size(peak)} compiled peak, {verdict}.", highlight=False)
  if len(texts) == 1:
    console.print("lowmem: not tried: make_step takes no lowmem argument (see lowmem-jax "
                  "report --help).", highlight=False)
  fits = [b for b, _ in measured if b.stats.peak_bytes <= budget]
  if not fits:
    smallest = min((b for b, _ in measured), key=lambda b: b.stats.peak_bytes)
    print(f"lowmem-jax: nothing fits {_size(budget)}: the smallest compiled peak is "
          f"{_size(smallest.stats.peak_bytes)}, with {smallest.label}.", file=sys.stderr)
    return 1
  console.print(f"Fits {_size(budget)}: {fits[0].label} ({_size(fits[0].stats.peak_bytes)} "
                "compiled peak).", highlight=False)
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


class _Given(argparse.Action):
  """Stores the value and records the option in ``given``: a default is not given."""

  def __call__(self, parser, namespace, values, option_string=None):
    setattr(namespace, self.dest, values)
    namespace.given = (*namespace.given, option_string)


def _parser() -> argparse.ArgumentParser:
  parser = _Parser(prog="lowmem-jax", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
  techniques = "\n".join(f"  {name:<15} {text}" for name, text in TECHNIQUES.items())
  rep = sub.add_parser("report", help="memory of a training step (a reference model's or yours: "
                       "--step), per technique set",
                       description=f"techniques:\n{techniques}\n\nwith --step: "
                       f"{', '.join(STEP_TECHNIQUES)} (default: both, or baseline where make_step "
                       "takes no lowmem argument)",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
  pl = sub.add_parser("plan", help="the cheapest technique set whose step fits a memory budget",
                      description=f"Tries, cheapest first: {', '.join(ladder(8))}, ...; with --step: "
                      f"whether its {' and '.join(STEP_TECHNIQUES)} steps fit")
  for p in (rep, pl):
    p.set_defaults(given=())
    # The plan's ladder is the transformers' (ms-norm, attention).
    p.add_argument("--model", default="vit-b16", action=_Given,
                   choices=models.NAMES if p is rep else
                   [n for n in models.NAMES if n not in models.WRN_CONFIGS])
    p.add_argument("--batch", type=int, default=64, action=_Given, help="examples per step (default 64)")
    p.add_argument("--seq", type=int, default=512, action=_Given,
                   help="tokens per example (LLaMA, BERT; default 512)")
    p.add_argument("--image", type=int, default=None, action=_Given,
                   help="image side in pixels (ViT: default 224; wrn-28-2: default 32)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   action=_Given,
                   help="compute dtype without the bf16 technique; parameters stay float32")
    p.add_argument("--step", metavar="SPEC",
                   help="your own step instead of --model: FILE.py:FUNCTION or MODULE:FUNCTION, where "
                        "FUNCTION() returns (step, args) or (step, args, (loss_fn, loss_args)); "
                        "FUNCTION(lowmem=lm.lowmem) makes the lowmem step (see lowmem-jax --help)")
    p.add_argument("--target", default=None, metavar="NAME",
                   help=f"what to compile for: {', '.join(targets.names())}, attached (this "
                        "process's devices) or a config file (.txtpb); default: this process's "
                        "GPU, else h100 where the target packages are installed, else cpu")
  rep.add_argument("--techniques",
                   help=f"comma list of technique sets (default {DEFAULT_TECHNIQUES}; with --step "
                        f"{','.join(STEP_TECHNIQUES)})")
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
    if args.image is None:
      args.image = 32 if args.model in models.WRN_CONFIGS else 224
    for name in ("batch", "seq", "image"):
      if getattr(args, name) < 1:
        raise UsageError(f"--{name} must be >= 1, got {getattr(args, name)}.")
    if getattr(args, "top", 0) < 0:
      raise UsageError(f"--top must be >= 0, got {args.top}.")
    if args.step is not None and args.given:
      raise UsageError(f"{args.given[0]} is for the reference models; --step {args.step} gives its "
                       "own step and shapes.")
    args.make_step = load_step(args.step) if args.step is not None else None
    args.target = _target(args.target)
    return (report if args.command == "report" else plan)(args, console)
  except UsageError as e:
    print(f"lowmem-jax: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
