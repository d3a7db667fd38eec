"""Technique sets: what ``lowmem-jax report`` and ``plan`` measure, as a library.

A technique set joins techniques with "+" (``"all+remat:full+adama:4"``);
`parse` makes a `TechniqueSet` of it. A `Job` says what is measured: a
reference model of `lowmem_jax.models` at a batch's shapes, or a step of the
user's own (``make_step``). `measure` compiles one set's training step for the
job's target and returns its `lowmem_jax.memory.Breakdown`; `row` gives its
summary figures against a baseline; `cheapest_fit` walks `ladder`, cheapest
first, to the first set whose compiled peak fits a budget; `TechniqueSet.python`
is the code that builds that step.

    job = lm.techniques.Job("llama-1b", batch=8, seq=2048, target="h100")
    b = lm.techniques.measure(job, lm.techniques.parse("all+fused-ce"))
"""

import dataclasses
import inspect
import re
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowmem_jax import (lowbit, memory, models, offload, optim, planner, policies, sparse, targets,
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
                 "fold_in_backward=True)); with 8bit, folded in the scan body; on the LLaMA "
                 "models the token embedding's gradient buffer is made late (embedding=\"late\", "
                 "exact)",
    "8bit": "optimizer moments block-wise in 8 bits (lowmem_jax.lowbit.adamw_8bit; with adama, "
            "adamaw(state_bits=8))",
    "bf16-params": "bfloat16 parameters with no float32 copy, each update rounded "
                   "stochastically (lowmem_jax.lowbit.stochastic_rounding); with 8bit",
    "offload-opt": "optimizer state in host memory, brought to the device leaf by leaf "
                   "(lowmem_jax.offload)",
    "conv:<pooled|int8>": "wrn-28-2: convolutions that keep their input 2x2-pooled or in int8 "
                          "(lowmem_jax.compress)",
    "sparse:<density>": "wrn-28-2: the blocks' conv kernels stored sparse at that density, values "
                        "and positions, moved every 100 steps (lowmem_jax.sparse.sparse_storage)",
    "fused-ce": "LLaMA: the head's cross-entropy block by block, no [tokens, vocab] logits "
                "(lowmem_jax.losses.linear_cross_entropy)",
    "all": "approx+ms-norm+attention+bf16",
    "lowmem": "a step of your own only: it differentiates lm.lowmem(loss_fn) "
              "(make_step(lowmem=lm.lowmem)): GELU/SiLU, norms and attention rewritten",
}
DEFAULT = "baseline,approx,ms-norm,attention,approx+ms-norm+attention,bf16,all"
"""The default technique sets of the transformers."""
LANGUAGE_MODEL_EXTRA = ",fused-ce,all+fused-ce"
"""Added to `DEFAULT` for the language models (``fused-ce``)."""
CONV_NET_DEFAULT = "baseline,approx,conv:pooled,conv:int8,bf16,approx+conv:int8+bf16"
"""The default technique sets of the WideResNet (batch norm, no attention)."""
STEP_TECHNIQUES = ("baseline", "lowmem")
"""The techniques of a user's step; the others change a reference model."""
LEARNING_RATE = 1e-3
WEIGHT_DECAY = 1e-4  # optax.adamw's default


class TechniqueError(ValueError):
  """A technique set or a job that cannot be measured, said in one line."""


@dataclasses.dataclass(frozen=True)
class Job:
  """What a technique set is measured on.

  Attributes:
    model: a reference model of `lowmem_jax.models.NAMES` (ignored with ``make_step``).
    batch: examples per step.
    seq: tokens per example (LLaMA, BERT).
    image: image side in pixels; None: 224 for the ViTs, 32 for the WideResNet.
    dtype: the compute dtype's name where the set has no ``bf16``; parameters stay float32.
    target: what to compile for: a `lowmem_jax.targets.Target`, its name, or None for
      `lowmem_jax.targets.default`.
    make_step: a step of the user's own instead of ``model``: ``make_step()`` returns
      ``(step, args)`` or ``(step, args, (loss_fn, loss_args))``, and
      ``make_step(lowmem=lm.lowmem)`` the step that differentiates ``lowmem(loss_fn)``.
  """
  model: str = "vit-b16"
  batch: int = 64
  seq: int = 512
  image: int | None = None
  dtype: str = "float32"
  target: "targets.Target | str | None" = None
  make_step: Callable | None = None

  def __post_init__(self):
    if self.make_step is None and self.model not in models.NAMES:
      raise TechniqueError(f"model must be one of {', '.join(models.NAMES)}, got {self.model!r}.")
    for name in ("batch", "seq", "image"):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise TechniqueError(f"{name} must be an int >= 1, got {value!r}.")
    if self.dtype not in ("float32", "bfloat16", "float16"):
      raise TechniqueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}.")

  @property
  def language_model(self) -> bool:
    """Whether the model is a language model, whose head ``fused-ce`` rewrites."""
    return self.make_step is None and self.model in models.llama.CONFIGS

  @property
  def conv_net(self) -> bool:
    """Whether the model is the WideResNet, whose techniques are the conv ones."""
    return self.make_step is None and self.model in models.WRN_CONFIGS

  @property
  def image_side(self) -> int:
    """``image``, or the model's default side."""
    return self.image if self.image is not None else 32 if self.conv_net else 224

  def step_techniques(self) -> tuple[str, ...]:
    """The techniques ``make_step`` allows: lowmem only where it takes ``lowmem``."""
    try:
      inspect.signature(self.make_step).bind(lowmem=transform.lowmem)
    except TypeError:
      return STEP_TECHNIQUES[:1]
    return STEP_TECHNIQUES

  def default_sets(self) -> list[str]:
    """The technique sets a report of this job shows by default."""
    if self.make_step is not None:
      return list(self.step_techniques())
    if self.conv_net:
      return CONV_NET_DEFAULT.split(",")
    return (DEFAULT + (LANGUAGE_MODEL_EXTRA if self.language_model else "")).split(",")


@dataclasses.dataclass(frozen=True)
class TechniqueSet:
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
  density: float | None = None

  def workload(self, job: Job) -> models.Workload:
    """The reference workload of ``job`` with this set's switches."""
    if self.fused_ce and not job.language_model:
      raise TechniqueError(f"fused-ce in {self.label!r} applies to the LLaMA models (a language "
                           f"model's vocabulary-sized head), not {job.model}.")
    if job.conv_net and (self.ms_norm or self.attention):
      raise TechniqueError(f"{self.label!r}: {job.model} has batch norm and no attention; its "
                           f"techniques are {CONV_NET_DEFAULT.replace(',', ', ')}.")
    if self.bf16_params and self.state_bits is None:
      raise TechniqueError(f"{self.label!r}: bf16-params needs 8bit: Adam keeps its moments in "
                           "the parameters' dtype, and a bfloat16 second moment rounded to nearest "
                           "stalls; 8bit keeps them in 8 bits, rounded stochastically.")
    if self.offload_opt and self.adama > 1:
      raise TechniqueError(f"{self.label!r}: offload-opt does not take adama (AdamA's moments "
                           "would cross to the device every micro-batch); use 8bit for its "
                           "moments.")
    if self.conv != "plain" and not job.conv_net:
      raise TechniqueError(f"conv:{self.conv} in {self.label!r} applies to wrn-28-2, not "
                           f"{job.model}.")
    if self.density is not None and not job.conv_net:
      raise TechniqueError(f"sparse:{self.density} in {self.label!r} applies to wrn-28-2 (sparse "
                           f"storage is built for its convs), not {job.model}.")
    if self.density is not None and self.offload_opt:
      raise TechniqueError(f"{self.label!r}: sparse does not take offload-opt (the moves zero "
                           "moments on the device).")
    try:
      return self._workload(job)
    except ValueError as e:  # a shape the model refuses, e.g. BERT's seq > 512
      raise TechniqueError(f"{self.label!r}: {e}") from e

  def _workload(self, job: Job) -> models.Workload:
    return models.workload(
        job.model, batch=job.batch, seq=job.seq, image=job.image,
        dtype=jnp.bfloat16 if self.bf16 else jnp.dtype(job.dtype),
        param_dtype=jnp.bfloat16 if self.bf16_params else jnp.float32, conv=self.conv,
        activation=("1bit" if job.conv_net else "approx") if self.approx else "exact",
        norm="ms" if self.ms_norm else "plain",
        attention="recompute" if self.attention else "plain",
        loss="fused" if self.fused_ce else "plain", embedding=self.embedding(job),
        density=self.density, remat=self.remat is not None, remat_policy=self.remat)

  def embedding(self, job: Job) -> str:
    """The LLaMA models' token embedding: "late" under AdamA (its gradient buffer made when
    needed, not at the start of each micro-batch's backward), else "plain"."""
    return "late" if self.adama > 1 and job.language_model else "plain"

  @property
  def moment_fold(self) -> "optim.MomentFold | int":
    """AdamA's `lowmem_jax.MomentFold` of ``adama`` micro-batches, given to both the
    optimizer and the step; 1 without AdamA."""
    return optim.MomentFold(self.adama) if self.adama > 1 else 1

  @property
  def fold_in_backward(self) -> bool:
    """AdamA folds in the backward, except with 8-bit moments (folded in the scan body)."""
    return self.adama > 1 and self.state_bits is None

  def optimizer(self) -> optax.GradientTransformation:
    """AdamW (`LEARNING_RATE`, `WEIGHT_DECAY`) as the set has it: AdamA, 8-bit, offloaded,
    bfloat16 parameters rounded stochastically (a sparse workload wraps it in
    `lowmem_jax.models.Workload.optimizer`)."""
    if self.adama > 1:
      tx = optim.adamaw(LEARNING_RATE, self.moment_fold, state_bits=self.state_bits)
    elif self.state_bits == 8:
      tx = lowbit.adamw_8bit(LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    else:
      tx = optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    if self.offload_opt:
      tx = offload.offload(tx)
    if self.bf16_params:
      tx = optax.chain(tx, lowbit.stochastic_rounding())
    return tx

  def python(self, job: Job) -> str:
    """The lines that build this set's training step of ``job`` (a reference model's)."""
    switches = [f"batch={job.batch}"]
    if job.model in models.VIT_CONFIGS or job.conv_net:
      switches.append(f"image={job.image_side}")
    else:
      switches.append(f"seq={job.seq}")
    switches.append(f"dtype=jnp.{'bfloat16' if self.bf16 else job.dtype}")
    if self.bf16_params:
      switches.append("param_dtype=jnp.bfloat16")
    if self.conv != "plain":
      switches.append(f'conv="{self.conv}"')
    if self.approx:
      switches.append(f'activation="{"1bit" if job.conv_net else "approx"}"')
    if self.ms_norm:
      switches.append('norm="ms"')
    if self.attention:
      switches.append('attention="recompute"')
    if self.fused_ce:
      switches.append('loss="fused"')
    if self.embedding(job) != "plain":
      switches.append(f'embedding="{self.embedding(job)}"')
    if self.remat is not None:
      switches.append(f"remat=True, remat_policy=lm.policies.{policies.describe(self.remat)}")
    if self.adama > 1:
      bits = ", state_bits=8" if self.state_bits == 8 else ""
      tx = f"lm.adamaw({LEARNING_RATE}, fold{bits})"
    elif self.state_bits == 8:
      tx = f"lm.lowbit.adamw_8bit({LEARNING_RATE}, weight_decay={WEIGHT_DECAY})"
    else:
      tx = f"optax.adamw({LEARNING_RATE}, weight_decay={WEIGHT_DECAY})"
    if self.offload_opt:
      tx = f"lm.offload.offload({tx})"
    if self.bf16_params:
      tx = f"optax.chain({tx}, lm.lowbit.stochastic_rounding())"
    if self.density is not None:
      switches.append(f"density={self.density}")
      tx = f"wl.optimizer({tx})"
    k = ", fold" if self.adama > 1 else ""
    fold = ", fold_in_backward=True" if self.fold_in_backward else ""
    return "\n".join([
        "import jax, jax.numpy as jnp, optax, lowmem_jax as lm",
        f'wl = lm.models.workload("{job.model}", {", ".join(switches)})',
        *([f"fold = lm.MomentFold({self.adama})  # AdamA's rule, for the optimizer and the step"]
          if self.adama > 1 else []),
        f"tx = {tx}",
        f"step = jax.jit(wl.train_step(tx{k}{fold}), donate_argnums=(0, 1))",
        "params = wl.init(jax.random.key(0))",
        "opt_state = tx.init(params)",
    ])


def parse(text: str, step: bool = False) -> TechniqueSet:
  """The `TechniqueSet` of ``"all+remat:full+adama:4"``, or for a user's step
  (``step``) of ``"baseline"`` or ``"lowmem"``; `TechniqueError` naming the
  term on a mistake."""
  fields = {}
  for term in text.strip().split("+"):
    name, _, value = term.strip().partition(":")
    if step and term.strip() not in STEP_TECHNIQUES:
      what = ("applies only to the reference models (--model)"
              if name in ("remat", "adama", "conv", "sparse") or (name in TECHNIQUES and not value)
              else "is unknown")
      raise TechniqueError(f"technique {term.strip()!r} in {text!r} {what}; with a step of your "
                           f"own (--step), choose from {', '.join(STEP_TECHNIQUES)}.")
    if name == "baseline" and not value:
      continue
    if name == "lowmem" and not value:
      if not step:
        raise TechniqueError(f"technique 'lowmem' in {text!r} applies only to --step (a step of "
                             "your own); a reference model takes approx, ms-norm, attention or all.")
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
        raise TechniqueError(f"conv:{value}: the convolution must be pooled or int8.")
      fields["conv"] = value
    elif name == "sparse":
      try:
        density = float(value)
      except ValueError:
        density = 0.0
      if not 0 < density < 1:
        raise TechniqueError(f"sparse:{value}: the density must be a number between 0 and 1, "
                             "e.g. sparse:0.1.")
      fields["density"] = density
    elif name == "remat":
      if value not in policies.READY_MADE:
        raise TechniqueError(f"remat:{value}: the policy must be one of "
                             f"{', '.join(policies.READY_MADE)}.")
      fields["remat"] = policies.READY_MADE[value]
    elif name == "adama":
      if not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
        raise TechniqueError(f"adama:{value}: k must be a positive integer, e.g. adama:4.")
      fields["adama"] = int(value)
    else:
      raise TechniqueError(f"unknown technique {term.strip()!r} in {text!r}; choose from "
                           f"{', '.join(TECHNIQUES)}.")
  return TechniqueSet(label=text.strip(), **fields)


def _what(x: Any) -> str:
  return f"a {type(x).__name__} of {len(x)}" if isinstance(x, (tuple, list)) else f"a {type(x).__name__}"


def check(job: Job, techniques: TechniqueSet) -> None:
  """Raises `TechniqueError` where ``techniques`` does not apply to ``job``: a step of
  the user's own takes baseline and lowmem only (lowmem where ``make_step`` takes
  it), a reference model every technique but lowmem."""
  if job.make_step is None:
    if techniques.lowmem:
      raise TechniqueError(f"technique 'lowmem' in {techniques.label!r} applies only to a step "
                           "of your own (make_step, --step).")
    return
  if techniques != TechniqueSet(techniques.label, lowmem=techniques.lowmem):
    raise TechniqueError(f"{techniques.label!r} changes a reference model; a step of your own "
                         f"takes {' or '.join(STEP_TECHNIQUES)}.")
  if techniques.lowmem and job.step_techniques() != STEP_TECHNIQUES:
    name = getattr(job.make_step, "__name__", "make_step")
    raise TechniqueError(f"lowmem calls {name}(lowmem=lm.lowmem), and {name} takes no lowmem "
                         f"argument: define {name}(lowmem=lambda f: f) and differentiate "
                         "lowmem(loss_fn) in the step.")


def _user_step(job: Job, techniques: TechniqueSet) -> tuple[Callable, tuple, Callable | None, tuple]:
  """``(step, step_args, loss_fn, loss_args)`` of ``job.make_step`` for ``techniques``, which
  `check` has passed (``loss_fn`` None where make_step gives none)."""
  name = getattr(job.make_step, "__name__", "make_step")
  made = job.make_step(lowmem=transform.lowmem) if techniques.lowmem else job.make_step()
  said = f"{name}() returned"
  if not isinstance(made, (tuple, list)) or len(made) not in (2, 3):
    raise TechniqueError(f"{said} {_what(made)}; expected (step, args) or "
                         "(step, args, (loss_fn, loss_args)).")
  step, step_args, *loss = made
  if not callable(step):
    raise TechniqueError(f"{said} {_what(step)} as its step; expected a function.")
  if not isinstance(step_args, (tuple, list)):
    raise TechniqueError(f"{said} {_what(step_args)} as the step's args; expected a tuple of its "
                         "arguments (arrays or jax.ShapeDtypeStruct pytrees).")
  if not loss:
    return step, tuple(step_args), None, ()
  if not (isinstance(loss[0], (tuple, list)) and len(loss[0]) == 2 and callable(loss[0][0])
          and isinstance(loss[0][1], (tuple, list))):
    raise TechniqueError(f"{said} {_what(loss[0])} as its third element; expected (loss_fn, "
                         "loss_args), loss_args a tuple.")
  return step, tuple(step_args), loss[0][0], tuple(loss[0][1])


def measure(job: Job, techniques: TechniqueSet, top: int | None = 10) -> memory.Breakdown:
  """The `memory.Breakdown` of ``techniques``' training step of ``job`` compiled for
  ``job.target``, with autodiff's residuals of its loss; a reference model's
  step is AdamW's (`TechniqueSet.optimizer`), parameters and state donated."""
  check(job, techniques)
  if job.make_step is not None:
    step, step_args, loss_fn, loss_args = _user_step(job, techniques)
    return memory.report(step, *step_args, loss_fn=loss_fn, loss_args=loss_args,
                         label=techniques.label, top=top, target=job.target)
  wl = techniques.workload(job)
  k = techniques.adama
  if job.batch % k:
    raise TechniqueError(f"adama:{k}: the batch ({job.batch}) must split into {k} equal "
                         "micro-batches.")
  tx = wl.optimizer(techniques.optimizer())
  params = wl.abstract_params()
  opt_state = offload.abstract_state(tx, params)
  batch = (wl.inputs, wl.labels)
  micro = [jax.ShapeDtypeStruct((x.shape[0] // k, *x.shape[1:]), x.dtype) for x in batch]
  positions = (sparse.find_state(opt_state).positions,) if wl.sparse else ()
  step = jax.jit(wl.train_step(tx, techniques.moment_fold,
                               fold_in_backward=techniques.fold_in_backward),
                 donate_argnums=(0, 1))
  return memory.report(step, params, opt_state, batch, loss_fn=wl.loss,
                       loss_args=(params, *micro, *positions), label=techniques.label,
                       top=top, target=job.target)


def row(b: memory.Breakdown, base: memory.Breakdown, techniques: TechniqueSet) -> dict:
  """The summary figures of one technique set's breakdown against ``base``'s: in bytes,
  parameters and optimizer state (None where no argument is one), gradients,
  activations, other, the live and compiled peaks and autodiff's saved
  activations (None without a loss); as ratios, the reduction and the extra
  FLOPs (None for loops, whose body XLA counts once)."""
  at = b.at_peak
  found = b.argument_components
  return {
      "techniques": b.label,
      "parameters": at["parameters"] if "parameters" in found else None,
      "optimizer_state": at["optimizer state"] if "optimizer state" in found else None,
      "gradients": at["gradients"],
      "activations": at["activations"],
      "other": at["inputs"] + at["updates"] + at["temporaries"],
      "live_peak_bytes": b.live_peak_bytes,
      "peak_bytes": b.stats.peak_bytes,
      "reduction": base.stats.peak_bytes / b.stats.peak_bytes,
      # A micro-batch scan's FLOPs are per micro-batch, fused-ce's per block of logits.
      "extra_flops": ((b.flops - base.flops) / base.flops
                      if techniques.adama == 1 and not techniques.fused_ce else None),
      "saved_activation_bytes": b.saved.activation_bytes if b.saved else None,
  }


def ladder(batch: int, language_model: bool = False) -> list[str]:
  """Technique sets `cheapest_fit` tries, cheapest first: exact techniques, then an
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


def planned(job: Job, text: str, budget: int) -> TechniqueSet | None:
  """The set ``text``; for ``remat:plan`` with the policy `lowmem_jax.plan` picks
  for ``budget`` bytes, or None where no policy fits."""
  if "remat:plan" not in text:
    return parse(text)
  techniques = parse(text.replace("+remat:plan", ""))
  wl = techniques.workload(job)
  params = wl.abstract_params()
  tx = techniques.optimizer()
  batch = (wl.inputs, wl.labels)

  def step(params, opt_state, batch, *, policy):
    return wl.with_policy(policy).train_step(tx)(params, opt_state, batch)
  try:
    chosen = planner.plan(step, params, jax.eval_shape(tx.init, params), batch, budget=budget,
                          donate_argnums=(0, 1), target=job.target)
  except planner.BudgetError:
    return None
  return dataclasses.replace(
      techniques, label=f"{techniques.label}+remat:{policies.describe(chosen.policy)}",
      remat=chosen.policy)


class Fit(NamedTuple):
  """What `cheapest_fit` found.

  Attributes:
    tried: ``(breakdown, techniques)`` of each set measured, in ladder order.
    fits: the first set whose compiled peak fits, or None.
    fixed_bytes: the float32 parameters and AdamW state, which no set here cuts
      below; nothing is measured where they alone exceed the budget.
  """
  tried: list
  fits: TechniqueSet | None
  fixed_bytes: int


def cheapest_fit(job: Job, budget: int,
                 on_try: Callable[[str], None] = lambda text: None) -> Fit:
  """Measures the sets of `ladder` for ``job`` (a reference model) in order, up to
  the first whose compiled peak is at most ``budget`` bytes; ``on_try(text)``
  is called before each. The ladder is the transformers' (ms-norm, attention): not
  for a step of the user's own nor the WideResNet."""
  if job.make_step is not None or job.conv_net:
    raise TechniqueError(f"the ladder is the transformers' (ms-norm, attention); "
                         f"{'a step of your own' if job.make_step else job.model} takes "
                         "measure() of chosen sets instead.")
  params = parse("baseline").workload(job).abstract_params()
  fixed = memory.tree_bytes((params, jax.eval_shape(optax.adamw(LEARNING_RATE).init, params)))
  tried = []
  if fixed > budget:
    return Fit(tried, None, fixed)
  for text in ladder(job.batch, job.language_model):
    on_try(text)
    techniques = planned(job, text, budget)
    if techniques is None:
      continue
    b = measure(job, techniques)
    tried.append((b, techniques))
    if b.stats.peak_bytes <= budget:
      return Fit(tried, techniques, fixed)
  return Fit(tried, None, fixed)
