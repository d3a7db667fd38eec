"""The block-size rule and call options every kernel of this package shares.

A kernel sees its operand as rows: ``[..., n]`` becomes ``[rows, n]`` (a
free reshape). Blocks are powers of two, as Triton needs. Pallas' Triton
backend does not mask a block that overhangs the array: an unmasked ``ref[...]``
there reads and writes the next rows' memory (on an H100, jax 0.11.2, the norm
kernels' padded columns overwrote the next row). Kernels therefore read and
write their blocks with `load` and `store`, which mask what lies outside.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lowmem_jax import _lane_ops

# Elements a program handles: 16 KiB of float32, a Triton elementwise sweet spot.
BLOCK_ELEMENTS = 4096


@dataclasses.dataclass(frozen=True)
class Options:
  """How a kernel is compiled: hashable, so it can ride in a ``custom_vjp``.

  Attributes:
    interpret: run the kernel in Pallas interpret mode (any backend, slow);
      what the tests use on CPU.
    block_rows: rows a program handles; ``None`` picks by `block_shape`.
    block_cols: columns (or bytes of packed codes) a program handles.
    num_warps: Triton warps a program; ``None`` lets Triton pick.
  """
  interpret: bool = False
  block_rows: int | None = None
  block_cols: int | None = None
  num_warps: int | None = None

  def __post_init__(self):
    for name in ("block_rows", "block_cols", "num_warps"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or value < 1 or value & (value - 1)):
        raise ValueError(f"{name} must be a power of two >= 1 or None, got {value!r}.")

  def compiler_params(self):
    """Pallas' Triton backend with ``num_warps``."""
    return _triton().CompilerParams(num_warps=self.num_warps)


def _triton():
  """Pallas' Triton module, imported when a kernel is built, not with this package."""
  from jax.experimental.pallas import triton
  return triton


def block_shape(rows: int, cols: int, options: Options, elements_per_col: int = 1) -> tuple[int, int]:
  """``(block_rows, block_cols)``: powers of two, about `BLOCK_ELEMENTS` elements.

  Columns come first (whole rows where they fit), then rows fill the rest.
  ``elements_per_col`` counts the elements behind one column (codes per byte).
  Values the caller set in ``options`` are kept.
  """
  cols_cap = max(1, BLOCK_ELEMENTS // elements_per_col)
  block_cols = options.block_cols or min(pl.next_power_of_2(max(cols, 1)), cols_cap)
  rows_cap = max(1, BLOCK_ELEMENTS // (block_cols * elements_per_col))
  block_rows = options.block_rows or min(pl.next_power_of_2(max(rows, 1)), rows_cap)
  return block_rows, block_cols


def as_rows(x: jax.Array) -> jax.Array:
  """``[..., n]`` as ``[prod(...), n]`` (a reshape, free in XLA)."""
  return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def in_bounds(block: tuple[int, ...], shape: tuple[int, ...],
              index: tuple) -> jax.Array | None:
  """bool ``block``: which elements of the block at ``index`` lie inside an
  array of ``shape``; None where all of them do (no axis overhangs).

  ``index`` gives the block's position on each axis (`pl.program_id` or 0).
  """
  mask = None
  for axis, (size, n, i) in enumerate(zip(block, shape, index)):
    if n % size:
      inside = i * size + jax.lax.broadcasted_iota(jnp.int32, block, axis) < n
      mask = inside if mask is None else mask & inside
  return mask


def load(ref, shape: tuple[int, ...], index: tuple) -> jax.Array:
  """The block ``ref`` of an array of ``shape``, zero outside the array."""
  mask = in_bounds(ref.shape, shape, index)
  if mask is None:
    return ref[...]
  return _triton().load(ref, mask=mask, other=0)


def store(ref, value: jax.Array, shape: tuple[int, ...], index: tuple) -> None:
  """Writes ``value`` to the block ``ref`` of an array of ``shape``, inside the array only."""
  mask = in_bounds(ref.shape, shape, index)
  if mask is None:
    ref[...] = value
  else:
    _triton().store(ref, value, mask=mask)


def pallas_call(kernel, *, metadata: dict | None = None, **kwargs):
  """``pl.pallas_call(kernel, **kwargs)``, its call declaring its kernel's vector ALU work in
  its metadata beside ``metadata`` (`lane_ops`), which the step-time estimate reads (XLA's
  text holds a Triton call's body only as its compiled IR). Under ``jax.vmap`` the count
  stays one example's."""
  def call(*operands):
    declared = {**(metadata or {}), **lane_ops(pl.pallas_call(kernel, **kwargs), *operands)}
    return pl.pallas_call(kernel, metadata=declared, **kwargs)(*operands)
  return call


def lane_ops(call, *operands) -> dict[str, str]:
  """A Pallas call's vector ALU work, as its ``metadata`` declares it to the step-time
  estimate (``{"int_ops": ..., ...}``): its kernel's lane operations a program
  (`lowmem_jax._lane_ops.of_jaxpr`) times its grid's programs. ``call`` is the
  ``pl.pallas_call(...)`` without that metadata, ``operands`` what it is called with."""
  shapes = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in operands]
  (eqn,) = [e for e in jax.make_jaxpr(call)(*shapes).eqns if e.primitive.name == "pallas_call"]
  programs = math.prod(eqn.params["grid_mapping"].grid)
  per_program = _lane_ops.of_jaxpr(eqn.params["jaxpr"])
  return {f"{kind}_ops": str(n * programs) for kind, n in sorted(per_program.items())}
