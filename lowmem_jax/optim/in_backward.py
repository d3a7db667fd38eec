"""Folding AdamA's moments inside the backward pass: each gradient dies where it is made.

`microbatch_step` with ``fold_in_backward`` computes a micro-batch's loss with
each selected parameter behind an identity whose backward rule folds the
parameter's gradient into its moments (`MomentFold.apply`), or, for stacked
layers, through `scan_layers`, whose backward is a reverse scan that folds
each layer's gradient as soon as it is complete. The gradient that reaches
``tx.update`` is zero there (NaN on a leaf whose folded gradient was not
finite, so `optax.apply_if_finite` still skips that micro-batch), and
``adama`` takes the folded moments as its extra argument ``folded``.

References:
  Zhang et al., 2023, "Adam Accumulation to Reduce Memory Footprints of both
  Activations and Gradients for Large-scale DNN Training"
  (https://arxiv.org/abs/2305.19982).
"""

import contextvars
import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from lowmem_jax.optim.accumulation import AdamAState, MomentFold

# While `microbatch_step` traces a fold-in-backward loss: one entry per `scan_layers` that folds.
_FOLDING_SCANS = contextvars.ContextVar("lowmem_jax_folding_scans", default=None)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["mu", "nu", "first"],
                   meta_fields=["fold"])
@dataclasses.dataclass(frozen=True)
class LayerMoments:
  """AdamA moments of stacked layers, handed to `scan_layers` to fold into in backward.

  Attributes:
    mu, nu: the moments of the stacked params, each leaf ``[layers, ...]``.
    first: bool [], whether this is the step's first micro-batch.
    fold: the `MomentFold` rule (static).
  """
  mu: Any
  nu: Any
  first: jax.Array
  fold: MomentFold


def scan_layers(layer_fn: Callable[[Any, jax.Array], jax.Array], x: jax.Array,
                stacked_params: Any, moments: LayerMoments | None = None) -> jax.Array:
  """Applies ``layer_fn`` once per layer, ``lax.scan`` over stacked params.

  With ``moments`` it is the optimizer-in-backward path: the backward pass is a
  reverse scan that recomputes each layer from its saved input (like
  ``nn.remat`` inside ``nn.scan``), takes that layer's parameter gradient and
  folds it at once into the layer's slice of ``moments`` by `MomentFold`. The
  stacked parameter gradient never exists: its cotangent is zero, and the
  cotangent of ``moments.mu`` / ``moments.nu`` is the folded moments. A
  ``lax.scan`` over layers otherwise returns the whole stacked gradient at the
  end of backward, which defeats the early release AdamA relies on.
  `microbatch_step` with ``fold_in_backward`` drives this.

  ``layer_fn`` is not differentiated through its closure: it may close over
  constants (masks, positions), not over values being differentiated.

  Args:
    layer_fn: ``(layer_params, h) -> h`` for one layer; h keeps its shape and dtype.
    x: the input of the first layer.
    stacked_params: params of all layers, each leaf ``[layers, ...]``.
    moments: None for a plain scan, or the moments to fold into.

  Returns:
    The output of the last layer, like ``x``.
  """
  if moments is None:
    return jax.lax.scan(lambda h, p: (layer_fn(p, h), None), x, stacked_params)[0]
  traced = _FOLDING_SCANS.get()
  if traced is not None:
    traced.append(layer_fn)
  return _folding_scan(layer_fn, moments.fold, x, stacked_params, moments.mu, moments.nu,
                       moments.first)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _folding_scan(layer_fn, fold, x, stacked_params, mu, nu, first):
  del fold, mu, nu, first
  return jax.lax.scan(lambda h, p: (layer_fn(p, h), None), x, stacked_params)[0]


def _folding_scan_fwd(layer_fn, fold, x, stacked_params, mu, nu, first):
  del fold
  y, layer_inputs = jax.lax.scan(lambda h, p: (layer_fn(p, h), h), x, stacked_params)
  return y, (layer_inputs, stacked_params, mu, nu, first)


def _folding_scan_bwd(layer_fn, fold, residuals, dy):
  layer_inputs, stacked_params, mu, nu, first = residuals
  n_layers = jax.tree.leaves(stacked_params)[0].shape[0]

  def layer_backward(carry, xs):
    dh, mu, nu, finite = carry
    h, p, i = xs
    _, vjp = jax.vjp(layer_fn, p, h)
    dp, dh = vjp(dh)
    at = lambda t: jax.lax.dynamic_index_in_dim(t, i, keepdims=False)
    folded = jax.tree.map(lambda g, m, v: fold.apply(g, at(m), at(v), first), dp, mu, nu)
    put = lambda t, pair, j: jax.lax.dynamic_update_index_in_dim(t, pair[j].astype(t.dtype), i, 0)
    mu = jax.tree.map(lambda t, _, pair: put(t, pair, 0), mu, dp, folded)
    nu = jax.tree.map(lambda t, _, pair: put(t, pair, 1), nu, dp, folded)
    finite = jax.tree.map(lambda f, g: f & jnp.all(jnp.isfinite(g)), finite, dp)
    return (dh, mu, nu, finite), None

  (dx, mu, nu, finite), _ = jax.lax.scan(
      layer_backward, (dy, mu, nu, jax.tree.map(lambda _: jnp.asarray(True), stacked_params)),
      (layer_inputs, stacked_params, jnp.arange(n_layers)), reverse=True)
  return dx, jax.tree.map(_zero_or_nan, stacked_params, finite), mu, nu, None


_folding_scan.defvjp(_folding_scan_fwd, _folding_scan_bwd)


def _zero_or_nan(like: jax.Array, finite: jax.Array) -> jax.Array:
  """The cotangent of a leaf folded in backward, like ``like``: zeros, or NaN where its
  gradient held a non-finite value, so that a finiteness check on the gradient
  (`optax.apply_if_finite`) sees it: a broadcast scalar, no gradient-sized buffer."""
  return jnp.broadcast_to(jnp.where(finite, 0, jnp.nan).astype(like.dtype), like.shape)


@dataclasses.dataclass(frozen=True)
class FoldInBackward:
  """Options of `microbatch_step`'s optimizer-in-backward path (AdamA only).

  With ``key=None`` (``fold_in_backward=True``) any params pytree works and
  ``loss_fn`` is unchanged: each selected leaf enters the loss through an
  identity whose backward rule folds the leaf's whole micro-batch gradient
  into its moments the moment it is complete, so the gradient dies there and
  no gradient-sized set of buffers need be live at once. With ``key`` a
  string, the params must be a dict whose entry ``key`` holds stacked layers,
  and ``loss_fn(params, batch, moments)`` must pass ``moments`` (a
  `LayerMoments`) to `scan_layers` over ``params[key]``, which folds layer by
  layer inside the scan's backward.

  The backward folds by the `MomentFold` given to `microbatch_step` as its
  ``k``, the one given to `adama` (an int ``k`` means ``MomentFold(k)``, whose
  rates `adama` checks against its own: an optax chain does not expose its
  members' hyperparameters). The folded leaves' gradients never reach
  ``tx.update``: it sees zeros there, so transformations that read the
  gradient's values before `adama` (global-norm clipping) do not see them. A
  leaf whose gradient held a NaN or an infinity reaches it as NaN instead, so
  `optax.apply_if_finite` around `adama` skips that micro-batch (moments and
  parameters kept, ``total_notfinite`` counting it) as without
  ``fold_in_backward``.

  Attributes:
    key: None (fold the leaves ``where`` selects), or the entry of the params
      dict with the stacked layers.
    where: with ``key=None``, ``where(path, leaf) -> bool`` selects the leaves
      to fold in backward (``path`` as `jax.tree_util.tree_map_with_path`
      gives it); None selects every leaf.
  """
  key: str | None = "layers"
  where: Callable[[Any, Any], bool] | None = None

  def __post_init__(self):
    if self.key is not None and not isinstance(self.key, str):
      raise ValueError(f"`FoldInBackward.key` must be a str or None, got {self.key!r}.")
    if self.where is not None and (self.key is not None or not callable(self.where)):
      raise ValueError("`FoldInBackward.where` must be a callable (path, leaf) -> bool, with "
                       f"key=None; got where={self.where!r}, key={self.key!r}.")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _folding_leaf(fold, p, mu, nu, first):
  """``p``; its backward folds ``p``'s gradient into ``(mu, nu)``, their cotangents."""
  del fold, mu, nu, first
  return p


def _folding_leaf_fwd(fold, p, mu, nu, first):
  del fold
  return p, (mu, nu, first)


def _folding_leaf_bwd(fold, residuals, g):
  mu, nu, first = residuals
  new_mu, new_nu = fold.apply(g, mu, nu, first)
  return (_zero_or_nan(g, jnp.all(jnp.isfinite(g))), new_mu.astype(mu.dtype),
          new_nu.astype(nu.dtype), None)


_folding_leaf.defvjp(_folding_leaf_fwd, _folding_leaf_bwd)


def grads_folded_in_backward(loss_of: Callable[..., Any], options: FoldInBackward,
                             fold: MomentFold, params: Any, state: Any, adama_state: AdamAState,
                             batch: Any) -> tuple[Any, Any, jax.Array, Any]:
  """One micro-batch's backward with the moments folded in it, for `microbatch_step`.

  Args:
    loss_of: ``loss_of(params, state, batch, *moments) -> (loss, (aux, state))``.
    options: which leaves fold (`FoldInBackward`).
    fold: the rule they fold by.
    params, state, batch: the micro-batch's arguments of ``loss_of``.
    adama_state: AdamA's state before this micro-batch.

  Returns:
    ``(grads, folded, loss, (aux, state))``: the gradient (zero where folded), and
    ``folded`` as `adama`'s extra argument takes it: ``(mu, nu)`` on the folded leaves,
    None on the others.
  """
  first = adama_state.micro_step == 0
  key = options.key
  if key is None:
    return _leaves_folded_in_backward(loss_of, options, fold, params, state, adama_state, first,
                                      batch)
  if not isinstance(params, dict) or key not in params:
    raise ValueError(f"`fold_in_backward.key` {key!r} is not an entry of the params dict.")

  def loss_with_moments(params, mu_nu):
    return loss_of(params, state, batch, LayerMoments(*mu_nu, first, fold))

  token = _FOLDING_SCANS.set([])
  try:
    (loss, aux_state), (grads, (mu, nu)) = jax.value_and_grad(
        loss_with_moments, argnums=(0, 1), has_aux=True)(
            params, (adama_state.mu[key], adama_state.nu[key]))
    scans = len(_FOLDING_SCANS.get())
  finally:
    _FOLDING_SCANS.reset(token)
  if scans != 1:
    raise ValueError(
        f"With `fold_in_backward`, `loss_fn` must pass its `moments` argument to exactly one "
        f"`lowmem_jax.optim.scan_layers` over params[{key!r}]; it made {scans} such calls.")
  pairs = jax.tree.map(lambda m, v: (m, v), mu, nu)
  folded = {name: pairs if name == key else jax.tree.map(lambda _: None, sub)
            for name, sub in params.items()}
  return grads, folded, loss, aux_state


def _leaves_folded_in_backward(loss_of, options, fold, params, state, adama_state, first, batch):
  """`grads_folded_in_backward` for any pytree: `_folding_leaf` on the selected leaves."""
  selected = jax.tree_util.tree_map_with_path(
      lambda path, leaf: True if options.where is None else bool(options.where(path, leaf)),
      params)
  if not any(jax.tree.leaves(selected)):
    raise ValueError("`FoldInBackward.where` selects no leaf of the params.")

  def loss_with_moments(params, mu_nu):
    hooked = jax.tree.map(lambda on, p, m, v: _folding_leaf(fold, p, m, v, first) if on else p,
                          selected, params, *mu_nu)
    return loss_of(hooked, state, batch)

  (loss, aux_state), (grads, (mu, nu)) = jax.value_and_grad(
      loss_with_moments, argnums=(0, 1), has_aux=True)(params, (adama_state.mu, adama_state.nu))
  folded = jax.tree.map(lambda on, m, v: (m, v) if on else None, selected, mu, nu)
  return grads, folded, loss, aux_state
