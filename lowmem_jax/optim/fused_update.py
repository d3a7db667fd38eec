"""One leaf's `lowmem_jax.optim.lowbit.adamw_8bit` update with bfloat16 parameters as one
Pallas kernel (``pallas_kernels.adam8bit``), written in place: what the layer-streamed step
runs for a leaf where its ``update_impl`` picks the kernel.

The kernel reads and writes each slice where it lies: the parameters in their stack (a
layer's leaf, some rows of one), the moments' codes and scales in the device state's stack
or in the slice's state brought over from the host. The transformation's state for a leaf is
the chain's, as ``tx.init`` made it on the leaf alone (`lowmem_jax.optim.streamed`):
``((ScaleByAdam8bitState, decay's, learning rate's), StochasticRoundingState)``, stacked
where the leaf is. This module makes the kernel's keys and bias corrections from it, as the
chain's ``update`` makes them, and the next counts and keys, which the kernel writes where the
step is taken. For a stack of states on the device (a layer leaf's, a leaf's slices') every
slice's are made at once before the loop over them (`Table`): about 100 scalar kernels fewer
a layer of Llama-3.2-1B.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowmem_jax.ops.token_chunks import slices
from lowmem_jax.optim import lowbit, slicing
from lowmem_jax.optim.rounding import Position, StochasticRoundingState, step_key


def takes(fused: lowbit.FusedAdamW8bit | None, p: jax.Array, part: tuple[int, ...]) -> bool:
  """Whether the kernel can update leaf ``p``, updated ``part`` (a shape) at a time:
  ``fused`` is an `lowmem_jax.optim.lowbit.AdamW8bit`'s, ``p`` is bfloat16, each part's
  moments are 8-bit (``min_size`` elements or more, as ``tx.init`` saw it), and the kernel
  takes the part (``fused.block`` a power of two; ``pallas_kernels.adam8bit.supports``).
  Imports Pallas: ask once a kernel is chosen."""
  if fused is None or jnp.dtype(p.dtype) != jnp.bfloat16 or math.prod(part) < fused.min_size:
    return False
  from pallas_kernels import adam8bit
  block = fused.block
  return block & (block - 1) == 0 and adam8bit.supports(part, block) is None


class Table(NamedTuple):
  """The kernel's words and bias corrections (``pallas_kernels.adam8bit.update``'s) of each
  slice whose state a stack holds, made at once before the loop over them, so no slice's
  scalar work (its count read, keys folded and split, bias corrections) runs on its own.

  Fields:
    words: uint32 ``[R, 14]``, a row a slice, the slices of the stack's counts in order.
    numbers: float32 ``[R, 2]``.
  """
  words: jax.Array
  numbers: jax.Array


def layer_table(fused: lowbit.FusedAdamW8bit, p: jax.Array, s: Any, at: Position,
                slice_elements: int) -> Table:
  """The `Table` of a stacked layer leaf ``p`` (``[L, ...]``) whose state ``s`` is stacked on
  the device (each leaf ``[L, ...]``, or ``[L, n, ...]`` for a leaf updated in ``n`` slices),
  ``at`` the stack's position: what `update_leaf` takes as its ``table`` for each layer."""
  shape = jnp.shape(p)[1:]
  n = slices(shape, slice_elements)
  part = (shape[0] // n, *shape[1:])

  def words(r):
    i, j = r // n, r % n
    if n == 1:
      return _words_at(fused, s, (i,), p, (i,), None, at.index(i))
    return _words_at(fused, s, (i, j), p, (i, j), part[0], at.index(i).part(j, part))

  return Table(*jax.vmap(words)(jnp.arange(jnp.shape(p)[0] * n, dtype=jnp.int32)))


def update_leaf(fused: lowbit.FusedAdamW8bit, options: Any, g: jax.Array, s: Any, p: Any,
                place: str, at: Position, ok: jax.Array, slice_elements: int,
                outer: tuple = (), state_outer: tuple = (),
                table: Table | None = None) -> tuple[Any, Any, jax.Array]:
  """`lowmem_jax.optim.streamed`'s ``update_leaf`` (its arguments; its returns but the
  flags) of a leaf the kernel `takes`, each slice in place; ``table``: the stack's
  `layer_table`, where ``s`` is the device's stack of a layer leaf's states (``state_outer``
  given), else None. A leaf outside the stacks (no ``outer``) in many slices, its states on
  the device, makes its own."""
  shape = jnp.shape(p)[len(outer):]
  n = slices(shape, slice_elements)
  if n == 1:
    p_index, s_index = slicing.late((outer, state_outer), g)
    state = s if state_outer else slicing.to("device", s)
    ok = _finite(g, ok)
    p, state = _step(fused, options, g, state, s_index, p, p_index, None, at, ok, shape, table)
    return p, (state if state_outer else slicing.to(place, state)), ok

  part = (shape[0] // n, *shape[1:])
  if not outer:
    p = slicing.sliced(p, n)
    if place == "device":
      words = lambda j: _words_at(fused, s, (j,), p, (j,), None, at.part(j, part))
      table = Table(*jax.vmap(words)(jnp.arange(n, dtype=jnp.int32)))

  def fn(all_ok, i, p, s, g):  # `slicing.scan_slices`' ``whole``: p's and s's stacks
    slice_ok = _finite(g, ok)
    state, s_index = (s.unpack(), ()) if place == "host" else (s, (*state_outer, i))
    p, state = _step(fused, options, g, state, s_index, p, (*outer, i),
                     part[0] if outer else None, at.part(i, part), slice_ok, part,
                     None if place == "host" else table)
    return jnp.logical_and(all_ok, slice_ok), p, state

  if outer:
    ok, p, s = slicing.scan_slices(fn, ok, p, s, slicing.sliced(g, n), place, outer=outer,
                                   state_outer=state_outer, rows=part[0], whole=True)
    return p, s, ok
  ok, p, s = slicing.scan_slices(fn, ok, p, s, slicing.sliced(g, n), place, whole=True)
  return p.reshape(shape), s, ok


def _finite(g: jax.Array, ok: jax.Array) -> jax.Array:
  """bool []: ``ok`` and every element of ``g`` finite, in one reduction (``ok`` taken
  inside it, so the kernel reads the reduction's result, not a kernel of its own after it).
  ``g`` is not empty: the kernel takes no empty slice (`takes`)."""
  return jnp.all(jnp.logical_and(jnp.isfinite(g), ok))


def _first_row(x: jax.Array, index: tuple, rows: int | None) -> jax.Array:
  """int32 []: where `slicing.at`'s window of ``x`` at ``index`` starts, in rows of ``x``'s
  last axis."""
  start = slicing.window(x, index, rows)[0]
  row = jnp.int32(0)
  for k, size in zip(start[:-1], jnp.shape(x)[:-1]):
    row = row * size + jnp.asarray(k, jnp.int32)
  return row


def _moments(state):
  """The quantized ``(mu, nu)`` of the chain's state, and ``mu``'s tree structure."""
  adam = state[0][0]
  (mu,), moments = jax.tree.flatten(adam.mu, is_leaf=lowbit.is_quantized)
  (nu,) = jax.tree.leaves(adam.nu, is_leaf=lowbit.is_quantized)
  return mu, nu, moments


def _next(state, s_index):
  """``(count, key, step)``: the chain's new step count (int32 []) and rounding key's data
  (uint32 [2]) of the state at ``s_index`` of ``state``, and the key its rounding draws with
  (a typed key)."""
  (adam, *_), rounding = state
  count, key_data = slicing.at((adam.count, rounding.key), *s_index)
  next_key, step = jax.random.split(jax.random.wrap_key_data(key_data, impl="threefry2x32"))
  return optax.safe_int32_increment(count), jax.random.key_data(next_key), step


def _words_at(fused, state, s_index, p, p_index, rows, at):
  """``(words, numbers)``: uint32 ``[14]`` and float32 ``[2]``, the kernel's for the slice of
  ``p`` at ``p_index`` (`slicing.at`, with ``rows``), its state at ``s_index`` of ``state``,
  its position ``at``: the keys and bias corrections the chain's ``update`` makes."""
  new_count, next_key, step = _next(state, s_index)
  key = step_key(fused.seed, new_count)
  folded = lambda k: jax.random.key_data(jax.random.fold_in(k, at.leaf))
  mu, nu, _ = _moments(state)
  firsts = [_first_row(p, p_index, rows), jnp.int32(0),
            *[_first_row(q.codes, s_index, None) for q in (mu, nu)]]
  words = jnp.concatenate([
      folded(jax.random.fold_in(key, True)), folded(step),
      jnp.stack([jnp.asarray(at.row, jnp.int32), jnp.asarray(at.offset, jnp.int32),
                 *firsts, new_count]).astype(jnp.uint32),
      next_key, jnp.zeros((1,), jnp.uint32)])
  numbers = jnp.stack([1 - fused.b1 ** new_count, 1 - fused.b2 ** new_count])
  return words, numbers.astype(jnp.float32)


def _step(fused, options, g, state, s_index, p, p_index, rows, at, ok, shape, table):
  """``(p, state)``: the chain's step on the slice of ``shape`` at ``p_index`` (`slicing.at`,
  with ``rows``) of ``p``, its state at ``s_index`` of ``state``, written in place where
  ``ok`` (bool []) holds; its words and numbers ``table``'s row at ``s_index`` (a `Table` of
  ``state``'s stack), or made here (None)."""
  from pallas_kernels import adam8bit  # Pallas loads where a kernel runs
  (adam, *others), rounding = state
  mu, nu, moments = _moments(state)
  in_stack = table is not None  # the kernel writes the count and key into the stack's
  if in_stack:
    counts, keys, row = adam.count.reshape(-1), rounding.key.reshape(-1, 2), jnp.int32(0)
    for k, size in zip(s_index, jnp.shape(adam.count)):
      row = row * size + jnp.asarray(k, jnp.int32)
  else:
    counts = keys = None
    row, table = 0, Table(*[x[None] for x in _words_at(fused, state, s_index, p, p_index, rows,
                                                        at)])
  p, mu, nu, counts, keys = adam8bit.update(p, g, mu, nu, counts, keys, *table, row, ok,
                                            hyper=fused, shape=shape, rows=at.rows,
                                            options=options)
  if in_stack:
    count, key_data = counts.reshape(jnp.shape(adam.count)), keys.reshape(jnp.shape(rounding.key))
  else:  # the step's count and key, from its words
    count, key_data = slicing.at((adam.count, rounding.key), *s_index)
    new_count, next_key = table.words[0, 10].astype(jnp.int32), table.words[0, 11:13]
    count, key_data = jnp.where(ok, new_count, count), jnp.where(ok, next_key, key_data)
    if s_index:
      count, key_data = slicing.put((adam.count, rounding.key), (count, key_data), *s_index)
  adam = adam._replace(count=count, mu=jax.tree.unflatten(moments, [mu]),
                       nu=jax.tree.unflatten(moments, [nu]))
  return p, ((adam, *others), StochasticRoundingState(key_data))
