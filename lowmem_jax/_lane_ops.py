"""A GPU kernel's vector ALU work: its elementwise operations, one a lane an element, by the
pipe that runs them, read from an optimized HLO fusion or from a Pallas kernel's jaxpr.

The pipes and their rates, results a clock an SM, are the CUDA C++ Programming Guide's
("Arithmetic Instructions", compute capability 7.0 to 9.0; `rates`):

* ``"fp"``: float add, subtract and multiply (fused or not), the config's ``fpus_per_core``
  a clock an SM (64 on sm_80, 128 on sm_86 and later);
* ``"int"``: integer arithmetic, bitwise operations and shifts, compares, selects, minimum
  and maximum, and the conversions between integers of different widths: 64;
* ``"special"``: 16: the SFUs' functions (exponential, logarithm, reciprocal and its square
  root, sine, tanh, ...; a float division is one reciprocal) and the guide's "all other type
  conversions" (between integers and floats, float32 to bfloat16).

A conversion between integers of one width, or of a type to itself, is free (a
reinterpretation), bfloat16 to float32 an integer shift. A rotation, ``or(shift-left(x, a), shift-right-logical(x, b))`` with
``a + b`` the width, is one operation, the funnel shift it compiles to (PTX ``shf``, taken
at the integer rate: the guide has no row for it): Threefry-2x32's 20 rounds are 20
rotations. Data movement (broadcasts, reshapes, slices, iota, bitcasts) is free, and so is
anything not elementwise (a dot, a sort, a scatter's own work: uncounted); a reduction
applies its computation once an input element. What the model leaves out: operations the
compiler simplifies away or merges (a multiply and an add into one FMA counts two here),
functions that take several instructions (an integer division, ``pow``: one each), and
issue limits shared between the pipes. Compute capabilities past 9.0 are given 9.0's rates.
"""

import collections
import functools
import math
import re
from typing import Any

from lowmem_jax import _hlo

PIPES = ("fp", "int", "special")
"""The pipes a `Counts` splits over."""

Counts = collections.Counter
"""Lane operations by pipe (`PIPES`), each an element of one operation's output."""

_FLOAT_ARITHMETIC = frozenset({"add", "subtract", "multiply"})
_SPECIAL = frozenset({
    "exponential", "exponential-minus-one", "log", "log-plus-one", "logistic", "tanh",
    "rsqrt", "sqrt", "cbrt", "sine", "cosine", "tan", "atan2", "erf", "power", "divide",
    "stochastic-convert"})
_INTEGER_PIPE = frozenset({
    "add", "subtract", "multiply", "divide", "remainder", "and", "or", "xor", "not",
    "shift-left", "shift-right-logical", "shift-right-arithmetic", "compare", "select",
    "clamp", "maximum", "minimum", "abs", "negate", "sign", "is-finite", "popcnt",
    "count-leading-zeros", "round-nearest-even", "round-nearest-afz", "floor", "ceil",
    "reduce-precision", "bit-reverse"})
_APPLIED = ("reduce", "reduce-window", "map")  # a computation applied once an input element
# jaxpr primitives by the HLO op they lower to, where the names differ; the others keep theirs
# with "_" as "-". Pallas' memory and grid primitives and the layout ones move data: free.
_FROM_JAXPR = {
    "sub": "subtract", "mul": "multiply", "div": "divide", "exp": "exponential",
    "exp2": "exponential", "log1p": "log-plus-one", "expm1": "exponential-minus-one",
    "pow": "power", "integer_pow": "multiply", "square": "multiply", "neg": "negate",
    "max": "maximum", "min": "minimum", "sin": "sine", "cos": "cosine", "erfc": "erf",
    "erf_inv": "erf", "asin": "atan2", "acos": "atan2", "atan": "atan2", "sinh": "exponential",
    "cosh": "exponential", "asinh": "log", "acosh": "log", "atanh": "log", "lgamma": "log",
    "digamma": "log", "round": "round-nearest-afz", "nextafter": "add",
    "convert_element_type": "convert", "select_n": "select",
    "eq": "compare", "ne": "compare", "lt": "compare", "le": "compare", "gt": "compare",
    "ge": "compare", "rem": "remainder", "population_count": "popcnt", "clz": "count-leading-zeros",
    "reduce_max": "maximum", "reduce_min": "minimum", "reduce_sum": "add",
    "reduce_prod": "multiply", "reduce_and": "and", "reduce_or": "or", "reduce_xor": "xor",
    "argmax": "compare", "argmin": "compare", "cumsum": "add", "cumprod": "multiply",
    "cummax": "maximum", "cummin": "minimum", "cumlogsumexp": "exponential"}
_REDUCTIONS = frozenset({"reduce_max", "reduce_min", "reduce_sum", "reduce_prod", "reduce_and",
                         "reduce_or", "reduce_xor", "argmax", "argmin"})


def pipe(op: str, dtype: str, source: str = "") -> str | None:
  """The pipe (`PIPES`) an elementwise HLO op with elements of ``dtype`` (an HLO element type,
  ``f32``, ``u32``) runs on; None where it is free or not elementwise. ``source``: a
  ``convert``'s operand's element type."""
  floating = dtype.startswith(("f", "bf"))
  if op == "convert":
    return _conversion(source, dtype)
  if op in _SPECIAL and floating:
    return "special"
  if op in _FLOAT_ARITHMETIC and floating:
    return "fp"
  return "int" if op in _INTEGER_PIPE else None


def of_op(op: str, shape: str, source: str = "") -> Counts:
  """The `Counts` of one elementwise HLO op with output ``shape`` (an HLO shape); ``source``,
  a ``convert``'s operand's shape."""
  elements, dtype = _elements(shape)
  kind = pipe(op, dtype, _elements(source)[1])
  return Counts({kind: elements} if kind and elements else {})


def of_computation(instructions: dict, computations: dict) -> Counts:
  """The `Counts` of an HLO computation run once (a fusion's, `lowmem_jax._hlo` instructions
  by name; ``computations``: the module's, for those it calls): each op over its output's
  elements, a reduction's computation over its input's, a nested fusion's inside it."""
  counts = Counts()
  rotations = _rotations(instructions)
  shape = functools.partial(_hlo.operand_shape, instructions)
  for name, i in instructions.items():
    if name in rotations:
      continue
    if i.op == "fusion" or i.op in _APPLIED:
      inner = Counts()
      for c in _hlo.called(i):
        inner += of_computation(computations[c], computations)
      times = 1 if i.op == "fusion" else _elements(shape(i.operands[0]))[0]
      counts += Counts({k: v * times for k, v in inner.items()})
    else:
      counts += of_op(i.op, i.shape, shape(i.operands[0]) if i.operands else "")
  return counts


def of_jaxpr(jaxpr: Any) -> Counts:
  """The `Counts` of a jaxpr run once (a Pallas kernel's body: a program's block), each
  equation over its output's elements (a reduction over its input's); nested jaxprs
  (``pjit``, ``cond``'s costliest branch) inside it.

  Raises:
    ValueError: a loop (its trips would be needed) or a dot (the tensor cores' work, not
      this count's) inside the jaxpr.
  """
  counts = Counts()
  producers = {id(v): e for e in jaxpr.eqns for v in e.outvars}
  skip = _jaxpr_rotations(jaxpr.eqns, producers)
  for k, e in enumerate(jaxpr.eqns):
    name = e.primitive.name
    if name in ("while", "scan", "dot_general"):
      raise ValueError(f"lane_ops.of_jaxpr: a {name} inside the kernel is not counted here.")
    if e.params.get("branches"):
      counts += max((of_jaxpr(getattr(b, "jaxpr", b)) for b in e.params["branches"]),
                    key=lambda c: sum(c.values()))
      continue
    inner = [p for p in e.params.values() if hasattr(p, "eqns") or hasattr(p, "jaxpr")]
    for p in inner:
      counts += of_jaxpr(getattr(p, "jaxpr", p))
    if inner or k in skip or not e.outvars:  # no output: a ref's update, a print
      continue
    out = e.outvars[0].aval
    aval = e.invars[0].aval if name in _REDUCTIONS else out
    source = _hlo_dtype(e.invars[0].aval.dtype) if name == "convert_element_type" else ""
    kind = pipe(_FROM_JAXPR.get(name, name.replace("_", "-")), _hlo_dtype(aval.dtype), source)
    if kind is not None:
      counts[kind] += math.prod(aval.shape)
  return counts


def seconds(counts: Counts, ops_per_s: dict[str, float]) -> float:
  """Seconds ``counts`` take at ``ops_per_s`` (`rates`), the pipes one after another."""
  return sum(n / ops_per_s[kind] for kind, n in counts.items() if n)


def rates_of(config: str) -> dict[str, float] | None:
  """`rates` of an XLA GPU target config's text (its ``core_count``, ``fpus_per_core`` and
  ``clock_rate_ghz``); None where it lacks one."""
  found = [re.search(rf"\b{k}: ([\d.]+)", config)
           for k in ("core_count", "fpus_per_core", "clock_rate_ghz")]
  if not all(found):
    return None
  cores, fpus, ghz = (float(m.group(1)) for m in found)
  return rates(int(cores), int(fpus), ghz * 1e9)


def rates(cores: int, fpus_per_core: int, clock_hz: float) -> dict[str, float]:
  """Lane operations a second on each pipe of a GPU of ``cores`` SMs at ``clock_hz``, its
  float pipe ``fpus_per_core`` wide (an XLA target config's ``core_count``,
  ``fpus_per_core`` and ``clock_rate_ghz``)."""
  per_clock = {"fp": fpus_per_core, "int": 64, "special": 16}
  return {k: cores * v * clock_hz for k, v in per_clock.items()}


def _conversion(source: str, dtype: str) -> str | None:
  """The pipe of a conversion from element type ``source`` to ``dtype`` (`pipe`)."""
  integer = lambda t: t.startswith(("s", "u", "pred"))
  bits = lambda t: _hlo.dtype_bits(t) or 8
  if source == dtype:
    return None
  if dtype == "pred":  # a compare with zero
    return "int"
  if integer(source) and integer(dtype):
    return None if bits(source) == bits(dtype) else "int"
  if source == "bf16" and dtype == "f32":
    return "int"
  return "special"


def _rotations(instructions: dict) -> set[str]:
  """The shifts that make rotations with an ``or`` (each rotation then counts once)."""
  def amount(name: str) -> int | None:
    i = instructions.get(name)
    while i is not None and i.op == "broadcast":
      i = instructions.get(i.operands[0])
    return int(i.operands[0]) if i is not None and i.op == "constant" and \
        i.operands[0].isdigit() else None

  out = set()
  for i in instructions.values():
    parts = [instructions.get(o) for o in i.operands] if i.op == "or" else []
    if len(parts) == 2 and all(parts) and {p.op for p in parts} == {
        "shift-left", "shift-right-logical"} and parts[0].operands[0] == parts[1].operands[0]:
      by = [amount(p.operands[1]) for p in parts]
      if None not in by and sum(by) == _bits_of(i.shape):
        out.update(i.operands)
  return out


def _jaxpr_rotations(eqns: list, producers: dict) -> set[int]:
  """`_rotations` in a jaxpr: the equations' indices of the shifts to skip."""
  def amount(v) -> int | None:
    while not hasattr(v, "val") and id(v) in producers and producers[id(v)].primitive.name in (
        "broadcast_in_dim", "convert_element_type"):
      v = producers[id(v)].invars[0]
    return int(v.val) if hasattr(v, "val") and math.prod(getattr(v.val, "shape", ())) == 1 \
        else None

  index = {id(e): k for k, e in enumerate(eqns)}
  out = set()
  for e in eqns:
    parts = [producers[id(v)] for v in e.invars if id(v) in producers] if (
        e.primitive.name == "or") else []
    if len(parts) == 2 and {p.primitive.name for p in parts} == {
        "shift_left", "shift_right_logical"} and parts[0].invars[0] is parts[1].invars[0]:
      by = [amount(p.invars[1]) for p in parts]
      if None not in by and sum(by) == 8 * e.outvars[0].aval.dtype.itemsize:
        out.update(index[id(p)] for p in parts)
  return out


def _bits_of(shape: str) -> int:
  """The bits of an HLO shape's element type (``u32[8]`` → 32)."""
  return _hlo.dtype_bits(_elements(shape)[1]) or 0


def _elements(shape: str) -> tuple[int, str]:
  """The elements and element type of an HLO shape's first array."""
  first = next(iter(_hlo.arrays(shape)), None)
  return (math.prod(first.dims), first.dtype) if first else (0, "")


def _hlo_dtype(dtype: Any) -> str:
  """A NumPy dtype as HLO writes it (``float32`` → ``f32``, ``uint32`` → ``u32``)."""
  m = re.match(r"(bfloat|float|uint|int|bool)(\d*)", str(dtype))
  if not m:
    return str(dtype)
  return {"bfloat": "bf", "float": "f", "uint": "u", "int": "s", "bool": "pred"}[m.group(1)] + (
      m.group(2) if m.group(1) != "bool" else "")
