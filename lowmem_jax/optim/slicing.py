"""Stacked trees read and written a slice at a time, in place, and moved between the
device and pinned host memory: the storage side of `lowmem_jax.optim.layer_streamed`.

A stack holds one slice per layer (or per slice of a big leaf) along its leading axis.
`at` reads slice ``i`` and `put` writes it back in place, never copying the stack;
`scan_slices` runs a function over the slices in a loop, bringing what lives on the host
over ahead and writing it back late, so the transfers overlap the compute; `late` keeps an
index from being used before a value is made (an optimization barrier), so a slice is not
read early and held; `layer_states` makes a stacked optimizer state where it is kept.
"""

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from lowmem_jax.optim.packed_rows import Layout, PackedRows, Row, dealt


def to(place: str, tree: Any) -> Any:
  """``tree`` moved to the memory of ``place``, a `lowmem_jax.choices.Place`."""
  return jax.device_put(tree, jax.memory.Space.Host if place == "host" else jax.memory.Space.Device)


def layer_states(init_layer: Callable, layers: Any, place: str, banks: int = 1) -> Any:
  """``jax.vmap(init_layer)(layers)`` in ``place``; in host memory as `PackedRows` in
  ``banks`` arrays (`stacked`).
  In host memory, outside a trace and on one device, each layer's state is made on the device
  and brought to the host before the next one's: a whole Llama-3-8B's 8-bit state (15 GiB)
  made on the device would not fit beside its bfloat16 parameters on a 24 GB card. (Traced,
  XLA places the states in host memory itself; under a mesh a layer's state is one device's
  share.)"""
  leaves = jax.tree.leaves(layers)
  if (place == "device" or len({getattr(x, "sharding", None) for x in leaves}) != 1
      or any(isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array) for x in leaves)
      or len(leaves[0].sharding.device_set) > 1):
    return stacked(place, jax.vmap(init_layer)(layers), leaves[0].shape[0], banks)
  first = {}  # the first layer's layout, which every layer's state has, and its packing

  def row(i):  # layer i's state made on the device, packed, brought to the host, dropped
    state = init_layer(jax.tree.map(lambda x: x[i], layers))
    if not first:
      first["layout"] = Layout.of(state)
      first["pack"] = jax.jit(first["layout"].pack)
    return jax.device_get(first["pack"](state))

  rows = np.stack([row(i) for i in range(leaves[0].shape[0])])
  host = leaves[0].sharding.with_memory_kind("pinned_host")
  return PackedRows(tuple(jax.device_put(bank, host) for bank in dealt(rows, banks)),
                    first["layout"])


def stacked(place: str, tree: Any, n: int, banks: int = 1) -> Any:
  """A stack of ``n`` trees (each leaf ``[n, ...]``) kept in ``place``: on the device as it
  is, in host memory as `PackedRows`, a row a slice in ``banks`` arrays (1, or 2 for the
  transfers' overlap in `scan_slices`), so a slice crosses the host link in one transfer."""
  return to(place, PackedRows.stack(tree, n, banks) if place == "host" else tree)


def at(tree: Any, *index: jax.Array, rows: int | None = None) -> Any:
  """``tree``'s leaves at the leading indices ``index`` (``tree`` itself without); with
  ``rows``, the last index ``i`` takes rows ``[i * rows, (i + 1) * rows)`` of its axis
  (kept), so a leaf is read a slice at a time without reshaping it (which would move a
  sharded leaf between devices). An index out of range is clamped, as XLA clamps it (a
  negative one is not counted from the end)."""
  if not index:
    return tree
  return jax.tree.map(lambda t: jax.lax.dynamic_slice(
      t, *window(t, index, rows), allow_negative_indices=False).reshape(
      window(t, index, rows)[1][len(index) - (rows is not None):]), tree)


def put(tree: Any, new: Any, *index: jax.Array, rows: int | None = None) -> Any:
  """``tree`` with ``new`` written in place where `at` reads."""
  return jax.tree.map(lambda t, x: jax.lax.dynamic_update_slice(
      t, x.astype(t.dtype).reshape(window(t, index, rows)[1]), window(t, index, rows)[0],
      allow_negative_indices=False), tree, new)


def window(t: Any, index: tuple, rows: int | None = None) -> tuple[tuple, tuple]:
  """`at`'s ``(start, size)`` in ``t``."""
  lead = len(index) - (rows is not None)
  start = (*index[:lead], *([] if rows is None else [index[-1] * rows]))
  size = (*[1] * lead, *([] if rows is None else [rows]))
  rest = jnp.shape(t)[len(start):]
  return (*start, *[0] * len(rest)), (*size, *rest)


def sliced(x: jax.Array, n: int) -> jax.Array:
  """``x`` as ``n`` equal slices of its first axis, stacked: ``[n, len / n, ...]``."""
  return x.reshape(n, -1, *jnp.shape(x)[1:])


def late(index: Any, after: Any) -> Any:
  """``index``, not to be used before ``after`` is made (an optimization barrier)."""
  if after is None or not jax.tree.leaves(index):
    return index
  return jax.lax.optimization_barrier((after, index))[1]


def scan_slices(fn: Callable, carry: Any, params: Any, states: Any, xs: Any, place: str,
                 reverse: bool = False, outer: tuple = (), state_outer: tuple = (),
                 rows: int | None = None, whole: bool = False,
                 fence: bool = False) -> tuple[Any, Any, Any]:
  """``fn(carry, i, params_i, state_i, xs_i) -> (carry, params_i, state_i)`` over the slices i
  of stacked ``params``, ``states`` and ``xs`` (leading axis), in a loop; a device state's
  slice read at the loop's index, which XLA reads in place (not at a barrier's copy of it).

  The params are updated in place; the states too where they live on the device
  (``place``); on the host they are `PackedRows` (`stacked`), brought over ahead and written
  back in place, a slice late: in one bank, a slice ahead, the read before the write (one
  array), each under part of the slice's compute; in two, two slices ahead, so both
  transfers can run under all of it, for one more slice's row held on the device
  (`_HostTrips`). Any leaf of ``xs`` in host memory comes over with the slice's state (on the
  device, one slice ahead). A donated host stack is updated where it lies, never copied host
  to host.

  The params and the device states may lie deeper in bigger stacks: slice i's at
  ``params[*outer, i]`` and ``states[*state_outer, i]`` (leading indices), read and
  written there, never copied out whole; with ``rows``, the params are not stacked by
  slice: slice i is rows ``[i * rows, (i + 1) * rows)`` of ``params[*outer]``. With
  ``whole``, ``fn`` takes and returns, in place of ``params_i`` and ``state_i``, the whole
  ``params`` and the whole device ``states`` (or, on the host, slice i's, packed: a
  `packed_rows.Row`; it returns the tree): it reads and writes slice i. With
  ``fence``, ``fn`` takes a last argument, ``fence(x) -> x``, and calls it once, in its own
  trace (not in a nested loop or cond), on a value its compute makes midway: in one host bank,
  the next row is to have come over by then and the previous one goes back from there
  (without it, from the slice's start, under all of ``fn``); elsewhere it returns ``x``.
  """
  n = jax.tree.leaves(params)[0].shape[len(outer)] // (rows or 1)
  if place == "host" and not isinstance(states, PackedRows):
    raise TypeError(f"States on the host must be PackedRows (`stacked`), got "
                    f"{type(states).__name__}.")
  if place == "host" and [len(b) for b in states.banks] != [len(b) for b in dealt(
      np.arange(n), len(states.banks))]:  # a slice out of range would read and write another's
    raise ValueError(f"The host states hold {states.count} rows in banks of "
                     f"{[len(b) for b in states.banks]}; the params have {n} slices.")
  index = lambda k: n - 1 - k if reverse else k  # trip k's slice

  def apply(c, params, kept, i, current, barrier=lambda x: x):
    """``(c, params, s)``: ``fn`` on slice i, its params written in place; ``s``: what
    ``fn`` returns of the states (slice i's, or the whole device stack with ``whole``);
    ``barrier``: what ``fn`` takes as its ``fence``."""
    row = Row(current[0], states.layout) if place == "host" else None
    calls = []

    def counted(y):  # ``barrier``, its calls counted
      calls.append(y)
      return barrier(y)

    extra, x = (counted,) if fence else (), _slice(xs, i, current[1])
    if whole:
      out = fn(c, i, params, row if place == "host" else kept, x, *extra)
    else:
      state = row.unpack() if place == "host" else at(kept, *state_outer, i)
      c, p, s = fn(c, i, at(params, *outer, i, rows=rows), state, x, *extra)
      out = c, put(params, p, *outer, i, rows=rows), s
    if fence and len(calls) != 1:
      raise RuntimeError(f"`scan_slices`' fn must call its fence once, called it {len(calls)} "
                         "times.")
    return out

  # A loop counter, not a scan over the indices: XLA then sees each slice's offset as a
  # function of the loop's induction variable, and moves a host row as a memcpy (the copy
  # engines' DMA) rather than with a kernel over pinned memory; jax 0.12's XLA only where the
  # offsets are linear in it, so `_HostTrips` reads and writes trips k + 1, k + 2 and k - 1
  # (`_HostTrips.later`), clamped at the ends onto the rows it means.
  if place == "host":
    return _HostTrips(apply, states, xs, n, index, fence).run(carry, params)

  def body(k, loop):
    c, params, kept, current = loop
    i = index(k)
    ahead = (None, _ahead(xs, index(k + 1)))
    c, params, s = apply(c, params, kept, i, current)
    return c, params, s if whole else put(kept, s, *state_outer, i), ahead

  first = (None, _ahead(xs, late(index(0), carry)))  # not before the carry is made
  carry, params, kept, _ = jax.lax.fori_loop(0, n, body, (carry, params, states, first))
  return carry, params, kept


@dataclasses.dataclass(frozen=True)
class _HostTrips:
  """`scan_slices`' loop over states in host memory (`PackedRows`).

  In one bank, trip k (slice ``index(k)``) starts bringing over the row of trip k + 1 and
  runs ``apply`` on its own row; at ``apply``'s fence (`scan_slices`), once the next row is
  read, it starts writing back the new row of trip k - 1 in place, so the read runs under
  the compute before the fence and the write under the rest. Trip 0 writes back its own row
  as it was brought over (one row more over the link a pass: trip -1's offset, clamped, is
  its own), and the last trip brings over its own row again (trip n's, clamped); the last
  trip's new row is written after the loop.

  In two banks, trip k starts bringing over the row of trip k + 2 and writing back the new row
  of trip k - 1, then runs ``apply`` on its own row, brought over two trips before; its new
  row is written back in the next trip. Rows i and i ± 1 lie in different banks, so the read
  and the write touch different buffers and XLA can run both under the trip's compute. The
  loop body runs two trips, so it knows each one's banks. Trip 0 writes back trip 1's row as
  it was brought over (no change: trip -1's offset in trip 1's bank, clamped, is trip 1's
  row), and the last two trips bring over a row they do not use (trips n and n + 1's offsets,
  clamped), so every trip is alike and each offset is linear in the loop's counter; the
  last trip's new row is written after the loop.
  """
  apply: Callable  # (c, params, kept, i, (row, `_ahead(xs, i)`), fence) -> (c, params, state_i)
  states: PackedRows
  xs: Any
  n: int
  index: Callable  # trip k's slice
  fence: bool  # ``apply`` calls its fence (else the trip fences before it)

  def bank(self, phase: int) -> int:
    """The bank of the rows of trips of parity ``phase`` (k % 2, where there are two banks)."""
    return self.index(phase) % len(self.states.banks)

  def later(self, k: Any, trips: int) -> Any:
    """The slice of trip k + ``trips`` (k an int, or the loop's int32 counter), written so
    that XLA finds no k + 1 in it to share with the loop counter's increment. XLA orders that
    increment, which overwrites k in place, after every other reader of k, so a transfer
    whose offset it computes starts after the trip's compute: under jax 0.12 the rtx4090
    8B's next row then started 11 ms of GEMMs before its fence, where it takes 17.6 ms
    (docs/benchmarks.md, "Session 43"). The offset stays linear in k, as DMA needs."""
    stride = self.index(1) - self.index(0)
    return (self.n + trips * stride) - (self.n - self.index(k))

  def fetch(self, banks: tuple, i: Any, phase: int) -> tuple:
    """Slice i's row (of a trip of phase ``phase``: its parity) and ``xs`` slice
    (`_ahead`), brought over."""
    return to("device", at(banks[self.bank(phase)], i // len(banks))), _ahead(self.xs, i)

  def write(self, banks: tuple, row: jax.Array, i: Any, phase: int) -> tuple:
    """``banks`` with slice i's new ``row`` (of a trip of phase ``phase``) written in
    place."""
    banks = list(banks)
    b = self.bank(phase)
    # A bank of one row is written in two parts: XLA (jax 0.12's) would take a row written
    # over the whole bank for the bank itself, a device buffer, and copy it to the host (or,
    # for a row brought over, fail to compile).
    cut = banks[b].shape[1] // 2 if banks[b].shape[0] == 1 else 0
    for start, part in ((0, row[:cut]), (cut, row[cut:])) if cut else ((0, row),):
      banks[b] = jax.lax.dynamic_update_slice(banks[b], _for(banks[b], part[None]),
                                              (i // len(banks), start),
                                              allow_negative_indices=False)
    return tuple(banks)

  def fetch_first(self, banks: tuple, k: int) -> tuple:
    """`fetch` of trip k (an int) outside the loop, its row in halves (`_halves`)."""
    bank, at_row = banks[self.bank(k % 2)], self.index(k) // len(banks)
    halves, at_half = _halves(bank, at_row)
    # The rows' buffer made from the banks, so not at the program's start (a broadcast of a
    # constant has no inputs: XLA would make it there and hold it until the loop).
    zero, halves = jax.lax.optimization_barrier((jnp.zeros((), bank.dtype), halves))
    move = lambda h, rows: jax.lax.dynamic_update_slice(
        rows, to("device", at(halves, at_half(h))[None]), (h, 0))
    parts = len(halves) // len(bank)  # 2, or 1 for a row of an odd width
    rows = jax.lax.fori_loop(0, parts, move,
                             jnp.zeros((parts, halves.shape[1]), bank.dtype) + zero)
    return rows.reshape(-1), _ahead(self.xs, self.index(k))

  def write_last(self, banks: tuple, row: jax.Array, k: int) -> tuple:
    """`write` of trip k (an int) outside the loop, in halves (`_halves`)."""
    banks, b = list(banks), self.bank(k % 2)
    halves, at_half = _halves(banks[b], self.index(k) // len(banks))
    parts = row.reshape(len(halves) // len(banks[b]), -1)
    move = lambda h, halves: jax.lax.dynamic_update_slice(
        halves, _for(halves, at(parts, h)[None]), (at_half(h), 0))
    banks[b] = jax.lax.fori_loop(0, len(parts), move, halves).reshape(banks[b].shape)
    return tuple(banks)

  def trip_one_bank(self, k: Any, loop: tuple) -> tuple:
    """Trip k in one bank: ``loop`` is ``(c, params, banks, now, pending)``, ``now`` this
    trip's row brought over, ``pending`` the previous trip's new row."""
    c, params, banks, now, pending = loop
    # The pending row is written into the bank the next one is read from: the read first.
    rows = [(pending, self.fetch(banks, self.later(k, 1), 0))]

    def fence(x):
      x, fenced = jax.lax.optimization_barrier((x, rows[0]))
      rows.append(fenced)
      return x

    if not self.fence:
      fence(None)
    c, params, s = self.apply(c, params, None, self.index(k), now, fence)
    pending, upcoming = rows[-1]
    banks = self.write(banks, pending, self.later(k, -1), 0)
    return c, params, banks, upcoming, self.states.layout.pack(s)

  def trip_two_banks(self, phase: int, k: Any, loop: tuple) -> tuple:
    """Trip k (of parity ``phase``; an int for the last trip, peeled) in two banks:
    ``loop`` is ``(c, params, banks, now, next, pending)``, ``now`` and ``next`` this trip's
    and the next one's rows brought over, ``pending`` the previous trip's new row."""
    c, params, banks, now, upcoming, pending = loop
    banks = (self.write_last(banks, pending, k - 1) if isinstance(k, int)  # peeled: by DMA
             else self.write(banks, pending, self.later(k, -1), 1 - phase))
    ahead = (upcoming if isinstance(k, int) and k + 2 >= self.n
             else self.fetch(banks, self.later(k, 2), phase))
    c, params, s = self.apply(c, params, None, jnp.int32(self.index(k)), now)
    # The next trip writes this trip's row into the bank just read: the read first, in place.
    s, ahead = jax.lax.optimization_barrier((s, ahead))
    return c, params, banks, upcoming, ahead, self.states.layout.pack(s)

  def run(self, carry: Any, params: Any) -> tuple[Any, Any, PackedRows]:
    n, layout = self.n, self.states.layout
    banks = late(self.states.banks, carry)  # not brought over before the carry is made
    now = self.fetch_first(banks, 0)
    if len(banks) == 1:
      c, params, banks, _, pending = jax.lax.fori_loop(0, n, self.trip_one_bank,
                                                       (carry, params, banks, now, now[0]))
      banks = self.write_last(banks, pending, n - 1)
      return c, params, PackedRows(tuple(to("host", bank) for bank in banks), layout)
    upcoming = self.fetch_first(banks, 1)
    trip = self.trip_two_banks
    loop = jax.lax.fori_loop(0, n // 2, lambda u, loop: trip(1, 2 * u + 1, trip(0, 2 * u, loop)),
                             (carry, params, banks, now, upcoming, upcoming[0]))
    if n % 2:
      loop = trip(0, n - 1, loop)
    c, params, banks, *_, pending = loop
    banks = self.write_last(banks, pending, n - 1)
    return c, params, PackedRows(tuple(to("host", bank) for bank in banks), layout)


def _ahead(xs: Any, i: jax.Array) -> list:
  """Slice i of each leaf of ``xs`` in host memory, brought over (to be carried into its
  trip); None for a device leaf, which `_slice` reads in its own trip: carried, its slice
  would be a copy."""
  return [to("device", at(x, i)) if jax.typeof(x).memory_space == jax.memory.Space.Host
          else None for x in jax.tree.leaves(xs)]


def _slice(xs: Any, i: jax.Array, ahead: list) -> Any:
  """``xs``' slice i, its host leaves' as `_ahead` brought them over."""
  return jax.tree.unflatten(jax.tree.structure(xs), [
      at(x, i) if a is None else a for x, a in zip(jax.tree.leaves(xs), ahead)])


def _for(bank: jax.Array, row: jax.Array) -> jax.Array:
  """``row`` made ready to write into ``bank``: a bank typed as host memory (made in the
  trace, or an argument placed there by a NamedSharding) takes a host row; one typed as the
  device's (a single-device argument in pinned memory: its buffer on the host all the same)
  takes the row as it is."""
  return to("host", row) if jax.typeof(bank).memory_space == jax.memory.Space.Host else row


def _halves(bank: jax.Array, at_row: int) -> tuple[jax.Array, Callable]:
  """``(halves, at_half)``: ``bank`` (``[rows, width]``) seen as ``[2 * rows, width / 2]``
  (the same bytes), and where half h of row ``at_row`` lies, so a row moves as two slices in
  a loop of two trips, at offsets of the loop's counter: XLA (jax 0.10's) moves such a slice
  of a host bank by DMA, where it moves one outside a loop (at fixed offsets) with a kernel
  over pinned memory at about a quarter of the link's rate (`lowmem_jax.compile.memory.
  step_time`). A row of an odd width stays whole: one slice, moved by a kernel."""
  if bank.shape[1] % 2:
    return bank, lambda h: at_row
  return bank.reshape(2 * bank.shape[0], bank.shape[1] // 2), lambda h: 2 * at_row + h
