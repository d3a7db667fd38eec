"""The two memory figures of a JAX function, on abstract shapes, and its FLOPs.

* `analyze`: XLA's buffer assignment of the function compiled for a target
  (``jax.jit(fn).lower(*args).compile().memory_analysis()``), by default the
  GPU the user trains on, compiled here without one (`lowmem_jax.compile.targets`).
  It needs no real arrays (`jax.ShapeDtypeStruct` pytrees will do). Compiled
  for ``target="cpu"`` it is a proxy only: the CPU compiler upcasts 16-bit
  dots and keeps float32 copies that a GPU does not.
* `saved_residuals`: what autodiff keeps from the forward pass for the
  backward pass (``jax.vjp``'s residuals), backend-free: what papers count.
"""

import dataclasses
import functools
import math
import re
from typing import Any, Callable

import jax
import numpy as np

from lowmem_jax import _hlo, _jax
from lowmem_jax.compile import targets


def aot_compile(fn: Callable, *args, target: "targets.Target | str | None" = None,
                compiler_options: dict | None = None,
                **kwargs) -> "jax.stages.Compiled | targets.HostArgumentsCompiled":
  """Compiles ``fn`` (jitted here unless it already is) for ``target`` on the
  shapes of ``args``; nothing runs.

  Args:
    fn: a function, or the result of `jax.jit` (whose static arguments and
      donation are then respected).
    *args, **kwargs: arrays or `jax.ShapeDtypeStruct` pytrees.
    target: a `lowmem_jax.compile.targets.Target` or its name (``"h100"``, ``"cpu"``,
      ...); None: `lowmem_jax.compile.targets.default`, the GPU the figures are for.
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
      offloads (`lowmem_jax.compile.policies.offload`) on a GPU target; 0 on the CPU,
      whose device memory is host memory.
    host_argument_bytes: inputs in host memory (`lowmem_jax.optim.offload`'s
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
  """Compiles ``fn`` for ``target`` (see `aot_compile`) on the shapes of ``args``
  and returns its `MemoryStats`.

  Example:
    >>> import jax, jax.numpy as jnp, lowmem_jax as lm
    >>> x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    >>> lm.memory.analyze(lambda x: x @ x, x, target="h100").argument_bytes
    262144
  """
  return stats_of(aot_compile(fn, *args, target=target, **kwargs))


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
  for aval, source in _jax.saved_residuals(fn, *args, **kwargs):
    shape = tuple(aval.shape)
    dtype = np.dtype(aval.dtype)
    named = _NAMED.match(source)
    rows.append(Residual(
        shape=shape, dtype=dtype, nbytes=math.prod(shape) * dtype.itemsize,
        source=source, name=named.group(1) if named else None,
        is_argument=source.startswith(("from the argument", "from a constant", "from a literal")),
        on_host=getattr(aval, "memory_space", None) == jax.memory.Space.Host))
  return Residuals(tuple(rows))


def flops_of(program: jax.stages.Compiled | jax.stages.Lowered) -> float:
  """FLOPs of a compiled (or lowered) program, from XLA's cost analysis.

  A compile-only GPU gives no cost analysis: there, give the lowered program,
  whose FLOPs XLA's HLO cost analysis counts on the host before optimisation
  (recompute from `jax.checkpoint` included; fusion changes no FLOP count).
  """
  try:
    cost = program.cost_analysis()
  except _jax.COST_ANALYSIS_ERRORS:
    cost = None
  if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
    cost = cost[0]
  if not cost and isinstance(program, jax.stages.Lowered):
    cost = _jax.hlo_cost_analysis(program.compiler_ir("hlo").as_hlo_module())
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


def loop_flops(lowered: jax.stages.Lowered) -> float | None:
  """FLOPs of a lowered program with each ``while`` loop's body counted as many times
  as the loop runs (XLA's cost analysis counts a body once), nested loops
  multiplied; None where a loop's trip count is not known at compile time (a
  ``lax.while_loop`` on a traced bound). XLA's HLO cost analysis on the host, of
  the program before optimisation, as `flops_of` a lowered program."""
  text = lowered.compiler_ir("hlo").as_hlo_text()
  computations, roots, entry = _hlo.computations(text)
  lines = text.splitlines()

  @functools.cache
  def once(name: str) -> float:  # XLA's count of the computation as an entry: loops once
    out = ["HloModule loop_body"]
    for line in lines[1:]:
      header = _hlo.HEADER.match(line)
      if header and not line.startswith(" "):
        line = ("ENTRY " if header.group(2) == name else "") + line.removeprefix("ENTRY ")
      out.append(line)
    module = _jax.hlo_module_from_text("\n".join(out))
    return float(_jax.hlo_cost_analysis(module).get("flops", 0.0))

  def whiles(name: str, seen: set) -> list[tuple[_hlo.Instruction, dict]]:
    """The loops ``name`` runs itself or through the computations it calls."""
    found = []
    for i in computations[name].values():
      if i.op == "while":
        found.append((i, computations[name]))
      for called in _hlo.called(i):
        if called not in seen:
          seen.add(called)
          found += whiles(called, seen)
    return found

  def full(name: str) -> float | None:  # XLA's count holds each loop's body once
    total = once(name)
    for i, caller in whiles(name, {name}):
      trips = _hlo.trip_count(i, caller, computations, roots)
      body = _hlo.body(i)
      body_flops = full(body)
      if trips is None or body_flops is None:
        return None
      total += trips * body_flops - once(body)
    return total
  return full(entry)


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
"""The HLO collectives `collective_bytes` counts; an asynchronous one by its ``-done``."""
def collective_bytes(hlo_text: str) -> int | None:
  """Bytes a device's collectives produce in one run of an optimised, SPMD-partitioned HLO
  module (``compiled.as_text()``): the outputs of every all-gather, all-reduce,
  reduce-scatter, all-to-all and collective-permute (`COLLECTIVES`, synchronous, or the
  ``-done`` of an asynchronous one, or inside an ``async-start``'s computation), a ``while``
  loop's body counted as many times as the loop runs (`loop_flops`' trip counts), a
  ``conditional``'s largest branch once; None where a loop's trip count is unknown. What a
  device receives is at most this (a ring all-gather receives ``(n - 1) / n`` of its output)."""
  computations, roots, entry = _hlo.computations(hlo_text)
  done = tuple(f"{c}-done" for c in COLLECTIVES)

  @functools.cache
  def count(name: str) -> int | None:
    total = 0
    for i in computations.get(name, {}).values():
      if i.op in COLLECTIVES or i.op in done:
        total += _hlo.shape_bytes(i.shape)
      if i.op == "while":
        trips = _hlo.trip_count(i, computations[name], computations, roots)
        inner = count(_hlo.body(i))
        if trips is None or inner is None:
          return None
        total += trips * inner
        continue
      inner = [count(c) for c in _hlo.called(i)]  # a conditional's branches: the largest
      if None in inner:
        return None
      total += max(inner, default=0)
    return total
  return count(entry)


def tree_bytes(tree: Any) -> int:
  """Bytes of every array (or `jax.ShapeDtypeStruct`) leaf of ``tree``, sub-byte dtypes
  (``uint4``) packed, as XLA's GPU and TPU backends store them."""
  return sum(-(-math.prod(x.shape) * jax.dtypes.itemsize_bits(x.dtype) // 8)
             for x in jax.tree.leaves(tree))
