"""Reading XLA's text dumps of a compiled program (``--xla_dump_to``).

Three files of one compilation: the optimised HLO module, its buffer
assignment and its buffer live ranges. Their format is XLA's, not an API,
and changes with XLA: ``tests/test_xla_dump.py`` reads dumps saved from the
XLA this project pins (``tests/data/``), so a change shows there first. Only
text is read here; what the values mean is `lowmem_jax.compile.memory.breakdown`'s.
"""

import glob
import os
import re
from typing import NamedTuple


class Instr(NamedTuple):
  """An instruction of the HLO module."""
  op_name: str  # the JAX op path that made it, e.g. jit(step)/jvp(f)/dot_general; "" if none
  source: str  # file:line of the user code that made it; "" if XLA kept none
  parameter: int | None  # its number, for an argument of the entry computation
  copy_of: str | None = None  # the operand, for a copy XLA adds


class Value(NamedTuple):
  """A value in device memory with its live range."""
  name: str  # the HLO value: instruction name and tuple index, e.g. fusion.3{}
  nbytes: int
  shape: str  # HLO shape and dtype without layout, e.g. f32[64,197,3072]
  op_name: str
  source: str
  start: int  # first position in program order where it is live
  end: int  # last such position
  component: str | None  # ``arguments``' entry for the argument it is or copies, else None


class Texts(NamedTuple):
  """The three dump files of one compilation."""
  hlo: str  # *after_optimizations.txt
  buffer_assignment: str  # *after_optimizations-buffer-assignment.txt
  live_range: str  # *after_optimizations-live-range.txt


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


def parse_hlo(text: str) -> dict[str, Instr]:
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
      out[m.group("name")] = Instr(
          op.group(1).replace("\\'", "'") if op else "",
          frames.get(frame.group(1), "") if frame else "",
          int(m.group("number")) if entry and m.group("op") == "parameter" else None,
          m.group("operand") if m.group("op") == "copy" else None)
  return out


def parse_dump(instructions: dict[str, Instr], arguments: dict[str, str], assignment: str,
               live_range: str) -> tuple[list[Value], list[str], dict[str, str]]:
  """The values in device memory with their live ranges, the program order, and the
  ``arguments`` entry of the argument whose buffer holds each other value, where one
  does (an output written over a donated argument).

  An argument, and a copy of one that XLA adds to change its layout, takes its
  ``arguments`` entry as its ``component``. Where a value is written over
  another in place (same buffer and offset), XLA's live ranges overlap at the
  writing position; here the new value takes over the buffer there, so the
  bytes are counted once. Values in host memory are left out.

  Args:
    instructions: `parse_hlo` of the module.
    arguments: an entry (a component) for each argument's instruction name.
    assignment: the buffer-assignment dump.
    live_range: the live-range dump.
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
      instr = instructions.get(instr_name, Instr("", "", None))
      component = arguments.get(instr_name) or arguments.get(instr.copy_of)
      if holder and not component:
        held[m.group("name")] = holder
      by_slot.setdefault(slot, []).append(Value(
          name=m.group("name"), nbytes=nbytes, shape=shape, op_name=instr.op_name,
          source=instr.source, start=int(m.group("start")), end=int(m.group("end")),
          component=component))
  values = []
  for in_slot in by_slot.values():
    in_slot.sort(key=lambda v: (v.start, v.end))
    for old, new in zip(in_slot, in_slot[1:]):
      if new.start <= old.end:
        old = old._replace(end=new.start - 1)
      if old.end >= old.start:
        values.append(old)
    values.append(in_slot[-1])
  return values, sequence, held


def read(dump: str) -> Texts:
  """The dump files of the one compilation dumped to directory ``dump``."""
  return Texts(*(_read_one(dump, suffix)
                 for suffix in (".txt", "-buffer-assignment.txt", "-live-range.txt")))


def _read_one(dump: str, suffix: str) -> str:
  paths = glob.glob(os.path.join(dump, f"*after_optimizations{suffix}"))
  if len(paths) != 1:
    raise RuntimeError(
        f"Expected one XLA dump file *after_optimizations{suffix}, found {paths}: a persistent "
        "compilation cache hit compiles nothing, and backends other than CPU and GPU may dump "
        "differently.")
  with open(paths[0]) as f:
    return f.read()
