"""A GPU kernel's vector ALU work: its elementwise operations, one a lane an element, by the
pipe that runs them, read from an optimized HLO fusion or from a Pallas kernel's jaxpr.

The pipes and their rates, results a clock an SM, are the CUDA C++ Programming Guide's
("Arithmetic Instructions", compute capability 7.0 to 9.0; `rates`):

* ``"fp"``: float add, subtract and multiply (fused or not), the config's ``fpus_per_core``
  a clock an SM (64 on sm_80, 128 on sm_86 and later);
* ``"int"``: integer arithmetic, bitwise operations and shifts, compares, selects, minimum
  and maximum, conversions: 64;
* ``"special"``: the SFUs' functions (exponential, logarithm, reciprocal and its square
  root, sine, tanh, ...; a float division is one reciprocal): 16.

A rotation, ``or(shift-left(x, a), shift-right-logical(x, b))``, is counted as one operation,
the funnel shift it compiles to (PTX ``shf``): Threefry-2x32's 20 rounds are 20 rotations.
Data movement (broadcasts, reshapes, slices, iota, bitcasts) is free; a reduction applies its
computation once an input element. What the model leaves out: operations the compiler
simplifies away or merges (a multiply and an add into one FMA counts two here), and issue
limits shared between the pipes.
"""

import collections
import math
import re
from typing import Any, Callable

PIPES = ("fp", "int", "special")
"""The pipes a `Counts` splits over."""

Counts = collections.Counter
"""Lane operations by pipe (`PIPES`), each an element of one operation's output."""

_FREE = frozenset({
    "parameter", "constant", "broadcast", "reshape", "bitcast", "bitcast-convert", "slice",
    "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "transpose", "copy",
    "tuple", "get-tuple-element", "iota", "gather", "reverse", "opt-barrier",
    "partition-id", "replica-id", "after-all", "custom-call", "rng-get-and-update-state"})
_FLOAT_ARITHMETIC = frozenset({"add", "subtract", "multiply"})
_SPECIAL = frozenset({
    "exponential", "exponential-minus-one", "log", "log-plus-one", "logistic", "tanh",
    "rsqrt", "sqrt", "cbrt", "sine", "cosine", "tan", "atan2", "erf", "power", "divide"})
_ARRAY = re.compile(r"\b([a-z]\w*?)\[([\d,]*)\]")
# jaxpr primitives by the HLO op they lower to, where the names differ; the others keep theirs
# with "_" as "-". Pallas' memory and grid primitives move data: free.
_FROM_JAXPR = {
    "sub": "subtract", "mul": "multiply", "div": "divide", "exp": "exponential",
    "exp2": "exponential", "log1p": "log-plus-one", "expm1": "exponential-minus-one",
    "pow": "power", "integer_pow": "multiply", "neg": "negate", "max": "maximum",
    "min": "minimum", "convert_element_type": "convert", "select_n": "select",
    "eq": "compare", "ne": "compare", "lt": "compare", "le": "compare", "gt": "compare",
    "ge": "compare", "broadcast_in_dim": "broadcast", "squeeze": "reshape",
    "expand_dims": "reshape", "bitcast_convert_type": "bitcast-convert",
    "get": "parameter", "swap": "parameter", "load": "parameter", "masked_load": "parameter",
    "store": "parameter", "masked_swap": "parameter", "program_id": "parameter",
    "num_programs": "parameter", "multiple_of": "parameter", "dynamic_slice": "dynamic-slice",
    "reduce_max": "reduce", "reduce_min": "reduce", "reduce_sum": "reduce",
    "reduce_and": "reduce", "reduce_or": "reduce", "argmax": "reduce", "argmin": "reduce"}


def pipe(op: str, dtype: str) -> str | None:
  """The pipe (`PIPES`) an elementwise HLO op on elements of ``dtype`` (an HLO element type,
  ``f32``, ``u32``) runs on; None for data movement."""
  if op in _FREE:
    return None
  if op in _SPECIAL and dtype.startswith(("f", "bf")):
    return "special"
  if op in _FLOAT_ARITHMETIC and dtype.startswith(("f", "bf")):
    return "fp"
  return "int"


def of_computation(instructions: dict, called: Callable[[Any], list[str]],
                   computations: dict) -> Counts:
  """The `Counts` of an HLO computation run once (a fusion's, `lowmem_jax.compile.memory._hlo`
  instructions by name): each op over its output's elements, a reduction's computation over
  its input's, a nested fusion's inside it."""
  counts = Counts()
  rotations = _rotations(instructions)
  for name, i in instructions.items():
    if name in rotations:
      continue
    if i.op in ("fusion", "reduce", "reduce-window", "map"):
      inner = Counts()
      for c in called(i):
        inner += of_computation(computations[c], called, computations)
      # a reduction's computation applied once an input element
      times = 1 if i.op == "fusion" else _elements(_shape_of(instructions, i.operands[0]))[0]
      counts += Counts({k: v * times for k, v in inner.items()})
    else:
      counts += of_op(i.op, i.shape)
  return counts


def of_op(op: str, shape: str) -> Counts:
  """The `Counts` of one elementwise HLO op with output ``shape`` (an HLO shape)."""
  elements, dtype = _elements(shape)
  kind = pipe(op, dtype)
  return Counts({kind: elements} if kind and elements else {})


def of_jaxpr(jaxpr: Any) -> Counts:
  """The `Counts` of a jaxpr run once (a Pallas kernel's body: a program's block), each
  equation over its output's elements; nested jaxprs (``pjit``, ``cond``'s costliest
  branch) inside it. Raises ValueError on a loop, whose trips the count would need."""
  counts = Counts()
  producers = {id(v): e for e in jaxpr.eqns for v in e.outvars}
  skip = _jaxpr_rotations(jaxpr.eqns, producers)
  for k, e in enumerate(jaxpr.eqns):
    name = e.primitive.name
    if name in ("while", "scan", "fori_loop"):
      raise ValueError("lane_ops.of_jaxpr: a loop inside the kernel; count its trips first.")
    inner = [p for p in e.params.values() if hasattr(p, "eqns") or hasattr(p, "jaxpr")]
    branches = e.params.get("branches")
    if branches:
      counts += max((of_jaxpr(getattr(b, "jaxpr", b)) for b in branches),
                    key=lambda c: sum(c.values()))
      continue
    if inner:
      for p in inner:
        counts += of_jaxpr(getattr(p, "jaxpr", p))
      continue
    if k in skip:
      continue
    aval = e.outvars[0].aval if name not in _REDUCTIONS else e.invars[0].aval
    dtype = _hlo_dtype(str(getattr(aval, "dtype", "")))
    op = _FROM_JAXPR.get(name, name.replace("_", "-"))
    if op == "reduce":
      op = "add" if name == "reduce_sum" else "maximum"
    kind = pipe(op, dtype)
    if kind is not None:
      counts[kind] += math.prod(getattr(aval, "shape", ()))
  return counts


def seconds(counts: Counts, ops_per_s: dict[str, float]) -> float:
  """Seconds ``counts`` take at ``ops_per_s`` (`rates`), the pipes one after another."""
  return sum(n / ops_per_s[kind] for kind, n in counts.items() if n)


def rates(cores: int, fpus_per_core: int, clock_hz: float) -> dict[str, float]:
  """Lane operations a second on each pipe of a GPU of ``cores`` SMs at ``clock_hz``, its
  float pipe ``fpus_per_core`` wide (an XLA target config's ``core_count``,
  ``fpus_per_core`` and ``clock_rate_ghz``)."""
  per_clock = {"fp": fpus_per_core, "int": 64, "special": 16}
  return {k: cores * v * clock_hz for k, v in per_clock.items()}


_REDUCTIONS = frozenset({"reduce_max", "reduce_min", "reduce_sum", "reduce_and", "reduce_or",
                         "argmax", "argmin"})


def _rotations(instructions: dict) -> set[str]:
  """The shifts that make rotations with an ``or`` (each rotation then counts once)."""
  out = set()
  for i in instructions.values():
    parts = [instructions.get(o) for o in i.operands] if i.op == "or" else []
    if len(parts) == 2 and all(parts) and {p.op for p in parts} == {
        "shift-left", "shift-right-logical"} and parts[0].operands[0] == parts[1].operands[0]:
      out.update(i.operands)
  return out


def _jaxpr_rotations(eqns: list, producers: dict) -> set[int]:
  """`_rotations` in a jaxpr: the equations' indices of the shifts to skip."""
  index = {id(e): k for k, e in enumerate(eqns)}
  out = set()
  for e in eqns:
    if e.primitive.name != "or":
      continue
    parts = [producers[id(v)] for v in e.invars if id(v) in producers]
    if len(parts) == 2 and {p.primitive.name for p in parts} == {
        "shift_left", "shift_right_logical"} and parts[0].invars[0] is parts[1].invars[0]:
      out.update(index[id(p)] for p in parts)
  return out


def _elements(shape: str) -> tuple[int, str]:
  """The elements and element type of an HLO shape's first array."""
  m = _ARRAY.search(shape)
  return (math.prod(int(d) for d in m.group(2).split(",") if d), m.group(1)) if m else (0, "")


def _shape_of(instructions: dict, name: str) -> str:
  i = instructions.get(name.split("#")[0])
  return i.shape if i else ""


def _hlo_dtype(dtype: str) -> str:
  """A NumPy dtype's name as HLO writes it (``float32`` → ``f32``, ``uint32`` → ``u32``)."""
  m = re.match(r"(bfloat|float|uint|int|bool)(\d*)", dtype)
  if not m:
    return dtype
  return {"bfloat": "bf", "float": "f", "uint": "u", "int": "s", "bool": "pred"}[m.group(1)] + (
      m.group(2) if m.group(1) != "bool" else "")
