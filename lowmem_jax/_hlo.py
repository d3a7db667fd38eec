"""Reading an HLO module's text (``compiled.as_text()``, XLA's dumps): its computations and
instructions, the computations an instruction calls, a loop's trip count, a shape's arrays and
bytes, which instructions run no kernel and which fusions XLA's GPU backend runs as a memcpy.

XLA's text format is not an API: the tests read programs compiled by the XLA of each end of
the supported jax range, so a change shows there first.
"""

import math
import re
from typing import NamedTuple

HEADER = re.compile(r"^(ENTRY )?%?([^\s(]+).*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) %?([a-z][\w\-]*)\(([^)]*)\)(.*)$")
_CALLED = re.compile(r"\b(?:to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)"
                     r"|branch_computations=\{([^}]*)\}")
_COMMENT = re.compile(r"/\*.*?\*/")  # /*index=5*/ among a long operand list
_KNOWN_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


class Instruction(NamedTuple):
  """One instruction: its op, operand names (``name#k``: a tuple's element k, newer XLA's
  text), the text after its operands, its shape."""
  op: str
  operands: tuple[str, ...]
  attributes: str
  shape: str = ""  # its HLO shape as written, layouts included


def computations(text: str) -> tuple[dict[str, dict[str, Instruction]], dict[str, str], str]:
  """``(computations, roots, entry)`` of an HLO module's text: each computation's
  instructions by name, each one's root instruction, the entry computation's name."""
  computations, roots, entry, current = {}, {}, "", None
  for line in text.splitlines():
    header = HEADER.match(line)
    if header and not line.startswith(" "):
      current = computations.setdefault(header.group(2), {})
      entry = header.group(2) if header.group(1) else entry
      name = header.group(2)
    elif current is not None and (m := _INSTRUCTION.match(line)):
      listed = _COMMENT.sub("", m.group(4)).split(",")
      operands = tuple(o.strip().lstrip("%") for o in listed if o.strip())
      current[m.group(1)] = Instruction(m.group(3), operands, m.group(5), m.group(2))
      if line.lstrip().startswith("ROOT "):
        roots[name] = m.group(1)
  return computations, roots, entry


def called(instruction: Instruction) -> list[str]:
  """The computations an instruction calls (`_CALLED`: reductions, calls, branches), not a
  ``while``'s body or condition."""
  names = []
  for m in _CALLED.finditer(instruction.attributes):
    names += [m.group(1)] if m.group(1) else [c.strip().lstrip("%") for c in m.group(2).split(",")]
  return names


def body(instruction: Instruction) -> str:
  """A ``while``'s body computation."""
  return re.search(r"body=%?([\w.\-]+)", instruction.attributes).group(1)


def condition(instruction: Instruction) -> str:
  """A ``while``'s condition computation."""
  return re.search(r"condition=%?([\w.\-]+)", instruction.attributes).group(1)


def trip_count(instruction: Instruction, caller: dict[str, Instruction],
               computations: dict, roots: dict) -> int | None:
  """The times a ``while`` runs: XLA's known trip count, else the pattern a JAX loop lowers
  to (a counter from a constant, +1 a trip, below a constant); None where neither holds."""
  known = _KNOWN_TRIP_COUNT.search(instruction.attributes)
  if known:
    return int(known.group(1))
  cond = condition(instruction)
  loop = body(instruction)
  c, b = computations[cond], computations[loop]

  def index(name: str, where: dict) -> int | None:  # the tuple element a get-tuple-element reads
    i = where.get(name)
    m = re.search(r"index=(\d+)", i.attributes) if i and i.op == "get-tuple-element" else None
    return int(m.group(1)) if m else None

  def constant(name: str, where: dict) -> int | None:
    i = where.get(name)
    return int(i.operands[0]) if i and i.op == "constant" and i.operands[0].lstrip("-").isdigit() \
        else None
  compare, init = c[roots[cond]], caller.get(instruction.operands[0])
  if compare.op != "compare" or "direction=LT" not in compare.attributes or init is None \
      or init.op != "tuple":
    return None
  i, limit = index(compare.operands[0], c), constant(compare.operands[1], c)
  new = b[roots[loop]]
  step = b.get(new.operands[i]) if i is not None and new.op == "tuple" else None
  start = constant(init.operands[i], caller) if i is not None else None
  if step is None or step.op != "add" or start is None or limit is None or sorted(
      (index(o, b) == i, constant(o, b) == 1) for o in step.operands) != [(False, True),
                                                                         (True, False)]:
    return None
  return max(limit - start, 0)


ARRAY = re.compile(r"\b([a-z]\w*?)\[([\d,]*)\](?:\{([^}]*)\})?")
"""An array in an HLO shape: its element type, dimensions and layout (``bf16[8,128]{1,0:S(5)}``)."""
_BITS = re.compile(r"[a-z]+(\d+)")
FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                  "opt-barrier", "after-all", "add-dependency", "partition-id", "replica-id",
                  "iota"})
"""The instructions that run no kernel of their own."""
GEMMS = ("__cublas$gemm", "__cublas$lt$matmul")
"""The custom-call targets of XLA's GEMMs."""
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


class Array(NamedTuple):
  """One array of an HLO shape: ``text`` as written (``bf16[8,128]{1,0:S(5)}``)."""
  dtype: str
  dims: tuple[int, ...]
  layout: str
  text: str

  @property
  def in_host_memory(self) -> bool:
    """Whether the layout puts it in host memory: memory space 5, ``S(5)`` after the dims and
    any tiling or element size (``{1,0:E(4)S(5)}``, an int4 array's)."""
    return "S(5)" in self.layout

  @property
  def bytes(self) -> int:
    """Its bytes; an element with no width in its type's name (``pred``) a byte, a token none."""
    if self.dtype == "token":
      return 0
    return -(-math.prod(self.dims) * (dtype_bits(self.dtype) or 8) // 8)


def arrays(shape: str) -> list[Array]:
  """The arrays of an HLO shape: one, or a tuple's in order (a ``token[]`` among them)."""
  return [Array(m.group(1), tuple(int(d) for d in m.group(2).split(",") if d), m.group(3) or "",
                m.group(0)) for m in ARRAY.finditer(shape)]


def in_host_memory(shape: str) -> bool:
  """Whether any array of an HLO shape is in host memory (`Array.in_host_memory`)."""
  return any(a.in_host_memory for a in arrays(shape))


def dtype_bits(dtype: str) -> int | None:
  """The bits of an HLO element type (``u32`` → 32); None for one without a width (``pred``)."""
  m = _BITS.match(dtype)
  return int(m.group(1)) if m else None


def shape_bytes(shape: str) -> int:
  """Bytes of the arrays of an HLO shape (``bf16[8,128]{1,0}``, or a tuple of them)."""
  return sum(a.bytes for a in arrays(shape))


def operand_shape(instructions: dict[str, Instruction], name: str) -> str:
  """The shape of operand ``name`` of a computation's instructions; ``name#k`` (newer XLA's
  text) is a tuple's element k; "" where no instruction has that name."""
  name, _, element = name.partition("#")
  i = instructions.get(name)
  if not i:
    return ""
  return arrays(i.shape)[int(element)].text if element else i.shape


def custom_call_target(i: Instruction) -> str | None:
  """A ``custom-call``'s target (``__cublas$gemm``); None for another instruction."""
  m = _TARGET.search(i.attributes) if i.op == "custom-call" else None
  return m.group(1) if m else None


def is_memcpy(computations: dict, roots: dict, i: Instruction) -> bool:
  """Whether ``i`` is a fusion XLA runs as a memcpy (DMA), or an asynchronous start of one.
  jax 0.10's XLA makes a custom fusion of a slice whose offsets follow the loop's counter
  (a ``dynamic_slice_config``); jax 0.12's keeps a loop fusion (`_copies_a_slice`) and its
  thunk emitter makes the copy (``AnalyzeDynamicSliceCopyFusion``)."""
  if i.op == "async-start":
    inner = computations[called(i)[0]]
    return any(is_memcpy(computations, roots, j) for j in inner.values() if j.op not in FREE)
  if i.op not in ("fusion", "fusion-start"):
    return False
  fused = called(i)[0]
  if "kind=kCustom" in i.attributes:
    return any("dynamic_slice_config" in j.attributes for j in computations[fused].values())
  return _copies_a_slice(computations[fused], roots[fused])


def _copies_a_slice(instructions: dict[str, Instruction], root: str) -> bool:
  """Whether a loop fusion's computation only copies a slice: its root (through bitcasts
  and reshapes) a dynamic slice or in-place update carrying a ``dynamic_slice_config``, of
  or from a parameter, as every dynamic slice in it carries one."""
  def source(name: str) -> Instruction | None:
    i = instructions.get(name.split("#")[0])
    while i is not None and i.op in ("bitcast", "reshape"):
      i = instructions.get(i.operands[0])
    return i

  if not all("dynamic_slice_config" in j.attributes for j in instructions.values()
             if j.op in ("dynamic-slice", "dynamic-update-slice")):
    return False
  out = source(root)
  if out is None or out.op not in ("dynamic-slice", "dynamic-update-slice"):
    return False
  copied = source(out.operands[0 if out.op == "dynamic-slice" else 1])
  if copied is not None and copied.op == "dynamic-slice" and out.op != "dynamic-slice":
    copied = source(copied.operands[0])  # an update from a slice of a parameter
  return copied is not None and copied.op == "parameter"
