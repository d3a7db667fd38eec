"""A compiled step's time on its GPU, estimated from the optimized program XLA made for it.

A roofline a kernel (Williams, Waterman and Patterson, CACM 2009), the kernels run in XLA's
schedule, asynchronous work overlapping only where the schedule has it:

* a cuBLAS GEMM does ``2·M·N·K`` FLOPs (its ``dot_dimension_numbers``) and cuDNN's flash
  attention ``4·B·H·Sq·Skv·D`` forward, 2.5 times that backward, half under a causal mask
  (Dao et al., 2022), both at `tensor_efficiency` of the target's dense bfloat16 peak
  (half of it for float32 operands: TF32);
* every kernel moves its bytes: what it reads (of an operand it only slices, the slice; of
  a buffer it updates in place, nothing) and what it writes (of an in-place update, the
  update), at a fraction of the device's memory bandwidth, or of the host link where the
  bytes are in host memory (``S(5)``) (`Calibration`);
* every kernel's elementwise operations (a fusion's, or what a Pallas kernel declares) run
  on the SMs' vector pipes at the target's rates (`lowmem_jax._lane_ops`):
  integer work such as Threefry's, for one, is no FLOP and no byte;
* a kernel takes the longest of its FLOPs', its ALU work's and its bytes' times, plus a
  launch;
* an asynchronous start (a host transfer, a slice copy, a collective) runs from its start on
  the stream XLA gives it (`lowmem_jax.compile.memory.streams`: before jaxlib 0.12 host
  transfers take turns with slice copies on four streams), after that stream's earlier work,
  and the host link moves one transfer a direction at a time; its done waits for it: a
  transfer hides only under the kernels scheduled between the two;
* a loop runs its condition and body as many times as its trip count, a conditional its
  slowest branch.

The constants are calibrated against every real GPU measurement on record
(``docs/gpu.jsonl``; ``benchmarks/step_time.py`` prints each row's estimate beside it).
XLA's own GPU cost model (``gpu_performance_model.cc``) does the same per kernel but runs
only with a device; JAX's ``cost_analysis`` counts FLOPs and bytes but gives no time.
"""

import dataclasses
import json
import math
import re
from typing import NamedTuple

from lowmem_jax import _lane_ops as lane_ops
from lowmem_jax import _hlo, _jax
from lowmem_jax.compile.memory import streams
from lowmem_jax.compile.memory.analysis import COLLECTIVES



class Calibration(NamedTuple):
  """The model's constants, calibrated against the real GPU measurements on record.

  Attributes:
    hbm_efficiency: the fraction of the memory bandwidth a memory-bound kernel reaches.
    launch_s: seconds a kernel costs beyond its FLOPs and bytes (launch, the gap after it).
    copy_link_efficiency: the fraction of the host link (one direction) a copy reaches (a
      ``copy`` or ``copy-start``: the copy engines' DMA).
    kernel_link_efficiency: the same for a kernel that reads or writes host memory itself
      (a host ``dynamic-slice`` or in-place ``dynamic-update-slice``: XLA runs those as SM
      kernels over pinned memory, openxla/xla#28421, except where it makes them a memcpy).
    float32_rate: a float32 GEMM's rate as a fraction of a bfloat16 one's (TF32, the tensor
      cores' float32 format and XLA's default for float32 dots on them, has half the peak).
    tensor_fraction: the fraction of the tensor-core peak the largest GEMMs reach.
    half_efficiency_flops: the FLOPs at which a GEMM reaches half of ``tensor_fraction``.
    pallas_alu_efficiency: the fraction of the pipes' rates a Pallas kernel's operations reach.
    concat_visit_ops: integer operations a thread of XLA's GPU concatenation spends on each
      operand: the kernel runs a thread an element of its largest operand, and each thread
      visits every operand (``xla/backends/gpu/codegen/emitters/concatenate.cc``).
  """
  hbm_efficiency: float = 0.9
  launch_s: float = 4e-6
  copy_link_efficiency: float = 0.8
  kernel_link_efficiency: float = 0.22
  float32_rate: float = 0.35
  tensor_fraction: float = 0.8
  half_efficiency_flops: float = 4.4e9
  pallas_alu_efficiency: float = 0.61
  concat_visit_ops: float = 11.0


CALIBRATION = Calibration()
"""The constants `estimate` uses. ``tensor_fraction`` and ``half_efficiency_flops`` put
bfloat16 GEMMs at 26% of the peak at 1024³ and 78% at 4096³, as XLA's measured table for
sm_90 has them (``default_matmul_perf_table.txtpb``); ``copy_link_efficiency`` is PCIe's
packet overhead; ``pallas_alu_efficiency`` the fused 8-bit update's kernels' time on an H100
(five shapes, each 1.58-1.68 times its jaxpr's operations at the published rates; likely Triton's
addressing); ``concat_visit_ops`` the H100 profile's pack of an 8B state row (54 operands, the
largest of 58.7M bytes: 2.085 ms a call at the integer pipe's published rate, session 40's
profile); the others are fit to ``docs/gpu.jsonl`` (``benchmarks/step_time.py``)."""
BOUNDS = ("compute", "ALU", "HBM", "launches", "host link", "collectives")
"""What a step's time is spent on, `StepTime.seconds_by_bound`'s keys: "compute" the tensor
cores, "ALU" the vector pipes (`lowmem_jax._lane_ops`)."""

_SLICES = frozenset({"dynamic-slice", "slice", "gather"})
_TRITON = "__gpu$xla.gpu.triton"  # a Pallas kernel's custom-call target: every output its own
# What a Pallas kernel says it moves (``pallas_call(metadata={"bytes_accessed": ...})``, in the
# call's backend config): a kernel writing a slice of a buffer in place reads and writes less
# than its operands and outputs.
_DECLARED_BYTES = re.compile(r'serialized_metadata\s*=\s*".*?'
                             r'bytes_accessed(?:\\22|\\"|[":\s])+(\d+)')
# And the lane operations it declares (``metadata={"int_ops": ...}``, one key a pipe).
_DECLARED_OPS = {kind: re.compile(r'serialized_metadata\s*=\s*".*?'
                                  rf'{kind}_ops(?:\\22|\\"|[":\s])+(\d+)')
                 for kind in lane_ops.PIPES}
_ASYNC_COLLECTIVES = tuple(f"{c}-start" for c in COLLECTIVES)


def tensor_efficiency(flops: float, calibration: Calibration = CALIBRATION) -> float:
  """The fraction of the tensor-core peak a GEMM or attention call of ``flops`` reaches."""
  return calibration.tensor_fraction / (1 + calibration.half_efficiency_flops / max(flops, 1.0))


@dataclasses.dataclass(frozen=True)
class StepTime:
  """The estimated time of one compiled step.

  Attributes:
    seconds: one step's wall time.
    seconds_by_bound: how ``seconds`` splits over `BOUNDS`: each kernel's time by what bounds
      it (its FLOPs, its bytes in HBM, its bytes over the host link), launches, and the time
      the step waits for a transfer or collective that the kernels did not hide.
    kernels: kernels launched in a step, loops counted as they run.
    tensor_flops: FLOPs of the GEMMs and attention calls.
    device_bytes: bytes the kernels read and write in the device's memory.
    to_device_bytes, to_host_bytes: bytes over the host link each way.
    host_copy_bytes: bytes copied from host memory to host memory.
    collective_bytes: bytes the collectives produce.
    lane_ops: the kernels' elementwise operations by pipe (`lowmem_jax._lane_ops.PIPES`).
  """
  seconds: float
  seconds_by_bound: dict
  kernels: int
  tensor_flops: float
  device_bytes: int
  to_device_bytes: int
  to_host_bytes: int
  host_copy_bytes: int
  collective_bytes: int
  lane_ops: dict = dataclasses.field(default_factory=dict)

  @property
  def bound(self) -> str:
    """What the step spends most of its time on, one of `BOUNDS`."""
    return max(self.seconds_by_bound, key=self.seconds_by_bound.get)

  def __str__(self) -> str:
    split = ", ".join(f"{k} {1e3 * v:,.1f}" for k, v in self.seconds_by_bound.items() if v)
    gib = [b / 2**30 for b in (self.to_device_bytes, self.to_host_bytes, self.host_copy_bytes)]
    host = (f"; host link {gib[0]:,.2f} GiB in, {gib[1]:,.2f} GiB out, {gib[2]:,.2f} GiB host "
            "to host" if any(gib) else "")
    return (f"estimated step time: {1e3 * self.seconds:,.1f} ms, bound by {self.bound} "
            f"(ms: {split}); {self.kernels:,} kernels, {self.tensor_flops / 1e12:,.2f} TFLOP "
            f"on the tensor cores{host} (lowmem_jax.compile.memory.step_time)")


class _Cost(NamedTuple):
  """What one kernel does."""
  tensor_flops: float = 0.0
  tensor_seconds: float = 0.0  # its FLOPs at the tensor cores' rate
  alu_seconds: float = 0.0  # its elementwise operations (`lane_ops`) at the pipes' rates
  lane_ops: tuple = ()  # (pipe, count) pairs
  device_bytes: int = 0
  to_device_bytes: int = 0  # read from host memory
  to_host_bytes: int = 0  # written to host memory
  collective_bytes: int = 0
  copy: bool = False  # moved by the copy engines, not by a kernel


def _arrays(shape: str) -> list[tuple[int, bool]]:
  """``(bytes, in host memory)`` of each array of an HLO shape."""
  return [(a.bytes, a.in_host_memory) for a in _hlo.arrays(shape)]


class _Program:
  """An optimized HLO module and the target's speeds, with each kernel's `_Cost`."""

  def __init__(self, hlo_text: str, peak_flops: float, hbm_bytes_per_s: float,
               link_bytes_per_s: float, interconnect_bytes_per_s: float | None,
               calibration: Calibration, lane_ops_per_s: dict[str, float] | None = None):
    self.computations, self.roots, self.entry = _hlo.computations(hlo_text)
    self.calibration, self.lane_ops_per_s = calibration, lane_ops_per_s
    self.peak, self.hbm, self.link = peak_flops, hbm_bytes_per_s, link_bytes_per_s
    self.interconnect = interconnect_bytes_per_s
    self.users = {name: self._users(name) for name in self.computations}
    self.costs: dict[tuple[str, str], _Cost] = {}

  def _users(self, computation: str) -> dict[str, list[tuple[str, int]]]:
    out: dict[str, list[tuple[str, int]]] = {}
    for name, i in self.computations[computation].items():
      for k, operand in enumerate(i.operands):
        out.setdefault(operand, []).append((name, k))
    return out

  def shape(self, computation: str, name: str) -> str:
    """The shape of operand ``name`` (`lowmem_jax._hlo.operand_shape`)."""
    return _hlo.operand_shape(self.computations[computation], name)

  def seconds(self, cost: _Cost) -> tuple[float, str]:
    """A kernel's time (launch excluded) and what bounds it."""
    c = self.calibration
    link = self.link * (c.copy_link_efficiency if cost.copy else c.kernel_link_efficiency)
    times = {"compute": cost.tensor_seconds, "ALU": cost.alu_seconds,
             "HBM": cost.device_bytes / (c.hbm_efficiency * self.hbm),
             "host link": max(cost.to_device_bytes, cost.to_host_bytes) / link,
             "collectives": (cost.collective_bytes / self.interconnect if self.interconnect
                             else 0.0)}
    bound = max(times, key=times.get)
    return times[bound], bound

  def cost(self, computation: str, name: str) -> _Cost:
    """The `_Cost` of instruction ``name``, run as a kernel (each counted once)."""
    if (computation, name) not in self.costs:
      self.costs[computation, name] = self._cost(computation, name)
    return self.costs[computation, name]

  def _cost(self, computation: str, name: str) -> _Cost:
    i = self.computations[computation][name]
    memcpy = _hlo.is_memcpy(self.computations, self.roots, i)
    if i.op == "fusion-start":  # an asynchronous fusion: its output, the tuple's second element
      i = i._replace(op="fusion", shape=_async_output(i.shape))
    inner = ([(c, n) for c in _hlo.called(i) for n in self.computations[c]]
             if i.op == "fusion" else [(computation, name)])  # a custom fusion's GEMM
    seconds = flops = 0.0
    for c, n in inner:
      f, per_second = self._tensor_flops(c, self.computations[c][n])
      flops += f
      seconds += f / (per_second * tensor_efficiency(f, self.calibration)) if f else 0.0
    reads, writes = self._reads(computation, i), self._writes(computation, i)
    ops = self._lane_ops(computation, i)
    alu = (lane_ops.seconds(ops, self.lane_ops_per_s) if self.lane_ops_per_s else 0.0) / (
        self.calibration.pallas_alu_efficiency if i.op == "custom-call" else 1.0)
    collective = (max(b for b, _ in _arrays(i.shape))
                  if i.op in (*COLLECTIVES, *_ASYNC_COLLECTIVES) else 0)
    return _Cost(
        tensor_flops=flops, tensor_seconds=seconds,
        alu_seconds=alu, lane_ops=tuple(ops.items()),
        device_bytes=sum(b for b, host in reads + writes if not host),
        to_device_bytes=sum(b for b, host in reads if host),
        to_host_bytes=sum(b for b, host in writes if host),
        collective_bytes=collective, copy=memcpy or i.op in ("copy", "copy-start"))

  def _lane_ops(self, computation: str, i: _hlo.Instruction) -> lane_ops.Counts:
    """A kernel's elementwise operations: a fusion's computation's, what a Pallas kernel
    declares, an unfused elementwise op's."""
    if i.op == "fusion":
      out = lane_ops.Counts()
      for c in _hlo.called(i):
        out += lane_ops.of_computation(self.computations[c], self.computations)
      return out + self._concatenation_visits(i)
    if i.op == "custom-call":
      found = {k: p.search(i.attributes) for k, p in _DECLARED_OPS.items()}
      return lane_ops.Counts({k: int(m.group(1)) for k, m in found.items() if m})
    return lane_ops.of_op(i.op, i.shape, self.shape(computation, i.operands[0])
                          if i.operands else "")

  def _concatenation_visits(self, i: _hlo.Instruction) -> lane_ops.Counts:
    """The integer work of a fusion XLA emits as a concatenation (its root a concatenate): a
    thread an element of the largest operand, each visiting every operand
    (`Calibration.concat_visit_ops` operations a visit)."""
    fused = _hlo.called(i)[0]
    root = self.computations[fused][self.roots[fused]]
    if root.op != "concatenate":
      return lane_ops.Counts()
    largest = max(math.prod(_dims(self.shape(fused, o))) for o in root.operands)
    return lane_ops.Counts(
        {"int": largest * len(root.operands) * self.calibration.concat_visit_ops})

  def _tensor_flops(self, computation: str, i: _hlo.Instruction) -> tuple[float, float]:
    """A GEMM's or attention call's FLOPs, and the tensor cores' peak for its operands."""
    target = _hlo.custom_call_target(i)
    if target and target.startswith(_hlo.GEMMS):
      f32 = self.shape(computation, i.operands[0]).startswith("f32")
      return (self._gemm_flops(computation, i),
              self.peak * (self.calibration.float32_rate if f32 else 1.0))
    if target and target.startswith("__cudnn$fmha"):
      return self._attention_flops(computation, i, "Backward" in target), self.peak
    return 0.0, self.peak

  def _gemm_flops(self, computation: str, i: _hlo.Instruction) -> float:
    config = json.loads(i.attributes.split("backend_config=", 1)[1])["gemm_backend_config"]
    lhs = _dims(self.shape(computation, i.operands[0]))
    contracted = math.prod(lhs[int(d)] for d in
                           config["dot_dimension_numbers"]["lhs_contracting_dimensions"])
    return 2.0 * math.prod(_dims(i.shape)) * contracted

  def _attention_flops(self, computation: str, i: _hlo.Instruction, backward: bool) -> float:
    config = json.loads(i.attributes.split("backend_config=", 1)[1])["cudnn_fmha_backend_config"]
    scores = [int(d) for d in config["intermediate_tensor_shape"]["dimensions"]]  # B,H,Sq,Skv
    queries = math.prod(_dims(self.shape(computation, i.operands[0])))  # B·H·Sq·D
    head = queries * scores[-1] / math.prod(scores)
    flops = 4.0 * math.prod(scores) * head * (2.5 if backward else 1.0)
    return flops / 2 if config.get("mask_type") == "CAUSAL" else flops

  def _reads(self, computation: str, i: _hlo.Instruction) -> list[tuple[int, bool]]:
    """``(bytes, in host memory)`` a kernel reads of each operand."""
    if i.op == "custom-call" and "AllocateBuffer" in i.attributes:
      return []
    declared = _declared_bytes(i)
    if declared is not None:
      return [(declared, False)]
    fused = _hlo.called(i)[0] if i.op == "fusion" else None
    out = []
    for k, operand in enumerate(i.operands):
      arrays = _arrays(self.shape(computation, operand))
      host = any(h for _, h in arrays)
      if fused is not None:
        nbytes = self._parameter_reads(fused, k)
        out.append((sum(b for b, _ in arrays) if nbytes is None else nbytes, host))
      elif i.op in _SLICES and k == 0:
        out.append((sum(b for b, _ in _arrays(i.shape)), host))
      elif i.op == "dynamic-update-slice" and k == 0:
        continue
      else:
        out += arrays
    return out

  def _parameter_reads(self, fused: str, number: int) -> int | None:
    """Bytes a fused computation reads of its parameter ``number`` where it only slices it or
    updates it in place (through bitcasts: newer XLA views a transposed array as its
    transpose before slicing it); None where it reads all of it."""
    name = next((n for n, i in self.computations[fused].items()
                 if i.op == "parameter" and i.operands == (str(number),)), None)
    return self._sliced_reads(fused, name)

  def _sliced_reads(self, fused: str, name: str | None) -> int | None:
    """`_parameter_reads` of the value ``name`` in ``fused``."""
    total = 0
    for user, k in self.users[fused].get(name, []):
      u = self.computations[fused][user]
      if u.op in _SLICES and k == 0:
        total += _hlo.shape_bytes(u.shape)
      elif u.op == "dynamic-update-slice" and k == 0:
        continue
      elif u.op == "bitcast":
        reads = self._sliced_reads(fused, user)
        if reads is None:
          return None
        total += reads
      else:
        return None
    return total

  def _writes(self, computation: str, i: _hlo.Instruction) -> list[tuple[int, bool]]:
    """``(bytes, in host memory)`` a kernel writes of each output array."""
    if ((i.op == "custom-call" and "AllocateBuffer" in i.attributes)
        or _declared_bytes(i) is not None):
      return []  # a kernel's declared bytes: its `_reads`
    arrays = _arrays(i.shape)
    if i.op == "copy-start" or (i.op == "custom-call" and _hlo.custom_call_target(i) != _TRITON):
      return arrays[:1]  # the rest: a workspace; the source and a context
    if i.op == "dynamic-update-slice":
      return [(_hlo.shape_bytes(self.shape(computation, i.operands[1])), arrays[0][1])]
    if i.op != "fusion":
      return arrays
    fused = _hlo.called(i)[0]
    root = self.computations[fused][self.roots[fused]]
    parts = ([self.computations[fused].get(o) for o in root.operands] if root.op == "tuple"
             else [root])  # None: an element of a tuple (name#k), written whole
    if len(parts) != len(arrays):
      return arrays
    return [(_hlo.shape_bytes(self.shape(fused, p.operands[1])), host)
            if p is not None and p.op == "dynamic-update-slice" else (nbytes, host)
            for p, (nbytes, host) in zip(parts, arrays)]


def _declared_bytes(i: _hlo.Instruction) -> int | None:
  """The bytes a Pallas kernel says it reads and writes together (`_DECLARED_BYTES`)."""
  if _hlo.custom_call_target(i) != _TRITON:
    return None
  declared = _DECLARED_BYTES.search(i.attributes)
  return int(declared.group(1)) if declared else None


def _async_output(shape: str) -> str:
  """The output of an asynchronous start's shape ``((operands...), output, context)``."""
  depth = 0
  for k, c in enumerate(shape[1:], 1):
    depth += {"(": 1, ")": -1}.get(c, 0)
    if depth == 0:
      return _hlo.ARRAY.search(shape, k + 1).group(0)
  raise ValueError(f"not an asynchronous start's shape: {shape}")


def _dims(shape: str) -> tuple[int, ...]:
  """The dimensions of an HLO shape's first array."""
  return next((a.dims for a in _hlo.arrays(shape)), ())


class UnknownTripCount(ValueError):
  """A loop runs a number of times the compiled program does not fix."""


class _Clock:
  """Runs a `_Program`'s schedule: the compute stream's time, each queue's, what waited."""

  def __init__(self, program: _Program, assignment: dict[tuple[str, str], str]):
    self.program, self.streams, self.now, self.kernels = program, assignment, 0.0, 0
    self.free: dict[str, float] = {}  # when each stream (and each way of the host link) is free
    self.last: dict[str, str] = {}  # the bound of each stream's last work
    self.ends: dict[str, tuple[float, str]] = {}  # a start's end, and its queue's bound
    self.by_bound = dict.fromkeys(BOUNDS, 0.0)
    self.lane_ops = lane_ops.Counts()
    self.moved = dict.fromkeys(("tensor_flops", "device", "to_device", "to_host", "host_copy",
                                "collective"), 0)

  def run(self, computation: str) -> None:
    for name, i in self.program.computations[computation].items():
      self.instruction(computation, name, i)

  def instruction(self, computation: str, name: str, i: _hlo.Instruction) -> None:
    if i.op in _hlo.FREE or (i.op == "custom-call" and "AllocateBuffer" in i.attributes):
      return
    if i.op == "while":
      self._loop(computation, i)
    elif i.op == "call":
      for c in _hlo.called(i):
        self.run(c)
    elif i.op == "conditional":
      self.run(max(_hlo.called(i), key=self._alone))
    elif i.op in ("async-start", "copy-start", "fusion-start", *_ASYNC_COLLECTIVES):
      self._start(computation, name, i)
    elif i.op.endswith("-done"):
      end, bound = self.ends.get(i.operands[0], (self.now, "HBM"))
      self.by_bound[bound] += max(end - self.now, 0.0)
      self.now = max(self.now, end)
    else:
      seconds, bound = self._kernel(computation, name)
      self.now += seconds
      launch = self.program.calibration.launch_s
      self.by_bound[bound] += seconds - launch
      self.by_bound["launches"] += launch

  def _kernel(self, computation: str, name: str) -> tuple[float, str]:
    """A kernel's seconds, launch included, and what bounds it; its FLOPs and bytes counted."""
    cost = self.program.cost(computation, name)
    self.kernels += 1
    self.moved["tensor_flops"] += cost.tensor_flops
    self.moved["device"] += cost.device_bytes
    copy = self.program.computations[computation][name].op == "copy"
    if copy and cost.to_device_bytes and cost.to_host_bytes:
      self.moved["host_copy"] += cost.to_host_bytes
    else:
      self.moved["to_device"] += cost.to_device_bytes
      self.moved["to_host"] += cost.to_host_bytes
    self.moved["collective"] += cost.collective_bytes
    self.lane_ops.update(dict(cost.lane_ops))
    seconds, bound = self.program.seconds(cost)
    return seconds + self.program.calibration.launch_s, bound

  def _loop(self, computation: str, i: _hlo.Instruction) -> None:
    p = self.program
    trips = _hlo.trip_count(i, p.computations[computation], p.computations, p.roots)
    if trips is None:
      raise UnknownTripCount(f"the loop {_hlo.body(i)} runs a number of times not known when "
                             "compiling")
    condition = _hlo.condition(i)
    for _ in range(trips):
      self.run(condition)
      self.run(_hlo.body(i))
    self.run(condition)

  def _alone(self, computation: str) -> float:
    """Seconds ``computation`` takes run by itself."""
    clock = _Clock(self.program, self.streams)
    clock.run(computation)
    return clock.now

  def _start(self, computation: str, name: str, i: _hlo.Instruction) -> None:
    """An asynchronous start: its work queued on its stream (`streams.assign`) from now, after
    the stream's earlier work, a host transfer after the earlier ones its way (the link moves
    one at a time each way); its done waits for it, the wait counted to what held it up."""
    if i.op == "async-start":  # the kernels of the computation it runs
      where = _hlo.called(i)[0]
      kernels = [n for n, j in self.program.computations[where].items() if j.op not in _hlo.FREE]
    else:
      where, kernels = computation, [name]
    parts = [self._kernel(where, n) for n in kernels]
    seconds = sum(s for s, _ in parts)
    bound = max(parts, key=lambda part: part[0])[1] if parts else "HBM"
    stream = self.streams[computation, name]
    queues = [stream]
    if bound == "host link":
      out = any(self.program.cost(where, n).to_host_bytes for n in kernels)
      queues.append(f"link {streams.TO_HOST if out else streams.TO_DEVICE}")
    begin = max(self.now, *(self.free.get(q, 0.0) for q in queues))
    held = self.last.get(stream, bound) if self.free.get(stream, 0.0) > self.now else bound
    for q in queues:
      self.free[q] = begin + seconds
    self.last[stream] = held if held == "host link" else bound
    self.ends[name] = (begin + seconds, held if held == "host link" else bound)


def estimate(hlo_text: str, target, calibration: Calibration = CALIBRATION,
             own_host_streams: bool | None = None) -> StepTime | None:
  """The `StepTime` of an optimized HLO module (``compiled.as_text()``) compiled for
  ``target`` (a `lowmem_jax.compile.targets.Target`); None where the target's speeds are not
  known (the CPU, a GPU without a bfloat16 peak or memory bandwidth on record).
  ``own_host_streams``: whether the XLA that compiled it runs host transfers on streams of
  their own (`lowmem_jax.compile.memory.streams`; None: the installed one's way,
  `lowmem_jax._jax.OWN_HOST_TRANSFER_STREAMS`).

  Raises:
    UnknownTripCount: a loop runs a number of times not known when compiling.
  """
  peak, hbm = target.peak_bf16_flops, target.memory_bytes_per_s
  lanes = target.lane_ops_per_s if target.platform == "cuda" else None
  if target.platform != "cuda" or not peak or not hbm or not lanes:
    return None
  program = _Program(hlo_text, peak, hbm, target.host_link_bytes_per_s,
                     target.interconnect_bytes_per_s, calibration, lanes)
  own_host = _jax.OWN_HOST_TRANSFER_STREAMS if own_host_streams is None else own_host_streams
  clock = _Clock(program, streams.assign(program.computations, program.roots, program.entry,
                                         own_host))
  clock.run(program.entry)
  moved = clock.moved
  return StepTime(seconds=clock.now, seconds_by_bound=dict(clock.by_bound), kernels=clock.kernels,
                  tensor_flops=moved["tensor_flops"], device_bytes=moved["device"],
                  to_device_bytes=moved["to_device"],
                  to_host_bytes=moved["to_host"], host_copy_bytes=moved["host_copy"],
                  collective_bytes=moved["collective"], lane_ops=dict(clock.lane_ops))
