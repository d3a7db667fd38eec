"""The layer-streamed train step: the optimizer runs inside the backward, one layer at a time.

For a model of identical stacked layers between an embedding and a head (a
`LayerStack`), `layer_streamed` makes a train step whose forward is a
``lax.scan`` over the stacked layer parameters that keeps only each layer's
input, and whose backward is a reverse scan that recomputes each layer from
its input, takes that layer's parameter gradient (`jax.vjp`) and applies the
optimizer to that layer's slice of the parameters and of the state right
there. The whole-model gradient never exists, and no optimizer temporary is
larger than one layer's. A layer given as consecutive parts (attention, then the
MLP) goes a part at a time: the backward recomputes the parts' inputs from the
layer's, then takes each part's backward from the last, updating the
parameters it reads right after, so one part's parameter copy and gradient are
held at a time, not the layer's (one more forward of the earlier parts). The
parameters and the device state are updated in place in their stacks, a slice
at a time, never copied out a layer at a time. The parameters only the head reads are updated
after the head's backward; those the embedding reads (a tied embedding: the
sum of both gradients) after the first layer's backward, when the
embedding's gradient is made.

Any optax transformation that works leaf by leaf runs this way: Adam, AdamW,
`lowmem_jax.scale_by_adam_8bit`, AdamA (`lowmem_jax.adama`: one call of the
step per micro-batch, the update at the k-th), bfloat16 parameters with
`lowmem_jax.optim.lowbit.stochastic_rounding`. One whose update of a leaf reads
another leaf (``optax.clip_by_global_norm``, ``optax.apply_if_finite``) is
refused, with the equation that mixes them (`check_per_leaf`).

The state is `StreamedState`: the transformation initialised on each
parameter leaf alone (a layer leaf's on each layer, ``jax.vmap`` over the
stacked layers; a leaf updated in slices, `slices`, on each slice), so each
has its own step counter and PRNG seed, all alike. Each update is told where
its part lies in the whole tree (the extra argument ``positions``, a
`lowmem_jax.optim.lowbit.Position` per leaf), so the project's stochastic roundings
(8-bit moments, `lowmem_jax.optim.lowbit.stochastic_rounding`) draw each element's
bits where the whole tree draws them. For a transformation that works leaf by
leaf (the check above) that is its own update: with the state on the device, a
step equals ``tx`` applied to ``jax.grad`` of the whole loss to float
tolerance (the tests' exact twins, float32 and rounded stochastically). A
leaf's 8-bit moments stay float32 below ``min_size`` elements counted per
layer, where the stacked leaf's count may pass it.

Where they live: the parameters on the device; the state and the saved layer
inputs on the device or in pinned host memory (``"host"``), brought over one
layer at a time, the next layer's while the current one computes. Per step the
host link carries the state twice and the saved inputs twice.

References:
  Lv et al., 2023, "Full Parameter Fine-tuning for Large Language Models with
  Limited Resources" (LOMO, the update fused into the backward,
  https://arxiv.org/abs/2306.09782); torchtune's ``optimizer_in_bwd``; Ren et
  al., 2021, "ZeRO-Offload" (state in host memory, https://arxiv.org/abs/2101.06840).
"""

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jcore

from lowmem_jax import _sharding
from lowmem_jax._checks import is_int
from lowmem_jax._jax import source_info_util
from lowmem_jax.optim import lowbit

PLACES = ("device", "host")


@dataclasses.dataclass(frozen=True)
class LayerStack:
  """A model of identical stacked layers between an embedding and a head.

  ``params`` is a dict whose entry ``key`` holds the layers, each leaf
  ``[layers, ...]``; the other entries (``rest``: embedding, final norm, head,
  tied or not) are read by ``embed`` and ``head``. The loss is
  ``head(rest, scan(run_layer, embed(rest, batch)), batch)``.

  Attributes:
    embed: ``(rest, batch) -> h``, ``h: [batch, length, dim]`` in the compute dtype.
    layer: ``(layer_params, h, batch) -> h`` for one layer (its params: one slice
      of ``params[key]``); ``h`` keeps its shape and dtype. ``batch`` is read, not
      differentiated (positions, masks). Or a tuple of such functions, the layer's
      consecutive parts (attention, then the MLP): `layer_streamed` then updates
      the parameters a part reads once that part's backward is done
      (`run_layer` composes them).
    head: ``(rest, h, batch) -> loss``, a float32 scalar (the mean over the batch).
    key: the entry of ``params`` that holds the stacked layers.
  """
  embed: Callable[[Any, Any], jax.Array]
  layer: Callable[[Any, jax.Array, Any], jax.Array] | tuple[Callable, ...]
  head: Callable[[Any, jax.Array, Any], jax.Array]
  key: str = "layers"

  def __post_init__(self):
    for name in ("embed", "head"):
      if not callable(getattr(self, name)):
        raise TypeError(f"`LayerStack.{name}` must be callable, got {getattr(self, name)!r}.")
    if not self.parts or not all(map(callable, self.parts)):
      raise TypeError(f"`LayerStack.layer` must be callable or a non-empty tuple of callables, "
                      f"got {self.layer!r}.")
    if not isinstance(self.key, str):
      raise TypeError(f"`LayerStack.key` must be a str, got {self.key!r}.")

  @property
  def parts(self) -> tuple[Callable, ...]:
    """The layer's consecutive parts: ``layer``'s tuple, or ``(layer,)``."""
    return self.layer if isinstance(self.layer, tuple) else (self.layer,)

  def run_layer(self, layer_params: Any, h: jax.Array, batch: Any) -> jax.Array:
    """One layer: its parts one after the other."""
    for part in self.parts:
      h = part(layer_params, h, batch)
    return h

  def loss(self, params: Any, batch: Any) -> jax.Array:
    """The model's loss, a plain scan over the layers: the function a plain step differentiates."""
    rest, layers = split(params, self.key)
    h = jax.lax.scan(lambda h, p: (self.run_layer(p, h, batch), None),
                     self.embed(rest, batch), layers)[0]
    return self.head(rest, h, batch)


class StreamedState(NamedTuple):
  """State of a `layer_streamed` step: ``tx``'s state of each parameter leaf, at its place.

  A leaf's state is ``tx.init`` of the leaf alone, or of each of its slices,
  stacked, where it is updated in slices (`slices`); a layer leaf's is that of
  each layer, stacked.
  """
  layers: Any  # params[key]'s structure, each leaf's place: its state, every leaf [layers, ...]
  rest: dict  # the other params' structure, each leaf's place: its state


@dataclasses.dataclass(frozen=True)
class LayerStreamed:
  """A layer-streamed train step and the state it takes (`layer_streamed`).

  Attributes:
    init: ``params -> StreamedState``, placed where the step keeps it.
    step: ``(params, state, batch) -> (params, state, {"loss": loss})``, one call
      per (micro-)batch; jit it with ``donate_argnums=(0, 1)`` so the
      parameters and the state are updated in place.
  """
  init: Callable[[Any], StreamedState]
  step: Callable[[Any, StreamedState, Any], tuple[Any, StreamedState, dict]]


def split(params: Any, key: str) -> tuple[dict, Any]:
  """``(rest, params[key])``: the params dict without the stacked layers, and the layers."""
  if not isinstance(params, dict) or key not in params:
    raise ValueError(f"`params` must be a dict with the stacked layers at {key!r} "
                     f"(`LayerStack.key`), got {type(params).__name__} with "
                     f"{list(params) if isinstance(params, dict) else 'no keys'}.")
  return {k: v for k, v in params.items() if k != key}, params[key]


def layer_count(layers: Any) -> int:
  """The stacked layers' leading axis, the same on every leaf (else a ValueError naming one)."""
  paths = jax.tree_util.tree_leaves_with_path(layers)
  if not paths:
    raise ValueError("The stacked layers have no leaves.")
  counts = {jnp.shape(x)[0] if jnp.ndim(x) else None for _, x in paths}
  if len(counts) != 1 or None in counts:
    first = jnp.shape(paths[0][1])[:1]
    odd = next(p for p, x in paths if jnp.shape(x)[:1] != first)
    raise ValueError(
        f"Every stacked layer leaf needs the same leading (layer) axis: "
        f"{jax.tree_util.keystr(paths[0][0])} has {first}, {jax.tree_util.keystr(odd)} has "
        f"{jnp.shape(next(x for p, x in paths if p == odd))[:1]}.")
  return counts.pop()


def _reads(fn: Callable, tree: Any, *args) -> Any:
  """Bool pytree like ``tree``: whether ``fn(tree, *args)`` reads each leaf."""
  closed = jax.make_jaxpr(fn)(tree, *args)
  n = len(jax.tree.leaves(tree))
  used = set(_used_inputs(closed.jaxpr))
  return jax.tree.unflatten(jax.tree.structure(tree), [i in used for i in range(n)])


def _used_inputs(jaxpr) -> list[int]:
  """The indices of ``jaxpr``'s inputs its outputs read, into nested calls (a remat, a jit)."""
  needed = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
  for eqn in reversed(jaxpr.eqns):
    if any(o in needed for o in eqn.outvars) or eqn.effects:
      inner = _inner_jaxpr(eqn)
      reads = (eqn.invars if inner is None or len(inner.invars) != len(eqn.invars)
               else [eqn.invars[i] for i in _used_inputs(inner)])
      needed.update(v for v in reads if isinstance(v, jcore.Var))
  return [i for i, v in enumerate(jaxpr.invars) if v in needed]


def _to(place: str, tree: Any) -> Any:
  """``tree`` moved to the memory of `PLACES`' ``place``."""
  return jax.device_put(tree, jax.memory.Space.Host if place == "host" else jax.memory.Space.Device)


def _layer_states(init_layer: Callable, layers: Any, place: str) -> Any:
  """``jax.vmap(init_layer)(layers)`` in ``place``. In host memory, outside a trace and on one
  device, each layer's state is made on the device and brought to the host before the next
  one's, then stacked there: a whole Llama-3-8B's 8-bit state (15 GiB) made on the device
  would not fit beside its bfloat16 parameters on a 24 GB card. (Traced, XLA places the
  states in host memory itself; under a mesh a layer's state is one device's share.)"""
  leaves = jax.tree.leaves(layers)
  if (place == "device" or len({getattr(x, "sharding", None) for x in leaves}) != 1
      or any(isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array) for x in leaves)
      or len(leaves[0].sharding.device_set) > 1):
    return _to(place, jax.vmap(init_layer)(layers))
  each = [jax.device_get(init_layer(jax.tree.map(lambda x: x[i], layers)))
          for i in range(layer_count(layers))]
  host = leaves[0].sharding.with_memory_kind("pinned_host")

  def stack(*states):
    if jax.dtypes.issubdtype(states[0].dtype, jax.dtypes.prng_key):  # a key a layer: small
      return jax.device_put(jnp.stack(states), host)
    return jax.device_put(np.stack(states), host)

  return jax.tree.map(stack, *each)


def _check_place(name: str, value: Any) -> None:
  if value not in PLACES:
    raise ValueError(f"`{name}` must be one of {PLACES}, got {value!r}.")


def check_per_leaf(tx: optax.GradientTransformation, params: Any) -> None:
  """Raises ValueError if ``tx``'s update of one leaf reads another leaf's gradient or param.

  Traces ``tx.update`` on two copies of ``params`` (a layer's) and follows each
  output back through the jaxpr to the leaves it reads (into nested calls;
  conservatively through loops and conditionals).

  Args:
    tx: the transformation.
    params: one layer's parameters (arrays or ``ShapeDtypeStruct``).
  """
  probe = {"a": params, "b": params}
  state = jax.eval_shape(tx.init, probe)
  n = len(jax.tree.leaves(probe))
  closed = jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))(probe, state, probe)
  jaxpr = closed.jaxpr
  n_state = len(jaxpr.invars) - 2 * n
  groups = ([frozenset({i}) for i in range(n)] + [frozenset()] * n_state
            + [frozenset({i}) for i in range(n)])
  mixed = []
  outs = _dependencies(jaxpr, groups, mixed)
  if mixed or any(len(o) > 1 for o in outs):
    where = mixed[0] if mixed else "its outputs"
    raise ValueError(
        f"The optimizer's update of one parameter leaf reads other leaves' gradients (first "
        f"at {where}): it needs the whole gradient (a global norm, a finiteness check of the "
        "whole tree) and cannot run inside the backward, one layer at a time. Clip per leaf "
        "instead (optax.clip_by_block_rms, optax.clip), or per layer inside `LayerStack.layer`.")


def _dependencies(jaxpr, groups: list[frozenset], mixed: list[str]) -> list[frozenset]:
  """For each outvar of ``jaxpr``, the union of the input groups it depends on; appends to
  ``mixed`` the source of each equation whose output first joins two groups."""
  env = dict(zip(jaxpr.invars, groups))
  read = lambda v: env.get(v, frozenset()) if isinstance(v, jcore.Var) else frozenset()
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    inner = _inner_jaxpr(eqn)
    if inner is not None and len(inner.invars) == len(ins):
      outs = _dependencies(inner, ins, mixed)
    else:
      together = frozenset().union(*ins)
      outs = [together] * len(eqn.outvars)
      if len(together) > 1 and all(len(i) <= 1 for i in ins) and not mixed:
        frames = list(source_info_util.user_frames(eqn.source_info.traceback))[:3]
        mixed.append(" <- ".join(
            [eqn.primitive.name] + [f"{f.function_name} ({_short(f.file_name)}:{f.start_line})"
                                    for f in frames]))
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _short(path: str) -> str:
  """``path`` from its package on (``optax/_src/clipping.py``) where it is installed."""
  return path.rsplit("site-packages/", 1)[-1]


def _inner_jaxpr(eqn):
  """The jaxpr a call-like equation runs once on its operands (pjit, remat, custom rules)."""
  for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    inner = eqn.params.get(name)
    if inner is not None and eqn.primitive.name not in ("scan", "while", "cond"):
      return getattr(inner, "jaxpr", inner)
  return None


def slices(shape: tuple[int, ...], limit: int) -> int:
  """How many equal slices along its first axis `layer_streamed` updates a leaf of ``shape``
  in: the fewest of at most ``limit`` elements each (1 for a leaf within it, or one that no
  split of its first axis brings within it)."""
  if len(shape) < 2 or math.prod(shape) <= limit:
    return 1
  row = math.prod(shape[1:])
  return next((n for n in range(2, shape[0] + 1) if shape[0] % n == 0
               and shape[0] // n * row <= limit), 1)


def _at(tree: Any, *index: jax.Array, rows: int | None = None) -> Any:
  """``tree``'s leaves at the leading indices ``index`` (``tree`` itself without); with
  ``rows``, the last index ``i`` takes rows ``[i * rows, (i + 1) * rows)`` of its axis
  (kept), so a leaf is read a slice at a time without reshaping it (which would move a
  sharded leaf between devices)."""
  if not index:
    return tree
  return jax.tree.map(lambda t: jax.lax.dynamic_slice(t, *_window(t, index, rows)).reshape(
      _window(t, index, rows)[1][len(index) - (rows is not None):]), tree)


def _put(tree: Any, new: Any, *index: jax.Array, rows: int | None = None) -> Any:
  """``tree`` with ``new`` written in place where `_at` reads."""
  return jax.tree.map(lambda t, x: jax.lax.dynamic_update_slice(
      t, x.astype(t.dtype).reshape(_window(t, index, rows)[1]), _window(t, index, rows)[0]),
      tree, new)


def _window(t: Any, index: tuple, rows: int | None) -> tuple[tuple, tuple]:
  """`_at`'s ``(start, size)`` in ``t``."""
  lead = len(index) - (rows is not None)
  start = (*index[:lead], *([] if rows is None else [index[-1] * rows]))
  size = (*[1] * lead, *([] if rows is None else [rows]))
  rest = jnp.shape(t)[len(start):]
  return (*start, *[0] * len(rest)), (*size, *rest)


def _late(index: Any, after: Any) -> Any:
  """``index``, not to be used before ``after`` is made (an optimization barrier)."""
  if after is None or not jax.tree.leaves(index):
    return index
  return jax.lax.optimization_barrier((after, index))[1]


def _scan_slices(fn: Callable, carry: Any, params: Any, states: Any, xs: Any, place: str,
                 reverse: bool = False, outer: tuple = (), state_outer: tuple = (),
                 rows: int | None = None, whole: bool = False) -> tuple[Any, Any, Any]:
  """``fn(carry, i, params_i, state_of, xs_i) -> (carry, params_i, state_i)`` over the slices i
  of stacked ``params``, ``states`` and ``xs`` (leading axis), in a ``lax.scan``;
  ``state_of(after)`` is ``state_i``, taken from device states only once ``after`` (the
  gradient) is made, so the slice is not held while the gradient is computed.

  The params are updated in place; the states too where they live on the device
  (``place``). What lives on the host (the states there, and any leaf of
  ``xs`` in host memory) is brought over one slice ahead: the body starts the
  copy of the next slice's before it runs ``fn`` on this one's, so the transfer
  can overlap the compute; the new states go back to the host as the scan's
  outputs.

  The params and the device states may lie deeper in bigger stacks: slice i's at
  ``params[*outer, i]`` and ``states[*state_outer, i]`` (leading indices), read and
  written there, never copied out whole; with ``rows``, the params are not stacked by
  slice: slice i is rows ``[i * rows, (i + 1) * rows)`` of ``params[*outer]``. With
  ``whole``, ``fn`` takes and returns, in place of ``params_i``, ``state_of`` and
  ``state_i``, the whole ``params`` and the whole device ``states`` (or, on the host,
  slice i's brought over): it reads and writes slice i itself.
  """
  n = jax.tree.leaves(params)[0].shape[len(outer)] // (rows or 1)
  on_host = place == "host"
  fetch = lambda i: _to("device", (_at(states, i) if on_host else None, _at(xs, i)))

  def body(c, i):
    c, params, device_states, current = c
    ahead = fetch(jnp.clip(i - 1 if reverse else i + 1, 0, n - 1))
    if whole:
      c, params, s = fn(c, i, params, current[0] if on_host else device_states, current[1])
    else:
      state_of = ((lambda after: current[0]) if on_host else
                  (lambda after: _at(device_states, *_late((*state_outer, i), after))))
      c, p, s = fn(c, i, _at(params, *outer, i, rows=rows), state_of, current[1])
      params = _put(params, p, *outer, i, rows=rows)
    if on_host:
      return (c, params, device_states, ahead), _to("host", s)
    return (c, params, s if whole else _put(device_states, s, *state_outer, i), ahead), None

  first = _late(n - 1 if reverse else 0, carry)  # not brought over before the carry is made
  (carry, params, device_states, _), host_states = jax.lax.scan(
      body, (carry, params, None if on_host else states, fetch(first)),
      jnp.arange(n), reverse=reverse)
  return carry, params, host_states if on_host else device_states


def layer_streamed(stack: LayerStack, tx: optax.GradientTransformation, *,
                   state: str = "device", saved_inputs: str = "device",
                   slice_elements: int = 2 ** 24,
                   gather_params: bool = False) -> LayerStreamed:
  """A train step over ``stack`` that applies ``tx`` inside the backward, one layer at a time.

  The other parameters are updated once their gradient is complete: after the
  head's backward those the embedding does not read, after the first layer's
  the others. Each parameter leaf has its own state (``tx`` works leaf by
  leaf: the same updates), and a leaf of more than ``slice_elements``
  elements (a layer's, or another) is updated in equal slices along its first
  axis, one after the other, each slice with its own state, so the
  optimizer's float32 temporaries stay within a slice: exact for an
  elementwise transformation and for 8-bit moments (whose blocks lie along
  the last axis); a per-leaf statistic (``optax.clip_by_block_rms``) is then
  taken per slice, as it is per layer.

  Args:
    stack: the model (`LayerStack`).
    tx: an optax transformation that works leaf by leaf (module docstring); its
      ``update`` is called with the params and, where it takes extra arguments,
      ``positions`` (each part's `lowmem_jax.optim.lowbit.Position` in the whole tree).
    state: where the optimizer state lives between steps, "device" or "host"
      (pinned host memory, brought over a layer, or a slice of another leaf, at a time).
    saved_inputs: where the forward keeps each layer's input for the backward,
      "device" or "host".
    slice_elements: the most elements a leaf is updated in at once, a positive int.
    gather_params: for parameters sharded FSDP-style over a mesh of ``Auto`` axes set
      for tracing (`jax.set_mesh`): each layer's parameters, and the embedding's and
      the head's, made whole on every device where they are used, as ZeRO-3 gathers
      them (Rajbhandari et al., 2020, https://arxiv.org/abs/1910.02054); without it
      XLA's propagation may move activations between devices instead. Nothing
      without such a mesh.

  Returns:
    A `LayerStreamed`: ``init(params)`` and ``step(params, state, batch)``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, lowmem_jax as lm
    >>> stack = lm.optim.LayerStack(
    ...     embed=lambda rest, b: b @ rest["w_in"],
    ...     layer=lambda p, h, b: jnp.tanh(h @ p["w"]),
    ...     head=lambda rest, h, b: jnp.mean(h ** 2))
    >>> params = {"w_in": jnp.ones((3, 4)), "layers": {"w": jnp.stack([jnp.eye(4)] * 2)}}
    >>> streamed = lm.optim.layer_streamed(stack, optax.adamw(1e-3))
    >>> params, opt_state, metrics = jax.jit(streamed.step)(
    ...     params, streamed.init(params), jnp.ones((2, 3)))
    >>> metrics["loss"].shape
    ()
  """
  if not isinstance(stack, LayerStack):
    raise TypeError(f"`stack` must be a LayerStack, got {type(stack).__name__}.")
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(f"`tx` must be an optax.GradientTransformation, got {type(tx).__name__}.")
  tx = optax.with_extra_args_support(tx)
  _check_place("state", state)
  _check_place("saved_inputs", saved_inputs)
  if not isinstance(gather_params, bool):
    raise TypeError(f"`gather_params` must be a bool, got {type(gather_params).__name__}.")
  gather = _sharding.gathered if gather_params else lambda tree: tree
  if not is_int(slice_elements) or slice_elements < 1:
    raise ValueError(f"`slice_elements` must be a positive int, got {slice_elements!r}.")

  def checked(params):
    """``(rest, layers, one_layer)``, the transformation checked on one layer."""
    rest, layers = split(params, stack.key)
    layer_count(layers)
    one_layer = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], x.dtype), layers)
    check_per_leaf(tx, one_layer)
    return rest, layers, one_layer

  def sliced(x, n):
    return x.reshape(n, -1, *jnp.shape(x)[1:])

  def leaf_init(x):
    n = slices(jnp.shape(x), slice_elements)
    return tx.init(x) if n == 1 else jax.vmap(tx.init)(sliced(x, n))

  def init(params):
    rest, layers, _ = checked(params)
    return StreamedState(_layer_states(lambda p: jax.tree.map(leaf_init, p), layers, state),
                         jax.tree.map(lambda x: _to(state, leaf_init(x)), rest))

  def update(g, s, p, at):
    updates, s = tx.update(g, s, p, positions=at)
    return optax.apply_updates(p, updates), s

  def update_leaf(g, s, p, place, at, outer=(), state_outer=()):
    """One leaf's update, its state in ``place`` before and after; ``at``: its
    `lowbit.Position` in the whole params tree. ``p`` may be a stack of such leaves, this
    one at ``p[*outer]`` (leading indices), and ``s`` on the device a stack of states,
    this one's at ``s[*state_outer]``: they come back updated in place."""
    shape = jnp.shape(p)[len(outer):]
    n = slices(shape, slice_elements)
    if n == 1:
      late = _late((outer, state_outer), g)
      new_p, new_s = update(g, _to("device", _at(s, *late[1])), _at(p, *late[0]), at)
      new_p = _put(p, new_p, *outer) if outer else new_p
      return new_p, _put(s, new_s, *state_outer) if state_outer else _to(place, new_s)
    part = (shape[0] // n, *shape[1:])
    fn = lambda _, i, p, s, g: (None, *update(g, s(g), p, at.part(i, part)))
    if outer:
      return _scan_slices(fn, None, p, s, sliced(g, n), place, outer=outer,
                          state_outer=state_outer, rows=part[0])[1:]
    _, p, s = _scan_slices(fn, None, sliced(p, n), s, sliced(g, n), place)
    return p.reshape(shape), s

  def update_tree(grads, states, params, place, where, which=None, outer=(), state_outer=()):
    """Each leaf's update (those ``which`` selects), the new params and states as trees;
    ``where``: each leaf's `lowbit.Position`; ``outer``, ``state_outer``: `update_leaf`'s."""
    treedef = jax.tree.structure(params)
    states = treedef.flatten_up_to(states)
    leaves = zip(treedef.flatten_up_to(grads), states, jax.tree.leaves(params),
                 treedef.flatten_up_to(where))
    out = [update_leaf(g, s, p, place, at, outer, state_outer)
           if which is None or which[i] else (p, s) for i, (g, s, p, at) in enumerate(leaves)]
    return (jax.tree.unflatten(treedef, [p for p, _ in out]),
            jax.tree.unflatten(treedef, [s for _, s in out]))

  def step(params, opt_state, batch):
    if not isinstance(opt_state, StreamedState):
      raise TypeError(f"`opt_state` must be the StreamedState `init` makes, got "
                      f"{type(opt_state).__name__}.")
    rest, layers, one_layer = checked(params)
    embed_reads = jax.tree.leaves(_reads(lambda r: stack.embed(r, batch), rest))
    # Each leaf's place in the whole tree: a seeded rounding draws the whole tree's bits.
    rest_at, layers_at = split(jax.tree.unflatten(jax.tree.structure(params), map(
        lowbit.Position, range(len(jax.tree.leaves(params))))), stack.key)

    h, embed_vjp = jax.vjp(lambda r: stack.embed(gather(r), batch), rest)
    h, saved = jax.lax.scan(lambda h, p: (stack.run_layer(gather(p), h, batch),
                                          _to(saved_inputs, h)),
                            h, layers)
    loss, head_vjp = jax.vjp(lambda r, h: stack.head(gather(r), h, batch), rest, h)
    head_grads, dh = head_vjp(jnp.ones_like(loss))
    new_rest, rest_states = update_tree(head_grads, opt_state.rest, rest, state, rest_at,
                                        [not r for r in embed_reads])
    if state == "device":
      # The head's own update before the layers' backward, so the head's gradient (the output
      # kernel's, vocab x dim) is gone by then: dh waits on the new states. Compiled for the
      # GPU targets, with the state on the host XLA's own order peaks lower.
      done = [s for s, r in zip(jax.tree.structure(rest).flatten_up_to(rest_states),
                                embed_reads) if not r]
      dh, _ = jax.lax.optimization_barrier((dh, done))

    part_reads = [jax.tree.leaves(_reads(lambda p, h: part(p, h, batch), one_layer, h))
                  for part in stack.parts]
    # A leaf is updated after the backward of the first part that reads it (a leaf no part
    # reads: after part 0's, with a zero gradient).
    owner = [next((j for j, reads in enumerate(part_reads) if reads[k]), 0)
             for k in range(len(part_reads[0]))]

    def backward(dh, i, stacked, states, h):
      """Layer i's backward, each part's parameters updated in ``stacked`` (all layers')
      once its backward is done; ``states``: the device's whole stack or layer i's from
      the host, updated."""
      p = _at(stacked, i)
      treedef, old = jax.tree.structure(p), jax.tree.leaves(p)
      at = jax.tree.map(lambda at: at.index(i), layers_at)
      # The updates write into the stacks in place; under a mesh, where a slice of a leaf
      # along a sharded axis would move the whole stack, into layer i's copy, put back after.
      in_place = not _sharding.in_auto_mesh()
      new_p = stacked if in_place else p
      new_s = states if in_place or state == "host" else None  # a copy once a gradient is made
      outer = (i,) if in_place else ()
      state_outer = (i,) if in_place and state == "device" else ()
      inputs = [_to("device", h)]
      for part in stack.parts[:-1]:
        inputs.append(part(gather(p), inputs[-1], batch))
      grads = [None] * len(old)
      for j in reversed(range(len(stack.parts))):
        read = [k for k, r in enumerate(part_reads[j]) if r]

        def part_of(sub, h, j=j, read=read):
          leaves = list(old)
          for k, x in zip(read, sub):
            leaves[k] = x
          return stack.parts[j](gather(jax.tree.unflatten(treedef, leaves)), h, batch)

        _, vjp = jax.vjp(part_of, [old[k] for k in read], inputs[j])
        sub, dh = vjp(dh)
        for k, g in zip(read, sub):
          grads[k] = g if grads[k] is None else grads[k] + g
        mine = [o == j for o in owner]
        if any(mine):
          full = [g if g is not None else jnp.zeros_like(x) for g, x in zip(grads, old)]
          if new_s is None:
            new_s = _at(states, *_late((i,), [g for g, m in zip(full, mine) if m]))
          new_p, new_s = update_tree(jax.tree.unflatten(treedef, full), new_s, new_p, "device",
                                     at, mine, outer, state_outer)
        if j:  # this part's update, then the part before: its forward recomputed, not kept
          dh, inputs[j - 1], new_p, new_s = jax.lax.optimization_barrier(
              (dh, inputs[j - 1], new_p, new_s))
      if in_place:
        return dh, new_p, new_s
      return dh, _put(stacked, new_p, i), new_s if state == "host" else _put(states, new_s, i)

    dh, layers, layer_states = _scan_slices(backward, dh, layers, opt_state.layers, saved,
                                            state, reverse=True, whole=True)
    grads = jax.tree.map(jnp.add, head_grads, embed_vjp(dh)[0])
    embedded, rest_states = update_tree(grads, rest_states, rest, state, rest_at, embed_reads)
    new_rest = jax.tree.map(lambda reads, old, new: new if reads else old,
                            jax.tree.unflatten(jax.tree.structure(rest), embed_reads),
                            new_rest, embedded)
    return ({**new_rest, stack.key: layers}, StreamedState(layer_states, rest_states),
            {"loss": loss})

  return LayerStreamed(init, step)
