"""What a technique set is measured on: a reference model at a batch's shapes, or a step
of the user's own, compiled for a target, on one device or FSDP over several."""

import contextlib
import dataclasses
import inspect
from typing import Any, Callable, Iterator

import jax

from lowmem_jax import models
from lowmem_jax.app.techniques import (
  CONV_NET_DEFAULT,
  DEFAULT,
  LANGUAGE_MODEL_EXTRA,
  TECHNIQUES,
  TechniqueError,
  TechniqueSet,
)
from lowmem_jax.app.step_options import STEP_DEFAULT, STEP_OPTIONS
from lowmem_jax.compile import targets
from lowmem_jax.ops import dispatch

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
    compiler_options: XLA options the reference model's step is jitted with in place of the
      set's own (`TechniqueSet.compiler_options`), e.g. those a measured row ran with; None:
      the set's.
  """
  model: str = "vit-b16"
  batch: int = 64
  seq: int = 512
  image: int | None = None
  dtype: str = "float32"
  target: targets.Target | str | None = None
  make_step: Callable | None = None
  devices: int = 1
  compiler_options: dict | None = dataclasses.field(default=None, hash=False)

  def __post_init__(self):
    if self.make_step is None and self.model not in models.NAMES:
      raise TechniqueError(f"model must be one of {', '.join(models.NAMES)}, got {self.model!r}.",
                           "model")
    for name in ("batch", "seq", "image", "devices"):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise TechniqueError(f"{name} must be an int >= 1, got {value!r}.", name)
    if self.dtype not in ("float32", "bfloat16", "float16"):
      raise TechniqueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}.",
                           "dtype")
    if self.compiler_options is not None and not isinstance(self.compiler_options, dict):
      raise TechniqueError("compiler_options must be a dict of XLA options or None, got "
                           f"{self.compiler_options!r}.", "compiler_options")
    try:
      object.__setattr__(self, "target", targets.resolve(self.target))
    except (ValueError, TypeError, targets.TargetUnavailable) as e:
      raise TechniqueError(f"target: {e}", "target") from e
    if self.devices > 1:
      self._check_devices()

  def _check_devices(self) -> None:
    """Raises `TechniqueError` where FSDP over `devices` does not apply to this job."""
    if self.make_step is not None:
      raise TechniqueError(f"devices={self.devices}: FSDP over several devices is for a "
                           "reference model; a step of your own shards itself.", "devices")
    if self.target.platform != "cuda":
      raise TechniqueError(f"devices={self.devices}: FSDP over several devices compiles for a "
                           f"GPU target (h100, ...); target {self.target.name} is not one (the "
                           "CPU proxy has no multi-GPU figure).", "devices")
    if self.batch % self.devices:
      raise TechniqueError(f"batch {self.batch} does not split over devices={self.devices}: "
                           "give a batch divisible by the devices.", "devices")
    try:
      self.target.devices(self.devices)
    except (ValueError, targets.TargetUnavailable) as e:
      raise TechniqueError(f"devices={self.devices}: {e}", "devices") from e

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
  def sequences(self) -> bool:
    """Whether the examples are sequences of ``seq`` tokens (LLaMA, BERT), counted in tokens,
    not images."""
    return self.make_step is None and self.model in (*models.llama.CONFIGS,
                                                     *models.BERT_CONFIGS)

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
    kept = [t for t in kept if t == "baseline"
            or all(n in names for n, _ in TECHNIQUES[t.partition(":")[0]].needs)]
    return ("+".join(t for t in kept if t != "baseline") or "baseline",
            tuple(t for t in terms if t not in kept))

  def missing_keywords(self, techniques: TechniqueSet) -> list[str]:
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
