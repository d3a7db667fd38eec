"""Memory accounting for any JAX function, on abstract shapes.

Two figures, and this module is the only place the project takes them from:

* `analyze`: XLA's buffer assignment of the compiled function
  (``jax.jit(fn).lower(*args).compile().memory_analysis()``). It needs no real
  arrays (`jax.ShapeDtypeStruct` pytrees will do) and works on every backend.
  On CPU it is a proxy for an accelerator: the CPU compiler upcasts bfloat16
  dots and inserts layout copies that a GPU does not, so compare variants in
  float32 compute there.
* `saved_residuals`: what autodiff keeps from the forward pass for the
  backward pass (``jax.vjp``'s residuals), backend-free: what papers count.

`live_buffers_at_peak` opens the compiled buffer assignment further: the
buffers live at the peak of XLA's heap simulation, each with the HLO op that
made it and the user's source line.
"""

import dataclasses
import glob
import math
import os
import re
import tempfile
from typing import Any, Callable

import jax
import numpy as np
from jax._src import ad_checkpoint as _ad_checkpoint
from jax._src import core as _core


def _abstract(tree):
  """Replaces every array leaf with a `jax.ShapeDtypeStruct` (with sharding)."""
  def leaf(x):
    if isinstance(x, jax.ShapeDtypeStruct) or not hasattr(x, "shape"):
      return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
  return jax.tree.map(leaf, tree)


# XLA's CPU pipeline expands optimization barriers before CSE, which merges the
# recompute of `jax.checkpoint` back into the forward pass: remat then saves
# nothing on CPU. Keeping the barriers compiles remat as accelerators do.
CPU_KEEPS_REMAT = {"xla_disable_hlo_passes": "cse_barrier_expander"}


def compile(fn: Callable, *args, compiler_options: dict | None = None, **kwargs) -> jax.stages.Compiled:
  """Compiles ``fn`` (jitted here unless it already is) for the shapes of ``args``.

  On CPU the compilation keeps `jax.checkpoint`'s optimization barriers
  (`CPU_KEEPS_REMAT`), so remat policies show in the memory figures and in
  the FLOP count; the program computes the same values.

  Args:
    fn: a function, or the result of `jax.jit` (whose static arguments and
      shardings are then respected).
    *args, **kwargs: arrays or `jax.ShapeDtypeStruct` pytrees.
    compiler_options: XLA debug options for this compilation only.
  """
  if not callable(fn):
    raise TypeError(f"fn must be callable, got {type(fn).__name__}.")
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  lowered = jitted.lower(*_abstract(args), **_abstract(kwargs))
  if jax.default_backend() == "cpu":
    compiler_options = {**CPU_KEEPS_REMAT, **(compiler_options or {})}
  return lowered.compile(compiler_options=compiler_options)


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
    xla_peak_bytes: XLA's own ``peak_memory_in_bytes``; on CPU it counts only
      arguments and outputs, so it is not used there.
    peak_bytes: ``xla_peak_bytes`` where it is at least
      ``argument_bytes + temp_bytes`` (a real simulated peak), else
      ``argument_bytes + output_bytes - alias_bytes + temp_bytes``: every
      allocation of the program at once, which is what the CPU backend holds.
  """
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  generated_code_bytes: int
  xla_peak_bytes: int
  peak_bytes: int


def stats_of(compiled: jax.stages.Compiled) -> MemoryStats:
  """`MemoryStats` of an already compiled program."""
  m = compiled.memory_analysis()
  if m is None:
    raise RuntimeError("This backend gives no memory analysis for compiled programs.")
  xla_peak = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
  lower_bound = m.argument_size_in_bytes + m.temp_size_in_bytes
  total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
  return MemoryStats(
      argument_bytes=int(m.argument_size_in_bytes),
      output_bytes=int(m.output_size_in_bytes),
      alias_bytes=int(m.alias_size_in_bytes),
      temp_bytes=int(m.temp_size_in_bytes),
      generated_code_bytes=int(m.generated_code_size_in_bytes),
      xla_peak_bytes=xla_peak,
      peak_bytes=int(xla_peak if xla_peak >= lower_bound else total),
  )


def analyze(fn: Callable, *args, **kwargs) -> MemoryStats:
  """Compiles ``fn`` on the shapes of ``args`` and returns its `MemoryStats`.

  Example:
    >>> import jax, jax.numpy as jnp, lowmem_jax as lm
    >>> x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    >>> lm.memory.analyze(lambda x: x @ x, x).argument_bytes
    262144
  """
  return stats_of(compile(fn, *args, **kwargs))


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


@dataclasses.dataclass(frozen=True)
class Buffer:
  """A buffer live at the peak of the compiled program.

  Attributes:
    name: the HLO value (instruction name and tuple index).
    nbytes: its size.
    shape: its HLO shape, e.g. ``f32[64,197,3072]``.
    op_name: the JAX op path that made it, e.g. ``jit(step)/transpose(jvp())/dot_general``.
    source: ``file:line`` of the user code, where XLA kept it.
  """
  name: str
  nbytes: int
  shape: str
  op_name: str
  source: str


@dataclasses.dataclass(frozen=True)
class PeakBuffers:
  """The buffers live at the peak of XLA's heap simulation, largest first."""
  peak_bytes: int
  buffers: tuple[Buffer, ...]

  def __str__(self) -> str:
    lines = [f"live at the peak: {self.peak_bytes:,} bytes in {len(self.buffers)} buffers"]
    for b in self.buffers:
      lines.append(f"{b.nbytes:>14,}  {b.shape:<28} {b.op_name}  {b.source}")
    return "\n".join(lines)


_INSTR = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<shape>\([^=]*?\)|\S+) ")
_COMMENT = re.compile(r"/\*.*?\*/")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_LIVE = re.compile(r"^\s+(?P<name>[\w.\-]+)\{[\d,]*\}: (?P<bytes>\d+) bytes")
_FILE = re.compile(r'^(\d+) "(.*)"$')
_LOCATION = re.compile(r"^(\d+) \{file_name_id=(\d+) function_name_id=\d+ line=(\d+)")
_FRAME = re.compile(r"^(\d+) \{file_location_id=(\d+)")


def _parse_hlo(text: str) -> dict[str, tuple[str, str, str]]:
  """Maps instruction name to (shape, op_name, source) from an HLO dump."""
  files, locations, frames, section = {}, {}, {}, None
  out = {}
  for line in text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      section = line
      continue
    if section == "FileNames" and (m := _FILE.match(line)):
      files[m.group(1)] = m.group(2)
    elif section == "FileLocations" and (m := _LOCATION.match(line)):
      locations[m.group(1)] = f"{files.get(m.group(2), '?')}:{m.group(3)}"
    elif section == "StackFrames" and (m := _FRAME.match(line)):
      frames[m.group(1)] = locations.get(m.group(2), "")
    elif (m := _INSTR.match(_COMMENT.sub("", line))):
      shape = re.sub(r"\{[^{}]*\}", "", m.group("shape"))
      op = _OP_NAME.search(line)
      frame = _FRAME_ID.search(line)
      out[m.group("name")] = (
          shape, op.group(1) if op else "", frames.get(frame.group(1), "") if frame else "")
  return out


def live_buffers_at_peak(fn: Callable, *args, top: int | None = 20, **kwargs) -> PeakBuffers:
  """The buffers live at the peak of the compiled ``fn``, largest first.

  Compiles ``fn`` once with XLA's dump enabled for this compilation only and
  reads its buffer live ranges (``*-live-range.txt``) and optimised HLO.

  Args:
    fn, *args, **kwargs: as for `analyze`.
    top: keep the ``top`` largest buffers (all of them if None).
  """
  with tempfile.TemporaryDirectory() as dump:
    compile(fn, *args, compiler_options={"xla_dump_to": dump}, **kwargs)
    live_range = _only(glob.glob(os.path.join(dump, "*after_optimizations-live-range.txt")))
    hlo = _only(glob.glob(os.path.join(dump, "*after_optimizations.txt")))
    with open(live_range) as f:
      live_text = f.read()
    with open(hlo) as f:
      instructions = _parse_hlo(f.read())
  if "(peak):" not in live_text:
    raise RuntimeError(f"XLA's live-range dump has no peak section; its format may have changed: {live_range}")
  at_peak = live_text.split("(peak):", 1)[1].split("Stack trace breakdown", 1)[0]
  buffers = []
  for line in at_peak.splitlines():
    if m := _LIVE.match(line):
      shape, op, source = instructions.get(m.group("name"), ("?", "", ""))
      buffers.append(Buffer(m.group("name"), int(m.group("bytes")), shape, op, source))
  buffers.sort(key=lambda b: -b.nbytes)
  return PeakBuffers(sum(b.nbytes for b in buffers), tuple(buffers[:top] if top else buffers))


def _only(paths: list[str]) -> str:
  if len(paths) != 1:
    raise RuntimeError(
        f"Expected one XLA dump file, found {paths}: a persistent compilation cache hit "
        "compiles nothing, and backends other than CPU and GPU may dump differently.")
  return paths[0]


def tree_bytes(tree: Any) -> int:
  """Bytes of every array (or `jax.ShapeDtypeStruct`) leaf of ``tree``."""
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
