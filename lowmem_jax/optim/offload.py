"""Optimizer state in host memory, brought to the device leaf by leaf for the update.

`offload_state` wraps an optimizer that updates once a step and treats each
parameter leaf on its own (Adam, AdamW, `lowmem_jax.scale_by_adam_8bit`; not
AdamA, which folds every micro-batch into its moments): the state of each leaf
lives in pinned host memory between steps (JAX's memories API,
``jax.memory.Space.Host``); the update runs the optimizer on one leaf at a
time, its state copied to the device and the new state back. XLA schedules
the copies: as many leaves are in flight as the device's memory allows (its
scheduler keeps under the limit), so a step whose whole state would not fit
holds the parameters, the gradient and the leaves in transit. (Updating the
whole tree at once, XLA's schedule keeps three times as much in flight.) The
cost is PCIe traffic: the state crosses twice a step. ZeRO-Offload (Ren et
al., 2021, arXiv:2101.06840) keeps the state on the host too and runs the
update on the CPU; here it runs on the device.

Transformations that couple leaves (``optax.clip_by_global_norm``) go
outside the wrapper, in a chain before it. Each leaf has its own copy of the
inner state, so its step counter and any PRNG seed are per leaf; each leaf's
update is told its place in the tree (the extra argument ``positions``, a
`lowmem_jax.optim.lowbit.Position`), so the project's stochastic roundings draw the
bits the whole tree draws.
"""

from typing import Any, NamedTuple

import jax
import optax

from lowmem_jax import _sharding
from lowmem_jax.optim.accumulation import find_adama_state
from lowmem_jax.optim import lowbit


class OffloadState(NamedTuple):
  """State of `offload_state`: the inner transformation's state for each parameter leaf, in
  ``jax.tree.leaves`` order, in host memory."""
  leaves: tuple


def offload_state(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """``inner`` with its state in host memory, applied one parameter leaf at a time.

  Args:
    inner: an optax transformation that updates each leaf independently of
      the others (module docstring); it is initialised on each leaf alone.

  Returns:
    An `optax.GradientTransformation` with state `OffloadState`; ``update``
    passes each leaf of ``params`` on to ``inner``. For a deviceless figure,
    compile a step on `abstract_state`.
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(f"`inner` must be an optax.GradientTransformation, got "
                    f"{type(inner).__name__}.")
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    # Each leaf's state goes to the host as it is made: the device never holds the whole.
    host = jax.memory.Space.Host
    states = tuple(jax.device_put(inner.init(p), host) for p in jax.tree.leaves(params))
    if any(find_adama_state(s) is not None for s in states):
      raise ValueError("`inner` is AdamA, which folds every micro-batch into its moments "
                       "(k crossings a step) and which microbatch_step finds as one state: "
                       "offload an optimizer that updates once a step.")
    return OffloadState(states)

  def update_fn(updates, state, params=None):
    grads, treedef = jax.tree.flatten(updates)
    if len(grads) != len(state.leaves):
      raise ValueError(f"`updates` has {len(grads)} leaves, the offloaded state "
                       f"{len(state.leaves)}: build the state with `init` on these params.")
    leaves = [None] * len(grads) if params is None else jax.tree.leaves(params)
    if len(leaves) != len(grads):
      raise ValueError(f"`params` has {len(leaves)} leaves, `updates` {len(grads)}.")
    out, states = [], []
    for i, (g, leaf_state, p) in enumerate(zip(grads, state.leaves, leaves)):
      u, new_state = inner.update(g, jax.device_put(leaf_state, jax.memory.Space.Device), p,
                                  positions=lowbit.Position(i))
      out.append(u)
      states.append(jax.device_put(new_state, jax.memory.Space.Host))
    return jax.tree.unflatten(treedef, out), OffloadState(tuple(states))

  return optax.GradientTransformation(init_fn, update_fn)


def abstract_state(tx: optax.GradientTransformation, params: Any) -> Any:
  """``tx.init``'s state on the shapes of ``params`` (`jax.eval_shape`), each `OffloadState`
  in host memory (`in_host_memory`): what a deviceless compile of a
  step takes, since ``eval_shape`` drops memory kinds."""
  is_offloaded = lambda x: isinstance(x, OffloadState)
  return jax.tree.map(lambda s: in_host_memory(s) if is_offloaded(s) else s,
                      jax.eval_shape(tx.init, params), is_leaf=is_offloaded)


HOST = "pinned_host"
"""The memory kind of host-resident arrays: pinned, so the device reads them by DMA."""


def in_host_memory(tree: Any) -> Any:
  """``tree`` (arrays or `jax.ShapeDtypeStruct`) as abstract arrays in the host memory
  (memory kind ``"pinned_host"``) of this process's first device (`_sharding.one_device`:
  typed as host memory when traced, as arrays there are): arguments that
  `lowmem_jax.compile.targets.Target.compile` keeps on the host, for the attached GPU or a
  compile-only one, and a target orbax restores into host memory."""
  host = _sharding.one_device(jax.devices()[0], HOST)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=host), tree)


def committed(tree: Any) -> Any:
  """``tree``'s arrays each committed where it lies (``jax.device_put(x, x.sharding)``), a
  leaf that is not a JAX array (a NumPy array or a number, as a restored checkpoint may hold)
  committed to the default device: the first arguments of a step that moves arrays between
  memories (`offload_state`, `lowmem_jax.optim.layer_streamed`). Such a step returns
  committed arrays and ``jax.jit`` keys its cache on committedness, so arguments fresh from
  ``init`` (uncommitted) would make the second step compile again."""
  return jax.tree.map(lambda x: jax.device_put(
      x, x.sharding if isinstance(x, jax.Array) else jax.devices()[0]), tree)
