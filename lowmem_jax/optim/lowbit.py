"""Training state in fewer bits: 8-bit moments, and bfloat16 parameters rounded stochastically.

Each moment leaf is cut into blocks of ``block`` consecutive elements along
its last axis (the last block of a row padded); a block keeps its absolute
maximum as a float32 scale and
each element as one byte, a code of a small floating-point format over
``[-1, 1]`` (the element over the scale). Such a code map is dynamic and
non-linear, as bitsandbytes' 8-bit optimizers' (Dettmers et al., 2022,
arXiv:2110.02861), so small values keep their relative precision:

- ``signed`` (the first moment): sign, 4 exponent bits, 3 mantissa bits;
  ``(1 + f/8) 2^(e - 15)`` for ``e = 1..15``, code 0 is zero.
- unsigned (the second moment): 5 exponent bits, 3 mantissa bits;
  ``(1 + f/8) 2^(e - 31)`` for ``e = 1..31``; a positive value never rounds to
  zero (it becomes the smallest code), so ``m / sqrt(v)`` stays bounded.

One quantise/dequantise of ``x`` in a block of scale ``s`` errs by at most
``2^-4 |x|`` (half a unit of the 3-bit mantissa, rounding to nearest;
``2^-3 |x|``, a whole unit, rounding stochastically) where ``|x| >= 2^-14 s``
(signed) or ``2^-30 s`` (unsigned); below that, signed values err by at most
``2^-14 s`` and unsigned ones by at most ``2^-30 s`` (`error_bound`), for finite values below 2^126 in magnitude (moments are).
A non-finite value makes its block's scale non-finite (NaN over infinity, on
every backend), so its 255 neighbours decode as NaN too, for good: put
`optax.apply_if_finite` around the optimizer where gradients may overflow.
Stochastic rounding is unbiased a step, but its noise adds up in ``v`` over
about ``1 / (1 - b2^2)`` steps.
Storage: 1 byte an element plus 4 bytes a block, 1.016
bytes at the default block of 256, against 4 for float32. Blocks lie along
the last axis, so codes and scales shard with the parameter along its
leading axes.

bfloat16 parameters with no float32 master copy (2 bytes a parameter, not
4 + 2): `stochastic_rounding` ends an optimizer chain so that
``optax.apply_updates`` rounds each new parameter stochastically; the
moments' stochastic rounding and the parameters' share one rounding rule.
Both draw an element's random bits from its place in the parameter tree
(`Position`, `rounding_bits`), so a part of the tree updated alone, as the
layer-streamed step updates a layer, rounds as the whole tree would.

An update reads the codes and writes them back in one pass that keeps no
float32 moment in memory: the new moments are made once for their block
scales and once more where they are coded (`moments_step`).
"""

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.extend.random import threefry2x32_p
from optax import tree_utils as otu

BLOCK = 256
MIN_SIZE = 4096  # leaves with fewer elements keep float32 moments, as bitsandbytes does
_MANTISSA = 3
_EXP_BITS = {True: 4, False: 5}  # signed, unsigned


class QuantizedArray(NamedTuple):
  """An array ``[..., n]`` in 8 bits: ``codes`` uint8 with its shape, ``scales`` float32
  ``[..., ceil(n / block)]``, each block's absolute maximum."""
  codes: jax.Array
  scales: jax.Array


def _check(block: Any) -> None:
  if isinstance(block, jax.Array):
    raise ValueError(f"`block` must be a positive int, got an array ({block!r}): "
                     "optax.inject_hyperparams makes each numeric argument an array; give it "
                     "static_args=('block', 'min_size', 'seed').")
  if isinstance(block, bool) or not isinstance(block, int) or block < 1:
    raise ValueError(f"`block` must be a positive int, got {block!r}.")


def _blocks(x: jax.Array, block: int) -> jax.Array:
  """``x [..., n]`` (a scalar as ``[1]``), its last axis padded with zeros to whole blocks,
  as ``[..., blocks, block]``."""
  x = x.reshape(x.shape or (1,))
  pad = [(0, 0)] * (x.ndim - 1) + [(0, -x.shape[-1] % block)]
  padded = jnp.pad(x, pad)
  return padded.reshape(*x.shape[:-1], padded.shape[-1] // block, block)


def _abs_max(blocks: jax.Array) -> jax.Array:
  """float32 ``blocks [..., block]``'s absolute maximum along the last axis, NaN where a block
  holds a NaN on every backend (XLA:CPU's float max may drop one). One integer max reduction
  over the bits with the sign cleared: they order as the magnitudes do, and NaN's above
  infinity's."""
  magnitudes = jax.lax.bitcast_convert_type(blocks, jnp.uint32) & jnp.uint32(0x7FFFFFFF)
  return jax.lax.bitcast_convert_type(jnp.max(magnitudes, axis=-1), jnp.float32)


def _unblocked(blocks: jax.Array, shape: tuple) -> jax.Array:
  """`_blocks` undone: ``[..., blocks, block]`` as ``shape``."""
  n = shape[-1] if shape else 1
  return blocks.reshape(*blocks.shape[:-2], -1)[..., :n].reshape(shape)


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


def rounding_bits(key: jax.Array, shape: tuple[int, ...],
                  position: Position = Position()) -> jax.Array:
  """``uint32[shape]`` uniform bits for the array at ``position`` of a tree drawn with
  ``key`` (another implementation's key made into a Threefry-2x32 one, `_threefry`):
  element ``i`` of row ``r`` of the leaf gets the
  first word of Threefry-2x32 (Salmon et al., 2011) of ``(r, i)`` under ``key``
  folded with the leaf's index, as ``jax.random.bits`` hashes a counter."""
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
  return threefry2x32_p.bind(data[0], data[1], row, within)[0]


def _rounded(bits: jax.Array, dropped: int, noise: jax.Array | None) -> jax.Array:
  """float32 ``bits`` (uint32) plus the offset that makes dropping their low ``dropped`` bits
  round: half a unit of the kept last bit (to nearest, ties away from zero) or, with
  uniform ``noise`` (uint32, ``bits``' shape), uniform bits below it (stochastically). A
  carry bumps the exponent."""
  if noise is None:
    return bits + (1 << (dropped - 1))
  return bits + (noise >> (32 - dropped))


def quantize(x: jax.Array, *, signed: bool, block: int = BLOCK, key: jax.Array | None = None,
             position: Position = Position()) -> QuantizedArray:
  """``x`` (float, any shape) as a `QuantizedArray`; ``signed`` False needs ``x >= 0``.

  The mantissa rounds to nearest, or with a PRNG ``key`` stochastically (up or
  down with the probabilities that make the code's expected value ``x``, in
  the normal range), which an exponential moving average needs: its per-step
  change is often below half a code's spacing, and nearest rounding would
  leave it where it is. The bits are `rounding_bits` of ``x`` at ``position``.
  """
  _check(block)
  noise = None if key is None else rounding_bits(key, jnp.shape(x), position)
  return _quantize(x, signed=signed, block=block, noise=noise)


def _quantize(x: jax.Array, *, signed: bool, block: int, noise: jax.Array | None,
              scales: jax.Array | None = None) -> QuantizedArray:
  """`quantize` with its rounding bits ``noise`` (uint32, ``x``'s shape; None: to nearest)
  given, and its ``scales`` (`block_scales` of ``x``, made beforehand; None: made here)."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"quantize takes a float array, got {x.dtype}.")
  blocks = _blocks(x.astype(jnp.float32), block)
  scales = _abs_max(blocks) if scales is None else scales
  # Clipped: scales made in another pass of the same arithmetic may differ in the last bit.
  unit = jnp.clip(blocks / jnp.where(scales > 0, scales, 1.0)[..., None], -1.0, 1.0)
  noise = None if noise is None else _blocks(noise, block)
  bits = _rounded(jax.lax.bitcast_convert_type(jnp.abs(unit), jnp.uint32), 23 - _MANTISSA, noise)
  exp_bits = _EXP_BITS[signed]
  exponent = (bits >> 23).astype(jnp.int32) - 127 + (2 ** exp_bits - 1)
  mantissa = ((bits >> (23 - _MANTISSA)) & (2 ** _MANTISSA - 1)).astype(jnp.int32)
  code = jnp.where(exponent >= 1, (exponent << _MANTISSA) | mantissa, 0)
  if signed:
    code = code | jnp.where(unit < 0, 1 << 7, 0)
  else:
    code = jnp.where(unit > 0, jnp.maximum(code, 1 << _MANTISSA), 0)
  return QuantizedArray(_unblocked(code.astype(jnp.uint8), x.shape), scales)


def block_scales(x: jax.Array, *, block: int = BLOCK) -> jax.Array:
  """float32 ``[..., ceil(n / block)]``: each block's absolute maximum of ``x [..., n]``
  (float), the scales `quantize` codes ``x`` with."""
  _check(block)
  return _abs_max(_blocks(x.astype(jnp.float32), block))


def dequantize(q: QuantizedArray, *, signed: bool, block: int = BLOCK,
               dtype: Any = jnp.float32) -> jax.Array:
  """The array `quantize` coded, in ``dtype``, of ``q.codes``' shape."""
  _check(block)
  code = _blocks(q.codes.astype(jnp.uint32), block)
  exponent = (code >> _MANTISSA) & (2 ** _EXP_BITS[signed] - 1)
  mantissa = code & (2 ** _MANTISSA - 1)
  # (1 + f/8) 2^(e - bias) built as float32 bits: no exp2, which XLA will not compute twice.
  bits = ((exponent + (127 - (2 ** _EXP_BITS[signed] - 1))) << 23) | (mantissa << (23 - _MANTISSA))
  magnitude = jnp.where(exponent > 0, jax.lax.bitcast_convert_type(bits, jnp.float32), 0.0)
  value = jnp.where(code >= 1 << 7, -magnitude, magnitude) if signed else magnitude
  return _unblocked(value * q.scales[..., None], q.codes.shape).astype(dtype)


def error_bound(x: jax.Array, scale: jax.Array, *, signed: bool,
                stochastic: bool = False) -> jax.Array:
  """The bound on ``|dequantize(quantize(x)) - x|`` for ``x`` in a block of ``scale``."""
  floor = 2.0 ** (2 - 2 ** _EXP_BITS[signed]) * scale  # the smallest normal code
  return jnp.maximum(2.0 ** -(_MANTISSA + 1 - stochastic) * jnp.abs(x), floor)


def is_quantized(x: Any) -> bool:
  """Whether ``x`` is a `QuantizedArray` (an ``is_leaf`` for trees of moments)."""
  return isinstance(x, QuantizedArray)


def tree_zeros(params: Any, *, signed: bool, min_size: int = MIN_SIZE, block: int = BLOCK,
               dtype: Any = None) -> Any:
  """Zero moments of ``params``' shapes: 8-bit where a leaf has at least ``min_size``
  elements, else zeros in ``dtype`` (None: the leaf's own)."""
  return jax.tree.map(lambda p: _quantized_zeros(jnp.shape(p), block=block)
                      if p.size >= min_size else jnp.zeros_like(p, dtype), params)


def _quantized_zeros(shape: tuple[int, ...], *, block: int = BLOCK) -> QuantizedArray:
  """`quantize` of float32 zeros of ``shape``, signed or not: zero codes and zero scales,
  made without the float32 array (an 8B's stacked MLP kernel: 7 GiB)."""
  _check(block)
  coded = jax.eval_shape(lambda: quantize(jnp.zeros(shape, jnp.float32), signed=True,
                                          block=block))
  return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), coded)


def tree_load(moments: Any, *, signed: bool, block: int = BLOCK) -> Any:
  """``moments`` with each 8-bit leaf dequantised to float32, the others as they are."""
  return jax.tree.map(lambda m: dequantize(m, signed=signed, block=block) if is_quantized(m)
                      else m, moments, is_leaf=is_quantized)


def positions_of(tree: Any, positions: Any = None) -> list[Position]:
  """The `Position` of each of ``tree``'s leaves: ``positions`` (a tree of them with
  ``tree``'s structure) flattened, or None: each leaf whole, at its own index. A leaf
  that ``optax.masked`` (or ``optax.partition``) masked out holds its place and index."""
  is_masked = lambda x: isinstance(x, optax.MaskedNode)
  slots, treedef = jax.tree.flatten(tree, is_leaf=is_masked)
  every = ([Position(i) for i in range(len(slots))] if positions is None
           else treedef.flatten_up_to(positions))
  return [at for at, x in zip(every, slots) if not is_masked(x)]


def moments_store(mu: Any, nu: Any, like: Any, *, key: jax.Array | None, positions: Any = None,
                  min_size: int = MIN_SIZE, block: int = BLOCK,
                  scales: tuple[Any, Any] | None = None) -> tuple[Any, Any]:
  """float32 ``(mu, nu)`` stored as `moments_zeros` makes them for ``like``'s leaves (the
  gradient), rounding stochastically with keys folded from ``key`` (None: to nearest) at
  ``positions`` (`positions_of`), with ``scales`` (`moments_step`'s; None: made here)."""
  treedef = jax.tree.structure(like)
  where = treedef.flatten_up_to(jax.tree.unflatten(treedef, positions_of(like, positions)))
  scales = scales or (None, None)
  scales = [[None] * treedef.num_leaves if s is None else treedef.flatten_up_to(s)
            for s in scales]
  out = []
  for m, v, p, at, sm, sv in zip(treedef.flatten_up_to(mu), treedef.flatten_up_to(nu),
                                 treedef.flatten_up_to(like), where, *scales):
    if p.size < min_size:
      out.append((m, v))
      continue
    out.append(tuple(
        _quantize(x, signed=signed, block=block, scales=s, noise=None if key is None else
                  rounding_bits(jax.random.fold_in(key, signed), jnp.shape(p), at))
        for x, signed, s in ((m, True, sm), (v, False, sv))))
  return tuple(jax.tree.unflatten(treedef, [pair[k] for pair in out]) for k in (0, 1))


def moments_step(update: Callable, mu: Any, nu: Any, grads: Any, *, min_size: int = MIN_SIZE,
                 block: int = BLOCK) -> tuple[Any, Any, Any, tuple[Any, Any]]:
  """The new float32 moments ``update(mu32, nu32, grads) -> (mu32, nu32)`` of the stored
  moments ``mu``, ``nu`` (`moments_zeros`' trees), made twice so that no float32 copy of
  them need be kept: once for their block scales alone, then again from the codes, the
  gradient and the scales passed through an ``optimization_barrier`` (a leaf's own) that
  keeps XLA from merging the two, where the caller quantises them (`moments_store` with
  the scales) and takes Adam's direction in the same pass. Compiled for a GPU, an 8-bit
  AdamW update of a bfloat16 weight, rounded stochastically, then moves about 14 bytes a
  parameter, not 26 (``benchmarks/optimizer_bytes.py``); inside the layer-streamed step,
  whose update writes three stacks in place, XLA still keeps one float32 moment
  (``docs/benchmarks.md``).

  Returns:
    ``(mu32, nu32, grads, scales)``: the moments made again; ``grads`` from the barrier (the
    same values: use these); and ``(mu, nu)``'s block scales for `moments_store`, a tree of
    ``grads``' structure each (None where a leaf is under ``min_size`` elements).
  """
  first = update(*moments_load(mu, nu, block=block), grads)
  scales = tuple(jax.tree.map(lambda x, g: block_scales(x, block=block)
                              if g.size >= min_size else None, m, grads) for m in first)
  treedef = jax.tree.structure(grads)
  leaves = zip(*(treedef.flatten_up_to(tree) for tree in (mu, nu, grads, *scales)))
  # A barrier a leaf: the update of one leaf reads no other's (`lowmem_jax.optim.per_leaf`).
  kept = [jax.lax.optimization_barrier(leaf) for leaf in leaves]
  mu, nu, grads, *scales = (jax.tree.unflatten(treedef, [leaf[k] for leaf in kept])
                            for k in range(5))
  return *update(*moments_load(mu, nu, block=block), grads), grads, tuple(scales)


def moments_zeros(params: Any, *, min_size: int = MIN_SIZE,
                  block: int = BLOCK) -> tuple[Any, Any]:
  """Adam's zero moments ``(mu, nu)`` of ``params``' shapes: 8-bit (``mu`` signed, ``nu``
  unsigned) where a leaf has at least ``min_size`` elements, else float32. With
  `moments_load` and `moments_store`, the 8-bit moment store of `scale_by_adam_8bit` and
  `lowmem_jax.adama` (``state_bits=8``)."""
  return tuple(tree_zeros(params, signed=signed, min_size=min_size, block=block,
                          dtype=jnp.float32) for signed in (True, False))


def moments_load(mu: Any, nu: Any, *, block: int = BLOCK) -> tuple[Any, Any]:
  """`moments_zeros`' ``(mu, nu)`` (or `moments_store`'s) with every leaf in float32."""
  return tree_load(mu, signed=True, block=block), tree_load(nu, signed=False, block=block)


def step_key(seed: int, step: Any) -> jax.Array:
  """The Threefry-2x32 key of step ``step`` (int or int32 []) of a transformation seeded
  with ``seed``, whatever JAX's default PRNG implementation."""
  return jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), step)


def adam_direction(mu: Any, nu: Any, count: jax.Array, *, b1: Any, b2: Any, eps: Any,
                   eps_root: Any, like: Any = None) -> Any:
  """Adam's direction ``m_hat / (sqrt(v_hat + eps_root) + eps)``, bias-corrected as
  `optax.scale_by_adam` does, of moments ``count`` (int32 []) steps old: in the moments'
  dtypes, or with ``like`` (the gradient) in its leaves' dtypes. `scale_by_adam_8bit` and
  `lowmem_jax.adama` share it."""
  mu_hat = otu.tree_bias_correction(mu, b1, count)
  nu_hat = otu.tree_bias_correction(nu, b2, count)
  direction = lambda m, v: m / (jnp.sqrt(v + eps_root) + eps)
  if like is None:
    return jax.tree.map(direction, mu_hat, nu_hat)
  return jax.tree.map(lambda m, v, g: direction(m, v).astype(g.dtype), mu_hat, nu_hat, like)


class ScaleByAdam8bitState(NamedTuple):
  """State of `scale_by_adam_8bit`: moments as `QuantizedArray` leaves (float32 for
  leaves under ``min_size`` elements)."""
  count: jax.Array  # int32 []
  mu: optax.Updates
  nu: optax.Updates


def scale_by_adam_8bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                       eps_root: float = 0.0, *, block: int = BLOCK,
                       min_size: int = MIN_SIZE, seed: int = 0,
                       stochastic: bool = True) -> optax.GradientTransformation:
  """`optax.scale_by_adam` with its moments stored in 8 bits, block-wise.

  Each step dequantises a leaf's moments to float32, updates them as Adam
  does, takes the direction ``m_hat / (sqrt(v_hat + eps_root) + eps)`` and
  quantises them again (first moment signed, second unsigned: module
  docstring), rounding stochastically with a key made from ``seed`` and the step
  count, each element's bits drawn at its place in the tree (`rounding_bits`), so
  a step is reproducible and a restored state goes on as the saved one would.
  (Rounding to nearest, ``v``'s 0.1% steps for b2 = 0.999 round away and it
  stalls.) The new moments are made twice, with no float32 copy kept
  (`moments_step`). Leaves with fewer than
  ``min_size`` elements keep float32 moments. The state is NamedTuples of
  arrays: it serialises and shards like optax's (``codes`` has the
  parameter's shape).

  Args:
    b1, b2, eps, eps_root: as in `optax.scale_by_adam`.
    block: elements a scale covers along the last axis, a positive int.
    min_size: leaves with fewer elements keep float32 moments, an int >= 0.
    seed: the stochastic rounding's seed, an int.
    stochastic: False rounds to nearest (to show the stall; not for training).

  Returns:
    An `optax.GradientTransformationExtraArgs`. Extra argument: ``positions``, a tree
    with the gradient's structure of each leaf's `Position` in the whole tree, for a
    part of a tree updated alone (`lowmem_jax.optim.layer_streamed` gives it); None:
    the gradient is the whole tree.
  """
  _check(block)
  if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
    raise ValueError(f"`min_size` must be an int >= 0, got {min_size!r}.")
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise ValueError(f"`seed` must be an int, got {seed!r}.")
  def init_fn(params):
    return ScaleByAdam8bitState(jnp.zeros([], jnp.int32),
                                *moments_zeros(params, min_size=min_size, block=block))

  def update_fn(updates, state, params=None, *, positions=None, **extra_args):
    del params, extra_args

    def moments(mu, nu, g):
      return (otu.tree_update_moment(g, mu, b1, 1),
              otu.tree_update_moment_per_elem_norm(g, nu, b2, 2))

    mu, nu, updates, scales = moments_step(moments, state.mu, state.nu, updates,
                                           min_size=min_size, block=block)
    count = optax.safe_int32_increment(state.count)
    direction = adam_direction(mu, nu, count, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                               like=updates)
    key = step_key(seed, count) if stochastic else None
    return direction, ScaleByAdam8bitState(count, *moments_store(
        mu, nu, updates, key=key, positions=positions, min_size=min_size, block=block,
        scales=scales))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def adamw_8bit(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8, weight_decay: float = 1e-4, mask: Any = None, *,
               block: int = BLOCK, min_size: int = MIN_SIZE,
               seed: int = 0) -> optax.GradientTransformation:
  """`optax.adamw` with `scale_by_adam_8bit`'s moments: the same chain, Adam's direction,
  decoupled weight decay (``weight_decay`` times the parameters) and the learning rate.

  Args:
    learning_rate: a float or an optax schedule.
    b1, b2, eps, weight_decay, mask: as in `optax.adamw` (whose default decay this
      keeps; ``mask`` selects the leaves that decay, e.g. not biases and norms).
    block, min_size, seed: as in `scale_by_adam_8bit`.
  """
  return optax.chain(
      scale_by_adam_8bit(b1, b2, eps, block=block, min_size=min_size, seed=seed),
      optax.add_decayed_weights(weight_decay, mask), optax.scale_by_learning_rate(learning_rate))


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
  bits = _rounded(jax.lax.bitcast_convert_type(x, jnp.uint32), 16,
                  rounding_bits(key, x.shape, position))
  rounded = jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16)
  return jnp.where(jnp.isnan(x), jnp.asarray(jnp.nan, jnp.bfloat16), rounded)


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
      p32 = p.astype(jnp.float32)
      new = stochastic_round(p32 + u.astype(jnp.float32), key=step,
                             position=at).astype(jnp.float32)
      return jnp.where(new == p32, 0.0, new - p32)  # an infinite parameter stays

    where = jax.tree.unflatten(jax.tree.structure(params), positions_of(params, positions))
    return (jax.tree.map(leaf, updates, params, where),
            StochasticRoundingState(jax.random.key_data(key)))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
