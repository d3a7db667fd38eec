"""Low precision: a dtype policy, and dynamic loss scaling for float16.

A policy keeps float32 master parameters, computes in bfloat16 or float16 and
returns float32 outputs, so activations (and the saved residuals) take half
the bytes while the optimizer updates stay exact. float16's range is narrow:
small gradients underflow. Dynamic loss scaling multiplies the loss by a
scale S before differentiating and divides the gradients by S after; a step
whose gradients overflow is skipped (parameters and optimizer state kept as
they were) and S halved; after ``period`` finite steps in a row S doubles.

Both parts are `jmp` (DeepMind's JAX mixed-precision library; 0.0.4 works
with current JAX): a policy is a ``jmp.Policy``, and `loss_scaled_step` scales
with jmp's loss scales. A dynamic scale is kept in a `DynamicLossScaleState`,
which `flax.serialization` and orbax save (jmp's ``DynamicLossScale`` neither:
flax cannot serialise it, and orbax's restore fails in its ``__post_init__``).
This module adds the Flax bridge and the train step.

References:
  Micikevicius et al., "Mixed Precision Training", ICLR 2018 (arXiv:1710.03740).
  Sohoni et al., "Low-Memory Neural Network Training: A Technical Report",
  2019 (arXiv:1904.10631), section on low precision.
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import jmp
import optax

from lowmem_jax._static import StaticInt


class DynamicLossScaleState(NamedTuple):
  """A dynamic loss scale as a state (`dynamic_loss_scale`); `loss_scaled_step` adjusts it
  with jmp's ``DynamicLossScale`` rule."""
  loss_scale: jax.Array  # float32 [], the scale S
  counter: jax.Array  # int32 [], finite steps in a row since S last changed
  period: StaticInt  # finite steps in a row before S grows, static
  factor: StaticInt  # S grows and shrinks by this factor, static

  def as_jmp(self) -> jmp.DynamicLossScale:
    """jmp's ``DynamicLossScale`` of these fields."""
    return jmp.DynamicLossScale(self.loss_scale, self.counter, self.period, self.factor)


Policy = jmp.Policy
LossScale = (DynamicLossScaleState | jmp.DynamicLossScale | jmp.StaticLossScale
             | jmp.NoOpLossScale)

POLICIES = {
    "float32": "params=float32,compute=float32,output=float32",
    "bfloat16": "params=float32,compute=bfloat16,output=float32",
    "float16": "params=float32,compute=float16,output=float32",
}


def get_policy(spec: str | Policy) -> Policy:
  """A ``jmp.Policy`` from a name in `POLICIES` or a jmp spec string such as
  ``"params=float32,compute=bfloat16,output=float32"``.

  The names of `POLICIES` are mixed precision (float32 parameters and output);
  jmp itself reads a bare ``"float16"`` as float16 everywhere.
  """
  if isinstance(spec, Policy):
    return spec
  if not isinstance(spec, str):
    raise TypeError(f"spec must be a policy name or string, got {type(spec).__name__}.")
  try:
    return jmp.get_policy(POLICIES.get(spec, spec))
  except ValueError as e:
    raise ValueError(f"spec must be one of {tuple(POLICIES)} or a jmp policy string such as "
                     f"{POLICIES['bfloat16']!r}, got {spec!r}.") from e


def flax_dtypes(policy: str | Policy) -> dict[str, Any]:
  """``dict(dtype=compute, param_dtype=params)`` for a Flax module or `lowmem_jax.models.workload`.

  A Flax module returns the compute dtype; cast its output with
  ``policy.cast_to_output`` where the loss wants the output dtype.
  """
  policy = get_policy(policy)
  return dict(dtype=policy.compute_dtype, param_dtype=policy.param_dtype)


def dynamic_loss_scale(initial: float = 2.0 ** 15, *, period: int = 2000,
                       factor: int = 2) -> DynamicLossScaleState:
  """A dynamic loss scale starting at ``initial`` that grows by ``factor`` after ``period``
  finite steps and shrinks by it on a non-finite one (jmp's ``DynamicLossScale`` rule), as a
  `DynamicLossScaleState` that `flax.serialization` and orbax save."""
  if not initial > 0:
    raise ValueError(f"initial must be > 0, got {initial!r}.")
  if not isinstance(period, int) or period < 1:
    raise ValueError(f"period must be an int >= 1, got {period!r}.")
  if not isinstance(factor, int) or factor < 2:
    raise ValueError(f"factor must be an int >= 2, got {factor!r}.")
  return DynamicLossScaleState(jnp.float32(initial), jnp.zeros([], jnp.int32), StaticInt(period),
                               StaticInt(factor))


def loss_scaled_step(loss_fn: Callable[[Any, Any], jax.Array],
                     tx: optax.GradientTransformation) -> Callable:
  """One optimizer step of ``tx`` on ``loss_fn(params, batch)`` under a loss scale.

  Args:
    loss_fn: ``(params, batch) -> scalar`` loss; its gradient is taken in the
      parameters' dtype (float32 master weights under a `POLICIES` policy).
    tx: the optax optimizer.

  Returns:
    ``step(params, opt_state, loss_scale, batch) -> (params, opt_state,
    loss_scale, metrics)``. Where the unscaled gradients are all finite, the
    update of ``tx`` is applied; otherwise ``params`` and ``opt_state`` are
    returned unchanged (the step is skipped). ``loss_scale`` is adjusted either
    way. ``metrics``: ``loss`` (unscaled), ``grads_finite`` (bool) and
    ``loss_scale`` (the scale this step used). With a power-of-two scale and
    neither overflow nor underflow the gradients, hence the step, equal the
    unscaled ones exactly. The loss is scaled in float32.

    Not for `lowmem_jax.microbatch_step` with AdamA: the moments it folds at
    earlier micro-batches cannot be taken back when a later one overflows.
    Jittable and scannable: the loss scale is a pytree carried in the state.
    ``loss_scale``: a `DynamicLossScaleState` (`dynamic_loss_scale`), or one of
    jmp's loss scales; the step returns the same kind.
  """
  def step(params, opt_state, loss_scale: LossScale, batch):
    ours = isinstance(loss_scale, DynamicLossScaleState)
    scale = loss_scale.as_jmp() if ours else loss_scale

    def scaled_loss(params):
      loss = loss_fn(params, batch).astype(jnp.float32)
      return scale.scale(loss), loss
    grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
    grads = scale.unscale(grads)
    finite = jmp.all_finite(grads)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jmp.select_tree(finite, (new_params, new_opt_state),
                                        (params, opt_state))
    metrics = {"loss": loss, "grads_finite": finite, "loss_scale": scale.loss_scale}
    adjusted = scale.adjust(finite)
    if ours:
      adjusted = loss_scale._replace(loss_scale=adjusted.loss_scale, counter=adjusted.counter)
    return params, opt_state, adjusted, metrics
  return step
