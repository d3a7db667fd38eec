"""Where the memory of a compiled training step goes: `report` and `explain_oom`.

`report` puts both figures of `lowmem_jax.compile.memory.analysis` together for a
training step: the buffers live at the peak of the program (over XLA's buffer
live ranges, read from its dumps by `lowmem_jax.compile.memory._xla_dump`), split into
parameters, optimizer state, gradients, activations and temporaries, each with
the op and source line that made it, the live bytes over program order, and
autodiff's residuals by checkpoint name. `explain_oom` says the same of a step
that does not fit.
"""

import dataclasses
import re
import sys
import tempfile
from typing import Any, Callable

import jax
import numpy as np

from lowmem_jax import _plots, _text, names as _names
from lowmem_jax.compile import targets
from lowmem_jax.compile.memory import _xla_dump
from lowmem_jax.compile.memory.analysis import (MemoryStats, Residuals, collective_bytes,
                                                loop_flops, saved_residuals, stats_of, step_flops)
from lowmem_jax.compile.memory.step_time import StepTime, UnknownTripCount, estimate


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
    parts = [p for p in _scopes(self.op_name)[:-1] if "(" not in p and p not in _NOT_MODULES]
    for i, part in enumerate(parts):
      if _NUMBERED.search(part):
        return "/".join(parts[:i + 1])
    return "/".join(parts) or "(top level)"


def _scopes(op_name: str) -> list[str]:
  """``op_name`` split at the slashes outside parentheses: ``"jit(f)/jvp(lowmem/attention)/dot"``
  -> ``["jit(f)", "jvp(lowmem/attention)", "dot"]``."""
  parts, depth, start = [], 0, 0
  for i, c in enumerate(op_name):
    depth = max(depth + (c == "(") - (c == ")"), 0)
    if c == "/" and depth == 0:
      parts.append(op_name[start:i])
      start = i + 1
  return parts + [op_name[start:]]


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
    target: the `lowmem_jax.compile.targets.Target` it was compiled for.
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
    loop_flops: FLOPs of the step with each loop's body counted as many times as it runs
      (`loop_flops`, of the lowered program), or None where a loop's trip count is unknown.
    collective_bytes: bytes of a device's collectives' outputs in one step, loops counted as
      they run (`collective_bytes`, of the compiled program); 0 on one device; None where a
      loop's trip count is unknown.
    step_time: the step's estimated time on the target (`estimate`, of the same
      compiled program), or None where the target's speeds or a loop's trip count are unknown.
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
  loop_flops: float | None = None
  collective_bytes: int | None = 0
  step_time: StepTime | None = None

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
        "loop_flops": self.loop_flops,
        "collective_bytes": self.collective_bytes,
        "step_time": dataclasses.asdict(self.step_time) if self.step_time else None,
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
    _plots.components(path, (self, *others), COMPONENTS, ESTIMATED)

  def plot_live_bytes(self, path: str, *others: "Breakdown") -> None:
    """Writes a PNG of the live bytes over program order, one curve per
    breakdown, each peak marked. Needs matplotlib."""
    _plots.live_bytes(path, (self, *others))

  def __str__(self) -> str:
    return _text.render(*_tables(self))


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
    target: what to compile for (see `lowmem_jax.compile.memory.aot_compile`);
      default: the GPU the figures are for (`lowmem_jax.compile.targets.default`).

  Returns:
    a `Breakdown`.
  """
  if top is not None and (not isinstance(top, int) or top < 0):
    raise ValueError(f"top must be an int >= 0 or None, got {top!r}.")
  saved = saved_residuals(loss_fn, *loss_args) if loss_fn is not None else None
  target = targets.resolve(target)
  lowered, compiled, texts = _compiled_with_dump(target, step_fn, args, kwargs)
  instructions = _xla_dump.parse_hlo(texts.hlo)
  typed = _typed_components(lowered, args, kwargs,
                            sum(i.parameter is not None for i in instructions.values()))
  arguments = {name: _argument_component(i.op_name, typed.get(i.parameter))
               for name, i in instructions.items() if i.parameter is not None}
  values, sequence, held = _xla_dump.parse_dump(instructions, arguments, texts.buffer_assignment,
                                                 texts.live_range)
  live_bytes = _live_bytes(values)
  peak_position = int(np.argmax(live_bytes))
  buffers = _buffers_at(peak_position, values, held, _names_by_place(saved))
  at_peak = {c: sum(b.nbytes for b in buffers if b.component == c) for c in COMPONENTS}
  by_layer: dict[str, int] = {}
  for b in buffers:
    if b.component == "activations":
      by_layer[b.layer] = by_layer.get(b.layer, 0) + b.nbytes
  peak_name = sequence[peak_position] if peak_position < len(sequence) else "(the end)"
  peak_instr = instructions.get(peak_name, _xla_dump.Instr("", "", None))
  return Breakdown(
      label=label, target=target, stats=stats_of(compiled),
      flops=step_flops(lowered, compiled), at_peak=at_peak, peak_position=peak_position,
      peak_op=f"{peak_name} {peak_instr.op_name} {peak_instr.source}".strip(),
      live_bytes=tuple(int(b) for b in live_bytes),
      buffers=tuple(buffers[:top] if top is not None else buffers),
      activations_by_layer=dict(sorted(by_layer.items(), key=lambda kv: -kv[1])),
      argument_components=frozenset(arguments.values()), saved=saved,
      loop_flops=loop_flops(lowered), collective_bytes=collective_bytes(texts.hlo),
      step_time=_estimated(texts.hlo, target))


def _estimated(hlo_text: str, target: targets.Target) -> StepTime | None:
  """`estimate` of the program, None where a loop's trip count is unknown."""
  try:
    return estimate(hlo_text, target)
  except UnknownTripCount:
    return None


def _compiled_with_dump(target, step_fn, args, kwargs):
  """``(lowered, compiled, texts)``: the step lowered and compiled for ``target``, with the
  texts of XLA's dump of it (`_xla_dump.read`)."""
  with tempfile.TemporaryDirectory() as dump:
    lowered = target.lower(step_fn, *args, **kwargs)
    if not isinstance(lowered, jax.stages.Lowered):
      lowered = lowered.lowered  # flax.nnx.jit's Lowered wraps jax's
    compiled = target.compile_lowered(lowered, {"xla_dump_to": dump})
    return lowered, compiled, _xla_dump.read(dump)


def _live_bytes(values) -> np.ndarray:
  """The bytes live at each position of the program's sequence (``int64 [positions]``),
  each value live from its start to its end, both included."""
  last = max(v.end for v in values)  # one past the last instruction: the program's end
  curve = np.zeros(last + 2, np.int64)
  for v in values:
    curve[v.start] += v.nbytes
    curve[v.end + 1] -= v.nbytes
  return np.cumsum(curve)[:-1]


def _buffers_at(position: int, values, held, names_by_place) -> list[Buffer]:
  """The `Buffer` of each value live at ``position``, largest first; a computed value's
  component told from what it is (an activation named by its checkpoint name)."""
  param_shapes = {v.shape for v in values if v.component == "parameters"}
  buffers = []
  for v in values:
    if v.start <= position <= v.end:
      buffer = Buffer(**v._asdict())
      if v.component is None:
        component = _computed_component(v, param_shapes, held.get(v.name))
        name = names_by_place.get((v.shape, v.source)) if component == "activations" else None
        buffer = dataclasses.replace(buffer, component=component, checkpoint_name=name)
      buffers.append(buffer)
  return sorted(buffers, key=lambda b: -b.nbytes)


def explain_oom(fn: Callable, *args, limit_bytes: int | None = None, top: int = 10,
                target: "targets.Target | str | None" = None, **kwargs) -> str:
  """Why ``fn(*args, **kwargs)`` does not fit: its compiled peak against the
  device's memory, what is live at the peak and the ``top`` largest buffers
  there, with the op and source line that made each.

  Compiles on abstract shapes, so it works for a step too big to run.

  Args:
    fn, *args, **kwargs, target: as for `report`.
    limit_bytes: the memory to compare with; default: the target's
      (`lowmem_jax.compile.targets.Target.memory_bytes`).
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
  from rich.table import Table  # rich loads with the first table printed, not the library
  live = b.live_peak_bytes
  host = (f"; {_mib(b.stats.host_temp_bytes)} MiB offloaded to host memory"
          if b.stats.host_temp_bytes else "")
  out = [b.target.note,
         f"{b.label}: compiled peak {_mib(b.stats.peak_bytes)} MiB (XLA memory analysis){host}; "
         f"live at the peak {_mib(live)} MiB (over XLA's buffer live ranges), at position "
         f"{b.peak_position} of {len(b.live_bytes)}: {b.peak_op}"]
  if b.step_time:
    out.append(str(b.step_time))
  if b.collective_bytes:
    out.append(f"collectives: {_mib(b.collective_bytes)} MiB a step on each device (the "
               "outputs of its all-gathers, all-reduces, reduce-scatters, all-to-alls and "
               "collective-permutes, each loop's body as many times as it runs)")
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
  if not b.buffers:  # top=0: none asked for
    return out
  largest = Table("MiB", "shape", "component", "name", "op", "source",
                  title="largest buffers live at the peak")
  for buf in b.buffers:
    largest.add_row(_mib(buf.nbytes), buf.shape, buf.component, buf.checkpoint_name or "",
                    buf.op_name or "(made by XLA)", buf.source)
  out.append(largest)
  return out


_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_RANK = {None: 0, "inputs": 0, "parameters": 1, "optimizer state": 2}  # the stronger one wins


def _argument_component(path: str, typed: str | None = None) -> str:
  """The component of an argument from its HLO path and the component its type says, if any."""
  words = set(_IDENTIFIER.findall(path))
  named = "optimizer state" if "opt_state" in words else "parameters" if "params" in words else "inputs"
  return max(named, typed or "inputs", key=_RANK.get)


def _type_component(node: Any) -> str | None:
  """The component a pytree node's type says its leaves belong to, if any."""
  nnx = sys.modules.get("flax.nnx")  # no node is NNX's where NNX was never imported
  if nnx is not None and isinstance(node, nnx.OptState):  # an nnx.Optimizer's state and step count
    return "optimizer state"
  if nnx is not None and isinstance(node, nnx.Param):
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


def _computed_component(value: _xla_dump.Value, param_shapes: set[str], holder: str | None) -> str:
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
