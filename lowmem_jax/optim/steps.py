"""Train steps over micro-batches: the drivers of AdamA, and of plain accumulation.

`microbatch_step` splits a batch into k strided micro-batches and runs them in
one ``lax.scan``, folding each gradient into AdamA's moments (after the
backward, or inside it: `lowmem_jax.optim.in_backward`); `train_step` is one
optimizer step over one batch or k. Besides AdamA's own extra arguments
(``folded``, ``folded_with``), the step passes ``tx.update`` one more, declared
here: `COMPLETES_STEP`, to the transformations whose state asks for it
(`takes_completes_step`).

Strided micro-batches: micro-batch i holds rows i, i + k, i + 2k, ... So a batch
sharded along its leading axis (data parallelism) splits on each device into its
share of every micro-batch, and no rows move between devices, provided each
device's rows are a multiple of k; contiguous blocks would put each micro-batch
on a few devices only.

An AdamA step: each call is one optimizer step, so AdamA's state must start it at
micro-step 0, as ``tx.init`` and every call leave it. The parameters change once,
by the k-th micro-batch's update: the micro-batches before it only fold into the
moments, and no parameter-sized update exists inside the loop; jitted with
``donate_argnums=(0, 1)``, XLA can free each gradient leaf once it is folded (how
much it does depends on its schedule: docs/benchmarks.md measures 0.36 to 0.92 of
the gradient bytes on CPU). Where ``tx`` holds a wrapper that may skip an update
(`optax.apply_if_finite`, ``conditionally_mask``, ``conditionally_transform``,
``MultiSteps``), every micro-batch's update is applied instead, since a skipped
micro-batch leaves the optimizer step unfinished at the end of the call and the
next call finishes it.

References:
  Zhang et al., 2023, "Adam Accumulation to Reduce Memory Footprints of both
  Activations and Gradients for Large-scale DNN Training"
  (https://arxiv.org/abs/2305.19982).
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from optax import tree_utils as otu

from lowmem_jax.optim import lowbit
from lowmem_jax.optim.accumulation import (MomentFold, as_moment_fold, find_adama_state,
                                           moment_structure)
from lowmem_jax.optim.in_backward import FoldInBackward, grads_folded_in_backward

# The extra argument of ``tx.update`` that says whether the update may complete an optimizer
# step: `microbatch_step` passes ``False`` inside its loop (`takes_completes_step`).
COMPLETES_STEP = "completes_step"

# optax's wrappers that may skip an update, so AdamA's step may end inside the loop.
_SKIPPING_STATES = (optax.ApplyIfFiniteState, optax.ConditionallyMaskState,
                    optax.ConditionallyTransformState, optax.MultiStepsState)


def takes_completes_step(state_class: type) -> type:
  """Class decorator: a transformation with this state takes the extra argument
  ``completes_step`` (`COMPLETES_STEP`).

  `microbatch_step` passes ``completes_step=False`` to ``tx.update`` inside its
  loop, where AdamA over the same k (its state at micro-step 0, as a step leaves
  it) completes no optimizer step, so that what a transformation does at a
  step's end (e.g. `lowmem_jax.optim.sparse.sparse_storage`'s move) is not compiled
  into the loop body. It passes it only where ``tx``'s state holds a state of a
  class so marked (an extra-args transformation may refuse an argument it does
  not know), and never where ``tx`` holds a wrapper that may skip an update
  (`optax.apply_if_finite`, ``conditionally_mask``, ``conditionally_transform``,
  ``MultiSteps``). Elsewhere the argument is absent: take it as True.

  Example:
    >>> from typing import NamedTuple
    >>> import jax, lowmem_jax as lm
    >>> @lm.optim.takes_completes_step
    ... class MyState(NamedTuple):
    ...   count: jax.Array  # int32 []
    >>> MyState.takes_completes_step
    True
  """
  state_class.takes_completes_step = True
  return state_class


def _asks_completes_step(state: Any) -> bool:
  """Whether ``state``'s class is marked by `takes_completes_step`."""
  return getattr(type(state), "takes_completes_step", False) is True


def microbatch_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    k: "int | MomentFold",
    *,
    has_aux: bool = False,
    has_state: bool = False,
    fold_in_backward: bool | FoldInBackward | None = None,
) -> Callable[..., tuple[Any, ...]]:
  """A train step over k micro-batches in one ``lax.scan``, strided (module docstring).

  With an AdamA ``tx`` (one whose state holds an `AdamAState`), each micro-batch
  gradient is folded into the moments inside the scan body by ``tx.update``, so no
  gradient accumulator exists (module docstring). With any other ``tx`` the step sums
  the gradients in an accumulator and calls ``tx.update`` once with their mean: plain
  accumulation, for comparison on the same call. Inside the scan, where AdamA over the
  same k completes no step, a ``tx`` whose state asks for it (`takes_completes_step`)
  gets the extra argument ``completes_step=False``. With ``has_state``, a state that is
  not differentiated (batch statistics, RNG counts) runs through the micro-batches in
  order, as k sequential calls would (`lowmem_jax.flax.nnx.microbatch_step` drives this).

  Args:
    loss_fn: ``loss_fn(params, micro_batch) -> loss`` (or ``(loss, aux)`` with
      ``has_aux``), the mean loss over the micro-batch, float32 [].
      With ``has_state``: ``loss_fn(params, state, micro_batch) -> (out, state)``,
      ``out`` as above and the new state of the old one's structure and dtypes.
      With ``fold_in_backward``: ``moments`` comes last, e.g.
      ``loss_fn(params, micro_batch, moments)``.
    tx: the optimizer.
    k: micro-batches per step, a positive Python int; for AdamA the ``k`` given to
      `adama` (its state holds it, and another raises), or better the `MomentFold` given
      as it, so the backward folds with exactly its rule (with ``fold_in_backward``).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    has_state: whether ``loss_fn`` takes and returns a state.
    fold_in_backward: fold each micro-batch gradient into the moments in the
      backward pass, so it dies there (AdamA only): True for every leaf of
      any params pytree (`FoldInBackward` with ``key=None``; its ``where``
      selects leaves), or a `FoldInBackward` with ``key`` for stacked layers
      folded layer by layer by `scan_layers`. `optax.apply_if_finite` around
      `adama` skips a non-finite micro-batch as without it (`FoldInBackward`).

  Returns:
    ``step(params, opt_state, batch) -> (params, opt_state, metrics)``, with
    ``has_state`` ``step(params, state, opt_state, batch) -> (params, state,
    opt_state, metrics)``, where ``metrics["loss"]`` is the mean micro-batch
    loss and, with ``has_aux``, ``metrics["aux"]`` stacks the micro-batches'
    aux along a leading k axis (per-example aux ``[k, n // k, ...]``:
    ``.swapaxes(0, 1).reshape(n, ...)`` gives the batch's order back).
  """
  fold_in_backward = _fold_option(fold_in_backward)
  fold = as_moment_fold(k)
  k = fold.k

  def loss_of(params, state, batch, *moments):
    """``loss_fn`` as ``(loss, (aux, state))``, for ``value_and_grad(has_aux=True)``."""
    if has_state:
      out, state = loss_fn(params, state, batch, *moments)
    else:
      out = loss_fn(params, batch, *moments)
    loss, aux = out if has_aux else (out, None)
    return loss, (aux, state)

  def stateful_step(params, state, opt_state, batch):
    adama_state = _adama_state_of(opt_state, k, params, fold_in_backward)
    micro_batches = _split(batch, k)
    if adama_state is None:
      return _accumulate(loss_of, tx, k, params, state, opt_state, micro_batches)
    return _fold(loss_of, tx, fold_in_backward, fold, k, params, state, opt_state, micro_batches)

  if has_state:
    return stateful_step

  def step(params, opt_state, batch):
    params, _, opt_state, metrics = stateful_step(params, None, opt_state, batch)
    return params, opt_state, metrics

  return step


def _fold_option(fold_in_backward: bool | FoldInBackward | None) -> FoldInBackward | None:
  """`microbatch_step`'s ``fold_in_backward`` as a `FoldInBackward` (True: every leaf), or
  None (False, None)."""
  if fold_in_backward is True:
    return FoldInBackward(key=None)
  if fold_in_backward is False or fold_in_backward is None:
    return None
  if not isinstance(fold_in_backward, FoldInBackward):
    raise ValueError(f"`fold_in_backward` must be a bool, a FoldInBackward or None, got "
                     f"{fold_in_backward!r}.")
  return fold_in_backward


def _adama_state_of(opt_state: Any, k: int, params: Any,
                    fold_in_backward: FoldInBackward | None) -> Any:
  """``opt_state``'s `AdamAState` over ``k`` (None where it has none), checked against
  ``params`` and ``fold_in_backward``: each mismatch refused by name."""
  adama_state = find_adama_state(opt_state, k)
  if adama_state is None and fold_in_backward is not None:
    raise ValueError("`fold_in_backward` is an AdamA option, but `tx` has no AdamA state; "
                     "use `lowmem_jax.adama` in `tx` or drop `fold_in_backward`.")
  if fold_in_backward is not None and any(
      map(lowbit.is_quantized, jax.tree.leaves(adama_state.mu, is_leaf=lowbit.is_quantized))):
    raise ValueError("`fold_in_backward` needs 32-bit AdamA moments; `tx` has 8-bit ones "
                     "(adama's state_bits=8): drop one of them.")
  if adama_state is not None and moment_structure(adama_state.mu) != jax.tree.structure(params):
    raise ValueError("`params` and `opt_state` have different tree structures: "
                     f"{jax.tree.structure(params)} vs {moment_structure(adama_state.mu)}.")
  return adama_state


def train_step(loss_fn: Callable[[Any, Any], jax.Array], tx: optax.GradientTransformation,
               k: "int | MomentFold" = 1, *,
               fold_in_backward: bool = False) -> Callable[..., tuple[Any, ...]]:
  """One optimizer step of ``tx``: ``step(params, opt_state, batch) -> (params, opt_state,
  metrics)``, ``metrics["loss"]`` the loss.

  k = 1: the gradient of ``loss_fn`` on the whole batch and one ``tx.update``.
  k > 1: `microbatch_step` over k micro-batches (an AdamA ``tx`` for the same k
  folds each micro-batch gradient into its moments; with ``fold_in_backward``,
  in the backward pass). An AdamA ``tx`` over another k raises.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss``, the mean loss, float32 [].
    tx: the optimizer.
    k: micro-batches per step, a positive Python int, or AdamA's `MomentFold`
      (as `microbatch_step`'s).
    fold_in_backward: as `microbatch_step`'s; it needs k > 1.
  """
  fold = as_moment_fold(k)
  if fold_in_backward and fold.k == 1:
    raise ValueError("`fold_in_backward` folds AdamA's micro-batches: it needs k > 1.")
  if fold.k > 1:
    return microbatch_step(loss_fn, tx, fold, fold_in_backward=fold_in_backward or None)

  def step(params, opt_state, batch):
    find_adama_state(opt_state, 1)
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss}
  return step


def _split(batch: Any, k: int) -> Any:
  """Each leaf ``[n, ...]`` as ``[n // k, k, ...]`` (a reshape, no copy): micro-batch i is
  ``[:, i]``, the rows i, i + k, ... (`_micro_batch`)."""
  def split(x):
    if x.ndim == 0 or x.shape[0] % k:
      raise ValueError(f"`batch` leaves need a leading axis divisible by k={k}, got shape "
                       f"{x.shape}.")
    return x.reshape(x.shape[0] // k, k, *x.shape[1:])
  return jax.tree.map(split, batch)


def _micro_batch(grouped: Any, i: Any) -> Any:
  """Micro-batch ``i`` of `_split`'s ``grouped`` batch, sliced where it is used: scanning
  over a transposed or sliced batch would copy the batch first."""
  return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False),
                      grouped)


def _metrics(losses, aux):
  metrics = {"loss": jnp.mean(losses)}
  if aux is not None:
    metrics["aux"] = aux
  return metrics


def _accumulate(loss_of, tx, k, params, state, opt_state, micro_batches):
  def body(carry, i):
    acc, state = carry
    (loss, (aux, state)), grads = jax.value_and_grad(loss_of, has_aux=True)(
        params, state, _micro_batch(micro_batches, i))
    return (jax.tree.map(jnp.add, acc, grads), state), (loss, aux)

  (acc, state), (losses, aux) = jax.lax.scan(
      body, (otu.tree_zeros_like(params), state), jnp.arange(k))
  grads = jax.tree.map(lambda g: g / k, acc)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), state, opt_state, _metrics(losses, aux)


def _fold(loss_of, tx, fold_in_backward, fold, k, params, state, opt_state, micro_batches):
  """Micro-batches 1..k-1 folded in a scan that holds no parameter-sized carry or update
  (AdamA's updates there are zeros, dropped), then the k-th, whose update alone is applied.

  A wrapper that may skip AdamA's update (`_SKIPPING_STATES`) can shift its step across
  calls, so an update may fall inside the loop: there every micro-batch's update is
  applied, as before."""
  def micro_step(params, state, opt_state, i, **hint):
    batch = _micro_batch(micro_batches, i)
    if fold_in_backward is None:
      (loss, (aux, state)), grads = jax.value_and_grad(loss_of, has_aux=True)(params, state, batch)
      updates, opt_state = tx.update(grads, opt_state, params, **hint)
    else:
      grads, folded, loss, (aux, state) = grads_folded_in_backward(
          loss_of, fold_in_backward, fold, params, state, find_adama_state(opt_state), batch)
      updates, opt_state = tx.update(grads, opt_state, params, folded=folded, folded_with=fold,
                                     **hint)
    return updates, state, opt_state, (loss, aux)

  if _holds(opt_state, lambda x: isinstance(x, _SKIPPING_STATES)):
    def applying(carry, i):
      params, state, opt_state = carry
      updates, state, opt_state, out = micro_step(params, state, opt_state, i)
      return (optax.apply_updates(params, updates), state, opt_state), out

    (params, state, opt_state), (losses, aux) = jax.lax.scan(
        applying, (params, state, opt_state), jnp.arange(k))
    return params, state, opt_state, _metrics(losses, aux)

  # Micro-batches 1..k-1 complete no step: a transformation that acts at a step's end is told.
  hint = {COMPLETES_STEP: False} if _holds(opt_state, _asks_completes_step) else {}

  def folding(carry, i):
    _, state, opt_state, out = micro_step(params, *carry, i, **hint)
    return (state, opt_state), out

  outs = []
  if k > 1:
    (state, opt_state), out = jax.lax.scan(folding, (state, opt_state), jnp.arange(k - 1))
    outs.append(out)
  updates, state, opt_state, out = micro_step(params, state, opt_state, k - 1)
  outs.append(jax.tree.map(lambda x: jnp.asarray(x)[None], out))
  losses, aux = jax.tree.map(lambda *xs: jnp.concatenate(xs), *outs)
  return optax.apply_updates(params, updates), state, opt_state, _metrics(losses, aux)



def _holds(opt_state: Any, is_state: Callable[[Any], bool]) -> bool:
  """Whether ``opt_state`` (e.g. of a chain) holds a state ``is_state`` picks."""
  return any(is_state(x) for x in jax.tree.leaves(opt_state, is_leaf=is_state))
