"""Stochastic rounding: each element's random bits from its place in the parameter tree, and
bfloat16 parameters rounded stochastically.

bfloat16 parameters with no float32 master copy (2 bytes a parameter, not
4 + 2): `stochastic_rounding` ends an optimizer chain so that
``optax.apply_updates`` rounds each new parameter stochastically; the 8-bit
moments' stochastic rounding (`lowmem_jax.optim.lowbit`) and the parameters'
share one rounding rule (`lowmem_jax.ops._lowbit_reference.rounded`). Both draw
an element's random bits from its place in the parameter tree (`Position`,
`rounding_bits`), so a part of the tree updated alone, as the layer-streamed
step updates a layer, rounds as the whole tree would.
"""

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.extend.random import threefry2x32_p

from lowmem_jax.ops import _lowbit_reference as reference


@dataclasses.dataclass(frozen=True)
class Position:
  """Where an array lies in the parameter tree whose rounding bits it takes (`rounding_bits`).

  A tree leaf's rows lie along its first axis (a scalar leaf is one row of one
  element). Element ``i`` (flat index) of row ``r`` of leaf ``leaf`` draws its
  bits from ``r``, ``i`` and the tree's key folded with ``leaf``, so a part of a
  leaf rounded alone (a layer of a stacked leaf, a slice of one) draws the bits
  the whole leaf draws there: `lowmem_jax.optim.layer_streamed` gives each part
  its position, and its stochastic rounding equals the whole tree's.

  Fields:
    leaf: the leaf's index among the tree's leaves (``jax.tree.leaves`` order), an int.
    row: the array's first row (``rows`` True) or the row it lies in; an int or int32 [].
    offset: the flat index, within its row, of the array's first element; an int or int32 [].
    rows: True: the array's first axis runs over rows; False: it lies within row ``row``.

  Not a pytree: a tree of positions has them as leaves, and they do not cross a
  ``jax.jit`` or ``jax.vmap`` boundary as arguments (close over them).
  """
  leaf: int = 0
  row: Any = 0
  offset: Any = 0
  rows: bool = True

  def index(self, i: Any) -> "Position":
    """The position of ``x[i]`` (a row) for an ``x`` at this position whose axis 0 is rows."""
    if not self.rows:
      raise ValueError(f"{self} lies within one row: its first axis is not rows to index.")
    return Position(self.leaf, self.row + i, self.offset, rows=False)

  def part(self, i: Any, shape: tuple[int, ...]) -> "Position":
    """The position of the ``i``-th of equal parts, each of ``shape``, that the array at
    this position is cut into along its first axis."""
    if self.rows:
      return Position(self.leaf, self.row + i * shape[0], self.offset, rows=True)
    return Position(self.leaf, self.row, self.offset + i * math.prod(shape), rows=False)


def _threefry(key: jax.Array) -> jax.Array:
  """``key`` as a typed Threefry-2x32 key: a raw key's two uint32 words wrapped; another
  implementation's key (``jax_default_prng_impl``) made into one by drawing two words."""
  if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    if key.shape[-1:] != (2,):
      raise ValueError(f"A raw `key` must be a threefry2x32 key's two uint32 words, got shape "
                       f"{key.shape}; pass a typed key (jax.random.key).")
    return jax.random.wrap_key_data(key, impl="threefry2x32")
  if str(jax.random.key_impl(key)) == "threefry2x32":
    return key
  return jax.random.wrap_key_data(jax.random.bits(key, (2,), jnp.uint32), impl="threefry2x32")


def rounding_bits(key: jax.Array, shape: tuple[int, ...], position: Position = Position(),
                  words: int = 1) -> jax.Array | tuple[jax.Array, jax.Array]:
  """``uint32[shape]`` uniform bits for the array at ``position`` of a tree drawn with
  ``key`` (another implementation's key made into a Threefry-2x32 one, `_threefry`):
  element ``i`` of row ``r`` of the leaf gets the
  first word of Threefry-2x32 (Salmon et al., 2011) of ``(r, i)`` under ``key``
  folded with the leaf's index, as ``jax.random.bits`` hashes a counter. ``words=2``: both
  words, a pair of such arrays (two draws for one evaluation)."""
  if isinstance(words, bool) or words not in (1, 2):
    raise ValueError(f"`words` must be 1 or 2, got {words!r}.")
  key = _threefry(key)
  shape = tuple(shape)
  across = position.rows and len(shape) > 0
  in_row = shape[1:] if across else shape
  if math.prod(in_row) >= 2 ** 32:
    raise ValueError(f"A row of {math.prod(in_row)} elements is past the 2^32 the counter holds.")
  u32 = lambda x: jnp.asarray(x).astype(jnp.uint32)
  row = u32(position.row) + (jax.lax.broadcasted_iota(jnp.uint32, shape, 0) if across else 0)
  within = u32(position.offset) + jnp.arange(math.prod(in_row), dtype=jnp.uint32).reshape(in_row)
  row, within = jnp.broadcast_to(row, shape), jnp.broadcast_to(within, shape)
  row, within = row + (within & 0), within + (row & 0)  # one batch axis, under jax.vmap too
  data = jax.random.key_data(jax.random.fold_in(key, position.leaf))
  pair = threefry2x32_p.bind(data[0], data[1], row, within)
  return pair[0] if words == 1 else tuple(pair)


def positions_of(tree: Any, positions: Any = None) -> list[Position]:
  """The `Position` of each of ``tree``'s leaves: ``positions`` (a tree of them with
  ``tree``'s structure) flattened, or None: each leaf whole, at its own index. A leaf
  that ``optax.masked`` (or ``optax.partition``) masked out holds its place and index."""
  is_masked = lambda x: isinstance(x, optax.MaskedNode)
  slots, treedef = jax.tree.flatten(tree, is_leaf=is_masked)
  every = ([Position(i) for i in range(len(slots))] if positions is None
           else treedef.flatten_up_to(positions))
  return [at for at, x in zip(every, slots) if not is_masked(x)]


def step_key(seed: int, step: Any) -> jax.Array:
  """The Threefry-2x32 key of step ``step`` (int or int32 []) of a transformation seeded
  with ``seed``, whatever JAX's default PRNG implementation."""
  return jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), step)


def stochastic_round(x: jax.Array, *, key: jax.Array,
                     position: Position = Position()) -> jax.Array:
  """``x`` (float32, any shape) in bfloat16, rounded stochastically with PRNG ``key``, the
  bits `rounding_bits` of ``x`` at ``position``.

  Each element goes to one of its two bfloat16 neighbours with the
  probabilities that make its expected value ``x`` (Gupta et al., "Deep
  Learning with Limited Numerical Precision", 2015, arXiv:1502.02551), so an
  addend far below half a bfloat16 unit (``2^-9 |x|``) still moves a sum on
  average. NaN stays NaN; a value within a unit of bfloat16's largest may
  round up to infinity.
  """
  if x.dtype != jnp.float32:
    raise TypeError(f"stochastic_round takes float32 `x`, got {x.dtype}.")
  return reference.bfloat16_of(x, rounding_bits(key, x.shape, position))


class StochasticRoundingState(NamedTuple):
  """State of `stochastic_rounding`: the raw PRNG key (``jax.random.key_data``, uint32)
  the next step splits."""
  key: jax.Array


def stochastic_rounding(seed: int = 0) -> optax.GradientTransformation:
  """The last transformation of a chain for bfloat16 parameters with no float32 master copy.

  ``optax.apply_updates`` adds each update to its parameter and casts the sum
  to the parameter's dtype, rounding to nearest: for a bfloat16 parameter an
  update below half a unit (``2^-9 |p|``; Adam at lr 1e-3 makes most of them)
  is lost. This transformation returns, for each bfloat16 leaf, the float32
  update ``stochastic_round(p + u) - p``, so that ``apply_updates`` gives
  the stochastically rounded sum, unbiased whatever the update's size (exactly
  where ``|p + u| >= 2^-16 |p|``: the difference of two bfloat16 values that
  far apart is a float32; where the update nearly cancels the parameter it
  may land up to ``2^-24 |p|`` off) (Zamirai et al., "Revisiting BFloat16 Training", 2020,
  arXiv:2010.06192). float32 and float64 leaves pass through unchanged. The
  key lives in the state, split every call, and each element's bits are drawn
  at its place in the tree (`rounding_bits`): a restored state goes on as the
  saved one would. In a jitted step XLA fuses the float32 update into the add,
  so no float32 copy of the parameters is kept.

  Args:
    seed: the PRNG seed, an int.

  Returns:
    An `optax.GradientTransformationExtraArgs` with state `StochasticRoundingState`;
    its ``update`` needs ``params``. Extra argument: ``positions``, as in
    `scale_by_adam_8bit`.
  """
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise ValueError(f"`seed` must be an int, got {seed!r}.")

  def init_fn(params):
    del params
    return StochasticRoundingState(jax.random.key_data(step_key(seed, 0)))

  def update_fn(updates, state, params=None, *, positions=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError("stochastic_rounding needs `params`: pass them to `update`.")
    leaves = jax.tree.leaves(params)
    for p in leaves:
      if p.dtype not in (jnp.bfloat16, jnp.float32, jnp.float64):
        raise TypeError(f"stochastic_rounding takes bfloat16, float32 or float64 `params`, "
                        f"got a {p.dtype} leaf.")
    key, step = jax.random.split(jax.random.wrap_key_data(state.key, impl="threefry2x32"))

    def leaf(u, p, at):
      if p.dtype != jnp.bfloat16:
        return u
      return reference.rounded_update(u, p, rounding_bits(step, p.shape, at))

    where = jax.tree.unflatten(jax.tree.structure(params), positions_of(params, positions))
    return (jax.tree.map(leaf, updates, params, where),
            StochasticRoundingState(jax.random.key_data(key)))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
