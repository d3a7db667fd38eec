"""The host transfers of a compiled program's loops, read from its schedule: which the copy
engines move, and what XLA scheduled between each one's start and its done (the kernels that
can hide it; `lowmem_jax.compile.memory.step_time` runs the schedule for its time).

A host transfer is a start (``async-start``, ``copy-start``, ``fusion-start``) with an array in
host memory (``S(5)``).
"""

from lowmem_jax import _hlo


def loop_host_transfers(hlo_text: str) -> dict[str, bool]:
  """The host transfers of the loop bodies of an optimized HLO module's text (named as
  `host_transfer_cover` names them), each True where the copy engines move it (a copy, or
  a fusion XLA runs as a memcpy), False where a kernel reads or writes pinned memory."""
  computations, roots, _ = _hlo.computations(hlo_text)
  bodies = sorted({_hlo.body(i) for c in computations.values() for i in c.values()
                   if i.op == "while"})
  return {f"{body}/{name}": i.op == "copy-start" or _hlo.is_memcpy(computations, roots, i)
          for body in bodies for name, i in computations[body].items()
          if i.op.endswith("-start") and _hlo.in_host_memory(i.shape)}


def exposed_host_transfers(hlo_text: str) -> list[str]:
  """The host transfers of a loop body (as `host_transfer_cover` names them) with no kernel
  scheduled between their start and their done: the compute waits for each whole."""
  return [name for name, (kernels, _) in host_transfer_cover(hlo_text).items() if not kernels]


def host_transfer_cover(hlo_text: str) -> dict[str, tuple[int, int]]:
  """What runs under each host transfer of a loop body (a ``while``'s, an optimized HLO module's
  text), named ``computation/start``: ``(kernels, tensor-core calls)`` scheduled between its
  start and its done (the calls: cuBLAS GEMMs and cuDNN attention). A loop that only moves
  data (`_moves_only`: a row moved in halves, as `lowmem_jax.optim.slicing` moves one outside
  its loop) has nothing to run under its transfers and is left out."""
  computations, roots, _ = _hlo.computations(hlo_text)
  bodies = {_hlo.body(i) for c in computations.values() for i in c.values() if i.op == "while"}
  cover = {}
  for body in sorted(b for b in bodies if not _moves_only(computations, roots, b)):
    open_: dict[str, list[int]] = {}  # each open host transfer: kernels and calls since its start
    for name, i in computations[body].items():
      if i.op.endswith("-start") and _hlo.in_host_memory(i.shape):
        open_[name] = [0, 0]
      elif i.op.endswith("-done"):
        start = i.operands[0].split("#")[0]
        if start in open_:
          cover[f"{body}/{start}"] = tuple(open_.pop(start))
      elif i.op not in _hlo.FREE and not i.op.endswith("-start"):
        target = _hlo.custom_call_target(i)
        tensor = bool(target) and target.startswith((*_hlo.GEMMS, "__cudnn$fmha"))
        for counts in open_.values():
          counts[:] = counts[0] + 1, counts[1] + tensor
  return cover


def ordered_host_transfers(hlo_text: str) -> list[tuple[str, str]]:
  """``(start, operand)`` for each host transfer (in any computation of an optimized HLO
  module's text) that starts from a value XLA orders after other instructions (its maker,
  through tuple elements, has ``control-predecessors``): such a transfer cannot start before
  them. A loop counter's increment is one (XLA orders it after every reader of the counter,
  which it overwrites): `lowmem_jax.optim.slicing` reads no row from it."""
  computations, _, _ = _hlo.computations(hlo_text)
  found = []
  for instructions in computations.values():
    def maker(operand: str) -> _hlo.Instruction | None:
      made = instructions.get(operand.split("#")[0])
      if made is not None and made.op == "get-tuple-element":
        return maker(made.operands[0])
      return made

    found += [(name, o) for name, i in instructions.items()
              if i.op.endswith("-start") and _hlo.in_host_memory(i.shape) for o in i.operands
              if "control-predecessors" in getattr(maker(o), "attributes", "")]
  return found


def _moves_only(computations: dict, roots: dict, body: str) -> bool:
  """Whether computation ``body`` only moves data: each kernel computes a scalar (a loop
  counter, an offset), makes an operand of an asynchronous start, or writes what a done
  brought into a buffer (a dynamic-update-slice, alone or fused)."""
  def stores(i: _hlo.Instruction) -> bool:
    called = _hlo.called(i)
    root = computations[called[0]][roots[called[0]]] if i.op == "fusion" and called else i
    return root.op == "dynamic-update-slice"

  instructions = computations[body]
  fed = {o.split("#")[0] for i in instructions.values() if i.op.endswith("-start")
         for o in i.operands}
  brought = {n for n, i in instructions.items() if i.op.endswith("-done")}
  scalar = lambda shape: all(not a.dims for a in _hlo.arrays(shape))
  return all(i.op in _hlo.FREE or i.op.endswith(("-start", "-done")) or scalar(i.shape)
             or name in fed or (stores(i) and any(o.split("#")[0] in brought
                                                  for o in i.operands))
             for name, i in instructions.items())
