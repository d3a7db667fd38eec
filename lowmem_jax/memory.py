"""Memory accounting for any JAX function, on abstract shapes.

Two figures, and this module is the only place the project takes them from:

* `analyze`: XLA's buffer assignment of the function compiled for a target
  (``jax.jit(fn).lower(*args).compile().memory_analysis()``), by default the
  GPU the user trains on, compiled here without one (`lowmem_jax.targets`).
  It needs no real arrays (`jax.ShapeDtypeStruct` pytrees will do). Compiled
  for ``target="cpu"`` it is a proxy only: the CPU compiler upcasts 16-bit
  dots and keeps float32 copies that a GPU does not.
* `saved_residuals`: what autodiff keeps from the forward pass for the
  backward pass (``jax.vjp``'s residuals), backend-free: what papers count.

`report` puts both together for a training step: the buffers live at the
peak of the program (over XLA's buffer live ranges), split into parameters, optimizer state,
gradients, activations and temporaries, each with the op and source line
that made it, the live bytes over program order, and autodiff's residuals by
checkpoint name. `explain_oom` says the same of a step that does not fit.
"""

import dataclasses
import glob
import io
import math
import os
import re
import tempfile
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax._src import ad_checkpoint as _ad_checkpoint
from jax._src import core as _core
from jax._src.lib import _jax  # XLA's HLO cost analysis, as jax.stages.Lowered calls it
from rich.console import Console
from rich.table import Table

from lowmem_jax import names as _names
from lowmem_jax import targets


def compile(fn: Callable, *args, target: "targets.Target | str | None" = None,
            compiler_options: dict | None = None,
            **kwargs) -> "jax.stages.Compiled | targets.HostArgumentsCompiled":
  """Compiles ``fn`` (jitted here unless it already is) for ``target`` on the
  shapes of ``args``; nothing runs.

  Args:
    fn: a function, or the result of `jax.jit` (whose static arguments and
      donation are then respected).
    *args, **kwargs: arrays or `jax.ShapeDtypeStruct` pytrees.
    target: a `lowmem_jax.targets.Target` or its name (``"h100"``, ``"cpu"``,
      ...); None: `lowmem_jax.targets.default`, the GPU the figures are for.
    compiler_options: XLA debug options for this compilation only.
  """
  return targets.resolve(target).compile(fn, *args, compiler_options=compiler_options, **kwargs)


@dataclasses.dataclass(frozen=True)
class MemoryStats:
  """Byte counts of one compiled program (XLA's buffer assignment).

  Attributes:
    argument_bytes: the inputs.
    output_bytes: the outputs.
    alias_bytes: outputs that reuse (donated) input buffers.
    temp_bytes: everything else the program allocates; XLA packs its
      temporaries into one block, live for the whole program.
    generated_code_bytes: the compiled program itself.
    host_temp_bytes: temporaries in host memory: what a remat policy
      offloads (`lowmem_jax.policies.offload`) on a GPU target; 0 on the CPU,
      whose device memory is host memory.
    host_argument_bytes: inputs in host memory (`lowmem_jax.offload`'s
      optimizer state); not in ``argument_bytes``.
    xla_peak_bytes: XLA's own ``peak_memory_in_bytes``; on CPU it counts only
      arguments and outputs, and with host temporaries or arguments it adds
      host bytes, so it is not used there.
    peak_bytes: the device's peak: ``xla_peak_bytes`` where it is at least
      ``argument_bytes + temp_bytes`` (a real simulated peak) and nothing is
      in host memory, else ``argument_bytes + output_bytes - alias_bytes +
      temp_bytes``: every device allocation of the program at once, which is
      what the CPU backend holds.
  """
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  generated_code_bytes: int
  host_temp_bytes: int
  host_argument_bytes: int
  xla_peak_bytes: int
  peak_bytes: int


def stats_of(compiled: "jax.stages.Compiled | targets.HostArgumentsCompiled") -> MemoryStats:
  """`MemoryStats` of an already compiled program."""
  m = compiled.memory_analysis()
  if m is None:
    raise RuntimeError("This backend gives no memory analysis for compiled programs.")
  xla_peak = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
  host_temp = int(getattr(m, "host_temp_size_in_bytes", 0) or 0)
  host_args = int(getattr(m, "host_argument_size_in_bytes", 0) or 0)
  lower_bound = m.argument_size_in_bytes + m.temp_size_in_bytes
  total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
  return MemoryStats(
      argument_bytes=int(m.argument_size_in_bytes),
      output_bytes=int(m.output_size_in_bytes),
      alias_bytes=int(m.alias_size_in_bytes),
      temp_bytes=int(m.temp_size_in_bytes),
      generated_code_bytes=int(m.generated_code_size_in_bytes),
      host_temp_bytes=host_temp,
      host_argument_bytes=host_args,
      xla_peak_bytes=xla_peak,
      peak_bytes=int(xla_peak if xla_peak >= lower_bound and not (host_temp or host_args)
                     else total),
  )


def analyze(fn: Callable, *args, target: "targets.Target | str | None" = None,
            **kwargs) -> MemoryStats:
  """Compiles ``fn`` for ``target`` (see `compile`) on the shapes of ``args``
  and returns its `MemoryStats`.

  Example:
    >>> import jax, jax.numpy as jnp, lowmem_jax as lm
    >>> x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    >>> lm.memory.analyze(lambda x: x @ x, x, target="h100").argument_bytes
    262144
  """
  return stats_of(compile(fn, *args, target=target, **kwargs))


@dataclasses.dataclass(frozen=True)
class Residual:
  """One array that autodiff saves for the backward pass.

  Attributes:
    shape, dtype, nbytes: the array.
    source: where it comes from: ``"argument <name>"``, ``"named <name>"`` for
      a `checkpoint_name`, or ``"output of <primitive>"``, with the source line.
    name: the `checkpoint_name` if it has one, else None.
    is_argument: True for a function input, a closed-over constant (the
      ``params`` of ``lambda x: model.apply(params, x)``) or a literal: memory
      that lives anyway, not activation memory.
    on_host: True for a residual a remat policy offloads to host memory.
  """
  shape: tuple[int, ...]
  dtype: np.dtype
  nbytes: int
  source: str
  name: str | None
  is_argument: bool
  on_host: bool = False


@dataclasses.dataclass(frozen=True)
class Residuals:
  """The residuals of ``jax.vjp(fn, *args)``, in the order autodiff keeps them."""
  rows: tuple[Residual, ...]

  @property
  def total_bytes(self) -> int:
    return sum(r.nbytes for r in self.rows)

  @property
  def activation_bytes(self) -> int:
    """Bytes of the residuals that are not function inputs, in device memory."""
    return sum(r.nbytes for r in self.rows if not (r.is_argument or r.on_host))

  @property
  def host_bytes(self) -> int:
    """Bytes of the residuals offloaded to host memory."""
    return sum(r.nbytes for r in self.rows if r.on_host)

  def by_name(self) -> dict[str, int]:
    """Device activation bytes grouped by checkpoint name (unnamed under ``None``)."""
    out: dict[str, int] = {}
    for r in self.rows:
      if not (r.is_argument or r.on_host):
        out[r.name] = out.get(r.name, 0) + r.nbytes
    return out

  def __str__(self) -> str:
    lines = [f"{'shape':<28} {'dtype':<9} {'bytes':>14}  source"]
    for r in self.rows:
      shape = f"[{','.join(map(str, r.shape))}]"
      lines.append(f"{shape:<28} {str(r.dtype):<9} {r.nbytes:>14,}  {r.source}")
    lines.append(f"activations {self.activation_bytes:,} bytes on the device, {self.host_bytes:,} on the "
                 f"host; with arguments {self.total_bytes:,} bytes")
    return "\n".join(lines)


_NAMED = re.compile(r"^named '([^']*)'")


def saved_residuals(fn: Callable, *args, **kwargs) -> Residuals:
  """What autodiff saves for the backward pass of ``fn`` at ``args``.

  Uses JAX's own residual analysis (the one behind
  `jax.ad_checkpoint.print_saved_residuals`), so `jax.checkpoint` policies and
  `custom_vjp` rules are honoured. Arguments may be `jax.ShapeDtypeStruct`.

  Returns:
    `Residuals`: a row per saved array with shape, dtype, bytes and source.
  """
  if not callable(fn):
    raise TypeError(f"fn must be callable, got {type(fn).__name__}.")
  rows = []
  for aval, source in _ad_checkpoint.saved_residuals(fn, *args, **kwargs):
    shape = tuple(aval.shape)
    dtype = np.dtype(aval.dtype)
    named = _NAMED.match(source)
    rows.append(Residual(
        shape=shape, dtype=dtype, nbytes=math.prod(shape) * dtype.itemsize,
        source=source, name=named.group(1) if named else None,
        is_argument=source.startswith(("from the argument", "from a constant", "from a literal")),
        on_host=getattr(aval, "memory_space", None) == _core.MemorySpace.Host))
  return Residuals(tuple(rows))


COMPONENTS = ("parameters", "optimizer state", "inputs", "gradients", "activations", "updates",
              "temporaries")
"""What `report` splits the buffers live at the peak into, in this order:

* parameters, optimizer state, inputs: the step's arguments, told apart by
  their type or their path. Optimizer state: a leaf inside an optax state
  (a NamedTuple of optax or of lowmem_jax, e.g. ``ScaleByAdamState``, ``AdamAState``),
  an ``nnx.Optimizer``'s state (``nnx.OptState`` variables), or under a name
  ``opt_state``; else a parameter: an ``nnx.Param`` variable (an NNX model or
  its ``nnx.state``), or under a name ``params`` (``train_step(state, batch)``
  with a Flax ``TrainState``, or ``train_step(params, opt_state, batch)``);
  any other argument is an input. A component with no argument at all is
  reported as "none found", not as 0.
* gradients (estimated): values made by the backward pass (an op under
  ``transpose(...)``) with the shape and dtype of a parameter. A gradient that
  XLA fuses into the optimizer's update never exists as a buffer.
* activations: values made by the forward pass of a differentiated function
  (an op under ``jvp(...)``, not under ``transpose``): the saved residuals and
  the forward values in flight.
* updates (estimated): other values with the shape and dtype of a parameter,
  made outside autodiff: the optimizer's new parameters and moments where they
  are not written over the old (no donation, or inside a micro-batch loop),
  and its intermediates. An argument's buffer keeps the argument's component
  when a new value is written over it (a donated step).
* temporaries: everything else (backward values, recomputed forward values,
  small outputs, copies XLA adds).
"""
ESTIMATED = frozenset({"gradients", "updates"})


@dataclasses.dataclass(frozen=True)
class Buffer:
  """A value of the compiled program (XLA's buffer assignment).

  Attributes:
    name: the HLO value (instruction name and tuple index), e.g. ``fusion.3{}``.
    nbytes: its size.
    shape: its HLO shape and dtype, e.g. ``f32[64,197,3072]``.
    op_name: the JAX op path that made it, e.g.
      ``jit(step)/transpose(jvp(ViT))/Transformer/encoderblock_1/MlpBlock_0/Dense_1/dot_general``;
      for an argument, its path, e.g. ``params['Dense_0']['kernel']``.
    source: ``file:line`` of the user code that made it, where XLA kept it.
    start, end: the first and last positions in program order where it is live.
    component: one of `COMPONENTS`.
    checkpoint_name: for an activation, the `checkpoint_name` of the autodiff
      residuals (`report` with ``loss_fn``) of the same shape, dtype and
      source line, where all of them carry that one name; else None. A match
      by place, not identity: XLA keeps no checkpoint names.
  """
  name: str
  nbytes: int
  shape: str
  op_name: str
  source: str
  start: int
  end: int
  component: str
  checkpoint_name: str | None = None

  @property
  def layer(self) -> str:
    """The module path of the op up to its first numbered module, e.g.
    ``Transformer/encoderblock_1``; ``(top level)`` where the op is in none."""
    parts = [p for p in self.op_name.split("/")[:-1] if "(" not in p and p not in _NOT_MODULES]
    for i, part in enumerate(parts):
      if _NUMBERED.search(part):
        return "/".join(parts[:i + 1])
    return "/".join(parts) or "(top level)"


_NOT_MODULES = frozenset({"while", "body", "cond", "closed_call", "checkpoint", "rematted_computation"})
_NUMBERED = re.compile(r"_\d+$")


@dataclasses.dataclass(frozen=True)
class Breakdown:
  """Where the memory of one compiled step goes.

  Two sources, never mixed: ``stats``, ``flops``, ``at_peak``, ``live_bytes``,
  ``buffers`` and ``activations_by_layer`` come from XLA's compilation of the
  step (buffer assignment, buffer live ranges, cost analysis); ``saved`` from
  autodiff's residual analysis of ``loss_fn``. Components marked in
  `ESTIMATED` are estimates.

  Attributes:
    label: what was compiled, for tables and plots.
    target: the `lowmem_jax.targets.Target` it was compiled for.
    stats: the compiled `MemoryStats`; ``stats.peak_bytes`` is the peak the
      figures of this project compare.
    flops: FLOPs of the step (XLA's cost analysis, `step_flops`; a loop body counts once).
    at_peak: bytes of each of `COMPONENTS` live at the peak of XLA's heap
      simulation; they sum to ``live_peak_bytes``.
    peak_position: where in program order the peak is, of ``len(live_bytes)``.
    peak_op: the op that runs at the peak, with its source line.
    live_bytes: bytes live at each position of the program order.
    buffers: the buffers live at the peak, largest first (``top`` of them).
    activations_by_layer: bytes of the activations live at the peak, by `Buffer.layer`.
    argument_components: which of parameters, optimizer state and inputs the
      step's arguments hold; parameters or optimizer state missing here are
      rendered as "none found".
    saved: the residuals autodiff saves for ``loss_fn``, or None.
  """
  label: str
  target: targets.Target
  stats: MemoryStats
  flops: float
  at_peak: dict[str, int]
  peak_position: int
  peak_op: str
  live_bytes: tuple[int, ...]
  buffers: tuple[Buffer, ...]
  activations_by_layer: dict[str, int]
  argument_components: frozenset[str]
  saved: Residuals | None = None

  @property
  def live_peak_bytes(self) -> int:
    """Bytes live at the peak, summed over XLA's buffer live ranges; at most
    ``stats.peak_bytes`` on CPU, whose allocation also holds what buffer
    packing leaves unused."""
    return sum(self.at_peak.values())

  def saved_by_kind(self) -> dict[str, int]:
    """Device bytes of ``saved`` by `lowmem_jax.names.kind`; empty without ``saved``."""
    out: dict[str, int] = {}
    for name, nbytes in (self.saved.by_name() if self.saved else {}).items():
      kind = _names.kind(name)
      out[kind] = out.get(kind, 0) + nbytes
    return out

  def to_dict(self) -> dict:
    """The figures as plain types, ready for `json.dump`."""
    saved = self.saved
    return {
        "label": self.label,
        "target": self.target.name,
        "device_kind": self.target.device_kind,
        "target_note": self.target.note,
        "compiled": dataclasses.asdict(self.stats),
        "flops": self.flops,
        "at_peak": dict(self.at_peak),
        "estimated": sorted(ESTIMATED),
        "live_peak_bytes": self.live_peak_bytes,
        "peak_position": self.peak_position,
        "positions": len(self.live_bytes),
        "peak_op": self.peak_op,
        "activations_by_layer": dict(self.activations_by_layer),
        "argument_components": sorted(self.argument_components),
        "saved_activation_bytes": saved.activation_bytes if saved else None,
        "saved_by_name": {str(k): v for k, v in saved.by_name().items()} if saved else None,
        "saved_by_kind": self.saved_by_kind() if saved else None,
        "largest_at_peak": [dataclasses.asdict(b) for b in self.buffers],
    }

  def plot(self, path: str, *others: "Breakdown") -> None:
    """Writes a PNG of stacked bars, one per breakdown (this one first), of
    `COMPONENTS` at the peak. Needs matplotlib (``pip install 'lowmem-jax[plot]'``)."""
    from lowmem_jax import _plots
    _plots.components(path, (self, *others))

  def plot_live_bytes(self, path: str, *others: "Breakdown") -> None:
    """Writes a PNG of the live bytes over program order, one curve per
    breakdown, each peak marked. Needs matplotlib."""
    from lowmem_jax import _plots
    _plots.live_bytes(path, (self, *others))

  def __str__(self) -> str:
    return _render(*_tables(self))


def report(step_fn: Callable, *args, loss_fn: Callable | None = None, loss_args: tuple = (),
           label: str = "step", top: int | None = 10,
           target: "targets.Target | str | None" = None, **kwargs) -> Breakdown:
  """Where the memory of the compiled ``step_fn(*args, **kwargs)`` goes.

  Compiles the step once on the shapes of ``args`` (nothing runs, nothing is
  allocated) and splits the buffers live at the peak of the program (summed over XLA's buffer live ranges)
  into `COMPONENTS`; with ``loss_fn``, adds autodiff's residuals of
  ``loss_fn(*loss_args)`` (by checkpoint name and kind).

  Example:
    >>> import jax, jax.numpy as jnp, optax, lowmem_jax as lm
    >>> tx = optax.adam(1e-3)
    >>> loss = lambda params, x: jnp.tanh(x @ params["w"]).sum()
    >>> def train_step(params, opt_state, x):
    ...   updates, opt_state = tx.update(jax.grad(loss)(params, x), opt_state)
    ...   return optax.apply_updates(params, updates), opt_state
    >>> params = {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32)}
    >>> x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    >>> b = lm.memory.report(train_step, params, jax.eval_shape(tx.init, params), x)
    >>> b.at_peak["parameters"], b.at_peak["optimizer state"]
    (262144, 524292)

  Args:
    step_fn: the step, jitted here unless it already is (then its static
      arguments and donation are respected).
    *args, **kwargs: its arguments, arrays or `jax.ShapeDtypeStruct` pytrees
      (NNX modules and ``nnx.Optimizer`` included, for an ``nnx.jit`` step).
      Parameters and optimizer state are told apart from the inputs by type
      (``nnx.Param``, an optax state, an ``nnx.Optimizer``) or by name
      (``params``, ``opt_state``, or a state with such fields); see `COMPONENTS`.
    loss_fn, loss_args: the function the step differentiates and its arguments,
      for autodiff's residual count; optional.
    label: a name for tables and plots.
    top: how many of the buffers live at the peak to keep (all if None).
    target: what to compile for (see `compile`); default: the GPU the
      figures are for (`lowmem_jax.targets.default`).

  Returns:
    a `Breakdown`.
  """
  if top is not None and (not isinstance(top, int) or top < 0):
    raise ValueError(f"top must be an int >= 0 or None, got {top!r}.")
  saved = saved_residuals(loss_fn, *loss_args) if loss_fn is not None else None
  target = targets.resolve(target)
  with tempfile.TemporaryDirectory() as dump:
    lowered = target.lower(step_fn, *args, **kwargs)
    if not isinstance(lowered, jax.stages.Lowered):
      lowered = lowered.lowered  # flax.nnx.jit's Lowered wraps jax's
    compiled = target.compile_lowered(lowered, {"xla_dump_to": dump})
    texts = [_read_one(dump, suffix) for suffix in (".txt", "-buffer-assignment.txt", "-live-range.txt")]
  instructions = _parse_hlo(texts[0])
  typed = _typed_components(lowered, args, kwargs,
                            sum(i.parameter is not None for i in instructions.values()))
  arguments = {name: _argument_component(i.op_name, typed.get(i.parameter))
               for name, i in instructions.items() if i.parameter is not None}
  values, sequence, held = _parse_dump(instructions, arguments, *texts[1:])
  names_by_place = _names_by_place(saved)
  param_shapes = {v.shape for v in values if v.component == "parameters"}
  last = max(v.end for v in values)  # one past the last instruction: the program's end
  curve = np.zeros(last + 2, np.int64)
  for v in values:
    curve[v.start] += v.nbytes
    curve[v.end + 1] -= v.nbytes
  live_bytes = np.cumsum(curve)[:-1]
  peak_position = int(np.argmax(live_bytes))
  buffers = []
  for v in values:
    if v.start <= peak_position <= v.end:
      if v.component is None:
        component = _computed_component(v, param_shapes, held.get(v.name))
        name = names_by_place.get((v.shape, v.source)) if component == "activations" else None
        v = dataclasses.replace(v, component=component, checkpoint_name=name)
      buffers.append(v)
  buffers.sort(key=lambda b: -b.nbytes)
  at_peak = {c: sum(b.nbytes for b in buffers if b.component == c) for c in COMPONENTS}
  by_layer: dict[str, int] = {}
  for b in buffers:
    if b.component == "activations":
      by_layer[b.layer] = by_layer.get(b.layer, 0) + b.nbytes
  peak_name = sequence[peak_position] if peak_position < len(sequence) else "(the end)"
  peak_instr = instructions.get(peak_name, _Instr("", "", None))
  return Breakdown(
      label=label, target=target, stats=stats_of(compiled), flops=step_flops(lowered, compiled), at_peak=at_peak,
      peak_position=peak_position,
      peak_op=f"{peak_name} {peak_instr.op_name} {peak_instr.source}".strip(),
      live_bytes=tuple(int(b) for b in live_bytes),
      buffers=tuple(buffers[:top] if top is not None else buffers),
      activations_by_layer=dict(sorted(by_layer.items(), key=lambda kv: -kv[1])),
      argument_components=frozenset(arguments.values()), saved=saved)


def explain_oom(fn: Callable, *args, limit_bytes: int | None = None, top: int = 10,
                target: "targets.Target | str | None" = None, **kwargs) -> str:
  """Why ``fn(*args, **kwargs)`` does not fit: its compiled peak against the
  device's memory, what is live at the peak and the ``top`` largest buffers
  there, with the op and source line that made each.

  Compiles on abstract shapes, so it works for a step too big to run.

  Args:
    fn, *args, **kwargs, target: as for `report`.
    limit_bytes: the memory to compare with; default: the target's
      (`lowmem_jax.targets.Target.memory_bytes`).
  """
  breakdown = report(fn, *args, top=top, target=target, **kwargs)
  if limit_bytes is None:
    limit_bytes = breakdown.target.memory_bytes
  peak = breakdown.stats.peak_bytes
  if limit_bytes is None:
    verdict = f"target {breakdown.target.name} has no memory size (pass limit_bytes=)"
  elif peak > limit_bytes:
    verdict = f"over the limit of {_mib(limit_bytes)} MiB by {_mib(peak - limit_bytes)} MiB"
  else:
    verdict = f"fits in the limit of {_mib(limit_bytes)} MiB with {_mib(limit_bytes - peak)} MiB to spare"
  return f"compiled peak {_mib(peak)} MiB: {verdict}.\n{breakdown}"


_NONE_FOUND = {
    "parameters": "pass them as an argument (or a field) named `params`, or as nnx.Param "
                  "variables (an NNX model).",
    "optimizer state": "pass it as an argument (or a field) named `opt_state`, as an optax "
                       "state or as an nnx.Optimizer.",
}


def _mib(nbytes: float) -> str:
  return f"{nbytes / 2**20:,.1f}"


def _tables(b: Breakdown) -> list:
  live = b.live_peak_bytes
  host = (f"; {_mib(b.stats.host_temp_bytes)} MiB offloaded to host memory"
          if b.stats.host_temp_bytes else "")
  out = [b.target.note,
         f"{b.label}: compiled peak {_mib(b.stats.peak_bytes)} MiB (XLA memory analysis){host}; "
         f"live at the peak {_mib(live)} MiB (over XLA's buffer live ranges), at position "
         f"{b.peak_position} of {len(b.live_bytes)}: {b.peak_op}"]
  main = Table("live at the peak", "MiB", "share")
  missing = [c for c in _NONE_FOUND if c not in b.argument_components]
  for component, nbytes in b.at_peak.items():
    note = " (estimated)" if component in ESTIMATED else ""
    if component in missing:
      main.add_row(component, "none found", "-")
    else:
      main.add_row(component + note, _mib(nbytes), f"{100 * nbytes / live:.1f}%" if live else "-")
  out.append(main)
  out.extend(f"{c}: none found among the step's arguments: {_NONE_FOUND[c]}" for c in missing)
  if b.saved is not None:
    out.append(f"saved for the backward pass: {_mib(b.saved.activation_bytes)} MiB "
               "(autodiff's residuals of loss_fn)")
    saved = Table("kind", "name", "MiB")
    for name, nbytes in sorted(b.saved.by_name().items(), key=lambda kv: -kv[1]):
      saved.add_row(_names.kind(name), name or "(unnamed)", _mib(nbytes))
    out.append(saved)
  if b.activations_by_layer:
    layers = Table("activations live at the peak, by layer", "MiB")
    for layer, nbytes in b.activations_by_layer.items():
      layers.add_row(layer, _mib(nbytes))
    out.append(layers)
  largest = Table("MiB", "shape", "component", "name", "op", "source",
                  title="largest buffers live at the peak")
  for buf in b.buffers:
    largest.add_row(_mib(buf.nbytes), buf.shape, buf.component, buf.checkpoint_name or "",
                    buf.op_name or "(made by XLA)", buf.source)
  out.append(largest)
  return out


def _render(*renderables) -> str:
  console = Console(file=io.StringIO(), width=160, color_system=None)
  for r in renderables:
    console.print(r)
  return console.file.getvalue().rstrip()


def flops_of(program: jax.stages.Compiled | jax.stages.Lowered) -> float:
  """FLOPs of a compiled (or lowered) program, from XLA's cost analysis.

  A compile-only GPU gives no cost analysis: there, give the lowered program,
  whose FLOPs XLA's HLO cost analysis counts on the host before optimisation
  (recompute from `jax.checkpoint` included; fusion changes no FLOP count).
  """
  try:
    cost = program.cost_analysis()
  except NotImplementedError:
    cost = None
  if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
    cost = cost[0]
  if not cost and isinstance(program, jax.stages.Lowered):
    host = jax.devices("cpu")[0].client
    cost = _jax.hlo_module_cost_analysis(host, program.compiler_ir("hlo").as_hlo_module())
  if not cost or "flops" not in cost:
    raise RuntimeError("This backend's cost analysis gives no FLOP count; for a compile-only "
                       "target, pass the lowered program (Target.lower).")
  return float(cost["flops"])


def step_flops(lowered: jax.stages.Lowered, compiled: jax.stages.Compiled) -> float:
  """`flops_of` the compiled program where its backend counts them, else of ``lowered``."""
  try:
    return flops_of(compiled)
  except RuntimeError:
    return flops_of(lowered)


class _Instr(NamedTuple):
  op_name: str
  source: str
  parameter: int | None  # its number, for an argument of the entry computation
  copy_of: str | None = None  # the operand, for a copy XLA adds


_INSTR = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<shape>\([^=]*?\)|\S+) "
                    r"(?P<op>[\w\-]+)\((?P<number>\d*)(?:%(?P<operand>[\w.\-]+)\))?")
_COMMENT = re.compile(r"/\*.*?\*/")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_FILE = re.compile(r'^(\d+) "(.*)"$')
_LOCATION = re.compile(r"^(\d+) \{file_name_id=(\d+) function_name_id=\d+ line=(\d+)")
_FRAME = re.compile(r"^(\d+) \{file_location_id=(\d+)")
_HOST_COLOR = "5"  # XLA's memory space of host memory in buffer assignment
_ALLOCATION = re.compile(r"^allocation (?P<allocation>\d+): size \d+, (?:color (?P<color>\d+), )?"
                         r"(?:parameter (?P<parameter>\d+))?")
_VALUE = re.compile(r"^ value: <\d+ (?P<name>[\w.\-]+)(?P<index>\{[\d,]*\})?(?: \(phi\))? @\d+> "
                    r"\(size=(?P<size>\d+),offset=(?P<offset>\d+)\): (?P<shape>.*)$")
_RANGE = re.compile(r"^\s+(?P<name>[\w.\-]+\{[\d,]*\}):(?P<start>\d+)-(?P<end>\d+)$")
_POSITION = re.compile(r"^\s+(\d+):([\w.\-]+)$")
_LAYOUT = re.compile(r"\{[^{}]*\}")


def _parse_hlo(text: str) -> dict[str, _Instr]:
  """Maps instruction name to its op_name, source line and, for an argument
  of the entry computation, its number, from an HLO dump."""
  files, locations, frames, section, entry = {}, {}, {}, None, False
  out = {}
  for line in text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      section = line
      continue
    entry = line.startswith("ENTRY ") or (entry and line != "}")
    if section == "FileNames" and (m := _FILE.match(line)):
      files[m.group(1)] = m.group(2)
    elif section == "FileLocations" and (m := _LOCATION.match(line)):
      locations[m.group(1)] = f"{files.get(m.group(2), '?')}:{m.group(3)}"
    elif section == "StackFrames" and (m := _FRAME.match(line)):
      frames[m.group(1)] = locations.get(m.group(2), "")
    elif (m := _INSTR.match(_COMMENT.sub("", line))):
      op = _OP_NAME.search(line)
      frame = _FRAME_ID.search(line)
      out[m.group("name")] = _Instr(
          op.group(1).replace("\\'", "'") if op else "",
          frames.get(frame.group(1), "") if frame else "",
          int(m.group("number")) if entry and m.group("op") == "parameter" else None,
          m.group("operand") if m.group("op") == "copy" else None)
  return out


def _parse_dump(instructions: dict[str, _Instr], arguments: dict[str, str], assignment: str,
                live_range: str) -> tuple[list[Buffer], list[str], dict[str, str]]:
  """The values in device memory with their live ranges, the program order, and the
  component of the argument whose buffer holds each other value, where one does (an
  output written over a donated argument).

  An argument, and a copy of one that XLA adds to change its layout, already
  has its component. Where a value is written over another in place (same
  buffer and offset), XLA's live ranges overlap at the writing position; here
  the new value takes over the buffer there, so the bytes are counted once.
  ``arguments`` maps each argument's instruction name to its component.
  """
  by_number = {i.parameter: arguments[name] for name, i in instructions.items() if name in arguments}
  found, allocation, parameter, on_device = {}, None, None, True
  for line in assignment.splitlines():
    if m := _ALLOCATION.match(line):
      allocation, parameter = m.group("allocation"), m.group("parameter")
      on_device = m.group("color") != _HOST_COLOR
    elif on_device and (m := _VALUE.match(line)):
      shape = _LAYOUT.sub("", _COMMENT.sub("", m.group("shape")))
      holder = by_number.get(int(parameter)) if parameter else None
      found[m.group("name") + (m.group("index") or "{}")] = (
          int(m.group("size")), shape, holder, (allocation, m.group("offset")))
  if "BufferLiveRange:" not in live_range:
    raise RuntimeError("XLA's live-range dump has no BufferLiveRange section; its format may have changed.")
  sequence, by_slot, held = [], {}, {}
  for line in live_range.split("Live ranges at", 1)[0].splitlines():
    if m := _POSITION.match(line):
      sequence.append(m.group(2))
    elif (m := _RANGE.match(line)) and m.group("name") in found:
      nbytes, shape, holder, slot = found[m.group("name")]
      instr_name = m.group("name").split("{", 1)[0]
      instr = instructions.get(instr_name, _Instr("", "", None))
      component = arguments.get(instr_name) or arguments.get(instr.copy_of)
      if holder and not component:
        held[m.group("name")] = holder
      by_slot.setdefault(slot, []).append(Buffer(
          name=m.group("name"), nbytes=nbytes, shape=shape, op_name=instr.op_name,
          source=instr.source, start=int(m.group("start")), end=int(m.group("end")),
          component=component))
  values = []
  for in_slot in by_slot.values():
    in_slot.sort(key=lambda v: (v.start, v.end))
    for old, new in zip(in_slot, in_slot[1:]):
      if new.start <= old.end:
        old = dataclasses.replace(old, end=new.start - 1)
      if old.end >= old.start:
        values.append(old)
    values.append(in_slot[-1])
  return values, sequence, held


_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_RANK = {None: 0, "inputs": 0, "parameters": 1, "optimizer state": 2}  # the stronger one wins


def _argument_component(path: str, typed: str | None = None) -> str:
  """The component of an argument from its HLO path and the component its type says, if any."""
  words = set(_IDENTIFIER.findall(path))
  named = "optimizer state" if "opt_state" in words else "parameters" if "params" in words else "inputs"
  return max(named, typed or "inputs", key=_RANK.get)


def _type_component(node: Any) -> str | None:
  """The component a pytree node's type says its leaves belong to, if any."""
  if isinstance(node, nnx.OptState):  # an nnx.Optimizer's state and step count
    return "optimizer state"
  if isinstance(node, nnx.Param):
    return "parameters"
  if (isinstance(node, tuple) and hasattr(node, "_fields")
      and type(node).__module__.partition(".")[0] in ("optax", "lowmem_jax")):
    return "optimizer state"  # optax's states, lowmem_jax.optim's AdamAState
  return None


def _typed_leaves(tree: Any, within: str | None = None) -> list[tuple[Any, str | None]]:
  """Each leaf of ``tree`` (in jax's flattening order) with the component the
  types of the nodes above it say, the stronger one where several do; None
  under no such node."""
  def typed(node):
    return node is not tree and _type_component(node) is not None

  out = []
  for node in jax.tree.leaves(tree, is_leaf=typed):
    if typed(node):
      out.extend(_typed_leaves(node, max(within, _type_component(node), key=_RANK.get)))
    else:
      out.append((node, within))
  return out


def _typed_components(lowered: jax.stages.Lowered, args: tuple, kwargs: dict,
                      parameters: int) -> dict[int, str]:
  """HLO entry parameter number -> the component its argument's type says,
  where one does (see `_typed_leaves`).

  The types are read from the step's own arguments where their leaves are
  the lowered program's arguments: those of a jit without static arguments,
  and of an ``nnx.jit``, to which each NNX module is a flat list of its
  Variables' arrays in the order jax flattens the module; else from the
  lowered program's own argument tree (a jit with static arguments). A jit
  prunes unused arguments: the entry parameters are the kept ones, in order.
  """
  avals = [(a.shape, a.dtype) for a in jax.tree.leaves(lowered.in_avals)]
  leaves = _typed_leaves((args, kwargs))
  if [(tuple(getattr(x, "shape", ())), getattr(x, "dtype", None)) for x, _ in leaves] != avals:
    leaves = _typed_leaves(lowered.args_info)
  # jax keeps the pruning only in its lowering's compile args.
  lowering = getattr(lowered, "_lowering", None)
  kept = sorted(getattr(lowering, "compile_args", {}).get("kept_var_idx", range(len(avals))))
  if len(kept) != parameters or len(leaves) != len(avals):
    return {}  # not the layout assumed here (a jax change): the names alone decide
  return {number: leaves[i][1] for number, i in enumerate(kept) if leaves[i][1]}


def _computed_component(value: Buffer, param_shapes: set[str], holder: str | None) -> str:
  backward, forward = "transpose(" in value.op_name, "jvp(" in value.op_name
  if backward and value.shape in param_shapes:
    return "gradients"
  if forward and not backward:
    return "activations"
  if holder:
    return holder
  return "updates" if value.shape in param_shapes and not forward else "temporaries"


_HLO_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64",
              "int8": "s8", "int16": "s16", "int32": "s32", "int64": "s64", "uint8": "u8",
              "uint16": "u16", "uint32": "u32", "uint64": "u64", "bool": "pred"}


_PLACE = re.compile(r" from (?P<file>.+):(?P<line>\d+):\d+ \(")


def _names_by_place(saved: Residuals | None) -> dict[tuple[str, str], str]:
  """(HLO shape, ``file:line``) -> the checkpoint name of the residuals made
  there, where they all carry that one name (none unnamed)."""
  found: dict[tuple[str, str], set] = {}
  for r in saved.rows if saved else ():
    if not r.is_argument and (m := _PLACE.search(r.source)):
      shape = f"{_HLO_TYPES.get(r.dtype.name, r.dtype.name)}[{','.join(map(str, r.shape))}]"
      found.setdefault((shape, f"{m.group('file')}:{m.group('line')}"), set()).add(r.name)
  return {place: next(iter(n)) for place, n in found.items() if len(n) == 1 and None not in n}


def _read_one(dump: str, suffix: str) -> str:
  paths = glob.glob(os.path.join(dump, f"*after_optimizations{suffix}"))
  if len(paths) != 1:
    raise RuntimeError(
        f"Expected one XLA dump file *after_optimizations{suffix}, found {paths}: a persistent "
        "compilation cache hit compiles nothing, and backends other than CPU and GPU may dump "
        "differently.")
  with open(paths[0]) as f:
    return f.read()


def tree_bytes(tree: Any) -> int:
  """Bytes of every array (or `jax.ShapeDtypeStruct`) leaf of ``tree``."""
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
