"""One technique set measured on a `Job`: its checks, its step's abstract arguments, the
compiled step's `lowmem_jax.compile.memory.Breakdown` and its summary row against a
baseline."""

from typing import Any, Callable

import jax

from lowmem_jax.app import code
from lowmem_jax.app.job import Job
from lowmem_jax.app.step_options import STEP_OPTIONS, STEP_TECHNIQUES
from lowmem_jax.app.techniques import (
  TechniqueError,
  TechniqueSet,
  describe,
)
from lowmem_jax.compile import memory, targets
from lowmem_jax.optim import offload, sparse


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


class StepError(Exception):
  """An error raised tracing a user's step on its arguments (or its loss on the loss's): the
  step's, not the library's (its cause: the error raised)."""


def _traced(step: Callable, step_args: tuple, loss_fn: Callable | None,
            loss_args: tuple) -> None:
  """Traces the step on its arguments and the loss on its own (`jax.eval_shape`; the step's
  trace is jit's cached one its lowering reuses); raises `StepError` from any error."""
  try:
    jax.eval_shape(step, *step_args)
    if loss_fn is not None:
      jax.eval_shape(loss_fn, *loss_args)
  except Exception as e:
    raise StepError(f"{type(e).__name__}: {str(e).strip().partition(chr(10))[0]}") from e


def user_step(job: Job, techniques: TechniqueSet) -> tuple[Callable, tuple, Callable | None, tuple]:
  """``(step, step_args, loss_fn, loss_args)`` of ``job.make_step`` for ``techniques``, which
  `check` has passed (``loss_fn`` None where make_step gives none)."""
  name = getattr(job.make_step, "__name__", "make_step")
  made = job.make_step(**{k: code.value(v) for k, v in techniques.step_options().items()})
  said = f"{name}() returned"
  if not isinstance(made, (tuple, list)) or len(made) not in (2, 3):
    raise TechniqueError(f"{said} {describe(made)}; expected (step, args) or "
                         "(step, args, (loss_fn, loss_args)).")
  step, step_args, *loss = made
  if not callable(step):
    raise TechniqueError(f"{said} {describe(step)} as its step; expected a function.")
  if not isinstance(step_args, (tuple, list)):
    raise TechniqueError(f"{said} {describe(step_args)} as the step's args; expected a tuple "
                         "of its arguments (arrays or jax.ShapeDtypeStruct pytrees).")
  if not loss:
    return step, tuple(step_args), None, ()
  if not (isinstance(loss[0], (tuple, list)) and len(loss[0]) == 2 and callable(loss[0][0])
          and isinstance(loss[0][1], (tuple, list))):
    raise TechniqueError(f"{said} {describe(loss[0])} as its third element; expected (loss_fn, "
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
    step, step_args, loss_fn, loss_args = user_step(job, techniques)
    _traced(step, step_args, loss_fn, loss_args)
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
  (None where either is unknown); the estimated step time (`memory.step_time`), what bounds
  it, and its model FLOPs utilisation: ``base``'s FLOPs (XLA's count, loops as they run) over
  this step's time at the target's bfloat16 peak (None where unknown)."""
  at = b.at_peak
  seconds = b.step_time.seconds if b.step_time else None
  peak = b.target.peak_bf16_flops
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
      "step_s": seconds,
      "bound": b.step_time.bound if b.step_time else None,
      "mfu": base.loop_flops / (seconds * peak) if seconds and peak and base.loop_flops else None,
  }
