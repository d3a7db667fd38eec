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
``2^-14 s`` and unsigned ones by at most ``2^-30 s`` (`error_bound`), for finite values
below 2^126 in magnitude (moments are).
A non-finite value makes its block's scale non-finite (NaN over infinity, on
every backend), so its 255 neighbours decode as NaN too, for good: put
`optax.apply_if_finite` around the optimizer where gradients may overflow.
Stochastic rounding is unbiased a step, but its noise adds up in ``v`` over
about ``1 / (1 - b2^2)`` steps.
Storage: 1 byte an element plus 4 bytes a block, 1.016
bytes at the default block of 256, against 4 for float32. Blocks lie along
the last axis, so codes and scales shard with the parameter along its
leading axes.

The moments round stochastically with the bits of `lowmem_jax.optim.rounding`, which also
holds the bfloat16 parameters' stochastic rounding (`stochastic_rounding`, re-exported here
with `Position` and `rounding_bits`).

An update reads the codes and writes them back in one pass that keeps no
float32 moment in memory: the new moments are made once for their block
scales and once more where they are coded (`moments_step`).
"""

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax import tree_utils as otu

from lowmem_jax.ops import _lowbit_reference as reference
from lowmem_jax.optim.rounding import (Position, StochasticRoundingState, positions_of,
                                       rounding_bits, step_key, stochastic_round,
                                       stochastic_rounding)

__all__ = ["AdamW8bit", "BLOCK", "FusedAdamW8bit", "MIN_SIZE", "Position", "QuantizedArray",
           "ScaleByAdam8bitState", "StochasticRoundingState", "adam_direction", "adamw_8bit",
           "all_finite", "block_scales", "dequantize", "error_bound", "is_quantized",
           "moments_load", "moments_step", "moments_store", "moments_zeros", "positions_of",
           "quantize", "rounding_bits", "scale_by_adam_8bit", "step_key", "stochastic_round",
           "stochastic_rounding", "tree_load", "tree_zeros"]

BLOCK = 256
MIN_SIZE = 4096  # leaves with fewer elements keep float32 moments, as bitsandbytes does
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


def _unblocked(blocks: jax.Array, shape: tuple) -> jax.Array:
  """`_blocks` undone: ``[..., blocks, block]`` as ``shape``."""
  n = shape[-1] if shape else 1
  return blocks.reshape(*blocks.shape[:-2], -1)[..., :n].reshape(shape)


def quantize(x: jax.Array, *, signed: bool, block: int = BLOCK, key: jax.Array | None = None,
             position: Position = Position(), word: int = 0) -> QuantizedArray:
  """``x`` (float, any shape) as a `QuantizedArray`; ``signed`` False needs ``x >= 0``.

  The mantissa rounds to nearest, or with a PRNG ``key`` stochastically (up or
  down with the probabilities that make the code's expected value ``x``, in
  the normal range), which an exponential moving average needs: its per-step
  change is often below half a code's spacing, and nearest rounding would
  leave it where it is. The bits are `rounding_bits` of ``x`` at ``position``: the
  evaluation's first word, or with ``word=1`` its second (as `moments_store` rounds ``nu``).
  """
  _check(block)
  if isinstance(word, bool) or word not in (0, 1):
    raise ValueError(f"`word` must be 0 or 1, got {word!r}.")
  noise = None if key is None else rounding_bits(key, jnp.shape(x), position, words=2)[word]
  return _quantize(x, signed=signed, block=block, noise=noise)


def _quantize(x: jax.Array, *, signed: bool, block: int, noise: jax.Array | None,
              scales: jax.Array | None = None) -> QuantizedArray:
  """`quantize` with its rounding bits ``noise`` (uint32, ``x``'s shape; None: to nearest)
  given, and its ``scales`` (`block_scales` of ``x``, made beforehand; None: made here)."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"quantize takes a float array, got {x.dtype}.")
  blocks = _blocks(x.astype(jnp.float32), block)
  scales = reference.abs_max(blocks) if scales is None else scales
  noise = None if noise is None else _blocks(noise, block)
  codes = reference.codes(blocks, scales, noise, signed=signed)
  return QuantizedArray(_unblocked(codes, x.shape), scales)


def all_finite(x: jax.Array, ok: Any = True, *, by_block: bool = True,
               min_size: int = MIN_SIZE, block: int = BLOCK) -> jax.Array:
  """bool []: ``ok`` (bool []) and whether every element of ``x`` is finite. ``by_block``,
  where the 8-bit moments of ``x``'s shape take block scales (``x`` of at least ``min_size``
  elements): each block is checked first, the blocks' results held by an
  ``optimization_barrier`` (XLA would fold the two reductions into one of another shape),
  then reduced with ``ok``: XLA reads a gradient once for its finiteness and
  `moments_step`'s first pass, and ands no ``ok`` in a kernel of its own. (The
  layer-streamed step's host rows check in one reduction: with the blocks' barrier XLA
  hid less of the rows' transfers, ``docs/benchmarks.md``, session 49.)"""
  if not by_block or jnp.size(x) == 0 or jnp.size(x) < min_size:
    return jnp.logical_and(ok, jnp.all(jnp.isfinite(x)))
  _check(block)
  blocks = jnp.all(jnp.isfinite(_blocks(x, block)), axis=-1)
  return jnp.all(jnp.logical_and(jax.lax.optimization_barrier(blocks), ok))


def block_scales(x: jax.Array, *, block: int = BLOCK) -> jax.Array:
  """float32 ``[..., ceil(n / block)]``: each block's absolute maximum of ``x [..., n]``
  (float), the scales `quantize` codes ``x`` with."""
  _check(block)
  return reference.abs_max(_blocks(x.astype(jnp.float32), block))


def dequantize(q: QuantizedArray, *, signed: bool, block: int = BLOCK,
               dtype: Any = jnp.float32) -> jax.Array:
  """The array `quantize` coded, in ``dtype``, of ``q.codes``' shape."""
  _check(block)
  value = reference.decoded(_blocks(q.codes.astype(jnp.uint32), block), signed=signed)
  return _unblocked(value * q.scales[..., None], q.codes.shape).astype(dtype)


def error_bound(x: jax.Array, scale: jax.Array, *, signed: bool,
                stochastic: bool = False) -> jax.Array:
  """The bound on ``|dequantize(quantize(x)) - x|`` for ``x`` in a block of ``scale``."""
  floor = 2.0 ** (2 - 2 ** reference.EXP_BITS[signed]) * scale  # the smallest normal code
  return jnp.maximum(2.0 ** -(reference.MANTISSA + 1 - stochastic) * jnp.abs(x), floor)


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


def moments_store(mu: Any, nu: Any, like: Any, *, key: jax.Array | None, positions: Any = None,
                  min_size: int = MIN_SIZE, block: int = BLOCK,
                  scales: tuple[Any, Any] | None = None) -> tuple[Any, Any]:
  """float32 ``(mu, nu)`` stored as `moments_zeros` makes them for ``like``'s leaves (the
  gradient), rounding stochastically (None: to nearest) with the two words of one Threefry
  evaluation an element under ``key`` folded with True (`rounding_bits`), ``mu`` the first,
  at ``positions`` (`positions_of`), with ``scales`` (`moments_step`'s; None: made here)."""
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
    bits = ((None, None) if key is None else
            rounding_bits(jax.random.fold_in(key, True), jnp.shape(p), at, words=2))
    out.append(tuple(_quantize(x, signed=signed, block=block, scales=s, noise=b)
                     for x, signed, s, b in ((m, True, sm, bits[0]), (v, False, sv, bits[1]))))
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
  parameter, not 26 (``benchmarks/optimizer_bytes.py``); inside the layer-streamed step
  too, whose new values pass one barrier before they are written into their stacks
  (``docs/benchmarks.md``, session 48).

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


def adam_direction(mu: Any, nu: Any, count: jax.Array, *, b1: Any, b2: Any, eps: Any,
                   eps_root: Any, like: Any = None) -> Any:
  """Adam's direction ``m_hat / (sqrt(v_hat + eps_root) + eps)``, bias-corrected as
  `optax.scale_by_adam` does, of moments ``count`` (int32 []) steps old: in the moments'
  dtypes, or with ``like`` (the gradient) in its leaves' dtypes. `scale_by_adam_8bit` and
  `lowmem_jax.adama` share it."""
  mu_hat = otu.tree_bias_correction(mu, b1, count)
  nu_hat = otu.tree_bias_correction(nu, b2, count)
  direction = functools.partial(reference.adam_step, eps=eps, eps_root=eps_root)
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
    min_size: leaves with fewer elements keep float32 moments, an int >= 0 (an empty
      leaf's moments are empty float32 arrays whatever it says).
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
  min_size = max(min_size, 1)  # an empty leaf has no block to scale
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise ValueError(f"`seed` must be an int, got {seed!r}.")
  def init_fn(params):
    return ScaleByAdam8bitState(jnp.zeros([], jnp.int32),
                                *moments_zeros(params, min_size=min_size, block=block))

  def update_fn(updates, state, params=None, *, positions=None, **extra_args):
    del params, extra_args

    moments = functools.partial(reference.adam_moments, b1=b1, b2=b2)
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


@dataclasses.dataclass(frozen=True)
class FusedAdamW8bit:
  """The static hyperparameters of an `adamw_8bit` with ``bfloat16_params``, whose update of a
  leaf the layer-streamed step can run as one kernel (``pallas_kernels.adam8bit``)."""
  learning_rate: float
  b1: float
  b2: float
  eps: float
  weight_decay: float
  block: int
  min_size: int
  seed: int


class AdamW8bit(optax.GradientTransformationExtraArgs):
  """`adamw_8bit`'s transformation with bfloat16 parameters: an optax one that also holds
  ``fused``, its `FusedAdamW8bit` (None where a mask or a schedule leaves no kernel to run)."""
  fused: FusedAdamW8bit | None = None


def adamw_8bit(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8, weight_decay: float = 1e-4, mask: Any = None, *,
               block: int = BLOCK, min_size: int = MIN_SIZE, seed: int = 0,
               bfloat16_params: bool = False) -> optax.GradientTransformation:
  """`optax.adamw` with `scale_by_adam_8bit`'s moments: the same chain, Adam's direction,
  decoupled weight decay (``weight_decay`` times the parameters) and the learning rate.

  Args:
    learning_rate: a float or an optax schedule.
    b1, b2, eps, weight_decay, mask: as in `optax.adamw` (whose default decay this
      keeps; ``mask`` selects the leaves that decay, e.g. not biases and norms).
    block, min_size, seed: as in `scale_by_adam_8bit`.
    bfloat16_params: end the chain with `stochastic_rounding` (``seed``), for bfloat16
      parameters with no float32 copy; the result is an `AdamW8bit`.
  """
  tx = optax.chain(
      scale_by_adam_8bit(b1, b2, eps, block=block, min_size=min_size, seed=seed),
      optax.add_decayed_weights(weight_decay, mask), optax.scale_by_learning_rate(learning_rate))
  if not bfloat16_params:
    return tx
  tx = AdamW8bit(*optax.chain(tx, stochastic_rounding(seed)))
  numbers = (learning_rate, b1, b2, eps, weight_decay)
  if mask is None and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                          for x in numbers):
    tx.fused = FusedAdamW8bit(float(learning_rate), b1, b2, eps, weight_decay, block,
                              max(min_size, 1), seed)  # as scale_by_adam_8bit takes it
  return tx
