"""Which stream each asynchronous start of a compiled GPU program runs on: XLA's execution
stream assignment (``xla/service/gpu/execution_stream_assignment.cc``), replayed on the
optimized program's text.

XLA walks the computations breadth first from the entry (into loops, calls and conditionals;
not into fusions or asynchronous computations), each one's instructions in post order
(`post_order`), and gives each start of a compute scope (an ``async-start`` that wraps no
collective, a ``copy-start``) the next of `COMPUTE_STREAMS` compute streams in turn; every
asynchronous collective runs on the one `COMMUNICATION` stream. A stream
runs its work in the order it is given. So where transfers to and from host memory take turns
with the device-side slice copies XLA makes asynchronous (a layer's weights sliced out of their
stack), a slice the next kernel needs can wait behind a whole transfer, by its place in the loop
body alone.

From jaxlib 0.12 XLA runs each transfer to or from host memory (a ``copy-start`` with an end in
host memory; an ``async-start`` of a dynamic slice of host memory or a dynamic update of it) on a
stream of its own each way, and only the rest take turns
(`lowmem_jax._jax.OWN_HOST_TRANSFER_STREAMS`).
"""

import collections
import re

from lowmem_jax import _hlo
from lowmem_jax.compile.memory.analysis import COLLECTIVES

COMPUTE_STREAMS = 4
"""XLA's ``kDefaultNumComputeStreams``: ``xla_gpu_executable_num_compute_streams`` allocates more
streams but does not change how many the starts take turns over."""
TO_HOST, TO_DEVICE = "to host", "to device"  # a host transfer's own stream, from jaxlib 0.12
COMMUNICATION = "communication"
"""The stream every asynchronous collective runs on: XLA's one communication stream
(``xla_gpu_experimental_enable_collective_multi_streaming``, off by default, gives more)."""
_CONTROL = re.compile(r"control-predecessors=\{([^}]*)\}")


def post_order(instructions: dict[str, _hlo.Instruction]) -> list[str]:
  """A computation's instruction names as XLA's ``MakeInstructionPostOrder`` lists them: from
  each instruction no other uses (in text order: the root, usually alone), depth first, an
  instruction after its operands (the first operand's first) and after its control
  predecessors (the last one's first)."""
  used = {o.split("#")[0] for i in instructions.values() for o in i.operands}
  order, done = [], set()
  for start in (n for n in instructions if n not in used):
    stack, entered = [start], set()
    while stack:
      name = stack[-1]
      if name in done or name not in instructions:
        stack.pop()
      elif name in entered:
        stack.pop()
        done.add(name)
        order.append(name)
      else:
        entered.add(name)
        i = instructions[name]
        stack += reversed([o.split("#")[0] for o in i.operands])
        control = _CONTROL.search(i.attributes)
        stack += [p.strip().lstrip("%") for p in control.group(1).split(",")] if control else []
  return order


def assign(computations: dict, roots: dict, entry: str,
           own_host: bool) -> dict[tuple[str, str], str]:
  """``(computation, start) -> stream`` for each asynchronous start of a program
  (`lowmem_jax._hlo.computations`): ``"compute k"``, `COMMUNICATION` for a collective, or
  with ``own_host`` `TO_HOST` / `TO_DEVICE` for a host transfer."""
  streams, turn, queue = {}, 0, collections.deque([entry])
  while queue:
    computation = queue.popleft()
    instructions = computations[computation]
    for name in post_order(instructions):
      i = instructions[name]
      if i.op.endswith("-start") and _collective(computations, roots, i):
        streams[computation, name] = COMMUNICATION
      elif i.op.endswith("-start"):
        way = _host_way(computations, roots, computation, i) if own_host else None
        streams[computation, name] = way or f"compute {turn % COMPUTE_STREAMS}"
        turn += not way
      if i.op == "while":
        queue += [_hlo.body(i), _hlo.condition(i)]
      elif i.op in ("call", "conditional"):
        queue += _hlo.called(i)
  return streams


def _collective(computations: dict, roots: dict, i: _hlo.Instruction) -> bool:
  """Whether a start begins a collective (it runs on `COMMUNICATION`): an
  ``all-gather-start`` and the like, or an ``async-start`` that wraps one."""
  if i.op != "async-start":
    return i.op.removesuffix("-start") in COLLECTIVES
  wrapped = _hlo.called(i)[0]
  return computations[wrapped][roots[wrapped]].op in COLLECTIVES


def _host_way(computations: dict, roots: dict, computation: str,
              i: _hlo.Instruction) -> str | None:
  """`TO_HOST` or `TO_DEVICE` for a start XLA runs on a host transfer stream, else None: a
  ``copy-start`` to or from host memory, or a start that wraps (alone, or as a fusion's root
  but a custom fusion's) a dynamic update of host memory or a dynamic slice of it."""
  if i.op == "copy-start":
    dst, src, *_ = (a.in_host_memory for a in _hlo.arrays(i.shape))
    return TO_HOST if dst else TO_DEVICE if src else None
  where, inner = computation, i._replace(op=i.op.removesuffix("-start"))  # the printed form
  if i.op == "async-start":
    where = _hlo.called(i)[0]
    inner = computations[where][roots[where]]
  if inner.op == "fusion" and "kind=kCustom" not in inner.attributes:
    where = _hlo.called(inner)[0]
    inner = computations[where][roots[where]]
  if inner.op not in ("dynamic-update-slice", "dynamic-slice") or not _hlo.in_host_memory(
      _hlo.operand_shape(computations[where], inner.operands[0])):  # written into, or sliced
    return None
  return TO_HOST if inner.op == "dynamic-update-slice" else TO_DEVICE
