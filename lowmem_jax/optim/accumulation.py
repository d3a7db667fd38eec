"""AdamA as optax transformations: Adam whose moments absorb each micro-batch gradient.

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

In a chain, every transformation after `adama` runs on every micro-step, so it
must map zero updates to zero and keep no per-call state that should count
optimizer steps: ``add_decayed_weights`` would decay the weights k times per
step, and a schedule would advance k times faster. Wrap such transformations in
`on_kth_micro_step`, as `adamaw` does.

Folded moments: `adama`'s ``update`` takes the extra argument ``folded``, a
pytree with the gradient's structure whose leaves are either None (fold that
leaf's gradient here) or a ``(mu, nu)`` pair already folded for this
micro-batch, e.g. by `scan_layers` in the backward pass; the gradient of such a
leaf is ignored. Folded pairs arrive in the moments' storage dtypes, so with a
low-precision ``mu_dtype`` their direction is computed from the rounded mu (the
plain path uses the unrounded one, as `optax.scale_by_adam` does).
``folded_with`` is the `MomentFold` that folded them (`microbatch_step` passes
its own); one that differs from this AdamA's in k, b1, b2 or nu_scale is an
error. Give both the same `MomentFold` as ``k`` and they agree by construction.

8-bit moments (``state_bits=8``): stored block-wise in 8 bits
(`lowmem_jax.optim.lowbit`: leaves of at least ``lowbit.MIN_SIZE`` elements,
smaller ones in float32), rounded stochastically, keyed by the seed, the step and
the micro-step, each element's bits drawn at its place in the tree
(`lowmem_jax.optim.lowbit.rounding_bits`; the extra argument ``positions`` as in
`lowmem_jax.optim.lowbit.scale_by_adam_8bit`), dequantised to float32 to fold
each micro-batch in. Not with ``folded`` moments (`microbatch_step`'s
``fold_in_backward``).

References:
  Zhang et al., 2023, "Adam Accumulation to Reduce Memory Footprints of both
  Activations and Gradients for Large-scale DNN Training"
  (https://arxiv.org/abs/2305.19982).
  Wang & Aitchison, 2024, "Batch size invariant Adam"
  (https://arxiv.org/abs/2402.18824).
"""

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax import tree_utils as otu

from lowmem_jax._static import StaticInt
from lowmem_jax.optim import lowbit

NU_SCALES = ("mean_sq", "mean")


class AdamAState(NamedTuple):
  """State of `adama`; no gradient-sized accumulator."""
  micro_step: jax.Array  # int32 [], micro-batches folded into the step in progress, 0..k-1
  count: jax.Array  # int32 [], optimizer steps completed
  mu: optax.Updates  # first moment: the params' shapes, in mu_dtype
  nu: optax.Updates  # second moment: the params' shapes and dtypes
  k: StaticInt  # micro-batches per optimizer step, static: what `microbatch_step` checks


def moment_structure(moments: Any) -> Any:
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


def as_moment_fold(k: "int | MomentFold", b1: Any = 0.9, b2: Any = 0.999,
                   nu_scale: str = "mean_sq") -> MomentFold:
  """``k`` if it is a `MomentFold`, else ``MomentFold(k, b1, b2, nu_scale)``: what every
  public entry taking ``k: int | MomentFold`` calls once, first, and hands on.

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


def adama(k: "int | MomentFold", b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, *, mu_dtype: Any | None = None, nu_scale: str = "mean_sq",
          state_bits: int | None = None,
          seed: int | None = None) -> optax.GradientTransformationExtraArgs:
  r"""Scale updates by AdamA: Adam over k micro-batches without a gradient accumulator.

  Call ``update`` once per micro-batch with that micro-batch's gradient. It
  returns zero updates on micro-steps 1..k-1 and Adam's direction
  :math:`\hat m / (\sqrt{\hat v + \epsilon_{root}} + \epsilon)` on the k-th,
  so ``optax.chain(adama(k), optax.scale_by_learning_rate(lr))`` is the full
  optimizer. A learning-rate schedule there counts micro-steps: `adamaw`
  counts optimizer steps; a transformation after it in a chain must pass zero updates
  on (module docstring). Extra arguments: ``folded`` and ``folded_with``, moments
  folded elsewhere (module docstring, "Folded moments").

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
    state_bits: None (moments in the params' dtypes, or ``mu_dtype``), or 8 for
      moments stored block-wise in 8 bits (module docstring; the extra argument
      ``positions``). A Python int: under `optax.inject_hyperparams` list it in
      ``static_args``.
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
    >>> updates["w"]  # doctest: +NUMBER
    Array([-0.0999993, -0.0999993, -0.0999993], dtype=float32)
  """
  fold = as_moment_fold(k, b1, b2, nu_scale)
  k, b1, b2 = fold.k, fold.b1, fold.b2
  mu_dtype, seed = _checked_storage(mu_dtype, state_bits, seed)

  def init_fn(params):
    if state_bits == 8:
      mu, nu = lowbit.moments_zeros(params)
    else:
      mu, nu = otu.tree_zeros_like(params, dtype=mu_dtype), otu.tree_zeros_like(params)
    return AdamAState(micro_step=jnp.zeros([], jnp.int32), count=jnp.zeros([], jnp.int32),
                      mu=mu, nu=nu, k=StaticInt(k))

  def update_fn(updates, state, params=None, *, folded=None, folded_with=None, positions=None,
                **extra_args):
    del params, extra_args
    _check_update(updates, state, fold, folded, folded_with, state_bits)
    if folded is None:
      folded = jax.tree.map(lambda _: None, updates)
    mu, nu, updates, scales = _folded_moments(fold, updates, state, folded, state_bits)
    count_inc = optax.safe_int32_increment(state.count)
    # With 8-bit moments, in the gradient's dtype, not the dequantised moments' float32.
    direction = lowbit.adam_direction(mu, nu, count_inc, b1=b1, b2=b2, eps=eps,
                                      eps_root=eps_root, like=updates if state_bits == 8 else None)
    if state_bits == 8:
      key = lowbit.step_key(seed, state.count * k + state.micro_step)
      mu, nu = lowbit.moments_store(mu, nu, updates, key=key, positions=positions,
                                    scales=scales)
    else:
      mu, nu = otu.tree_cast(mu, mu_dtype), otu.tree_cast_like(nu, state.nu)
    return _after_micro_step(k, state, direction, mu, nu, count_inc)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _after_micro_step(k: int, state: AdamAState, direction: Any, mu: Any, nu: Any,
                      count_inc: jax.Array) -> tuple[Any, AdamAState]:
  """``(updates, state)`` after a micro-step of ``k``: Adam's ``direction`` and the step
  counted (``count_inc``) at the k-th micro-step, zero updates and the next micro-step before
  it; the new moments ``mu``, ``nu`` (stored) either way."""
  if k == 1:
    return direction, AdamAState(jnp.zeros([], jnp.int32), count_inc, mu, nu, state.k)
  last = state.micro_step == k - 1
  direction = jax.tree.map(lambda d: jnp.where(last, d, jnp.zeros_like(d)), direction)
  return direction, AdamAState(
      micro_step=jnp.where(last, 0, state.micro_step + 1).astype(jnp.int32),
      count=jnp.where(last, count_inc, state.count), mu=mu, nu=nu, k=state.k)


def _folded_moments(fold: "MomentFold", updates: Any, state: AdamAState, folded: Any,
                    state_bits: int | None) -> tuple[Any, Any, Any, Any]:
  """``(mu, nu, updates, scales)``: `adama`'s moments with ``updates`` folded in (``folded``'s
  leaf where one is given), in float32 where the state is 8-bit, made twice then
  (`lowmem_jax.optim.lowbit.moments_step`: ``updates`` and ``scales`` from it); else
  ``updates`` as given and ``scales`` None."""
  first = state.micro_step == 0

  def moments(mu, nu, g):
    pairs = jax.tree.map(lambda g, m, v, done: fold.apply(g, m, v, first)
                         if done is None else done, g, mu, nu, folded)
    return tuple(jax.tree.map(lambda _, mv: mv[i], g, pairs) for i in (0, 1))

  if state_bits == 8:
    return lowbit.moments_step(moments, state.mu, state.nu, updates)
  return *moments(state.mu, state.nu, updates), updates, None


def _checked_storage(mu_dtype: Any, state_bits: Any, seed: Any) -> tuple[Any, int]:
  """`adama`'s ``(mu_dtype, seed)`` checked (a dtype or None; an int, None read as 0)."""
  mu_dtype = jax.dtypes.canonicalize_dtype(mu_dtype) if mu_dtype is not None else None
  if not (state_bits is None or isinstance(state_bits, int) and state_bits == 8):
    raise ValueError(f"`state_bits` must be None or 8 (a Python int: under "
                     f"`optax.inject_hyperparams`, pass static_args=('k', 'state_bits')), got "
                     f"{state_bits!r}.")
  if seed is not None and (isinstance(seed, (bool, float)) or not jnp.issubdtype(
      getattr(seed, "dtype", type(seed)), jnp.integer)):
    raise ValueError(f"`seed` must be an int or None, got {seed!r}.")
  if state_bits == 8 and mu_dtype is not None:
    raise ValueError("`mu_dtype` applies to 32-bit state; with `state_bits=8` give mu_dtype=None.")
  return mu_dtype, 0 if seed is None else seed


def _check_update(updates: Any, state: AdamAState, fold: "MomentFold", folded: Any,
                  folded_with: "MomentFold | None", state_bits: int | None) -> None:
  """Raises the ValueError that says why `adama`'s ``update`` cannot take these arguments: a
  state of another k, moments folded in the backward by another or a traced fold, another
  tree, folded moments with 8-bit state."""
  if state.k != fold.k:
    raise ValueError(f"The AdamA state was built by an AdamA over k={state.k}, and this one "
                     f"folds over k={fold.k}: build the state with this one's `init`.")
  if folded_with is not None and any(isinstance(v, jax.core.Tracer) for v in (fold.b1, fold.b2)):
    raise ValueError(
        "This AdamA's b1 or b2 is traced (optax.inject_hyperparams), and the moments were "
        "folded in the backward by a MomentFold with fixed rates: list b1 and b2 in "
        "static_args, or fold after the backward (fold_in_backward=False).")
  if folded_with is not None and _disagree(folded_with, fold):
    raise ValueError(
        f"The moments were folded in the backward with {folded_with}, and this AdamA folds "
        f"with {fold}: build one `MomentFold` and give it to both, as `adama`'s and "
        "`microbatch_step`'s `k`.")
  if jax.tree.structure(updates) != moment_structure(state.mu):
    raise ValueError(
        "`updates` (the gradient) and the AdamA state have different tree structures: "
        f"{jax.tree.structure(updates)} vs {moment_structure(state.mu)}. "
        "Build the state with `init` on the params you differentiate.")
  if folded is not None and state_bits == 8:
    raise ValueError("AdamA with `state_bits=8` folds in `update` only: `folded` moments "
                     "(microbatch_step's fold_in_backward) are not supported.")


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
  fold = as_moment_fold(k, b1, b2, nu_scale)
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


def find_adama_state(opt_state: Any, k: int | None = None) -> AdamAState | None:
  """The `AdamAState` inside ``opt_state`` (e.g. of a chain), or None if there is none.

  Args:
    opt_state: an optimizer state.
    k: the micro-batches per step of the driver that asks (None: any); an AdamA state
      over another k is refused.

  Raises:
    ValueError: if ``opt_state`` holds more than one, or one over another k than ``k``.
  """
  found = [s for _, s in otu.tree_get_all_with_path(opt_state, "AdamAState")]
  if len(found) > 1:
    raise ValueError(f"`opt_state` holds {len(found)} AdamA states; expected at most one.")
  if found and k is not None and found[0].k != k:
    raise ValueError(
        f"`tx` is an AdamA over k={found[0].k} micro-batches per optimizer step, and the step "
        f"splits each batch into k={k}: give the step the `MomentFold` (or k) given to AdamA.")
  return found[0] if found else None
