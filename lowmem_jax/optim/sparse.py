"""Sparse storage for training: each sparse weight kept as its active values and their positions.

A sparse leaf of the params is a float vector ``[nnz]`` of its active entries;
the optimizer's moments for it are ``[nnz]`` too, and its gradient is made
``[nnz]`` (a gather of the dense one, which lives for one layer). Its flat
positions in the dense weight, ``int32 [nnz]``, live in the state of
`sparse_storage`, the optimizer wrapper that also moves them during training:
every ``update_every`` optimizer steps each sparse leaf prunes its
``round(prune_fraction * nnz)`` active entries of smallest magnitude and
regrows as many at random positions that were inactive, at zero, with their
moments zeroed (`prune_and_regrow`). Its temporaries are O(nnz) whatever the
density: no dense mask, no ``top_k`` over the dense weight.

The budget is per leaf, as in SET: array shapes are fixed under `jax.jit`, so
the global reallocation of DSR (`lowmem_jax.optim.masked_sparsity.dynamic_sparsity`, stored
dense with a mask) would need every leaf stored at its largest size.

The model reads the weight through `densify` inside its layers (e.g.
`lowmem_jax.flax.linen.SparseConv`), so under `nn.remat` a dense weight exists for
one layer at a time.

Steps, as `sparse_storage` counts them: as ``inner`` completes them. Under
`lowmem_jax.adama` over k micro-batches, as its step count moves (once per k
updates, at the k-th). Without AdamA every ``update`` is a step: put a wrapper that
skips steps (`optax.apply_if_finite`, `optax.MultiSteps`) around ``sparse_storage``,
not inside it. ``update``'s extra argument ``completes_step=False``
(`lowmem_jax.optim.COMPLETES_STEP`: what `lowmem_jax.microbatch_step` passes inside
its loop, where AdamA over the same k, entering at micro-step 0, completes no step)
says statically that this update completes none: the move is then not compiled, and
the positions pass through unchanged (so XLA keeps them out of the loop); the step
count still follows AdamA's. The argument is not passed on to ``inner``.

References:
  Mocanu et al., 2018, "Scalable training of artificial neural networks with
  adaptive sparse connectivity inspired by network science" (SET),
  https://doi.org/10.1038/s41467-018-04316-3.
  Sohoni et al., 2019, "Low-Memory Neural Network Training: A Technical Report",
  https://arxiv.org/abs/1904.10631.
"""

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowmem_jax import optim
from lowmem_jax._checks import is_int
from lowmem_jax.optim import lowbit
from lowmem_jax.optim.move_schedule import MoveSchedule


@optim.takes_completes_step  # `microbatch_step` tells update where no step completes
class SparseStorageState(NamedTuple):
  """State of `sparse_storage`."""
  inner: Any  # the wrapped optimizer's state, over the stored params
  positions: Any  # the params' structure: int32 [nnz] flat positions on sparse leaves, else None
  count: jax.Array  # int32 [], optimizer steps completed (under AdamA, not micro-batches)
  key: jax.Array  # uint32 raw PRNG key (`jax.random.key_data`) of the next regrowth


def densify(values: jax.Array, positions: jax.Array, shape: tuple[int, ...], *,
            after: jax.Array | None = None) -> jax.Array:
  """The dense weight of ``shape``: ``values`` at the flat ``positions``, zero elsewhere.

  Args:
    values: float ``[nnz]``.
    positions: int32 ``[nnz]``, distinct, in ``[0, prod(shape))``.
    shape: the dense weight's shape.
    after: None, or an array the dense weight is made after (the layer's input):
      its zeros come out of an `jax.lax.optimization_barrier` with it. Without,
      XLA makes the zeros of every layer's weight in one fusion at the start.

  Returns:
    ``values.dtype[shape]``. Its gradient with respect to ``values`` is the
    dense cotangent gathered at ``positions``.
  """
  if values.ndim != 1 or positions.shape != values.shape:
    raise ValueError(f"`values` and `positions` must both be [nnz], got {values.shape} and "
                     f"{positions.shape}.")
  if not jnp.issubdtype(positions.dtype, jnp.integer):
    raise TypeError(f"`positions` must be integers, got {positions.dtype}.")
  zero = jnp.zeros((), values.dtype)
  if after is not None:
    # `after` enters without its tangent: a barrier that carried one would make autodiff
    # save `after` again for the backward.
    zero, _ = jax.lax.optimization_barrier((zero, jax.lax.stop_gradient(after)))
  dense = jnp.broadcast_to(zero, (math.prod(shape),))
  return dense.at[positions].set(values, unique_indices=True,
                                 mode="promise_in_bounds").reshape(shape)


@jax.custom_vjp
def tie_gradients(x: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(x, values)`` unchanged; in the backward their cotangents leave together, through an
  `optimization_barrier`.

  A layer that takes ``x`` and reads its weight from ``values`` (``x`` any
  shape, ``values`` float ``[nnz]``) calls it first: then the weight's gradient
  (the dense one, gathered to ``[nnz]``) is made before ``x``'s gradient flows on
  to the layers below, and the dense weight gradient and the output's
  cotangent die there. Without it XLA gathers the weight gradient where the
  optimizer reads it, after the whole backward, and keeps every layer's
  output cotangent alive until then. A `jax.custom_vjp`: reverse mode only
  (``jax.jvp``, ``jacfwd`` and forward-over-reverse Hessians raise).
  """
  return x, values


def _tie_fwd(x, values):
  return (x, values), None


def _tie_bwd(_, cotangents):
  return jax.lax.optimization_barrier(cotangents)


tie_gradients.defvjp(_tie_fwd, _tie_bwd)


def to_dense(params: Any, positions: Any, dense: Any) -> Any:
  """``params`` with each sparse leaf made dense (`densify`), for evaluation or export.

  Args:
    params: the stored params; positions: `SparseStorageState.positions` (int32 ``[nnz]``
      on sparse leaves, None on dense ones); dense: the dense params' shapes (arrays or
      ``jax.ShapeDtypeStruct``), as given to `sparse_storage`.
  """
  return jax.tree.map(lambda p, leaf, d: leaf if p is None else densify(leaf, p, d.shape),
                      positions, params, dense, is_leaf=lambda p: p is None)


def to_values(dense_params: Any, positions: Any) -> Any:
  """`to_dense` undone: ``dense_params`` with each sparse leaf's entries taken at its
  ``positions`` (``[nnz]``), e.g. to start sparse training from dense weights."""
  return jax.tree.map(lambda p, d: d if p is None else d.reshape(-1)[p], positions,
                      dense_params, is_leaf=lambda p: p is None)


def random_positions(key: jax.Array, size: int, nnz: int) -> jax.Array:
  """``nnz`` distinct flat positions in ``[0, size)``, uniform, sorted: int32 ``[nnz]``."""
  return jnp.sort(jax.random.choice(key, size, (nnz,), replace=False)).astype(jnp.int32)


def prune_and_regrow(values: jax.Array, positions: jax.Array, key: jax.Array, *, size: int,
                     moves: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Moves ``moves`` entries of one sparse leaf: the smallest |values| to fresh positions.

  The ``moves`` slots of smallest ``|values|`` (ties: the lower slot) take
  positions drawn uniformly among those inactive before the move, and their
  values become zero. The draw is ``2 moves + 32`` uniform ranks among the
  ``size - nnz`` inactive positions, each mapped to its position through the
  sorted active ones (so every draw is inactive, at any density), less
  repeats, the first ``moves`` kept in draw order. Should fewer remain, the
  slots of largest magnitude among the ``moves`` stay where they are
  (``moved`` says which moved): that needs more than ``moves + 32`` repeats
  among the draws, which happens only when ``moves`` nears ``size - nnz``
  (with ``moves <= (size - nnz) / 2`` the draws hold 1.26 ``moves`` distinct
  ranks on average). Temporaries are O(nnz + moves).

  Args:
    values: float ``[nnz]``; positions: int32 ``[nnz]``, distinct, in ``[0, size)``.
    key: a PRNG key.
    size: the dense leaf's size, a static int > nnz; moves: a static int in
      ``[0, min(nnz, size - nnz)]``.

  Returns:
    ``(values, positions, moved)``: the new values (zero where moved), the new
    positions, and bool ``[nnz]``, True on the slots that moved.
  """
  nnz = values.shape[0]
  if not (is_int(size) and size > nnz):
    raise ValueError(f"`size` must be a static int above nnz = {nnz}, got {size!r}.")
  if not (is_int(moves) and 0 <= moves <= min(nnz, size - nnz)):
    raise ValueError(f"`moves` must be a static int in [0, {min(nnz, size - nnz)}] (at most "
                     f"the {nnz} active and the {size - nnz} free positions), got {moves!r}.")
  if positions.dtype != jnp.int32 or size >= 2 ** 31:
    raise ValueError(f"`positions` must be int32 and `size` below 2^31, got {positions.dtype} "
                     f"and {size}.")
  if moves == 0:
    return values, positions, jnp.zeros(nnz, bool)
  _, pruned = jax.lax.top_k(-jnp.abs(values.astype(jnp.float32)), moves)
  draws = 2 * moves + 32
  ranks = jax.random.randint(key, (draws,), 0, size - nnz, jnp.int32)
  # The r-th inactive position is r plus the active ones at or before it: those whose count
  # of inactive positions before them, a_i - i, is at most r.
  active = jnp.sort(positions)
  inactive_before = active - jnp.arange(nnz, dtype=active.dtype)
  candidates = ranks + jnp.searchsorted(inactive_before, ranks, side="right").astype(jnp.int32)
  order = jnp.argsort(candidates, stable=True)
  ranked = candidates[order]
  fresh = ~jnp.zeros(draws, bool).at[order[1:]].set(ranked[1:] == ranked[:-1])
  # The first `moves` fresh candidates in draw order.
  rank = jnp.arange(draws, dtype=jnp.int32)
  _, chosen = jax.lax.top_k(jnp.where(fresh, -rank, -jnp.int32(draws)), moves)
  ok = fresh[chosen]
  positions = positions.at[pruned].set(jnp.where(ok, candidates[chosen], positions[pruned]))
  moved = jnp.zeros(nnz, bool).at[pruned].set(ok)
  return jnp.where(moved, jnp.zeros((), values.dtype), values), positions, moved


def _zero_slots(state_leaf: Any, moved: jax.Array | None) -> Any:
  """An optimizer-state leaf of a stored leaf, zero on the ``moved`` slots."""
  if moved is None:
    return state_leaf
  if lowbit.is_quantized(state_leaf):  # code 0 decodes to 0.0 in both code maps
    return state_leaf._replace(codes=jnp.where(moved, jnp.zeros((), jnp.uint8), state_leaf.codes))
  if getattr(state_leaf, "shape", None) != moved.shape:
    raise ValueError(f"`sparse_storage` zeroes the moments of moved slots; the inner optimizer "
                     f"keeps a {getattr(state_leaf, 'shape', type(state_leaf).__name__)} state "
                     f"for a sparse leaf of {moved.shape}, which it cannot zero slot by slot.")
  return jnp.where(moved, jnp.zeros((), state_leaf.dtype), state_leaf)


def sparse_storage(inner: optax.GradientTransformation, dense: Any, *, update_every: int = 100,
                   prune_fraction: float = 0.2, stop_after: int | None = None,
                   seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """``inner`` over params with sparse leaves stored as values, moving their positions.

  A leaf of the params is sparse where its shape differs from ``dense``'s: it
  must then be ``[nnz]`` with ``nnz`` below the dense size. ``init`` draws each
  sparse leaf's positions uniformly (`random_positions`, from ``seed``).
  ``update`` runs ``inner``; at the end of every ``update_every``-th optimizer
  step (and not after ``stop_after`` steps, if given) each sparse leaf moves
  ``round(prune_fraction * nnz)`` entries with `prune_and_regrow`, on the new
  weights ``params + updates``: the returned updates set the moved slots to
  zero, and ``inner``'s moments there are zeroed. Steps are counted as ``inner``
  completes them, and the extra argument ``completes_step=False`` leaves the move out
  (module docstring, "Steps").

  Give the model the positions (`find_state` ``(opt_state).positions``) and
  read each weight through `densify`.

  Args:
    inner: the optimizer of the stored params.
    dense: the params as the dense model has them (arrays or
      ``jax.ShapeDtypeStruct``), the stored params' tree structure.
    update_every: a positive int, optimizer steps between moves.
    prune_fraction: in [0, 1), the share of each sparse leaf moved per move.
    stop_after: None, or an int >= 0: no move after this many steps.
    seed: an int, seeds the positions and the regrowth.

  Returns:
    An `optax.GradientTransformationExtraArgs` with state `SparseStorageState`;
    ``update`` needs ``params``.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from lowmem_jax import sparse
    >>> dense = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32), "b": jnp.zeros(8)}
    >>> params = {"w": jnp.ones(16), "b": jnp.zeros(8)}  # 16 of w's 64 entries
    >>> tx = sparse.sparse_storage(optax.sgd(0.1), dense, update_every=1, prune_fraction=0.25)
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> int((params["w"] == 0).sum()), state.positions["w"].shape, state.positions["b"]
    (4, (16,), None)
  """
  schedule = MoveSchedule.checked(update_every, prune_fraction, stop_after)
  if not is_int(seed):
    raise ValueError(f"`seed` must be an int, got {seed!r}.")
  dense_def = jax.tree.structure(dense)
  sizes = functools.partial(_dense_sizes, dense=dense, schedule=schedule)

  def init_fn(params):
    leaf_sizes = sizes(params)
    keys = jax.random.split(jax.random.key(seed), len(leaf_sizes) + 1)
    positions = [None if s is None else random_positions(k, s, p.size)
                 for k, s, p in zip(keys, leaf_sizes, jax.tree.leaves(params))]
    return SparseStorageState(inner.init(params), jax.tree.unflatten(dense_def, positions),
                              jnp.zeros([], jnp.int32), jax.random.key_data(keys[-1]))

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError("`params` is required: `sparse_storage` prunes by the new weights' "
                       "magnitude.")
    leaf_sizes = sizes(params)
    may_complete = extra_args.pop(optim.COMPLETES_STEP, True) is not False
    updates, inner_state = inner.update(updates, state.inner, params, **extra_args)
    adama = optim.find_adama_state(inner_state)
    completed = (jnp.bool_(may_complete) if adama is None
                 else adama.count != optim.find_adama_state(state.inner).count)
    count = jnp.where(completed, optax.safe_int32_increment(state.count), state.count)
    if not may_complete:
      return updates, state._replace(inner=inner_state, count=count)
    sparse_ids = [i for i, s in enumerate(leaf_sizes) if s is not None]
    ps = jax.tree.leaves(params)
    if not any(schedule.ever(ps[i].size) for i in sparse_ids):
      return updates, SparseStorageState(inner_state, state.positions, count, state.key)
    return _moved(inner, updates, params, state._replace(inner=inner_state, count=count),
                  completed & schedule.due(count), leaf_sizes, schedule)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _dense_sizes(params: Any, *, dense: Any, schedule: MoveSchedule) -> list[int | None]:
  """The dense size of each sparse leaf of ``params`` (None on dense leaves), or the error
  that says which does not fit `sparse_storage`'s ``dense``."""
  leaves, treedef = jax.tree.flatten(params)
  dense_leaves, dense_def = jax.tree.flatten(dense)
  if treedef != dense_def:
    raise ValueError(f"`dense` must have the params' tree structure {treedef}, got {dense_def}.")
  out = []
  for p, d in zip(leaves, dense_leaves):
    if p.shape == d.shape:
      out.append(None)
      continue
    size = math.prod(d.shape)
    if p.ndim != 1 or not 0 < p.size < size:
      raise ValueError(f"A sparse leaf must be [nnz] with 0 < nnz < its dense size; got "
                       f"{p.shape} for a dense {d.shape}.")
    moves = schedule.moves(p.size)
    if moves > size - p.size:
      raise ValueError(f"`prune_fraction` {schedule.prune_fraction} moves {moves} entries of a "
                       f"leaf of {p.size} in {size}: only {size - p.size} positions are free.")
    out.append(size)
  if all(s is None for s in out):
    raise ValueError("No leaf of the params is sparse: each has its shape in `dense`.")
  return out


def _moved(inner, updates, params, state, due, leaf_sizes, schedule):
  """`sparse_storage`'s ``(updates, state)`` where a move is ``due``: each sparse leaf's
  positions moved on the new weights ``params + updates`` (`prune_and_regrow`), the moved
  slots' updates setting them to zero and ``inner``'s moments there zeroed."""
  treedef = jax.tree.structure(params)
  ps, us = jax.tree.leaves(params), jax.tree.leaves(updates)
  sparse_ids = [i for i, s in enumerate(leaf_sizes) if s is not None]

  def move(inner_state, positions, key):
    key, *subs = jax.random.split(jax.random.wrap_key_data(key), len(sparse_ids) + 1)
    new, moved = list(positions), [None] * len(ps)
    for i, sub in zip(sparse_ids, subs):
      _, new[i], moved[i] = prune_and_regrow(ps[i] + us[i], positions[i], sub,
                                             size=leaf_sizes[i], moves=schedule.moves(ps[i].size))
    inner_state = optax.tree_utils.tree_map_params(
        inner, _zero_slots, inner_state, jax.tree.unflatten(treedef, moved),
        is_leaf=lowbit.is_quantized)
    return inner_state, new, [m for m in moved if m is not None], jax.random.key_data(key)

  def keep(inner_state, positions, key):
    return inner_state, positions, [jnp.zeros(ps[i].shape, bool) for i in sparse_ids], key

  positions = jax.tree.leaves(state.positions, is_leaf=lambda x: x is None)
  inner_state, positions, moved, key = jax.lax.cond(due, move, keep, state.inner, positions,
                                                    state.key)
  out = list(us)
  for i, m in zip(sparse_ids, moved):
    out[i] = jnp.where(m, -ps[i], us[i])
  return jax.tree.unflatten(treedef, out), SparseStorageState(
      inner_state, jax.tree.unflatten(treedef, positions), state.count, key)


def find_state(opt_state: Any) -> SparseStorageState:
  """The one `SparseStorageState` inside ``opt_state`` (e.g. of a chain)."""
  found = [s for _, s in optax.tree_utils.tree_get_all_with_path(opt_state,
                                                                 "SparseStorageState")]
  if len(found) != 1:
    raise ValueError(f"`opt_state` must hold exactly one SparseStorageState; it holds "
                     f"{len(found)}.")
  return found[0]
