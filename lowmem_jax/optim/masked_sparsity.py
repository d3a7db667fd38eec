"""Dynamic sparse reparameterisation, stored dense under a mask: a fixed global budget of
weights, moved during training.

Each sparse leaf (by default every leaf of rank >= 2) starts with a random
``round(density * size)`` of its entries active; their sum over the sparse
leaves is the global budget B, which holds after every step. Every
``update_every`` steps the K = round(prune_fraction * B) active weights of
smallest magnitude, compared globally across leaves, are pruned, and K
inactive positions are regrown at zero, drawn so that each leaf's expected
share follows its surviving weights, as DSR reallocates them.

The weights stay stored dense with a bool mask beside them, so this saves no
memory; `storage_bytes` accounts for it honestly. `lowmem_jax.optim.sparse` stores
them sparse (values and positions), with a per-leaf budget.

The move (`dynamic_sparsity`), on steps t = count + 1 that are multiples of
``update_every`` (and t <= ``stop_after`` if given), on the new weights
w = params + updates: the K active entries of smallest |w| (in float32) over all
sparse leaves are pruned, ties going to the entry first in `jax.tree.leaves`
order, then row-major. Then K positions inactive before the pruning are regrown
at zero, sampled without replacement with weights making each leaf's expected
share roughly proportional to its surviving weights (exactly so for a single
draw); a leaf left with none gets only what the others have no room for. Each
update thus moves exactly K entries and the active count stays exactly B.

The optimizer before it in the chain sees dense gradients: its moments keep
accumulating at inactive positions, and a regrown weight starts at zero with
them. (A sparse storage format would hold no moments there; DSR trains with
momentum SGD on the active weights.) After `lowmem_jax.adama` over k micro-batches
(`lowmem_jax.microbatch_step`) ``update`` runs once a micro-batch, so ``count``
and ``update_every`` count micro-batches: give a multiple of k, and the masks
move at the k-th micro-batch, where the optimizer step lands.

References:
  Mostafa & Wang, 2019, "Parameter Efficient Training of Deep Convolutional
  Neural Networks by Dynamic Sparse Reparameterization"
  (https://arxiv.org/abs/1902.05967).
  Sohoni et al., 2019, "Low-Memory Neural Network Training: A Technical Report"
  (https://arxiv.org/abs/1904.10631).
"""

import functools
import itertools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowmem_jax._checks import is_int, is_real
from lowmem_jax.optim.move_schedule import MoveSchedule


class SparsityState(NamedTuple):
  """State of `dynamic_sparsity`."""
  masks: Any  # the params' structure: bool, the leaf's shape, on sparse leaves; None on dense ones
  count: jax.Array  # int32 [], steps seen
  key: jax.Array  # uint32 raw PRNG key (`jax.random.key_data`) of the next regrowth, which
  # flax.serialization and orbax save (a typed key they cannot)


def _leaves_or_none(masks: Any) -> list[jax.Array | None]:
  return jax.tree.leaves(masks, is_leaf=lambda m: m is None)


def _budget(masks: list[jax.Array], density: float) -> int:
  return sum(round(density * m.size) for m in masks)


@functools.partial(jax.jit, static_argnums=1)
def _random_mask(key: jax.Array, shape: tuple[int, ...], active: int) -> jax.Array:
  """A bool array of ``shape`` with ``active`` True entries at random positions."""
  return (jax.random.permutation(key, math.prod(shape)) < active).reshape(shape)


def _prune_and_regrow(masks, weights, key, moves):
  """Prunes ``moves`` active entries of smallest |weight| and regrows as many inactive ones.

  Ties in magnitude go to the entry first in `jax.tree.leaves` order, then
  row-major (`jax.lax.top_k` keeps the lower index). Regrowth is Gumbel-top-k
  (what `jax.random.choice` does with ``replace=False``) over the positions
  inactive before pruning, with log-weight log(survivors / inactive) of the
  position's leaf. It is written out so that a leaf left with no survivors
  (weight zero) still ranks above the positions that cannot be chosen.
  """
  sizes = [m.size for m in masks]
  offsets = list(itertools.accumulate(sizes))[:-1]
  active = jnp.concatenate([m.ravel() for m in masks])
  magnitude = jnp.concatenate([jnp.abs(w.astype(jnp.float32)).ravel() for w in weights])
  _, pruned = jax.lax.top_k(jnp.where(active, -magnitude, -jnp.inf), moves)
  kept = active.at[pruned].set(False)
  survivors = jnp.stack([k.sum() for k in jnp.split(kept, offsets)]).astype(jnp.float32)
  inactive = jnp.stack([(~m).sum() for m in masks]).astype(jnp.float32)
  log_weight = jnp.log(survivors) - jnp.log(inactive)
  # Noise drawn leaf by leaf: the generator's temporaries then scale with the largest leaf.
  score = jnp.concatenate([
      jnp.where(survivors[i] > 0, jax.random.gumbel(k, (n,)) + log_weight[i],
                jnp.finfo(jnp.float32).min)
      for i, (k, n) in enumerate(zip(jax.random.split(key, len(sizes)), sizes))])
  _, grown = jax.lax.top_k(jnp.where(active, -jnp.inf, score), moves)
  new = kept.at[grown].set(True)
  return [n.reshape(m.shape) for n, m in zip(jnp.split(new, offsets), masks)]


def dynamic_sparsity(density: float, *, update_every: int = 100, prune_fraction: float = 0.2,
                     stop_after: int | None = None, sparse: Callable[[Any], Any] | None = None,
                     seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """Keeps a fixed global budget of active weights and moves it every ``update_every`` steps
  (Mostafa & Wang, 2019).

  Put it last in an ``optax.chain``, after the optimizer and the learning
  rate: it rewrites the final updates so that ``optax.apply_updates(params,
  new_updates)`` is zero outside the masks (``where(mask, updates, -params)``
  on sparse leaves; dense leaves pass through). The first step thus also zeroes
  the initial params outside the masks. Every ``update_every`` steps the
  K = round(prune_fraction * B) active entries of smallest magnitude are pruned and K
  regrown at zero (module docstring, "The move"); the optimizer before it sees dense
  gradients, and under AdamA ``update_every`` counts micro-batches (module docstring).

  Args:
    density: in (0, 1], the fraction of each sparse leaf active at init.
    update_every: a positive int, the steps between mask updates.
    prune_fraction: in [0, 1), the fraction of the budget B moved per update.
    stop_after: None, or an int >= 0: no mask update after this many steps.
    sparse: ``params -> pytree of bools`` with the params' structure, True on
      the sparse leaves; None: the leaves of rank >= 2 (kernels).
    seed: seeds the initial masks and the regrowth.

  Returns:
    An `optax.GradientTransformationExtraArgs` with state `SparsityState` (its masks a
    bool array of the leaf's shape for each sparse leaf, None for each dense one);
    ``update`` needs ``params``, and the updates of sparse leaves in the params' dtypes.

  Example:
    >>> import optax, jax.numpy as jnp
    >>> from lowmem_jax import masked_sparsity
    >>> tx = optax.chain(optax.sgd(0.1), masked_sparsity.dynamic_sparsity(0.25, update_every=1))
    >>> params = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> int((params["w"] != 0).sum()), int(state[-1].masks["w"].sum()), state[-1].masks["b"]
    (3, 4, None)
  """
  if not (is_real(density) and 0 < density <= 1):
    raise ValueError(f"`density` must be a number in (0, 1], got {density!r}.")
  schedule = MoveSchedule.checked(update_every, prune_fraction, stop_after)
  density = float(density)  # a NumPy scalar as Python's
  if sparse is not None and not callable(sparse):
    raise TypeError(f"`sparse` must be None or a function params -> bools, got {sparse!r}.")

  def move(masks, weights, key):  # defined once, so that eager calls reuse its compilation
    key, sub = jax.random.split(key)
    return _prune_and_regrow(masks, weights, sub, schedule.moves(_budget(masks, density))), key

  def keep(masks, weights, key):
    del weights
    return masks, key

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    ps, us, masks = _checked_update(updates, state, params)
    sparse_ids = [i for i, m in enumerate(masks) if m is not None]
    old = [masks[i] for i in sparse_ids]
    count = optax.safe_int32_increment(state.count)
    new, key = old, jax.random.wrap_key_data(state.key)
    if schedule.ever(_budget(old, density)):
      weights = [ps[i] + us[i] for i in sparse_ids]
      new, key = jax.lax.cond(schedule.due(count), move, keep, old, weights, key)
    out, new_masks = list(us), list(masks)
    for i, m_old, m_new in zip(sparse_ids, old, new):
      out[i] = jnp.where(m_old & m_new, us[i], -ps[i])
      new_masks[i] = m_new
    treedef = jax.tree.structure(params)
    return jax.tree.unflatten(treedef, out), SparsityState(
        jax.tree.unflatten(treedef, new_masks), count, jax.random.key_data(key))

  return optax.GradientTransformationExtraArgs(
      functools.partial(_init_masks, density=density, schedule=schedule, sparse=sparse,
                        seed=seed), update_fn)


def _init_masks(params, *, density, schedule, sparse, seed) -> SparsityState:
  """`dynamic_sparsity`'s ``init``: a random mask of ``density`` on each sparse leaf."""
  flags = jax.tree.map(lambda p: p.ndim >= 2, params) if sparse is None else sparse(params)
  treedef = jax.tree.structure(params)
  if jax.tree.structure(flags) != treedef:
    raise ValueError(f"`sparse` must return the params' structure {treedef}, got "
                     f"{jax.tree.structure(flags)}.")
  flags = jax.tree.leaves(flags)
  if not all(isinstance(f, bool) for f in flags) or not any(flags):
    raise ValueError(f"`sparse` must return Python bools, at least one True; got {flags}.")
  leaves = jax.tree.leaves(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves) + 1)
  masks = [_random_mask(k, p.shape, round(density * p.size)) if f else None
           for k, p, f in zip(keys, leaves, flags)]
  sparse_masks = [m for m in masks if m is not None]
  budget = _budget(sparse_masks, density)
  pool = sum(m.size for m in sparse_masks) - budget
  if schedule.moves(budget) > pool:
    raise ValueError(
        f"`prune_fraction` {schedule.prune_fraction} moves {schedule.moves(budget)} entries per "
        f"update but `density` {density} leaves only {pool} inactive positions to regrow into.")
  return SparsityState(jax.tree.unflatten(treedef, masks), jnp.zeros([], jnp.int32),
                       jax.random.key_data(keys[-1]))


def _checked_update(updates, state, params) -> tuple[list, list, list]:
  """``(params' leaves, updates' leaves, masks)`` of `dynamic_sparsity`'s ``update``, or the
  error that says which argument does not fit."""
  if params is None:
    raise ValueError("`params` is required: `dynamic_sparsity` zeroes the weights outside "
                     "the masks and prunes by their magnitude.")
  treedef = jax.tree.structure(params)
  masks = _leaves_or_none(state.masks)
  if jax.tree.structure(updates) != treedef or len(masks) != treedef.num_leaves:
    raise ValueError("`updates`, `params` and the state's masks must share the params' "
                     f"structure {treedef}; build the state with `init` on these params.")
  ps, us = jax.tree.leaves(params), jax.tree.leaves(updates)
  for p, u, m in zip(ps, us, masks):
    if m is not None and u.dtype != p.dtype:
      raise TypeError(f"`updates` of sparse leaves must have the params' dtypes (so that "
                      f"they zero them exactly), got {u.dtype} for {p.dtype}.")
  return ps, us, masks


def storage_bytes(params: Any, state: Any, *, index_bytes: int = 4) -> dict[str, int]:
  """Bytes of the params as stored here, of the masks, and under a sparse format.

  Dense storage with a mask saves NOTHING: every entry of every param is
  stored, and the masks cost one byte per sparse-leaf entry on top.
  ``projected_sparse`` is a projection for a sparse storage format (values plus
  one index per active entry, as `lowmem_jax.optim.sparse` stores them with a budget
  per leaf); under such a format the gradient and each optimizer moment per
  parameter shrink by the same ratio.

  Args:
    params: the params, concrete arrays (not under `jax.jit`).
    state: the `SparsityState`, or an optimizer state holding exactly one.
    index_bytes: bytes per stored index of the sparse format, an int >= 0.

  Returns:
    A dict of ints: ``dense`` (the params as stored, all entries), ``mask``
    (the bool masks, one byte per entry) and ``projected_sparse`` (sparse
    leaves at nnz * (itemsize + index_bytes), dense leaves at full size).
  """
  if not (is_int(index_bytes) and index_bytes >= 0):
    raise ValueError(f"`index_bytes` must be an int >= 0, got {index_bytes!r}.")
  found = [s for _, s in optax.tree_utils.tree_get_all_with_path(state, "SparsityState")]
  if len(found) != 1:
    raise ValueError(f"`state` must be or hold exactly one SparsityState; it holds {len(found)}.")
  leaves, masks = jax.tree.leaves(params), _leaves_or_none(found[0].masks)
  if len(masks) != len(leaves):
    raise ValueError(f"`params` has {len(leaves)} leaves but the state's masks {len(masks)}.")
  itemsizes = [jnp.dtype(p.dtype).itemsize for p in leaves]
  return {
      "dense": sum(p.size * b for p, b in zip(leaves, itemsizes)),
      "mask": sum(m.size * jnp.dtype(m.dtype).itemsize for m in masks if m is not None),
      "projected_sparse": sum(
          p.size * b if m is None else int(jnp.sum(m)) * (b + index_bytes)
          for p, m, b in zip(leaves, masks, itemsizes)),
  }
