"""AdamA: optimizer accumulation, Adam whose moments absorb each micro-batch gradient.

Gradient accumulation over k micro-batches keeps a gradient-sized accumulator
alive for the whole step. AdamA folds each micro-batch gradient g_i (of that
micro-batch's mean loss) straight into Adam's moments, so no accumulator
exists and each gradient can die as soon as it is folded in:

- at the first micro-batch of a step: m <- b1 m, v <- b2 v;
- at every micro-batch i: m <- m + (1 - b1) g_i / k, v <- v + (1 - b2) w g_i^2;
- at the k-th: t <- t + 1 and the direction is m_hat / (sqrt(v_hat + eps_root) + eps).

m is exactly Adam's m for the mean gradient. v cannot be Adam's, which needs
the square of the whole sum; ``nu_scale`` picks the weight w:

- ``"mean_sq"`` (default), w = 1/k^2: what public AdamA implementations
  compute (they square the gradients of loss/k). Equals Adam's v in
  expectation when micro-batch noise dominates the gradient.
- ``"mean"``, w = 1/k: the mean of squares, as in batch-size-invariant Adam.
  Equals Adam's v when the gradient signal dominates, and is never below it.

With k = 1 both are Adam, bit for bit against `optax.adam`.

References:
  Zhang et al., 2023, "Adam Accumulation to Reduce Memory Footprints of both
  Activations and Gradients for Large-scale DNN Training"
  (https://arxiv.org/abs/2305.19982).
  Wang & Aitchison, 2024, "Batch size invariant Adam"
  (https://arxiv.org/abs/2402.18824).
"""

import contextvars
import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax import tree_utils as otu

from lowmem_jax import lowbit

NU_SCALES = ("mean_sq", "mean")

# While `microbatch_step` traces a fold-in-backward loss: one entry per `scan_layers` that folds.
_FOLDING_SCANS = contextvars.ContextVar("lowmem_jax_folding_scans", default=None)


class AdamAState(NamedTuple):
  """State of `adama`; no gradient-sized accumulator."""
  micro_step: jax.Array  # int32 [], micro-batches folded into the step in progress, 0..k-1
  count: jax.Array  # int32 [], optimizer steps completed
  mu: optax.Updates  # first moment: the params' shapes, in mu_dtype
  nu: optax.Updates  # second moment: the params' shapes and dtypes


def _moment_structure(moments: Any) -> Any:
  """The tree structure of moments, an 8-bit leaf (`lowbit.QuantizedArray`) counting as one."""
  return jax.tree.structure(moments, is_leaf=lowbit.is_quantized)


def _disagree(a: "MomentFold", b: "MomentFold") -> bool:
  """Whether two folds differ in a field both know (a rate traced under
  `optax.inject_hyperparams` is not known)."""
  known = lambda v: not isinstance(v, jax.core.Tracer)
  return any(known(x) and known(y) and x != y for x, y in (
      (a.k, b.k), (a.b1, b.b1), (a.b2, b.b2), (a.nu_scale, b.nu_scale)))


def _check_k(k: Any, name: str = "k") -> None:
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(
        f"`{name}` must be a positive Python int (the micro-batches per optimizer step), "
        f"got {k!r}. Under `optax.inject_hyperparams`, pass `static_args=('{name}',)`.")


@dataclasses.dataclass(frozen=True)
class MomentFold:
  """How one micro-batch gradient enters AdamA's moments (see the module docstring).

  Build one and give it to both halves of AdamA, so they cannot disagree:
  ``tx = adama(fold)`` (or ``adamaw(lr, fold)``) and
  ``microbatch_step(loss_fn, tx, fold, fold_in_backward=True)``, which folds in
  the backward pass with this rule and ``tx`` applies the direction of its
  moments with the same b1 and b2.

  Example:
    >>> import lowmem_jax as lm
    >>> fold = lm.MomentFold(4, b1=0.95)
    >>> tx = lm.adamaw(1e-3, fold)

  Attributes:
    k: micro-batches per optimizer step.
    b1, b2: Adam's decay rates.
    nu_scale: "mean_sq" (w = 1/k^2) or "mean" (w = 1/k).
  """
  k: int
  b1: Any = 0.9
  b2: Any = 0.999
  nu_scale: str = "mean_sq"

  def __post_init__(self):
    _check_k(self.k)
    if self.nu_scale not in NU_SCALES:
      raise ValueError(f"`nu_scale` must be one of {NU_SCALES}, got {self.nu_scale!r}.")

  def apply(self, g: jax.Array, mu: jax.Array, nu: jax.Array,
            first: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Folds one leaf ``g`` into ``(mu, nu)``; ``first``: bool [], the step's first micro-batch.

    Returns the moments in the promoted dtype, as `optax.scale_by_adam` computes
    them before casting for storage.
    """
    mu_weight = (1 - self.b1) / self.k
    nu_weight = (1 - self.b2) / (self.k ** 2 if self.nu_scale == "mean_sq" else self.k)
    if self.k == 1:
      new_mu, new_nu = self.b1 * mu, self.b2 * nu
    else:
      new_mu = jnp.where(first, self.b1 * mu, mu)
      new_nu = jnp.where(first, self.b2 * nu, nu)
    with jax.numpy_dtype_promotion("standard"):  # JAX's promotion, made explicit below
      dtype = jnp.promote_types(g.dtype, mu.dtype)
    return ((mu_weight * g).astype(dtype) + new_mu.astype(dtype),
            (nu_weight * (g * g)).astype(dtype) + new_nu.astype(dtype))


_DEFAULT_FOLD = {f.name: f.default for f in dataclasses.fields(MomentFold) if f.name != "k"}


def _moment_fold(k: "int | MomentFold", b1: Any = 0.9, b2: Any = 0.999,
                 nu_scale: str = "mean_sq") -> MomentFold:
  """``k`` if it is a `MomentFold`, else ``MomentFold(k, b1, b2, nu_scale)``.

  With a `MomentFold` ``k`` the rates are its own: one of b1, b2, nu_scale
  given with another value than its default and the fold's raises, as does
  one traced (injected by `optax.inject_hyperparams`, which the fold would
  ignore)."""
  if not isinstance(k, MomentFold):
    return MomentFold(k, b1, b2, nu_scale)
  for name, value in (("b1", b1), ("b2", b2), ("nu_scale", nu_scale)):
    if isinstance(value, jax.core.Tracer) or value not in (_DEFAULT_FOLD[name],
                                                           getattr(k, name)):
      raise ValueError(f"`k` is a MomentFold, which holds b1, b2 and nu_scale; `{name}`="
                       f"{value!r} differs from its {getattr(k, name)!r} (under "
                       "optax.inject_hyperparams, give an int k or list the rates in "
                       "static_args).")
  return k


def adama(
    k: "int | MomentFold",
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    mu_dtype: Any | None = None,
    nu_scale: str = "mean_sq",
    state_bits: int | None = None,
    seed: int | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Scale updates by AdamA: Adam over k micro-batches without a gradient accumulator.

  Call ``update`` once per micro-batch with that micro-batch's gradient. It
  returns zero updates on micro-steps 1..k-1 and Adam's direction
  :math:`\hat m / (\sqrt{\hat v + \epsilon_{root}} + \epsilon)` on the k-th,
  so ``optax.chain(adama(k), optax.scale_by_learning_rate(lr))`` is the full
  optimizer. A learning-rate schedule there counts micro-steps: `adamaw`
  counts optimizer steps.

  Every transformation after ``adama`` in a chain runs on every micro-step, so
  it must map zero updates to zero and keep no per-call state that should
  count optimizer steps: ``add_decayed_weights`` would decay the weights k
  times per step, and a schedule would advance k times faster. Wrap such
  transformations in `on_kth_micro_step`, as `adamaw` does.

  Extra argument: ``folded``, a pytree with the gradient's structure whose
  leaves are either None (fold that leaf's gradient here) or a ``(mu, nu)``
  pair already folded for this micro-batch, e.g. by `scan_layers` in the
  backward pass; the gradient of such a leaf is ignored. Folded pairs arrive
  in the moments' storage dtypes, so with a low-precision ``mu_dtype`` their
  direction is computed from the rounded mu (the plain path uses the
  unrounded one, as `optax.scale_by_adam` does). ``folded_with``: the
  `MomentFold` that folded them (`microbatch_step` passes its own); one that
  differs from this AdamA's in k, b1, b2 or nu_scale is an error. Give both
  the same `MomentFold` as ``k`` and they agree by construction.

  Args:
    k: micro-batches per optimizer step, a positive Python int; or a
      `MomentFold`, which holds k, b1, b2 and nu_scale (the one to give
      `microbatch_step` too; under `optax.inject_hyperparams` list it in
      ``static_args``).
    b1, b2: decay rates of the first and second moments (with a `MomentFold`
      ``k``: its own; another value raises).
    eps, eps_root: as in `optax.adam`.
    mu_dtype: dtype of the first moment; None keeps the params' dtypes.
    nu_scale: "mean_sq" (w = 1/k^2) or "mean" (w = 1/k): the weight of each
      squared micro-batch gradient in v (module docstring).
    state_bits: None (moments in the params' dtypes, or ``mu_dtype``), or 8
      for moments stored block-wise in 8 bits (`lowmem_jax.lowbit`: leaves of
      at least ``lowbit.MIN_SIZE`` elements, smaller ones in float32,
      stochastic rounding keyed by
      ``seed``, the step and the micro-step), dequantised to float32 to fold
      each micro-batch in. Not with ``folded`` moments (`microbatch_step`'s
      ``fold_in_backward``). A Python int: under `optax.inject_hyperparams`
      list it in ``static_args``.
    seed: the 8-bit moments' rounding seed, an int (None: 0).

  Returns:
    An `optax.GradientTransformationExtraArgs` with state `AdamAState`.

  Example:
    >>> import optax, jax.numpy as jnp, lowmem_jax as lm
    >>> tx = optax.chain(lm.adama(2, nu_scale="mean"), optax.scale_by_learning_rate(0.1))
    >>> params = {"w": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones(3)}, state)  # micro-step 1 of 2
    >>> updates["w"]
    Array([-0., -0., -0.], dtype=float32)
    >>> updates, state = tx.update({"w": jnp.ones(3)}, state)  # micro-step 2 of 2
    >>> updates["w"]
    Array([-0.09999934, -0.09999934, -0.09999934], dtype=float32)
  """
  fold = _moment_fold(k, b1, b2, nu_scale)
  k, b1, b2 = fold.k, fold.b1, fold.b2
  mu_dtype = jax.dtypes.canonicalize_dtype(mu_dtype) if mu_dtype is not None else None
  if not (state_bits is None or isinstance(state_bits, int) and state_bits == 8):
    raise ValueError(f"`state_bits` must be None or 8 (a Python int: under "
                     f"`optax.inject_hyperparams`, pass static_args=('k', 'state_bits')), got "
                     f"{state_bits!r}.")
  if seed is not None and (isinstance(seed, (bool, float)) or not jnp.issubdtype(
      getattr(seed, "dtype", type(seed)), jnp.integer)):
    raise ValueError(f"`seed` must be an int or None, got {seed!r}.")
  seed = 0 if seed is None else seed
  if state_bits == 8 and mu_dtype is not None:
    raise ValueError("`mu_dtype` applies to 32-bit state; with `state_bits=8` give mu_dtype=None.")

  def init_fn(params):
    if state_bits == 8:
      mu, nu = lowbit.moments_zeros(params)
    else:
      mu, nu = otu.tree_zeros_like(params, dtype=mu_dtype), otu.tree_zeros_like(params)
    return AdamAState(micro_step=jnp.zeros([], jnp.int32), count=jnp.zeros([], jnp.int32),
                      mu=mu, nu=nu)

  def update_fn(updates, state, params=None, *, folded=None, folded_with=None, **extra_args):
    del params, extra_args
    if folded_with is not None and any(isinstance(v, jax.core.Tracer) for v in (b1, b2)):
      raise ValueError(
          "This AdamA's b1 or b2 is traced (optax.inject_hyperparams), and the moments were "
          "folded in the backward by a MomentFold with fixed rates: list b1 and b2 in "
          "static_args, or fold after the backward (fold_in_backward=False).")
    if folded_with is not None and _disagree(folded_with, fold):
      raise ValueError(
          f"The moments were folded in the backward with {folded_with}, and this AdamA folds "
          f"with {fold}: build one `MomentFold` and give it to both, as `adama`'s and "
          "`microbatch_step`'s `k`.")
    if jax.tree.structure(updates) != _moment_structure(state.mu):
      raise ValueError(
          "`updates` (the gradient) and the AdamA state have different tree structures: "
          f"{jax.tree.structure(updates)} vs {_moment_structure(state.mu)}. "
          "Build the state with `init` on the params you differentiate.")
    if folded is None:
      folded = jax.tree.map(lambda _: None, updates)
    elif state_bits == 8:
      raise ValueError("AdamA with `state_bits=8` folds in `update` only: `folded` moments "
                       "(microbatch_step's fold_in_backward) are not supported.")
    first = state.micro_step == 0
    last = state.micro_step == k - 1
    moments = jax.tree.map(
        lambda g, m, v, done: fold.apply(g, m, v, first) if done is None else done,
        updates, *lowbit.moments_load(state.mu, state.nu), folded)
    mu = jax.tree.map(lambda _, mv: mv[0], updates, moments)
    nu = jax.tree.map(lambda _, mv: mv[1], updates, moments)
    count_inc = optax.safe_int32_increment(state.count)
    # With 8-bit moments, in the gradient's dtype, not the dequantised moments' float32.
    direction = lowbit.adam_direction(mu, nu, count_inc, b1=b1, b2=b2, eps=eps,
                                      eps_root=eps_root, like=updates if state_bits == 8 else None)
    if state_bits == 8:
      key = jax.random.fold_in(jax.random.key(seed), state.count * k + state.micro_step)
      mu, nu = lowbit.moments_store(mu, nu, updates, key=key)
    else:
      mu, nu = otu.tree_cast(mu, mu_dtype), otu.tree_cast_like(nu, state.nu)
    if k == 1:
      return direction, AdamAState(jnp.zeros([], jnp.int32), count_inc, mu, nu)
    direction = jax.tree.map(lambda d: jnp.where(last, d, jnp.zeros_like(d)), direction)
    return direction, AdamAState(
        micro_step=jnp.where(last, 0, state.micro_step + 1).astype(jnp.int32),
        count=jnp.where(last, count_inc, state.count),
        mu=mu, nu=nu)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def adamaw(
    learning_rate: optax.ScalarOrSchedule,
    k: "int | MomentFold",
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    mu_dtype: Any | None = None,
    nu_scale: str = "mean_sq",
    weight_decay: float = 1e-4,
    mask: Any = None,
    state_bits: int | None = None,
    seed: int | None = None,
) -> optax.GradientTransformationExtraArgs:
  """AdamA with decoupled weight decay: `optax.adamw` over k micro-batches.

  The chain is ``adama``, then, on the k-th micro-step only (through
  `on_kth_micro_step`), ``add_decayed_weights`` and
  ``scale_by_learning_rate``. So the weights decay once per optimizer step and
  a learning-rate schedule counts optimizer steps, not micro-steps. With
  k = 1 it is `optax.adamw`.

  With ``optax.inject_hyperparams``, ``k`` must be static and a callable
  ``mask`` or a schedule that should count optimizer steps must be too:
  ``optax.inject_hyperparams(adamaw, static_args=("k", "learning_rate"))``.
  A schedule injected by ``inject_hyperparams`` itself counts micro-steps.

  Args:
    learning_rate: a float or an `optax.Schedule` over optimizer steps.
    k, b1, b2, eps, eps_root, mu_dtype, nu_scale, state_bits, seed: as in `adama`.
    weight_decay: the decoupled weight decay rate.
    mask: as in `optax.adamw`: which params decay.

  Returns:
    An `optax.GradientTransformationExtraArgs`.
  """
  fold = _moment_fold(k, b1, b2, nu_scale)
  return optax.chain(
      adama(fold, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, state_bits=state_bits,
            seed=seed),
      on_kth_micro_step(optax.chain(optax.add_decayed_weights(weight_decay, mask),
                                    optax.scale_by_learning_rate(learning_rate)), fold.k))


class KthMicroStepState(NamedTuple):
  """State of `on_kth_micro_step`."""
  inner_state: Any  # ``inner``'s state, advanced on the k-th micro-steps only
  micro_step: jax.Array  # int32 [], micro-steps seen


def on_kth_micro_step(inner: optax.GradientTransformation,
                      k: int) -> optax.GradientTransformationExtraArgs:
  """``inner`` on micro-steps k - 1, 2k - 1, ... (AdamA's k-th); zero updates elsewhere.

  What ``optax.conditionally_transform(inner, lambda n: n % k == k - 1)`` does,
  with a select in place of its ``lax.cond``: ``inner`` runs on every
  micro-step (it must be cheap and elementwise, as weight decay and a
  learning rate are) and its updates and state are kept on the k-th only. A
  select fuses into the parameter update, where a ``cond`` makes XLA
  materialise the updates: two parameter-sized buffers at AdamA's step.

  Args:
    inner: the transformation to apply once per optimizer step.
    k: micro-batches per optimizer step, a positive Python int.
  """
  _check_k(k)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return KthMicroStepState(inner.init(params), jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, **extra_args):
    kth = state.micro_step % k == k - 1
    new_updates, new_state = inner.update(updates, state.inner_state, params, **extra_args)
    keep = lambda new, old: jnp.where(kth, new, old)
    return (jax.tree.map(keep, new_updates, updates),
            KthMicroStepState(jax.tree.map(keep, new_state, state.inner_state),
                              optax.safe_int32_increment(state.micro_step)))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def find_adama_state(opt_state: Any) -> AdamAState | None:
  """The `AdamAState` inside ``opt_state`` (e.g. of a chain), or None if there is none.

  Raises:
    ValueError: if ``opt_state`` holds more than one.
  """
  found = [s for _, s in otu.tree_get_all_with_path(opt_state, "AdamAState")]
  if len(found) > 1:
    raise ValueError(f"`opt_state` holds {len(found)} AdamA states; expected at most one.")
  return found[0] if found else None


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
    dh, mu, nu = carry
    h, p, i = xs
    _, vjp = jax.vjp(layer_fn, p, h)
    dp, dh = vjp(dh)
    at = lambda t: jax.lax.dynamic_index_in_dim(t, i, keepdims=False)
    folded = jax.tree.map(lambda g, m, v: fold.apply(g, at(m), at(v), first), dp, mu, nu)
    put = lambda t, pair, j: jax.lax.dynamic_update_index_in_dim(t, pair[j].astype(t.dtype), i, 0)
    mu = jax.tree.map(lambda t, _, pair: put(t, pair, 0), mu, dp, folded)
    nu = jax.tree.map(lambda t, _, pair: put(t, pair, 1), nu, dp, folded)
    return (dh, mu, nu), None

  (dx, mu, nu), _ = jax.lax.scan(
      layer_backward, (dy, mu, nu),
      (layer_inputs, stacked_params, jnp.arange(n_layers)), reverse=True)
  return dx, jax.tree.map(jnp.zeros_like, stacked_params), mu, nu, None


_folding_scan.defvjp(_folding_scan_fwd, _folding_scan_bwd)


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
  ``tx.update`` (it sees zeros there), so transformations that read the
  gradient before `adama` (global-norm clipping, `optax.apply_if_finite`'s
  finiteness check) do not see them.

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
  return jnp.zeros_like(g), new_mu.astype(mu.dtype), new_nu.astype(nu.dtype), None


_folding_leaf.defvjp(_folding_leaf_fwd, _folding_leaf_bwd)


def microbatch_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    k: "int | MomentFold",
    *,
    has_aux: bool = False,
    has_state: bool = False,
    fold_in_backward: bool | FoldInBackward | None = None,
) -> Callable[..., tuple[Any, ...]]:
  """A train step over k micro-batches in one ``lax.scan``.

  The batch's leading axis is split into k micro-batches, strided: micro-batch
  i holds rows i, i + k, i + 2k, ... So a batch sharded along its leading axis
  (data parallelism) splits on each device into its share of every
  micro-batch, and no rows move between devices, provided each device's rows
  are a multiple of k; contiguous blocks would put each micro-batch on a few
  devices only. With an AdamA ``tx``
  (one whose state holds an `AdamAState`), each micro-batch gradient is folded
  into the moments inside the scan body by ``tx.update``, so no gradient
  accumulator exists; jitted with ``donate_argnums=(0, 1)``, XLA can free each
  gradient leaf once it is folded (how much it does depends on its schedule:
  docs/benchmarks.md measures 0.36 to 0.92 of the gradient bytes on CPU).
  With any other ``tx`` the step sums
  the gradients in an accumulator and calls ``tx.update`` once with their
  mean: plain accumulation, for comparison on the same call. Inside the
  scan, where AdamA over the same k (its state at micro-step 0, as a step
  leaves it) completes no step, a ``tx`` whose state asks for it
  (`lowmem_jax.sparse.sparse_storage`'s) gets the extra argument
  ``completes_step=False``, so its move at the end of a step stays out of
  the loop body.

  With ``has_state``, a state that is not differentiated (batch statistics,
  RNG counts) runs through the micro-batches in order: micro-batch i sees the
  state micro-batch i - 1 left, as k sequential calls would.
  `lowmem_jax.nnx.microbatch_step` drives this for NNX models.

  Args:
    loss_fn: ``loss_fn(params, micro_batch) -> loss`` (or ``(loss, aux)`` with
      ``has_aux``), the mean loss over the micro-batch, float32 [].
      With ``has_state``: ``loss_fn(params, state, micro_batch) -> (out, state)``,
      ``out`` as above and the new state of the old one's structure and dtypes.
      With ``fold_in_backward``: ``moments`` comes last, e.g.
      ``loss_fn(params, micro_batch, moments)``.
    tx: the optimizer.
    k: micro-batches per step, a positive Python int; for AdamA the same k,
      or better the `MomentFold` given to `adama` as its ``k``, so the
      backward folds with exactly its rule (with ``fold_in_backward``).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    has_state: whether ``loss_fn`` takes and returns a state.
    fold_in_backward: fold each micro-batch gradient into the moments in the
      backward pass, so it dies there (AdamA only): True for every leaf of
      any params pytree (`FoldInBackward` with ``key=None``; its ``where``
      selects leaves), or a `FoldInBackward` with ``key`` for stacked layers
      folded layer by layer by `scan_layers`.

  Returns:
    ``step(params, opt_state, batch) -> (params, opt_state, metrics)``, with
    ``has_state`` ``step(params, state, opt_state, batch) -> (params, state,
    opt_state, metrics)``, where ``metrics["loss"]`` is the mean micro-batch
    loss and, with ``has_aux``, ``metrics["aux"]`` stacks the micro-batches'
    aux along a leading k axis (per-example aux ``[k, n // k, ...]``:
    ``.swapaxes(0, 1).reshape(n, ...)`` gives the batch's order back).

  For AdamA, ``k`` must be the ``k`` given to `adama` (the state does not hold
  it), and each call is one optimizer step: AdamA's state must start it at
  micro-step 0, as ``tx.init`` and every call leave it. The parameters change
  once, by the k-th micro-batch's update: the micro-batches before it only
  fold into the moments, and no parameter-sized update exists inside the
  loop. Where ``tx`` holds a wrapper that may skip an update
  (`optax.apply_if_finite`, ``conditionally_mask``, ``conditionally_transform``,
  ``MultiSteps``), every micro-batch's update is applied instead, since a
  skipped micro-batch leaves the optimizer step unfinished at the end of the
  call and the next call finishes it.
  """
  if fold_in_backward is True:
    fold_in_backward = FoldInBackward(key=None)
  if fold_in_backward is False:
    fold_in_backward = None
  if fold_in_backward is not None and not isinstance(fold_in_backward, FoldInBackward):
    raise ValueError(f"`fold_in_backward` must be a bool, a FoldInBackward or None, got "
                     f"{fold_in_backward!r}.")
  fold = _moment_fold(k)
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
    adama_state = find_adama_state(opt_state)
    if adama_state is None and fold_in_backward is not None:
      raise ValueError("`fold_in_backward` is an AdamA option, but `tx` has no AdamA state; "
                       "use `lowmem_jax.adama` in `tx` or drop `fold_in_backward`.")
    if fold_in_backward is not None and any(
        map(lowbit.is_quantized, jax.tree.leaves(adama_state.mu, is_leaf=lowbit.is_quantized))):
      raise ValueError("`fold_in_backward` needs 32-bit AdamA moments; `tx` has 8-bit ones "
                       "(adama's state_bits=8): drop one of them.")
    if adama_state is not None and _moment_structure(adama_state.mu) != jax.tree.structure(params):
      raise ValueError("`params` and `opt_state` have different tree structures: "
                       f"{jax.tree.structure(params)} vs {_moment_structure(adama_state.mu)}.")
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


def train_step(loss_fn: Callable[[Any, Any], jax.Array], tx: optax.GradientTransformation,
               k: "int | MomentFold" = 1, *,
               fold_in_backward: bool = False) -> Callable[..., tuple[Any, ...]]:
  """One optimizer step of ``tx``: ``step(params, opt_state, batch) -> (params, opt_state,
  metrics)``, ``metrics["loss"]`` the loss.

  k = 1: the gradient of ``loss_fn`` on the whole batch and one ``tx.update``.
  k > 1: `microbatch_step` over k micro-batches (an AdamA ``tx`` for the same k
  folds each micro-batch gradient into its moments; with ``fold_in_backward``,
  in the backward pass).

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss``, the mean loss, float32 [].
    tx: the optimizer.
    k: micro-batches per step, a positive Python int, or AdamA's `MomentFold`
      (as `microbatch_step`'s).
    fold_in_backward: as `microbatch_step`'s; it needs k > 1.
  """
  micro_batches = _moment_fold(k).k
  if fold_in_backward and micro_batches == 1:
    raise ValueError("`fold_in_backward` folds AdamA's micro-batches: it needs k > 1.")
  if micro_batches > 1:
    return microbatch_step(loss_fn, tx, k, fold_in_backward=fold_in_backward or None)

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss}
  return step


def _split(batch: Any, k: int) -> Any:
  """Each leaf ``[n, ...]`` as ``[n // k, k, ...]`` (a reshape, no copy): micro-batch i is
  ``[:, i]``, the rows i, i + k, ... (`_micro_batch`)."""
  def split(x):
    if x.ndim == 0 or x.shape[0] % k:
      raise ValueError(f"`batch` leaves need a leading axis divisible by k={k}, got shape {x.shape}.")
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

  A wrapper that may skip AdamA's update (`_SKIPPING_STATES`: `optax.apply_if_finite`,
  ``conditionally_mask``, ``conditionally_transform``, ``MultiSteps``) can shift its step
  across calls, so an update may fall inside the loop: there every micro-batch's update is
  applied, as before."""
  def micro_step(params, state, opt_state, i, **hint):
    batch = _micro_batch(micro_batches, i)
    if fold_in_backward is None:
      (loss, (aux, state)), grads = jax.value_and_grad(loss_of, has_aux=True)(params, state, batch)
      updates, opt_state = tx.update(grads, opt_state, params, **hint)
    else:
      grads, folded, loss, (aux, state) = _grads_folded_in_backward(
          loss_of, fold_in_backward, fold, params, state, opt_state, batch)
      updates, opt_state = tx.update(grads, opt_state, params, folded=folded, folded_with=fold,
                                     **hint)
    return updates, state, opt_state, (loss, aux)

  if _has_skips(opt_state):
    def applying(carry, i):
      params, state, opt_state = carry
      updates, state, opt_state, out = micro_step(params, state, opt_state, i)
      return (optax.apply_updates(params, updates), state, opt_state), out

    (params, state, opt_state), (losses, aux) = jax.lax.scan(
        applying, (params, state, opt_state), jnp.arange(k))
    return params, state, opt_state, _metrics(losses, aux)

  # Micro-batches 1..k-1 complete no step: sparse storage, which acts at a step's end, is told.
  hint = {"completes_step": False} if _takes_completes_step(opt_state) else {}

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


_SKIPPING_STATES = (optax.ApplyIfFiniteState, optax.ConditionallyMaskState,
                    optax.ConditionallyTransformState, optax.MultiStepsState)


def _takes_completes_step(opt_state: Any) -> bool:
  """Whether ``opt_state`` holds the state of a transformation that takes the extra argument
  ``completes_step`` (its state class says so: ``takes_completes_step = True``, as
  `lowmem_jax.sparse.SparseStorageState`)."""
  takes = lambda x: getattr(type(x), "takes_completes_step", False) is True
  return any(takes(x) for x in jax.tree.leaves(opt_state, is_leaf=takes))


def _has_skips(opt_state: Any) -> bool:
  """Whether ``opt_state`` holds the state of a wrapper that may skip updates."""
  is_skip = lambda x: isinstance(x, _SKIPPING_STATES)
  return any(is_skip(x) for x in jax.tree.leaves(opt_state, is_leaf=is_skip))


def _grads_folded_in_backward(loss_of, options, fold, params, state, opt_state, batch):
  """The gradient (zero where folded), the moments folded in backward, loss, (aux, state)."""
  key = options.key
  if key is None:
    return _leaves_folded_in_backward(loss_of, options, fold, params, state, opt_state, batch)
  if not isinstance(params, dict) or key not in params:
    raise ValueError(f"`fold_in_backward.key` {key!r} is not an entry of the params dict.")
  adama_state = find_adama_state(opt_state)
  first = adama_state.micro_step == 0

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


def _leaves_folded_in_backward(loss_of, options, fold, params, state, opt_state, batch):
  """`_grads_folded_in_backward` for any pytree: `_folding_leaf` on the selected leaves."""
  adama_state = find_adama_state(opt_state)
  first = adama_state.micro_step == 0
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
