"""Technique sets: what ``lowmem-jax report`` and ``plan`` measure, as a library.

`TECHNIQUES` declares each technique once (its CLI term, the model switches it
sets, its `lowmem_jax.lowmem` option, how it wraps the optimizer, whether its
gradient is exact); everything below reads it. A technique set joins
techniques with "+" (``"all+remat:full+adama:4"``);
`parse` makes a `TechniqueSet` of it. A `Job` says what is measured: a
reference model of `lowmem_jax.models` at a batch's shapes, or a step of the
user's own (``make_step``). `measure` compiles one set's training step for the
job's target and returns its `lowmem_jax.compile.memory.Breakdown`; `row` gives its
summary figures against a baseline; `cheapest_fit` walks `ladder`, cheapest
first, to the first set whose compiled peak fits a budget; `TechniqueSet.python`
is the code that builds that step.

    from lowmem_jax.app import techniques
    job = techniques.Job("llama-1b", batch=8, seq=2048, target="h100")
    b = techniques.measure(job, techniques.parse("all+fused-ce"))
"""

import contextlib
import dataclasses
import inspect
import re
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowmem_jax import models, transform
from lowmem_jax.app import code
from lowmem_jax.compile import memory, planner, policies, targets
from lowmem_jax.ops import dispatch
from lowmem_jax.optim import offload, sparse


@dataclasses.dataclass(frozen=True)
class Technique:
  """One technique, declared once: parsing, the workloads, the printed Python,
  ``--help`` and the checks all read this.

  Attributes:
    term: the CLI term; a term that takes a value is written ``term:<value>``.
    summary: what it does, for ``--help``.
    value: how the value reads in ``--help`` (``"<k>"``), or None for a term without one.
    parse: the value from its text; raises ValueError with the reason.
    off: a value that leaves the technique off (``adama:1``: one micro-batch is Adam).
    switches: the reference models' switches it sets (`lowmem_jax.models.workload`'s
      keywords), or a function of ``(value, job)`` giving them; the models say which
      model takes which.
    lowmem: the `lowmem_jax.lowmem` option that does the same to a step of your own.
    optimizer: wraps the optimizer's `code.Call` (offload-opt, bf16-params), in the
      order of `TECHNIQUES`; the optimizer itself is AdamW, or AdamA with ``adama``,
      with 8-bit moments with ``8bit`` (`TechniqueSet.adamw`).
    exact: whether the gradient is the plain step's to float tolerance (on the
      transformers, for a technique that differs by model).
    needs: ``(term, why)``: a term the set must also hold.
    excludes: ``(term, why)`` pairs: terms the set must not also hold.
  """
  term: str
  summary: str
  value: str | None = None
  parse: Callable[[str], Any] | None = None
  off: Any = None
  switches: Mapping[str, Any] | Callable[[Any, "Job"], Mapping[str, Any]] = dataclasses.field(
      default_factory=dict)
  lowmem: Mapping[str, str] = dataclasses.field(default_factory=dict)
  optimizer: Callable[["code.Call"], "code.Call"] | None = None
  exact: bool = True
  needs: tuple[str, str] | None = None
  excludes: tuple[tuple[str, str], ...] = ()

  def model_switches(self, value: Any, job: "Job") -> dict[str, Any]:
    """The model switches this technique sets on ``job`` with ``value``."""
    return dict(self.switches(value, job) if callable(self.switches) else self.switches)

  def help(self) -> str:
    """The ``--help`` line: term, summary, exactness."""
    term = f"{self.term}:{self.value}" if self.value else self.term
    return f"  {term:<19} {self.summary}{'' if self.exact else ' [approximate gradient]'}"


def _policy(text: str) -> Callable:
  if text not in policies.READY_MADE:
    raise ValueError(f"the policy must be one of {', '.join(policies.READY_MADE)}")
  return policies.READY_MADE[text]


def _micro_batches(text: str) -> int:
  if not re.fullmatch(r"[0-9]+", text) or int(text) < 1:
    raise ValueError("k must be a positive integer, e.g. adama:4")
  return int(text)


def _conv(text: str) -> str:
  if text not in ("pooled", "int8"):
    raise ValueError("the convolution must be pooled or int8")
  return text


def _place(text: str) -> str:
  if text not in ("device", "host"):
    raise ValueError("the saved layer inputs' place must be device or host, e.g. stream:host")
  return text


def _density(text: str) -> float:
  try:
    density = float(text)
  except ValueError:
    density = 0.0
  if not 0 < density < 1:
    raise ValueError("the density must be a number between 0 and 1, e.g. sparse:0.1")
  return density


_ALL = ("approx", "ms-norm", "attention", "bf16")

TECHNIQUES = {t.term: t for t in (
    Technique("baseline", "plain JAX/Flax: exact GELU/SiLU, LayerNorm/RMSNorm, attention keeping "
              "its probabilities, AdamW"),
    Technique("approx", "ReGELU2/ReSiLU2 keeping 2-bit activation residuals; on wrn-28-2, ReLU "
              "keeping a 1-bit mask instead, exact there",
              switches=lambda _, job: {"activation": "1bit" if job.conv_net else "approx"},
              lowmem={"activations": "approx"}, exact=False),
    Technique("ms-norm", "memory-sharing norms: the norm keeps only its output and 1/sigma",
              switches={"norm": "ms"}, lowmem={"norms": "ms"}),
    Technique("attention", "attention that keeps no L×L residual (lowmem_jax.attention)",
              switches={"attention": "recompute"}, lowmem={"attention": "recompute"}),
    Technique("bf16", "bfloat16 compute; parameters and optimizer state stay float32",
              switches={"dtype": code.Code(jnp.bfloat16, "jnp.bfloat16")}, exact=False),
    Technique("remat", "nn.remat of every block with lowmem_jax.compile.policies.<policy>, one of "
              + ", ".join(policies.READY_MADE), value="<policy>", parse=_policy,
              switches=lambda policy, _: {"remat": True, "remat_policy": code.Code(
                  policy, f"lm.policies.{policies.describe(policy)}")}),
    Technique("adama", "AdamA over k micro-batches of the batch, each micro-batch gradient "
              "folded into the moments in its backward rule (lowmem_jax.adamaw, microbatch_step("
              "fold_in_backward=True)); with 8bit, folded in the scan body; on the LLaMA models "
              "the token embedding's gradient buffer is made late (embedding=\"late\", exact)",
              value="<k>", parse=_micro_batches, off=1,
              switches=lambda _, job: {"embedding": "late"} if job.language_model else {}),
    Technique("8bit", "optimizer moments block-wise in 8 bits (lowmem_jax.optim.lowbit.adamw_8bit; "
              "with adama, adamaw(state_bits=8))"),
    Technique("offload-opt", "optimizer state in host memory, brought to the device leaf by leaf "
              "(lowmem_jax.optim.offload); with stream, a layer at a time",
              optimizer=lambda tx: code.Call.of("lm.offload.offload_state", tx),
              excludes=(("adama", "AdamA's moments would cross to the device every micro-batch; "
                         "use 8bit for its moments"),)),
    Technique("bf16-params", "bfloat16 parameters with no float32 copy, each update rounded "
              "stochastically (lowmem_jax.optim.lowbit.stochastic_rounding); with 8bit",
              switches={"param_dtype": code.Code(jnp.bfloat16, "jnp.bfloat16")},
              optimizer=lambda tx: code.Call.of("optax.chain", tx, code.Call.of(
                  "lm.lowbit.stochastic_rounding")), exact=False,
              needs=("8bit", "Adam keeps its moments in the parameters' dtype, and a bfloat16 "
                     "second moment rounded to nearest stalls; 8bit keeps them in 8 bits, "
                     "rounded stochastically")),
    Technique("conv", "wrn-28-2: convolutions that keep their input 2x2-pooled or in int8 "
              "(lowmem_jax.ops.compress)", value="<pooled|int8>", parse=_conv,
              switches=lambda conv, _: {"conv": conv}, exact=False),
    Technique("sparse", "wrn-28-2: the blocks' conv kernels stored sparse at that density, values "
              "and positions, moved every 100 steps (lowmem_jax.optim.sparse.sparse_storage)",
              value="<density>", parse=_density,
              switches=lambda density, _: {"density": density}, exact=False,
              excludes=(("offload-opt", "the moves zero moments on the device"),)),
    Technique("fused-ce", "LLaMA: the head's cross-entropy block by block, no [tokens, vocab] "
              "logits (lowmem_jax.ops.losses.linear_cross_entropy)",
              switches={"loss": "fused"}, lowmem={"loss": "fused"}),
    Technique("late-embed", "LLaMA: the token embedding's gradient buffer made when its "
              "cotangent arrives, where XLA may otherwise make it at the start of the backward "
              "(embedding=\"late\", exact); adama sets it",
              switches={"embedding": "late"}),
    Technique("stream", "LLaMA: the layer-streamed step (lowmem_jax.optim.layer_streamed): the "
              "optimizer applied inside the backward, one layer at a time, so no whole-model "
              "gradient; each layer's saved input on the device or the host; each layer in "
              "two parts, the MLP's parameters updated before the attention's backward; each "
              "layer's MLP over chunks of 1,024 tokens, recomputed chunk by chunk "
              "(mlp_chunk_tokens)",
              value="<device|host>", parse=_place,
              switches=lambda _, job: {"mlp_chunk_tokens": 1024} if job.language_model else {},
              excludes=(("adama", "the streamed step takes one micro-batch a call: measure it "
                         "at the micro-batch's size"),
                        ("remat", "the streamed backward recomputes each layer from its input "
                         "already"))),
    Technique("all", "+".join(_ALL), exact=False),
    Technique("lowmem", "a step of your own only: the exact rewrites of lm.lowmem(loss_fn): "
              "memory-sharing norms, attention keeping no L×L residual, the loss head "
              "block by block, GELU/SiLU keeping their input alone (add approx for "
              "ReGELU2/ReSiLU2)",
              lowmem={"activations": "exact", "norms": "ms", "attention": "recompute",
                      "loss": "fused"}),
)}
"""Every technique by its CLI term."""
DEFAULT = "baseline,approx,ms-norm,attention,approx+ms-norm+attention,bf16,all"
"""The default technique sets of the transformers."""
LANGUAGE_MODEL_EXTRA = ",fused-ce,all+fused-ce"
"""Added to `DEFAULT` for the language models (``fused-ce``)."""
CONV_NET_DEFAULT = "baseline,approx,conv:pooled,conv:int8,bf16,approx+conv:int8+bf16"
"""The default technique sets of the WideResNet (batch norm, no attention)."""
STEP_TECHNIQUES = ("baseline", "lowmem", "approx", "bf16", "remat", "adama", "8bit",
                   "bf16-params", "offload-opt")
"""The techniques of a user's step, each given to ``make_step`` as `STEP_OPTIONS`."""
STEP_DEFAULT = "baseline,lowmem,lowmem+approx"
"""The default technique sets of a user's step."""
class StepOption(NamedTuple):
  """A keyword argument of a user's ``make_step``: ``default`` its default's Python, ``what``
  it is and what each technique of ``terms`` passes."""
  default: str
  what: str
  terms: tuple[str, ...]


STEP_OPTIONS = {
    "lowmem": StepOption("lambda f: f", "the step differentiates lowmem(loss_fn); lowmem: "
                         "lm.lowmem, its exact rewrites (norms, attention, loss head, GELU/SiLU "
                         "recomputed), approx: with activations=\"approx\"",
                         ("lowmem", "approx")),
    "dtype": StepOption("jnp.float32", "the compute dtype; bf16: jnp.bfloat16", ("bf16",)),
    "policy": StepOption("None", "a remat policy, for jax.checkpoint(loss_fn, policy=policy); "
                         "remat:<policy>: lm.policies.<policy> (plan's remat:plan: lm.plan's)",
                         ("remat",)),
    "adamw": StepOption("optax.adamw", "the AdamW, called adamw(learning_rate); 8bit: "
                        "lm.lowbit.adamw_8bit; adama:<k>: functools.partial(lm.adamaw, k=<k>), "
                        "with 8bit state_bits=8", ("8bit", "adama")),
    "micro_batches": StepOption("1", "micro-batches a step, as lm.microbatch_step(loss_fn, tx, "
                                "micro_batches); adama:<k>: <k>", ("adama",)),
    "param_dtype": StepOption("jnp.float32", "the parameters' dtype; bf16-params: jnp.bfloat16",
                              ("bf16-params",)),
    "optimizer": StepOption("lambda tx: tx", "wraps the optimizer; bf16-params: optax.chain(tx, "
                            "lm.lowbit.stochastic_rounding()); offload-opt: "
                            "lm.offload.offload_state(tx), whose state the step's arguments hold "
                            "in host memory (lm.offload.abstract_state(tx, params))",
                            ("bf16-params", "offload-opt")),
}
"""``make_step``'s keyword arguments, by keyword, the one place they are declared (``lowmem-jax
report --help`` prints them). A technique whose keywords ``make_step`` does not take is left
out of the default sets and the ladder (`Job.without_missing`), and refused where a set names
it (`check`)."""


def step_help() -> str:
  """The ``--help`` lines of `STEP_OPTIONS`."""
  return "\n".join(f"  {k}={o.default}: {o.what}" for k, o in STEP_OPTIONS.items())


LEARNING_RATE = 1e-3
WEIGHT_DECAY = 1e-4  # optax.adamw's default


class TechniqueError(ValueError):
  """A technique set or a job that cannot be measured, said in one line."""


FSDP = "fsdp"
"""The mesh axis `Job.shard` splits over."""


def fsdp_spec(shape: tuple[int, ...], devices: int) -> jax.sharding.PartitionSpec:
  """The `PartitionSpec` splitting an array of ``shape`` on its largest axis divisible by
  ``devices`` (the last of equal ones: a stacked layer's weight ``[layers, d_in, d_out]``
  splits a feature axis, as the FSDP test of tests/test_streamed.py does), over `FSDP`;
  replicated where no axis divides."""
  axes = [i for i, n in enumerate(shape) if n % devices == 0]
  if not axes:
    return jax.sharding.PartitionSpec()
  axis = max(axes, key=lambda i: (shape[i], i))
  return jax.sharding.PartitionSpec(*(FSDP if i == axis else None for i in range(len(shape))))


@dataclasses.dataclass(frozen=True)
class Job:
  """What a technique set is measured on.

  Attributes:
    model: a reference model of `lowmem_jax.models.NAMES` (ignored with ``make_step``).
    batch: examples per step.
    seq: tokens per example (LLaMA, BERT).
    image: image side in pixels; None: 224 for the ViTs, 32 for the WideResNet.
    dtype: the compute dtype's name where the set has no ``bf16``; parameters stay float32.
    target: what to compile for: a `lowmem_jax.compile.targets.Target`, its name, or None for
      `lowmem_jax.compile.targets.default`; the `Target` once the job is made.
    make_step: a step of the user's own instead of ``model``: ``make_step()`` returns
      ``(step, args)`` or ``(step, args, (loss_fn, loss_args))``, and ``make_step`` with
      a technique set's `STEP_OPTIONS` (`TechniqueSet.step_options`) the step with those
      techniques, e.g. ``make_step(lowmem=lm.lowmem)`` the step that differentiates
      ``lowmem(loss_fn)``.
    devices: GPUs of the target the step runs on, FSDP over a 1-D mesh of them (`shard`):
      each parameter and optimizer state leaf split on an axis, the batch on its first; every
      figure is then one device's. A reference model on a GPU target only.
  """
  model: str = "vit-b16"
  batch: int = 64
  seq: int = 512
  image: int | None = None
  dtype: str = "float32"
  target: "targets.Target | str | None" = None
  make_step: Callable | None = None
  devices: int = 1

  def __post_init__(self):
    if self.make_step is None and self.model not in models.NAMES:
      raise TechniqueError(f"model must be one of {', '.join(models.NAMES)}, got {self.model!r}.")
    for name in ("batch", "seq", "image", "devices"):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise TechniqueError(f"{name} must be an int >= 1, got {value!r}.")
    if self.dtype not in ("float32", "bfloat16", "float16"):
      raise TechniqueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}.")
    try:
      object.__setattr__(self, "target", targets.resolve(self.target))
    except (ValueError, TypeError, targets.TargetUnavailable) as e:
      raise TechniqueError(f"target: {e}") from e
    if self.devices > 1:
      if self.make_step is not None or self.target.platform != "cuda":
        raise TechniqueError(f"devices={self.devices}: FSDP over several devices is for a "
                             "reference model on a GPU target (a step of your own shards "
                             "itself; the CPU proxy has no multi-GPU figure).")
      if self.batch % self.devices:
        raise TechniqueError(f"batch {self.batch} does not split over devices={self.devices}: "
                             "give a batch divisible by the devices.")

  def mesh(self) -> jax.sharding.Mesh:
    """The 1-D mesh (axis `FSDP`) of ``devices`` of the target's devices."""
    return self.target.mesh((self.devices,), (FSDP,))

  def shard(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, Any]:
    """The step's abstract arguments FSDP-sharded over `mesh`: each parameter and optimizer
    state leaf on `fsdp_spec`'s axis, the batch's leaves on their first axis (``batch`` is
    divisible by ``devices``); unchanged on one device. State in host memory raises
    `TechniqueError`: a step with host arguments compiles for one device."""
    if self.devices == 1:
      return params, opt_state, batch
    mesh = self.mesh()

    def place(x, spec):
      if getattr(getattr(x, "sharding", None), "memory_kind", None) == targets.HOST:
        raise TechniqueError(f"devices={self.devices}: state in host memory (offload-opt) "
                             "compiles for one device; leave it out.")
      return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                  sharding=jax.sharding.NamedSharding(mesh, spec))
    state = lambda x: place(x, fsdp_spec(x.shape, self.devices))
    return (jax.tree.map(state, params), jax.tree.map(state, opt_state),
            jax.tree.map(lambda x: place(x, jax.sharding.PartitionSpec(FSDP)), batch))

  @contextlib.contextmanager
  def compiling(self) -> Iterator[None]:
    """Where the job's steps are traced: over several devices under `mesh`
    (`jax.set_mesh`, where the layer-streamed step gathers each layer's parameters,
    `lowmem_jax.optim.layer_streamed`'s ``gather_params``, and the LLaMA's token chunks
    and loss-head blocks run position-major), with attention's chunked XLA implementation
    (`lowmem_jax.ops.dispatch.using`), as cuDNN's partitioner needs q, k and v sharded alike
    and XLA's propagation shards them apart."""
    if self.devices == 1:
      yield
      return
    with dispatch.using("xla"), jax.set_mesh(self.mesh()):
      yield

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

  def step_keywords(self) -> frozenset[str]:
    """The `STEP_OPTIONS` ``make_step`` takes as keywords (all with ``**kwargs``)."""
    parameters = inspect.signature(self.make_step).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
      return frozenset(STEP_OPTIONS)
    return frozenset(p.name for p in parameters if p.name in STEP_OPTIONS
                     and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))

  def without_missing(self, text: str) -> tuple[str, tuple[str, ...]]:
    """``(text less the techniques whose `STEP_OPTIONS` make_step does not take and those
    that need them, those left out)``; ``"baseline"`` where none is left."""
    taken = self.step_keywords()
    terms = [t.strip() for t in text.split("+")]
    kept = [t for t in terms if all(k in taken for k, option in STEP_OPTIONS.items()
                                    if t.partition(":")[0] in option.terms)]
    names = {t.partition(":")[0] for t in kept}
    kept = [t for t in kept if t == "baseline" or TECHNIQUES[t.partition(":")[0]].needs is None
            or TECHNIQUES[t.partition(":")[0]].needs[0] in names]
    return ("+".join(t for t in kept if t != "baseline") or "baseline",
            tuple(t for t in terms if t not in kept))

  def missing_keywords(self, techniques: "TechniqueSet") -> list[str]:
    """The `STEP_OPTIONS` ``techniques`` passes that ``make_step`` does not take."""
    taken = self.step_keywords()
    return [k for k, option in STEP_OPTIONS.items()
            if k not in taken and any(t in techniques for t in option.terms)]

  def default_sets(self) -> list[str]:
    """The technique sets a report of this job shows by default."""
    if self.make_step is not None:
      return list(dict.fromkeys(self.without_missing(t)[0] for t in STEP_DEFAULT.split(",")))
    if self.conv_net:
      return CONV_NET_DEFAULT.split(",")
    return (DEFAULT + (LANGUAGE_MODEL_EXTRA if self.language_model else "")).split(",")


@dataclasses.dataclass(frozen=True)
class TechniqueSet:
  """One technique set: its techniques by term, with their values (True for a term
  that takes none), in `TECHNIQUES`' order.

  `program` is the step it measures on a reference model, `python` the same step
  printed; a step of the user's own holds ``lowmem`` or nothing.
  """
  label: str
  values: tuple[tuple[str, Any], ...] = ()

  def __contains__(self, term: str) -> bool:
    return any(t == term for t, _ in self.values)

  def get(self, term: str, default: Any = None) -> Any:
    """The value of ``term`` in the set, else ``default``."""
    return next((v for t, v in self.values if t == term), default)

  @property
  def adama(self) -> int:
    """AdamA's micro-batches a step; 1 without AdamA."""
    return self.get("adama", 1)

  @property
  def fold_in_backward(self) -> bool:
    """AdamA folds in the backward, except with 8-bit moments (folded in the scan body)."""
    return self.adama > 1 and "8bit" not in self

  def switches(self, job: Job) -> dict[str, Any]:
    """`lowmem_jax.models.workload`'s keywords for ``job`` (a reference model's), as
    `code.Code` where a value prints otherwise than its repr."""
    out = _shapes(job)
    for term, value in self.values:
      out.update(TECHNIQUES[term].model_switches(value, job))
    return out

  def check(self, job: Job) -> None:
    """Raises `TechniqueError` where a technique does not apply to ``job``'s model (the
    models' own check of its switches), the set lacks a technique one needs or holds
    one another excludes, or the model refuses ``job``'s shapes."""
    try:
      _workload(job.model, _shapes(job))
      refused = None
    except ValueError as e:  # a shape the model refuses, e.g. BERT's seq > 512
      refused = e
    for term, value in self.values if refused is None else ():
      try:
        _workload(job.model, {**_shapes(job), **TECHNIQUES[term].model_switches(value, job)})
      except ValueError as e:
        raise TechniqueError(f"{self.text(term)} in {self.label!r}: {e}") from e
    self.check_together()
    if refused is not None:
      raise TechniqueError(f"{self.label!r}: {refused}") from refused
    if "stream" in self and not job.language_model:
      raise TechniqueError(f"{self.text('stream')} in {self.label!r}: the layer-streamed step "
                           f"takes the LLaMA models' stacked layers; {job.model} is not one.")

  def check_together(self) -> None:
    """Raises `TechniqueError` where the set lacks a technique one needs or holds one
    another excludes."""
    for term, _ in self.values:
      technique = TECHNIQUES[term]
      if technique.needs is not None and technique.needs[0] not in self:
        raise TechniqueError(f"{self.label!r}: {term} needs {technique.needs[0]}: "
                             f"{technique.needs[1]}.")
      for other, why in technique.excludes:
        if other in self:
          raise TechniqueError(f"{self.label!r}: {term} does not take {other}: {why}.")

  def with_value(self, term: str, value: Any) -> "TechniqueSet":
    """The set with ``term`` at ``value``, its label saying so (``...+remat:dots``)."""
    values = dict(self.values, **{term: value})
    label = "+".join(t for t in self.label.split("+") if t.partition(":")[0] != term
                     and t != "baseline")
    shown = policies.describe(value) if term == "remat" else value
    return TechniqueSet("+".join(filter(None, (label, f"{term}:{shown}"))),
                        tuple((t, values[t]) for t in TECHNIQUES if t in values))

  def step_options(self) -> dict[str, Any]:
    """The `STEP_OPTIONS` this set passes to a user's ``make_step``, as `code`
    expressions (the defaults left out); `code.value` makes each."""
    out = {}
    lowmem = {}
    for t, _ in self.values:  # the first technique to set an option wins: approx over lowmem's
      for k, v in TECHNIQUES[t].lowmem.items():
        lowmem.setdefault(k, v)
    if lowmem:
      defaults = {k: p.default for k, p in inspect.signature(transform.lowmem).parameters.items()
                  if p.kind is p.KEYWORD_ONLY}
      given = {k: lowmem.get(k) for k in defaults if lowmem.get(k) != defaults[k]}
      out["lowmem"] = (code.Call.of("functools.partial", code.Name("lm.lowmem"), **given)
                       if given else code.Name("lm.lowmem"))
    if "bf16" in self:
      out["dtype"] = code.Code(jnp.bfloat16, "jnp.bfloat16")
    if "remat" in self:
      policy = self.get("remat")
      out["policy"] = code.Code(policy, f"lm.policies.{policies.describe(policy)}")
    if self.adama > 1:
      bits = {"state_bits": 8} if "8bit" in self else {}
      out["adamw"] = code.Call.of("functools.partial", code.Name("lm.adamaw"), k=self.adama,
                                  **bits)
      out["micro_batches"] = self.adama
    elif "8bit" in self:
      out["adamw"] = code.Name("lm.lowbit.adamw_8bit")
    if "bf16-params" in self:
      out["param_dtype"] = code.Code(jnp.bfloat16, "jnp.bfloat16")
    tx = code.Name("tx")
    for term, _ in self.values:
      if TECHNIQUES[term].optimizer is not None:
        tx = TECHNIQUES[term].optimizer(tx)
    if tx != code.Name("tx"):
      out["optimizer"] = code.Lambda("tx", tx)
    return out

  def text(self, term: str) -> str:
    """How ``term`` is written in the label (``"remat:full"``), or its name where the
    label gives it through ``all``."""
    return next((t.strip() for t in self.label.split("+") if t.strip().partition(":")[0] == term),
                term)

  def workload(self, job: Job) -> models.Workload:
    """The reference workload of ``job`` with this set's switches."""
    self.check(job)
    return _workload(job.model, self.switches(job))

  def _adamw_code(self) -> code.Call:
    """`adamw`'s call; its AdamA rule is the program's ``fold``."""
    if self.adama > 1:
      bits = {"state_bits": 8} if "8bit" in self else {}
      tx = code.Call.of("lm.adamaw", LEARNING_RATE, code.Name("fold"), **bits)
    elif "8bit" in self:
      tx = code.Call.of("lm.lowbit.adamw_8bit", LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    else:
      tx = code.Call.of("optax.adamw", LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    for term, _ in self.values:
      if TECHNIQUES[term].optimizer is not None and not (term == "offload-opt"
                                                         and "stream" in self):
        tx = TECHNIQUES[term].optimizer(tx)
    return tx

  def adamw(self) -> optax.GradientTransformation:
    """AdamW (`LEARNING_RATE`, `WEIGHT_DECAY`) as the set has it: AdamA, 8-bit,
    offloaded, bfloat16 parameters rounded stochastically (a sparse workload wraps it
    in `lowmem_jax.models.Workload.optimizer`)."""
    return code.Program(self._fold() + (("tx", self._adamw_code(), ""),)).run()["tx"]

  def _fold(self) -> tuple:
    if self.adama == 1:
      return ()
    return (("fold", code.Call.of("lm.MomentFold", self.adama),
             "AdamA's rule, for the optimizer and the step"),)

  def program(self, job: Job) -> code.Program:
    """The assignments ``wl`` (the workload), ``fold`` (with AdamA), ``tx`` and ``step``
    (jitted, parameters and state donated) of this set's training step of ``job``."""
    self.check(job)
    tx = self._adamw_code()
    if "sparse" in self:
      tx = code.Call.of("wl.optimizer", tx)
    fold = (code.Name("fold"),) if self.adama > 1 else ()
    in_backward = {"fold_in_backward": True} if self.fold_in_backward else {}
    streamed = ()
    if "stream" in self:
      fsdp = {"gather_params": True} if job.devices > 1 else {}
      streamed = (("streamed", code.Call.of(
          "lm.optim.layer_streamed", code.Call.of("wl.layer_stack"), code.Name("tx"),
          state="host" if "offload-opt" in self else "device", saved_inputs=self.get("stream"),
          **fsdp),
          "the optimizer inside the backward, a layer at a time"),)
      train_step = code.Name("streamed.step")
    else:
      train_step = code.Call.of("wl.train_step", code.Name("tx"), *fold, **in_backward)
    step = code.Call.of("jax.jit", train_step, donate_argnums=(0, 1))
    return code.Program((("wl", code.Call.of("lm.models.workload", job.model,
                                             **self.switches(job)), ""),
                         *self._fold(), ("tx", tx, ""), *streamed, ("step", step, "")))

  def python(self, job: Job) -> str:
    """`program`'s lines, then the parameters and optimizer state it starts from; for a
    step of the user's own, the call of ``make_step`` with `step_options`."""
    if job.make_step is not None:
      name = getattr(job.make_step, "__name__", "make_step")
      return code.Program((("step, args, *loss", code.Call(name, (), tuple(
          self.step_options().items())), ""),)).source()
    init = "streamed.init" if "stream" in self else "tx.init"
    start = (("params", code.Call.of("wl.init", code.Call.of("jax.random.key", 0)), ""),
             ("opt_state", code.Call.of(init, code.Name("params")), ""))
    return code.Program(self.program(job).lines + start).source()


def _shapes(job: Job) -> dict[str, Any]:
  """`lowmem_jax.models.workload`'s batch, size and compute dtype keywords for ``job``."""
  size = ({"image": job.image_side} if job.model in models.VIT_CONFIGS or job.conv_net
          else {"seq": job.seq})
  return {"batch": job.batch, **size, "dtype": code.Code(jnp.dtype(job.dtype), f"jnp.{job.dtype}")}


def _workload(model: str, switches: dict) -> models.Workload:
  return models.workload(model, **{k: v.value if isinstance(v, code.Code) else v
                                   for k, v in switches.items()})


def parse(text: str, step: bool = False) -> TechniqueSet:
  """The `TechniqueSet` of ``"all+remat:full+adama:4"``, or for a user's step
  (``step``) of `STEP_TECHNIQUES` (``"lowmem+approx+8bit"``); `TechniqueError`
  naming the term on a mistake."""
  values = {}
  for term in text.strip().split("+"):
    name, colon, value = term.strip().partition(":")
    technique = TECHNIQUES.get(name)
    if step and name not in STEP_TECHNIQUES:
      what = "applies only to the reference models (--model)" if technique else "is unknown"
      raise TechniqueError(f"technique {term.strip()!r} in {text!r} {what}; with a step of your "
                           f"own (--step), choose from {', '.join(STEP_TECHNIQUES)}.")
    if technique is not None and technique.value and not colon:
      raise TechniqueError(f"{name} in {text!r} takes a value: {name}:{technique.value}.")
    if technique is None or bool(colon) != bool(technique.value):
      raise TechniqueError(f"unknown technique {term.strip()!r} in {text!r}; choose from "
                           f"{', '.join(TECHNIQUES)}.")
    if name == "lowmem" and not step:
      raise TechniqueError(f"technique 'lowmem' in {text!r} applies only to --step (a step of "
                           "your own); a reference model takes approx, ms-norm, attention or all.")
    if technique.parse is not None:
      try:
        values[name] = technique.parse(value)
      except ValueError as e:
        raise TechniqueError(f"{term.strip()}: {e}.") from e
      if values[name] == technique.off:
        del values[name]
    elif name == "all":
      values.update(dict.fromkeys(_ALL, True))
    elif name != "baseline":
      values[name] = True
  return TechniqueSet(text.strip(), tuple((t, values[t]) for t in TECHNIQUES if t in values))


def _what(x: Any) -> str:
  return f"a {type(x).__name__} of {len(x)}" if isinstance(x, (tuple, list)) else f"a {type(x).__name__}"


def check(job: Job, techniques: TechniqueSet) -> None:
  """Raises `TechniqueError` where ``techniques`` does not apply to ``job``: a step of
  the user's own takes `STEP_TECHNIQUES` only, each where ``make_step`` takes its
  `STEP_OPTIONS`; a reference model every technique but lowmem."""
  if job.make_step is None:
    if "lowmem" in techniques:
      raise TechniqueError(f"technique 'lowmem' in {techniques.label!r} applies only to a step "
                           "of your own (make_step, --step).")
    return
  if any(term not in STEP_TECHNIQUES for term, _ in techniques.values):
    raise TechniqueError(f"{techniques.label!r} changes a reference model; a step of your own "
                         f"takes {', '.join(STEP_TECHNIQUES)}.")
  techniques.check_together()
  missing = job.missing_keywords(techniques)
  if missing:
    name = getattr(job.make_step, "__name__", "make_step")
    default = STEP_OPTIONS[missing[0]].default
    raise TechniqueError(f"{techniques.label!r} calls {name}({missing[0]}=...), and {name} takes "
                         f"no {missing[0]} argument: define {name}({missing[0]}={default}) (see "
                         "lowmem-jax report --help: the options of make_step).")


def _user_step(job: Job, techniques: TechniqueSet) -> tuple[Callable, tuple, Callable | None, tuple]:
  """``(step, step_args, loss_fn, loss_args)`` of ``job.make_step`` for ``techniques``, which
  `check` has passed (``loss_fn`` None where make_step gives none)."""
  name = getattr(job.make_step, "__name__", "make_step")
  made = job.make_step(**{k: code.value(v) for k, v in techniques.step_options().items()})
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


def arguments(job: Job, techniques: TechniqueSet) -> tuple[dict, Any, Any, tuple]:
  """``(built, params, opt_state, batch)``: `TechniqueSet.program`'s names and the step's
  abstract arguments, the offloaded state in host memory, sharded over ``job.devices``
  (`Job.shard`)."""
  built = techniques.program(job).run()
  wl, tx = built["wl"], built["tx"]
  params = wl.abstract_params()
  if "stream" in techniques:
    opt_state = jax.eval_shape(built["streamed"].init, params)
    if "offload-opt" in techniques:
      opt_state = targets.in_host_memory(opt_state)
  else:
    opt_state = offload.abstract_state(tx, params)
  return built, *job.shard(params, opt_state, (wl.inputs, wl.labels))


def device_argument_bytes(job: Job, techniques: TechniqueSet) -> int:
  """The bytes of ``techniques``' step's arguments (parameters, optimizer state, batch) that
  live on a device (its shards, over ``job.devices``): a floor under its peak, found without
  compiling."""
  _, *args = arguments(job, techniques)
  on_device = [jax.ShapeDtypeStruct(x.sharding.shard_shape(x.shape), x.dtype)
               if isinstance(x.sharding, jax.sharding.NamedSharding) else x
               for x in jax.tree.leaves(args)
               if getattr(getattr(x, "sharding", None), "memory_kind", None) != targets.HOST]
  return memory.tree_bytes(on_device)


def measure(job: Job, techniques: TechniqueSet, top: int | None = 10) -> memory.Breakdown:
  """The `memory.Breakdown` of ``techniques``' training step of ``job`` compiled for
  ``job.target``, with autodiff's residuals of its loss; a reference model's
  step is `TechniqueSet.program`'s: AdamW's, parameters and state donated."""
  check(job, techniques)
  if job.make_step is not None:
    step, step_args, loss_fn, loss_args = _user_step(job, techniques)
    return memory.report(step, *step_args, loss_fn=loss_fn, loss_args=loss_args,
                         label=techniques.label, top=top, target=job.target)
  k = techniques.adama
  if job.batch % k:
    raise TechniqueError(f"adama:{k}: the batch ({job.batch}) must split into {k} equal "
                         "micro-batches.")
  built, params, opt_state, batch = arguments(job, techniques)
  wl, step = built["wl"], built["step"]
  if job.devices > 1:  # the new parameters and state sharded as the old, which they replace
    shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
    step = jax.jit(step, out_shardings=(shardings(params), shardings(opt_state), None),
                   donate_argnums=(0, 1))
  micro = [jax.ShapeDtypeStruct((x.shape[0] // k, *x.shape[1:]), x.dtype) for x in batch]
  positions = (sparse.find_state(opt_state).positions,) if wl.sparse else ()
  # The streamed step saves each layer's input, not the residuals of the loss's backward.
  with job.compiling():
    return memory.report(step, params, opt_state, batch,
                         loss_fn=None if "stream" in techniques else wl.loss,
                         loss_args=(params, *micro, *positions), label=techniques.label,
                         top=top, target=job.target)


def row(b: memory.Breakdown, base: memory.Breakdown, techniques: TechniqueSet) -> dict:
  """The summary figures of one technique set's breakdown against ``base``'s: in bytes,
  parameters and optimizer state (None where no argument is one), gradients,
  activations, other, the live and compiled peaks, what lives in host memory
  (arguments and temporaries, beside the peak) and autodiff's saved
  activations (None without a loss: autodiff's count, which XLA's reuse and fusion can
  put above the peak) and the peak's saving (base's less this one's); as ratios, the
  reduction and the extra FLOPs, each loop's body counted as many times as it runs (None
  where a loop's trip count is unknown, `memory.loop_flops`); a device's collective bytes
  (`memory.collective_bytes`) and the seconds they take at the target's interconnect bandwidth
  one way (`Target.interconnect_bytes_per_s`), a floor under the step's communication time
  (None where either is unknown)."""
  at = b.at_peak
  link = b.target.interconnect_bytes_per_s
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
      "host_bytes": b.stats.host_argument_bytes + b.stats.host_temp_bytes,
      "reduction": base.stats.peak_bytes / b.stats.peak_bytes,
      "peak_saved_bytes": base.stats.peak_bytes - b.stats.peak_bytes,
      "extra_flops": (None if b.loop_flops is None or not base.loop_flops
                      else (b.loop_flops - base.loop_flops) / base.loop_flops),
      "saved_activation_bytes": b.saved.activation_bytes if b.saved else None,
      "collective_bytes": b.collective_bytes,
      "transfer_floor_s": (None if b.collective_bytes is None or link is None
                           else b.collective_bytes / link),
  }


def ladder(batch: int | None, language_model: bool = False, step: bool = False) -> list[str]:
  """Technique sets `cheapest_fit` tries, cheapest first: exact techniques, then an
  approximate gradient, then the optimizer state in fewer bits (8-bit moments,
  bfloat16 parameters), then recompute (``remat:plan``: `lowmem_jax.plan`'s
  policy); a language model's then the layer-streamed step (its saved inputs on
  the device, then the host, with ``late-embed`` (it lowers some rows' peaks and
  raises others': XLA's schedule), then its state on the host too), any other model's state on
  the host; last, micro-batches with full remat (k a power of 2 dividing
  ``batch``; 2, 4 and 8 for a ``step`` of the user's own, whose batch is its
  own). A language model's sets all take ``fused-ce`` (exact, and the largest
  single saving), after it alone. A user's ``step`` has the same ladder in its
  terms: ``lowmem`` for the exact rewrites, ``lowmem+approx`` for ``all``."""
  exact = "lowmem" if step else "ms-norm+attention"
  best = "bf16+lowmem+approx" if step else "all+fused-ce" if language_model else "all"
  state = f"{best}+8bit+bf16-params"
  sets = (["baseline"] + (["fused-ce"] if language_model else [])
          + [f"{s}+fused-ce" if language_model else s for s in ("bf16", f"bf16+{exact}")]
          + [best, f"{best}+8bit", state, f"{state}+remat:plan"])
  if language_model:
    sets += [f"{state}+stream:device", f"{state}+stream:host", f"{state}+stream:host+late-embed",
             f"{state}+stream:host+offload-opt"]
  else:
    sets.append(f"{state}+offload-opt")
  ks = (2, 4, 8) if step else [2**i for i in range(1, batch.bit_length()) if batch % 2**i == 0]
  return sets + [f"{state}+remat:full+adama:{k}" for k in ks]


def ladder_of(job: Job) -> tuple[list[str], tuple[str, ...]]:
  """``(sets, left out)``: `ladder` for ``job``, over several devices without the sets that
  hold state in host memory (``offload-opt``: such a step compiles for one device); for a
  user's step, each set without the techniques whose options ``make_step`` does not take
  (`Job.without_missing`), once, and those techniques."""
  texts = ladder(job.batch, job.language_model, step=job.make_step is not None)
  if job.make_step is None:
    return [t for t in texts if job.devices == 1 or "offload-opt" not in t], ()
  reduced = [job.without_missing(t) for t in texts]
  return (list(dict.fromkeys(t for t, _ in reduced)),
          tuple(dict.fromkeys(term for _, left in reduced for term in left)))


def planned(job: Job, text: str, budget: int) -> TechniqueSet | None:
  """The set ``text``; for ``remat:plan`` with the policy `lowmem_jax.plan` picks
  for ``budget`` bytes, or None where no policy fits. A user's step is compiled
  donating its first two arguments (the parameters and optimizer state) as the
  planner weighs the policies."""
  step = job.make_step is not None
  if "remat:plan" not in text:
    return parse(text, step=step)
  techniques = parse(text.replace("+remat:plan", ""), step=step)
  if step:
    _, args, _, _ = _user_step(job, techniques)
    donated = (0, 1)[:len(args)]

    def train_step(*args, policy):
      return _user_step(job, techniques.with_value("remat", policy))[0](*args)
  else:
    wl = techniques.workload(job)
    params = wl.abstract_params()
    tx = techniques.adamw()
    args = job.shard(params, jax.eval_shape(tx.init, params), (wl.inputs, wl.labels))
    donated = (0, 1)

    def train_step(params, opt_state, batch, *, policy):
      new_params, new_state, metrics = wl.with_policy(policy).train_step(
          tx, techniques.adama)(params, opt_state, batch)
      if job.devices == 1:
        return new_params, new_state, metrics
      like = lambda new, old: jax.tree.map(  # sharded as the old, which they replace
          lambda n, o: jax.lax.with_sharding_constraint(n, o.sharding), new, old)
      return like(new_params, args[0]), like(new_state, args[1]), metrics
  try:
    with job.compiling():
      chosen = planner.plan(train_step, *args, budget=budget, donate_argnums=donated,
                            target=job.target)
  except planner.BudgetError:
    return None
  return techniques.with_value("remat", chosen.policy)


class Fit(NamedTuple):
  """What `cheapest_fit` found.

  Attributes:
    tried: ``(breakdown, techniques)`` of each set measured, in ladder order.
    fits: the first set whose compiled peak fits, or None.
    fixed_bytes: the least any set of the ladder holds on the device in its arguments
      (parameters, optimizer state, batch); nothing is measured where it exceeds the budget.
    skipped: ``(text, bytes)`` of each set not compiled because its arguments alone on the
      device exceed the budget, in ladder order.
    not_taken: the techniques left out of a user's step's ladder (`Job.without_missing`),
      as its sets write them.
  """
  tried: list
  fits: TechniqueSet | None
  fixed_bytes: int
  skipped: list
  not_taken: tuple = ()


def cheapest_fit(job: Job, budget: int,
                 on_try: Callable[[str], None] = lambda text: None) -> Fit:
  """Measures the sets of `ladder` for ``job`` in order, up to the first whose
  compiled peak is at most ``budget`` bytes; ``on_try(text)`` is called before
  each. A set whose arguments alone on the device exceed the budget
  (`device_argument_bytes`, a reference model's) is skipped without compiling; a
  user's step's sets go without the techniques whose options ``make_step`` does not
  take (`Job.without_missing`), each set once. The
  ladder is the transformers' (ms-norm, attention), or a user's step's: not the
  WideResNet's."""
  if job.conv_net:
    raise TechniqueError(f"the ladder is the transformers' (ms-norm, attention); {job.model} "
                         "takes measure() of chosen sets instead.")
  step = job.make_step is not None
  texts, not_taken = ladder_of(job)
  arguments = {} if step else {
      text: device_argument_bytes(job, parse(text.replace("+remat:plan", ""))) for text in texts}
  floor = min(arguments.values(), default=0)
  tried, skipped = [], []
  if floor > budget:
    return Fit(tried, None, floor, skipped, not_taken)
  for text in texts:
    if arguments.get(text, 0) > budget:
      skipped.append((text, arguments[text]))
      continue
    on_try(text)
    techniques = planned(job, text, budget)
    if techniques is None:
      continue
    b = measure(job, techniques)
    tried.append((b, techniques))
    if b.stats.peak_bytes <= budget:
      return Fit(tried, techniques, floor, skipped, not_taken)
  return Fit(tried, None, floor, skipped, not_taken)
