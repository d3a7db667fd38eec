"""The public face of `lowmem`: its options, the matchers they turn on, and `lowmem` itself."""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from lowmem_jax.choices import Activation, Attention, Loss, Norm, checked
from lowmem_jax.transform import activations as _activations
from lowmem_jax.transform import attention as _attention
from lowmem_jax.transform import loss as _loss
from lowmem_jax.transform import norms as _norms
from lowmem_jax.transform.interpreter import evaluate
from lowmem_jax.transform.rewrites import Pass, Rewrites

# Each option's kind and the values it takes; "plain" (or None) leaves the pattern as written.
OPTIONS = {
    "activations": (Activation, (Activation.EXACT, Activation.APPROX, Activation.PLAIN)),
    "norms": (Norm, (Norm.MS, Norm.PLAIN)),
    "attention": (Attention, (Attention.RECOMPUTE, Attention.PLAIN)),
    "loss": (Loss, (Loss.FUSED, Loss.PLAIN)),
}

# Each option's matcher, in the order they run on a jaxpr: the equations one
# takes are not offered to those after it.
MATCHERS = (
    ("loss", _loss.match),
    ("attention", _attention.match),
    ("norms", _norms.match),
    ("activations", _activations.match),
)


def _check_options(options: dict) -> dict:
  """The options as `lowmem_jax.choices` members (None read as "plain"), or the error that
  names the one that is not."""
  out = {}
  for key, value in options.items():
    if key not in OPTIONS:
      raise TypeError(f"lowmem got an unknown option {key}={value!r}; the options are "
                      f"{sorted(OPTIONS)}.")
    kind, allowed = OPTIONS[key]
    out[key] = checked(kind, value, f"lowmem's {key}", allowed, none=kind.PLAIN)
  return out


def lowmem(fn: Callable, *, activations: str | None = "exact", norms: str | None = "ms",
           attention: str | None = "recompute", loss: str | None = "fused") -> Callable:
  """``fn`` with its norms, softmax attention, LM head's loss and activations rewritten.

  By default every rewrite keeps the gradient: ``jax.grad(lowmem(fn))`` equals
  ``jax.grad(fn)`` to float tolerance. Only ``activations="approx"`` changes it:
  GELU and SiLU then take ReGELU2/ReSiLU2's backward, a 2-bit step function in
  place of the derivative (LowMemoryBP, Yang et al., ICML 2024, arXiv:2406.16282,
  who fine-tune pretrained ViT, LLaMA and RoBERTa models with it to accuracy
  comparable to GELU/SiLU's). On a freshly initialised model the step is far
  from the derivative: GPT-2 small's whole gradient at initialisation has cosine
  0.855 to the exact one (``gradient_cosine`` measures it on your arguments).

  Args:
    fn: any function of arrays (pytrees of them, NNX modules included; other
      leaves are static) that traces to a jaxpr: a loss, a model's apply. Give
      the function the step differentiates (``jax.grad(lowmem(loss))``,
      ``nnx.value_and_grad(lowmem(loss))``), not the step: a step's jaxpr
      already holds its backward, which the rewrites do not reach.
    activations: "exact" (ReLU keeps a 1-bit mask; GELU and SiLU keep their
      input alone, the rest recomputed in the backward under `jax.checkpoint`:
      gradients exact), "approx" (GELU and SiLU with ReGELU2/ReSiLU2's 2-bit
      approximate backward instead) or "plain" (or None) to leave them all.
    norms: "ms" (memory-sharing norms, affine folded into the matmuls they
      feed) or "plain" (or None).
    attention: "recompute" (`lowmem_jax.attention`: no L×L residual) or "plain" (or None).
    loss: "fused" (a matmul's logits wider than its input, sliced along the
      tokens or not, their log-softmax taken at integer labels or their
      one-hot → `lowmem_jax.ops.losses.linear_cross_entropy`: no
      ``[tokens, vocab]`` logits) or "plain" (or None).

  Returns:
    A function with ``fn``'s signature and outputs (to float tolerance) whose
    backward keeps less. ``.explain(*args, **kwargs)`` (arrays or
    `jax.ShapeDtypeStruct`s) returns the `Rewrites` of that trace, each marked
    exact or approximate. ``.gradient_cosine(*args, **kwargs)`` (arrays; ``fn``
    returning a scalar) is the cosine between the rewritten and the original
    gradient in every float array argument, flattened together: 1.0 to float
    tolerance where every rewrite is exact; it costs a second backward. Composes
    with ``jit``, ``grad``, ``vmap``, ``jax.checkpoint`` and ``scan``.
  """
  if not callable(fn):
    raise TypeError(f"fn must be callable, got {type(fn).__name__}.")
  options = _check_options(
      {"activations": activations, "norms": norms, "attention": attention, "loss": loss})
  matchers = tuple(
      functools.partial(m, approx=options[key] == Activation.APPROX) if key == "activations"
      else m for key, m in MATCHERS if options[key] != "plain")

  def traced(args, kwargs):
    flat_fn, arrays = _of_leaves(fn, args, kwargs, _is_array)
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*arrays)
    return closed, arrays, out_shape

  def rewrites(closed, arrays, count) -> Rewrites:
    pass_ = Pass(matchers, count=count)
    jax.make_jaxpr(lambda *a: evaluate(closed.jaxpr, closed.consts, a, pass_))(*arrays)
    return pass_.result()

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    closed, arrays, out_shape = traced(args, kwargs)
    if not rewrites(closed, arrays, count=False).counts:
      return fn(*args, **kwargs)  # nothing to rewrite: fn's own jaxpr
    # Evaluated again under the caller's trace rather than replayed from the
    # jaxpr above: ops that choose an implementation when differentiated
    # (lm.attention's cuDNN fallback) choose under the caller's transformations.
    outs = evaluate(closed.jaxpr, closed.consts, arrays, Pass(matchers))
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  def explain(*args, **kwargs) -> Rewrites:
    closed, arrays, _ = traced(args, kwargs)
    return rewrites(closed, arrays, count=True)

  wrapped.explain = explain
  wrapped.gradient_cosine = lambda *args, **kwargs: _gradient_cosine(wrapped, fn, args, kwargs)
  return wrapped


def _gradient_cosine(rewritten: Callable, fn: Callable, args, kwargs) -> float:
  """`lowmem`'s ``.gradient_cosine``: the cosine between ``rewritten``'s and ``fn``'s
  gradients at ``args``, ``kwargs`` in every float array argument, flattened together."""
  is_float = lambda x: _is_array(x) and jnp.issubdtype(jnp.result_type(x), jnp.floating)

  def grads(f):
    of_floats, floats = _of_leaves(f, args, kwargs, is_float)
    if not floats:
      raise ValueError("gradient_cosine needs a float array among the arguments, got none.")
    g = jax.grad(of_floats, argnums=tuple(range(len(floats))))(*floats)
    return jnp.concatenate([x.astype(jnp.float32).ravel() for x in g])

  got, want = grads(rewritten), grads(fn)
  return float(jnp.vdot(got, want) / (jnp.linalg.norm(got) * jnp.linalg.norm(want)))


def _of_leaves(fn: Callable, args, kwargs, chosen: Callable) -> tuple[Callable, list]:
  """``(flat_fn, leaves)``: the leaves of ``(args, kwargs)`` that ``chosen`` picks, and
  ``fn`` as a function of them alone, the other leaves as given."""
  leaves, treedef = jax.tree.flatten((args, kwargs))
  picked = [chosen(x) for x in leaves]

  def flat_fn(*values):
    it = iter(values)
    a, kw = jax.tree.unflatten(treedef, [next(it) if p else x for x, p in zip(leaves, picked)])
    return fn(*a, **kw)

  return flat_fn, [x for x, p in zip(leaves, picked) if p]


def _is_array(x) -> bool:
  """Arrays (tracers included) and abstract arrays; other leaves are static."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


