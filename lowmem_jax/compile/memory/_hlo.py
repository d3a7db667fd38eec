"""Reading an HLO module's text (``compiled.as_text()``, XLA's dumps): its computations and
instructions, the computations an instruction calls, a loop's trip count, a shape's bytes.

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


_ARRAY = re.compile(r"\b([a-z]\w*?)\[([\d,]*)\]")


def shape_bytes(shape: str) -> int:
  """Bytes of the arrays of an HLO shape (``bf16[8,128]{1,0}``, or a tuple of them)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    if dtype == "token":
      continue
    bits = re.match(r"[a-z]+(\d+)", dtype)
    count = math.prod(int(d) for d in dims.split(",") if d)
    total += -(-count * (int(bits.group(1)) if bits else 8) // 8)  # pred: a byte
  return total
