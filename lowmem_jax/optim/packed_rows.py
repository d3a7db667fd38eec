"""A stack of like trees held as byte rows, a row a tree: how `layer_streamed` keeps a
stacked state in pinned host memory.

Each leaf of a tree is viewed as bytes (``lax.bitcast_convert_type``; a typed PRNG key as its
key data, a bool as a byte) and the leaves are laid end to end in one ``uint8`` row, in the
tree's leaf order. A layer's state then crosses the host link as one transfer each way, not one
a leaf: compiled for the ``h100`` target, XLA runs a layer's single transfer under the
layer's compute, where it runs the 43 transfers of a Llama layer's 8-bit state one after the
other between two kernels (``docs/benchmarks.md``; the ``rtx4090`` target still leaves a few
exposed). Packing and unpacking are exact (bit for bit).
"""

import dataclasses
import functools
import math
from collections.abc import Collection
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class _Leaf(NamedTuple):
  """One leaf of a row's tree: its shape and dtype, a PRNG key's implementation, and the
  shape and dtype of the array whose bytes are kept (a key's data; a bool as a byte)."""
  shape: tuple[int, ...]
  dtype: Any  # a numpy dtype, or a typed key's
  impl: Any  # a typed key's `jax.random.key_impl`, else None
  stored_shape: tuple[int, ...]
  stored_dtype: np.dtype

  @classmethod
  def of(cls, x: Any, lead: int) -> "_Leaf":
    """The leaf of array (or tracer) ``x`` without its ``lead`` leading axes."""
    shape = tuple(x.shape[lead:])
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      data = jax.eval_shape(jax.random.key_data, x)
      return cls(shape, x.dtype, jax.random.key_impl(x), tuple(data.shape[lead:]),
                 np.dtype(data.dtype))
    return cls(shape, x.dtype, None, shape, np.dtype(np.uint8 if x.dtype == np.bool_ else x.dtype))

  @property
  def nbytes(self) -> int:
    return math.prod(self.stored_shape) * self.stored_dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each leaf of a tree lies in its row: the tree's structure and leaves, in order."""
  treedef: Any
  leaves: tuple[_Leaf, ...]

  @classmethod
  def of(cls, tree: Any, lead: int = 0) -> "Layout":
    """The layout of ``tree``'s leaves (arrays or tracers) without their ``lead`` leading axes."""
    leaves, treedef = jax.tree.flatten(tree)
    return cls(treedef, tuple(_Leaf.of(x, lead) for x in leaves))

  @property
  def row_bytes(self) -> int:
    return sum(leaf.nbytes for leaf in self.leaves)

  def pack(self, tree: Any) -> jax.Array:
    """``tree`` (this layout's) as one row, ``uint8[row_bytes]``; a ValueError where its
    structure, a shape or a dtype differs. Where every leaf is a whole number of 4-byte
    words, the leaves are laid end to end as ``uint32`` words and the row viewed as bytes:
    XLA's GPU concatenation runs a thread an element of its largest operand, each visiting
    every operand, so words take a quarter of the threads bytes do (session 42)."""
    if Layout.of(tree) != self:
      raise ValueError(f"The tree to pack is not laid out as the packed rows: "
                       f"{Layout.of(tree)} against {self}.")
    unit = jnp.uint32 if all(leaf.nbytes % 4 == 0 for leaf in self.leaves) else jnp.uint8
    parts = []
    for x, leaf in zip(jax.tree.leaves(tree), self.leaves):
      x = jax.random.key_data(x) if leaf.impl is not None else x
      x = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
      parts.append(_view(x, unit))
    row = jnp.concatenate(parts) if parts else jnp.zeros((0,), unit)
    return jax.lax.bitcast_convert_type(row, jnp.uint8).reshape(-1)

  def unpack(self, row: jax.Array, keep: Collection[int] | None = None) -> Any:
    """The tree `pack` made ``row`` (``uint8[row_bytes]``) from, bit for bit; with ``keep``
    (indices into ``leaves``, the tree's leaf order), only those leaves, the others None (no
    slice of the row made for them)."""
    leaves, start = [], 0
    for k, leaf in enumerate(self.leaves):
      if keep is not None and k not in keep:
        leaves.append(None)
        start += leaf.nbytes
        continue
      size = leaf.stored_dtype.itemsize
      part = row[start:start + leaf.nbytes].reshape(*leaf.stored_shape,
                                                     *([size] if size > 1 else []))
      x = jax.lax.bitcast_convert_type(part, leaf.stored_dtype)
      if leaf.impl is not None:
        x = jax.random.wrap_key_data(x, impl=leaf.impl)
      leaves.append(x != 0 if leaf.dtype == np.bool_ else x)
      start += leaf.nbytes
    return jax.tree.unflatten(self.treedef, leaves)


def _view(x: jax.Array, unit: Any) -> jax.Array:
  """``x``'s bytes as a flat array of ``unit`` (``uint8``, or ``uint32`` where ``x.nbytes`` is
  a multiple of 4) elements, in memory order. Words are made from the bytes: XLA's simplifier
  folds a bfloat16-to-word view followed by a word-to-byte one into one view of the wrong
  shape (a lone bfloat16 leaf failed to compile)."""
  data = jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)
  return data if unit == jnp.uint8 else jax.lax.bitcast_convert_type(data.reshape(-1, 4), unit)


class Row(NamedTuple):
  """One row, ``uint8[layout.row_bytes]``, and its layout: a tree handed over packed, so
  that a reader unpacks a leaf where it reads it, not before (`read_after`)."""
  row: jax.Array
  layout: Layout

  def unpack(self) -> Any:
    """The row's tree (`Layout.unpack`)."""
    return self.layout.unpack(self.row)

  def read_after(self, x: Any, keep: Collection[int] | None = None) -> Any:
    """The row's tree unpacked once ``x`` is made (an ``optimization_barrier``): XLA makes
    no leaf's copy out of the row before it, so none is held while ``x`` is computed; with
    ``keep`` only those leaves (`Layout.unpack`)."""
    return self.layout.unpack(jax.lax.optimization_barrier((self.row, x))[0], keep)


@dataclasses.dataclass(frozen=True)
class PackedRows:
  """A stack of ``n`` like trees, tree ``i`` packed in row ``i`` (module docstring).

  The ``n`` rows, ``uint8[n, layout.row_bytes]``, are dealt over ``b`` arrays, row ``i`` at
  ``banks[i % b][i // b]``. In two banks, a row written in place and its neighbour read touch
  different buffers, so XLA can run the two transfers at once
  (`lowmem_jax.optim.slicing.scan_slices`), where in one array the read waits for the write.

  Attributes:
    banks: the rows, dealt (above), where the stack lives (device or pinned host).
    layout: each leaf's place in a row (static: not a leaf of the pytree).
  """
  banks: tuple[jax.Array, ...]
  layout: Layout

  def __post_init__(self):
    _register_with_flax()

  @classmethod
  def stack(cls, tree: Any, n: int, banks: int = 1) -> "PackedRows":
    """``tree``, whose leaves are stacked along a leading axis of ``n``, packed a row a slice
    (``n`` rows of no bytes where the tree has no leaves: a stateless transformation's), dealt
    over ``banks`` arrays (`dealt`)."""
    layout = Layout.of(tree, lead=1)
    return cls(dealt(jax.vmap(layout.pack, axis_size=n)(tree), banks), layout)

  @property
  def count(self) -> int:
    """The number of rows, ``n``."""
    return sum(bank.shape[0] for bank in self.banks)

  def joined(self) -> jax.Array:
    """The rows in order, ``uint8[n, row_bytes]``, as one array (the bank itself where there
    is one)."""
    if len(self.banks) == 1:
      return self.banks[0]
    rows = jnp.zeros((self.count, self.layout.row_bytes), jnp.uint8)
    for b, bank in enumerate(self.banks):
      rows = rows.at[b::len(self.banks)].set(bank)
    return rows

  def unstacked(self) -> Any:
    """The stacked tree `stack` took: each leaf ``[n, ...]``."""
    return jax.vmap(self.layout.unpack)(self.joined())

  def with_leaf(self, k: int, value: Any) -> "PackedRows":
    """These rows with leaf ``k`` (of ``layout.leaves``) set to ``value`` (an array of its
    shape, or one that broadcasts to it) in every row, where the rows live: its bytes
    written in place (these rows donated), the rest of each row not moved (a state in host
    memory stays there)."""
    leaf = self.layout.leaves[k]
    if leaf.impl is not None:
      raise ValueError(f"Leaf {k} of the packed rows is a PRNG key: set it unpacked.")
    start = sum(x.nbytes for x in self.layout.leaves[:k])
    data = jnp.broadcast_to(jnp.asarray(value, leaf.dtype), leaf.shape)
    data = jax.lax.bitcast_convert_type(data.astype(leaf.stored_dtype), jnp.uint8).reshape(-1)
    banks = tuple(
        _writer(bank.sharding)(bank, jax.device_put(
            jnp.broadcast_to(data, (bank.shape[0], leaf.nbytes)), bank.sharding), jnp.int32(start))
        for bank in self.banks)
    return PackedRows(banks, self.layout)


def dealt(rows: Any, banks: int) -> tuple[Any, ...]:
  """``rows`` (``[n, ...]``, a numpy or JAX array) dealt over ``banks`` arrays (fewer where
  ``n`` is less, one at least), as `PackedRows.banks`."""
  return tuple(rows[b::banks] for b in range(min(banks, rows.shape[0]) or 1))


@functools.cache
def _writer(sharding: jax.sharding.Sharding):
  """``(rows, block, start) -> rows`` with ``block`` written at column ``start`` of every row,
  in place (``rows`` donated), kept in ``sharding``: one compile for each shape."""
  return jax.jit(lambda rows, block, start: jax.lax.dynamic_update_slice(rows, block, (0, start)),
                 out_shardings=sharding, donate_argnums=0)


jax.tree_util.register_dataclass(PackedRows, data_fields=["banks"], meta_fields=["layout"])


@functools.cache
def _register_with_flax() -> None:
  """`flax.serialization` saves `PackedRows.banks` and takes the layout from the template (as
  `lowmem_jax._static.StaticInt`: registered by the first one made, Flax loaded then)."""
  from flax import serialization
  serialization.register_serialization_state(
      PackedRows, lambda p: {str(b): bank for b, bank in enumerate(p.banks)}, _restored,
      override=True)


def _restored(template: PackedRows, saved: dict) -> PackedRows:
  """``template`` with the rows of ``saved`` (`_register_with_flax`'s state dict; a state
  saved before the rows were dealt into banks holds ``{"rows": rows}``, one bank), dealt again
  where the template has another bank count (a state saved with another ``prefetch``, or
  before a sliced leaf's rows took two banks)."""
  saved = {"0": saved["rows"]} if set(saved) == {"rows"} else saved
  banks = [saved[str(b)] for b in range(len(saved))]
  if len(banks) == len(template.banks):
    return dataclasses.replace(template, banks=tuple(banks))
  shape = (template.count, template.layout.row_bytes)
  widths = {np.shape(b)[1:] for b in banks}
  if len(widths) != 1 or (sum(np.shape(b)[0] for b in banks), *widths.pop()) != shape:
    raise ValueError(f"The saved packed rows are {[np.shape(b) for b in banks]}, the "
                     f"template's {shape} rows: restore into a state made for the same "
                     "parameters and optimizer.")
  rows = np.empty(shape, np.uint8)
  for b, bank in enumerate(banks):
    rows[b::len(banks)] = np.asarray(bank)
  return dataclasses.replace(template, banks=dealt(rows, len(template.banks)))
