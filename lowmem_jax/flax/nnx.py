"""Flax NNX substitutes: drop-in modules over the functional core, and a micro-batched train step.

`microbatch_step` runs `lowmem_jax.optim.microbatch_step` on an NNX model and
an ``nnx.Optimizer``, updating both in place. With ``tx`` built on
`lowmem_jax.adama` (k micro-batches per step) each micro-batch gradient is
folded into Adam's moments as soon as it exists, so no gradient accumulator
is kept; with any other optax ``tx`` the gradients are accumulated and
applied once. Dropout RNG counts and batch statistics run through the
micro-batches as through k sequential calls.

Example:
  >>> import jax.numpy as jnp, optax, lowmem_jax as lm
  >>> from flax import nnx
  >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Dropout(0.1, rngs=nnx.Rngs(1)),
  ...                        nnx.Linear(8, 1, rngs=nnx.Rngs(2)))
  >>> tx = optax.chain(lm.adama(2), optax.scale_by_learning_rate(1e-2))
  >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  >>> loss_fn = lambda model, batch: jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
  >>> step = nnx.jit(lm.nnx.microbatch_step(loss_fn, 2))
  >>> metrics = step(model, optimizer, {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 1))})
  >>> metrics["loss"].shape, int(optimizer.step[...])
  ((), 1)
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from lowmem_jax import optim
from lowmem_jax.flax.linen import attention_fn
from lowmem_jax.ops.embedding import take
from lowmem_jax.ops.norms import ms_layer_norm, ms_rms_norm
from lowmem_jax.optim.accumulation import as_moment_fold


class MultiHeadAttention(nnx.MultiHeadAttention):
  """`flax.nnx.MultiHeadAttention` running `lowmem_jax.flax.linen.attention_fn`: no L×L residual.

  Takes the same arguments and has the same parameters as Flax's, so a
  pretrained state loads unchanged; ``attention_fn`` defaults to ours. No
  attention dropout and no ``sow_weights``.
  """

  def __init__(self, *args, attention_fn: Callable[..., jax.Array] = attention_fn, **kwargs):
    super().__init__(*args, attention_fn=attention_fn, **kwargs)


class Embed(nnx.Embed):
  """`flax.nnx.Embed` looking rows up with `lowmem_jax.ops.embedding.take`.

  The same arguments, parameter (``embedding``) and values, gradients bit for
  bit; the table-sized gradient buffer is made when the cotangent arrives,
  not at the start of the backward pass: for AdamA's micro-batch loop (a plain
  step is not helped; see `lowmem_jax.ops.embedding`).
  """

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    (embedding,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
    if self.num_embeddings == 1 and jnp.issubdtype(inputs.dtype, jnp.integer):
      return jnp.broadcast_to(embedding, inputs.shape + (self.features,))  # as Flax's
    if out_sharding is not None:
      return jax.sharding.auto_axes(take, out_sharding=out_sharding)(embedding, inputs)
    return take(embedding, inputs)


class _MSNorm(nnx.Module):
  _norm = None
  _affine = ("scale", "bias")

  def __init__(self, num_features: int | None = None, *, epsilon: float = 1e-6,
               dtype: Any = None, param_dtype: Any = jnp.float32, use_scale: bool = True,
               use_bias: bool = True, impl: str | None = None, rngs: nnx.Rngs | None = None):
    del rngs  # accepted so that the module replaces nnx.LayerNorm/RMSNorm as called
    used = {"scale": use_scale, "bias": use_bias}
    names = [name for name in type(self)._affine if used[name]]
    if names and num_features is None:
      raise ValueError(f"num_features is needed for the norm's {' and '.join(names)}; give "
                       f"it, or use_{'=False, use_'.join(names)}=False.")
    self.num_features = num_features
    self.epsilon = epsilon
    self.dtype = dtype
    self.impl = impl
    inits = {"scale": jnp.ones, "bias": jnp.zeros}
    for name in type(self)._affine:
      setattr(self, name, nnx.Param(inits[name]((num_features,), param_dtype))
              if used[name] else None)

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.num_features is not None and x.shape[-1] != self.num_features:
      raise ValueError(
          f"x's last axis must be num_features={self.num_features}, got shape {x.shape}.")
    affine = {name: getattr(self, name)[...] for name in type(self)._affine
              if getattr(self, name) is not None}
    return type(self)._norm(x, **affine, eps=self.epsilon, dtype=self.dtype, impl=self.impl)


class MSLayerNorm(_MSNorm):
  """`flax.nnx.LayerNorm` whose backward keeps only its output and 1/sigma.

  MS-BP (Yang et al., ICML 2024, arXiv:2406.16282). The same parameters as
  Flax's (``scale``, ones, and ``bias``, zeros, ``[num_features]`` in
  ``param_dtype``), trained as Flax's are. Without them (``use_scale=False,
  use_bias=False``) it is the paper's norm, whose pretrained affine
  `lowmem_jax.flax.affine_folding` folds into the next Linear.

  Args:
    num_features: the size of the input's last axis; needed for the affine.
    epsilon: added to the variance.
    dtype: dtype of the output; defaults to the input's.
    param_dtype: the dtype of ``scale`` and ``bias``.
    use_scale, use_bias: whether the norm has them.
    impl: "xla", "pallas", "pallas_interpret" or "auto" (`lowmem_jax.ops.dispatch`);
      ``None`` reads ``$LOWMEM_JAX_IMPL``, else "auto".
    rngs: accepted for signature compatibility with `nnx.LayerNorm`; unused.
  """
  _norm = staticmethod(ms_layer_norm)


class MSRMSNorm(_MSNorm):
  """`flax.nnx.RMSNorm` whose backward keeps only its output and 1/rms.

  MS-BP (Yang et al., ICML 2024, arXiv:2406.16282). The same parameter as
  Flax's (``scale``, ones, ``[num_features]`` in ``param_dtype``), trained as
  Flax's is. Without it (``use_scale=False``) it is the paper's norm, whose
  pretrained scale `lowmem_jax.flax.affine_folding` folds into the next Linear.

  Args:
    num_features: the size of the input's last axis; needed for the scale.
    epsilon: added to the mean square.
    dtype: dtype of the output; defaults to the input's.
    param_dtype: the dtype of ``scale``.
    use_scale: whether the norm has it.
    impl: "xla", "pallas", "pallas_interpret" or "auto" (`lowmem_jax.ops.dispatch`);
      ``None`` reads ``$LOWMEM_JAX_IMPL``, else "auto".
    rngs: accepted for signature compatibility with `nnx.RMSNorm`; unused.
  """
  _norm = staticmethod(ms_rms_norm)
  _affine = ("scale",)

  def __init__(self, num_features: int | None = None, *, epsilon: float = 1e-6,
               dtype: Any = None, param_dtype: Any = jnp.float32, use_scale: bool = True,
               impl: str | None = None, rngs: nnx.Rngs | None = None):
    super().__init__(num_features, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype,
                     use_scale=use_scale, use_bias=False, impl=impl, rngs=rngs)


def microbatch_step(
    loss_fn: Callable[..., Any], k: "int | optim.MomentFold", *, has_aux: bool = False,
    fold_in_backward: bool | optim.FoldInBackward | None = None,
) -> Callable[[nnx.Module, nnx.Optimizer, Any], dict[str, Any]]:
  """A train step over k micro-batches for an NNX model and ``nnx.Optimizer``, in place.

  `lowmem_jax.optim.microbatch_step` with ``has_state``, on the model split
  by the optimizer's ``wrt`` (the differentiated state, e.g. ``nnx.Param``)
  and everything else (RNG keys and counts, ``nnx.BatchStat``, other
  Variables). Micro-batch i holds rows i, i + k, i + 2k, ... of the batch and
  sees the state micro-batch i - 1 left; the model ends with the state of the
  last. With `lowmem_jax.adama` in the optimizer's ``tx`` the update is folded
  per micro-batch, with another ``tx`` the mean gradient is applied once.
  ``optimizer.step`` grows by one per call. (A model that the loss of
  `lowmem_jax.optim.microbatch_step` closes over fails in its scan with
  ``TraceContextError: Cannot mutate RngCount from a different trace level``;
  this step merges a model from the carried state per micro-batch instead.)

  Wrap the step in ``nnx.jit``. For plain ``jax.jit``, split the pair first:
  ``graphdef, state = nnx.split((model, optimizer))``, then in the jitted
  function ``model, optimizer = nnx.merge(graphdef, state)``, call the step and
  return ``nnx.state((model, optimizer))`` with the metrics.

  Args:
    loss_fn: ``loss_fn(model, micro_batch) -> loss`` (or ``(loss, aux)`` with
      ``has_aux``), the mean loss over the micro-batch, float32 []. The model
      it gets is a copy inside the trace: its mutations (RNG counts, batch
      statistics) reach ``model`` through the step, not by reference.
    k: micro-batches per step, a positive Python int; for AdamA the ``k`` given
      to `lowmem_jax.adama`, best the `lowmem_jax.MomentFold` itself.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    fold_in_backward: True (or a `lowmem_jax.optim.FoldInBackward` with
      ``key=None``) folds each parameter's micro-batch gradient into AdamA's
      moments in the backward pass, as `lowmem_jax.optim.microbatch_step` does.

  Returns:
    ``step(model, optimizer, batch) -> metrics``: updates ``model`` and
    ``optimizer`` in place; ``metrics`` as from `lowmem_jax.optim.microbatch_step`.
  """
  k = as_moment_fold(k)

  def step(model, optimizer, batch):
    if not isinstance(model, nnx.Module):
      raise TypeError(f"`model` must be an nnx.Module, got {type(model).__name__}.")
    if not isinstance(optimizer, nnx.Optimizer):
      raise TypeError(
          f"`optimizer` must be an nnx.Optimizer, e.g. nnx.Optimizer(model, tx, wrt=nnx.Param), "
          f"got {type(optimizer).__name__}.")
    wrt, graph = optimizer.wrt, optimizer.graph
    graphdef, params, rest = nnx.split(model, wrt, ..., graph=graph)

    def pure_loss(params, rest, micro_batch):
      micro_model = nnx.merge(graphdef, params, rest)
      out = loss_fn(micro_model, micro_batch)
      return out, nnx.as_pure(nnx.split(micro_model, wrt, ..., graph=graph)[2])

    functional = optim.microbatch_step(pure_loss, optimizer.tx, k, has_aux=has_aux, has_state=True,
                                       fold_in_backward=fold_in_backward)
    params, rest, opt_state, metrics = functional(
        *nnx.as_pure((params, rest, optimizer.opt_state)), batch)
    nnx.update(model, params, rest)
    nnx.update(optimizer.opt_state, nnx.state(opt_state, graph=graph))
    optimizer.step[...] += 1
    return metrics

  return step
