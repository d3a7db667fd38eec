"""Stacked trees read and written a slice at a time, in place, and moved between the
device and pinned host memory: the storage side of `lowmem_jax.optim.layer_streamed`.

A stack holds one slice per layer (or per slice of a big leaf) along its leading axis.
`at` reads slice ``i`` and `put` writes it back in place, never copying the stack;
`scan_slices` runs a function over the slices in a loop, bringing what lives on
the host over one slice ahead so the transfer overlaps the compute; `late` keeps an index
from being used before a value is made (an optimization barrier), so a slice is not read
early and held; `layer_states` makes a stacked optimizer state where it is kept.
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from lowmem_jax.optim.packed_rows import Layout, PackedRows


def to(place: str, tree: Any) -> Any:
  """``tree`` moved to the memory of ``place``, a `lowmem_jax.choices.Place`."""
  return jax.device_put(tree, jax.memory.Space.Host if place == "host" else jax.memory.Space.Device)


def layer_states(init_layer: Callable, layers: Any, place: str) -> Any:
  """``jax.vmap(init_layer)(layers)`` in ``place``; in host memory as `PackedRows` (`stacked`).
  In host memory, outside a trace and on one device, each layer's state is made on the device
  and brought to the host before the next one's: a whole Llama-3-8B's 8-bit state (15 GiB)
  made on the device would not fit beside its bfloat16 parameters on a 24 GB card. (Traced,
  XLA places the states in host memory itself; under a mesh a layer's state is one device's
  share.)"""
  leaves = jax.tree.leaves(layers)
  if (place == "device" or len({getattr(x, "sharding", None) for x in leaves}) != 1
      or any(isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array) for x in leaves)
      or len(leaves[0].sharding.device_set) > 1):
    return stacked(place, jax.vmap(init_layer)(layers), leaves[0].shape[0])
  first = {}  # the first layer's layout, which every layer's state has, and its packing

  def row(i):  # layer i's state made on the device, packed, brought to the host, dropped
    state = init_layer(jax.tree.map(lambda x: x[i], layers))
    if not first:
      first["layout"] = Layout.of(state)
      first["pack"] = jax.jit(first["layout"].pack)
    return jax.device_get(first["pack"](state))

  rows = np.stack([row(i) for i in range(leaves[0].shape[0])])
  host = leaves[0].sharding.with_memory_kind("pinned_host")
  return PackedRows(jax.device_put(rows, host), first["layout"])


def stacked(place: str, tree: Any, n: int) -> Any:
  """A stack of ``n`` trees (each leaf ``[n, ...]``) kept in ``place``: on the device as it
  is, in host memory as `PackedRows`, a row a slice, so a slice crosses the host link in one
  transfer."""
  return to(place, PackedRows.stack(tree, n) if place == "host" else tree)


def at(tree: Any, *index: jax.Array, rows: int | None = None) -> Any:
  """``tree``'s leaves at the leading indices ``index`` (``tree`` itself without); with
  ``rows``, the last index ``i`` takes rows ``[i * rows, (i + 1) * rows)`` of its axis
  (kept), so a leaf is read a slice at a time without reshaping it (which would move a
  sharded leaf between devices)."""
  if not index:
    return tree
  return jax.tree.map(lambda t: jax.lax.dynamic_slice(t, *_window(t, index, rows)).reshape(
      _window(t, index, rows)[1][len(index) - (rows is not None):]), tree)


def put(tree: Any, new: Any, *index: jax.Array, rows: int | None = None) -> Any:
  """``tree`` with ``new`` written in place where `at` reads."""
  return jax.tree.map(lambda t, x: jax.lax.dynamic_update_slice(
      t, x.astype(t.dtype).reshape(_window(t, index, rows)[1]), _window(t, index, rows)[0]),
      tree, new)


def _window(t: Any, index: tuple, rows: int | None) -> tuple[tuple, tuple]:
  """`at`'s ``(start, size)`` in ``t``."""
  lead = len(index) - (rows is not None)
  start = (*index[:lead], *([] if rows is None else [index[-1] * rows]))
  size = (*[1] * lead, *([] if rows is None else [rows]))
  rest = jnp.shape(t)[len(start):]
  return (*start, *[0] * len(rest)), (*size, *rest)


def late(index: Any, after: Any) -> Any:
  """``index``, not to be used before ``after`` is made (an optimization barrier)."""
  if after is None or not jax.tree.leaves(index):
    return index
  return jax.lax.optimization_barrier((after, index))[1]


def scan_slices(fn: Callable, carry: Any, params: Any, states: Any, xs: Any, place: str,
                 reverse: bool = False, outer: tuple = (), state_outer: tuple = (),
                 rows: int | None = None, whole: bool = False) -> tuple[Any, Any, Any]:
  """``fn(carry, i, params_i, state_of, xs_i) -> (carry, params_i, state_i)`` over the slices i
  of stacked ``params``, ``states`` and ``xs`` (leading axis), in a loop;
  ``state_of(after)`` is ``state_i``, taken from device states only once ``after`` (the
  gradient) is made, so the slice is not held while the gradient is computed.

  The params are updated in place; the states too where they live on the device
  (``place``); on the host they are `PackedRows` (`stacked`). What lives on the host (the
  states there, and any leaf of ``xs`` in host memory) is brought over one slice ahead: the
  body starts the copy of the next slice's before it runs ``fn`` on this one's, so the
  transfer can overlap the compute; the new state is packed and written back in place into
  its row of the host stack, carried through the loop (a donated stack is updated where it
  lies, never copied host to host).

  The params and the device states may lie deeper in bigger stacks: slice i's at
  ``params[*outer, i]`` and ``states[*state_outer, i]`` (leading indices), read and
  written there, never copied out whole; with ``rows``, the params are not stacked by
  slice: slice i is rows ``[i * rows, (i + 1) * rows)`` of ``params[*outer]``. With
  ``whole``, ``fn`` takes and returns, in place of ``params_i``, ``state_of`` and
  ``state_i``, the whole ``params`` and the whole device ``states`` (or, on the host,
  slice i's brought over): it reads and writes slice i itself.
  """
  n = jax.tree.leaves(params)[0].shape[len(outer)] // (rows or 1)
  on_host = place == "host"
  if on_host and not isinstance(states, PackedRows):
    raise TypeError(f"States on the host must be PackedRows (`stacked`), got "
                    f"{type(states).__name__}.")
  fetch = lambda kept, i: to("device", (at(kept, i) if on_host else None, at(xs, i)))

  def body(k, c):
    i = n - 1 - k if reverse else k
    c, params, kept, current = c  # kept: the device states, or the host's packed rows
    ahead = fetch(kept, jnp.clip(i - 1 if reverse else i + 1, 0, n - 1))
    if whole:
      c, params, s = fn(c, i, params, states.layout.unpack(current[0]) if on_host else kept,
                        current[1])
    else:
      state_of = ((lambda after: states.layout.unpack(current[0])) if on_host else
                  (lambda after: at(kept, *late((*state_outer, i), after))))
      c, p, s = fn(c, i, at(params, *outer, i, rows=rows), state_of, current[1])
      params = put(params, p, *outer, i, rows=rows)
    if on_host:  # the next slice read before this one's row is written in place
      s, ahead = jax.lax.optimization_barrier((s, ahead))
      row = states.layout.pack(s)[None]
      # A stack typed as host memory (made in the trace, or an argument placed there by a
      # NamedSharding) takes a host row; one typed as the device's (a single-device argument in
      # pinned memory: its buffer on the host all the same) takes the row as it is.
      if jax.typeof(kept).memory_space == jax.memory.Space.Host:
        row = to("host", row)
      return c, params, jax.lax.dynamic_update_slice(kept, row, (i, 0)), ahead
    return c, params, s if whole else put(kept, s, *state_outer, i), ahead

  first = late(n - 1 if reverse else 0, carry)  # not brought over before the carry is made
  kept = states.rows if on_host else states
  # A loop counter, not a scan over the indices: XLA then sees each slice's offset as a
  # function of the loop's induction variable, and jax 0.10's XLA moves a host row as a memcpy
  # (the copy engines' DMA) rather than with a kernel over pinned memory.
  carry, params, kept, _ = jax.lax.fori_loop(0, n, body, (carry, params, kept, fetch(kept, first)))
  return carry, params, PackedRows(to("host", kept), states.layout) if on_host else kept
