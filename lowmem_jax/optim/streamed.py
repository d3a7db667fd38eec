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
layer's (or takes those the forward kept, ``keep_part_inputs``), then takes each part's
backward from the last, updating the parameters it reads right after, so one part's
parameter copy and gradient are held at a time, not the layer's (one more forward of the
earlier parts, where their inputs are not kept). The
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
refused, with the equation that mixes them (`lowmem_jax.optim.per_leaf.check_per_leaf`);
the step itself skips a non-finite loss or gradient (`layer_streamed`). A transformation made
with ``optax.inject_hyperparams`` takes new hyperparameters between steps through
`lowmem_jax.optim.layer_stack.with_hyperparams`, in every leaf's state.

The state is `StreamedState`: the transformation initialised on each
parameter leaf alone (a layer leaf's on each layer, ``jax.vmap`` over the
stacked layers; a leaf updated in slices, `slices`, on each slice), so each
has its own step counter and PRNG seed, all alike (``optax.add_noise`` draws every layer's
noise alike: not the whole tree's). The transformation sees each
leaf as the only leaf of nested dicts along its path in the whole tree, so a mask
or partition by path (``optax.adamw(mask=...)``, `optax.masked`, `optax.partition`)
picks what it picks on the whole tree; a mask by shape sees one layer's (or slice's).
Each update is told where its part lies in the whole tree (the extra argument ``positions``, a
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
host link carries the state twice and the saved inputs twice. A big leaf outside the
layers (the head, the embedding), updated in slices, has its slices' host rows in two
arrays whatever ``prefetch`` says: a slice's update is too short to hide one transfer, let
alone two in turn.

References:
  Lv et al., 2023, "Full Parameter Fine-tuning for Large Language Models with
  Limited Resources" (LOMO, the update fused into the backward,
  https://arxiv.org/abs/2306.09782); torchtune's ``optimizer_in_bwd``; Ren et
  al., 2021, "ZeRO-Offload" (state in host memory, https://arxiv.org/abs/2101.06840).
"""

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowmem_jax import _sharding
from lowmem_jax.ops.token_chunks import slices
from lowmem_jax.ops import dispatch
from lowmem_jax.optim import fused_update, hoisted, lowbit, slicing, streamed_state
from lowmem_jax.optim.layer_stack import (LayerStack, LayerStreamed, StreamedState, check_args,
                                          check_state, layer_count, part_input_shapes, wheres)
from lowmem_jax.optim.per_leaf import reads

SLICE_ELEMENTS = 2 ** 24
"""`layer_streamed`'s default ``slice_elements``: a leaf of more elements is updated in slices."""


def layer_streamed(stack: LayerStack, tx: optax.GradientTransformation, *,
                   state: str = "device", saved_inputs: str = "device",
                   slice_elements: int = SLICE_ELEMENTS, prefetch: int = 1,
                   gather_params: bool = False, update_impl: str | None = None,
                   keep_part_inputs: bool = False) -> LayerStreamed:
  """A train step over ``stack`` that applies ``tx`` inside the backward, one layer at a time.

  The other parameters are updated once their gradient is complete: after the head's backward
  those the embedding does not read, after the first layer's the others. Each parameter leaf has
  its own state (``tx`` works leaf by leaf: the same updates), and a leaf of more than
  ``slice_elements`` elements (a layer's, or another) is updated in equal slices along its first
  axis, one after the other, each slice with its own state, so the optimizer's float32
  temporaries stay within a slice: exact for an elementwise transformation and for 8-bit moments
  (whose blocks lie along the last axis; slices below their ``min_size`` refused). A
  transformation whose update of a slice reads another slice (a statistic of the whole leaf:
  ``optax.clip_by_block_rms``, lamb, muon, adafactor) is refused for a leaf updated in slices
  (`lowmem_jax.optim.per_leaf.check_per_slice`); on a layer leaf it is the layer's statistic, as
  optax takes it on each layer's leaf.

  A step whose loss is not finite (a NaN input, an infinite label) changes nothing: every
  parameter and state keeps its value, the metric ``finite`` is False and
  ``StreamedState.total_notfinite`` counts the step, as ``optax.apply_if_finite`` does on the
  whole tree (the backward still runs; its updates are dropped). A gradient that is not finite
  under a finite loss (a frozen leaf's too, as ``optax.apply_if_finite`` checks the gradients it
  is given) stops the update where the backward meets it: the leaf whose gradient it is (the
  slice, where a leaf is updated in slices) keeps its value and state, and so do every layer
  part after it in the backward and the embedding; what was updated before (the head's
  parameters, the later layers, the part's other leaves) keeps its update; the step is counted
  as well. Each leaf's state then counts the steps it took, so step counts (an Adam's bias
  correction) can differ between leaves. Each leaf, or slice, waits only for its own gradient's
  check: Llama-3.1-8B's streamed steps estimate 0.6% to 3.9% slower for it (docs/benchmarks.md).

  Args:
    stack: the model (`LayerStack`).
    tx: an optax transformation that works leaf by leaf (module docstring); its
      ``update`` is called with the params and, where it takes extra arguments,
      ``positions`` (each part's `lowmem_jax.optim.lowbit.Position` in the whole tree).
    state: where the optimizer state lives between steps, "device" or "host"
      (pinned host memory, brought over a layer, or a slice of another leaf, at a time).
    saved_inputs: where the forward keeps each layer's input, "device" or "host".
    slice_elements: the most elements a leaf is updated in at once, a positive int.
    prefetch: with ``state="host"``, how many layers ahead the layers' state is brought
      over, its rows dealt over as many arrays (`lowmem_jax.optim.packed_rows.PackedRows`),
      each written back a layer late: 1, the read under the layer's backward before its
      first update and the write under the rest (one array: the read first; the least
      device memory); or 2, both under the whole layer's compute, for another layer's
      state on the device (Llama-3.1-8B's figures: docs/benchmarks.md). The same step bit
      for bit; a state made with one is refused by the other's step, and one saved with
      `flax.serialization` restores into a state made with either (its rows dealt again;
      orbax restores into the `abstract` of the ``prefetch`` it was saved with).
    gather_params: for parameters sharded FSDP-style over a mesh of ``Auto`` axes set for
      tracing (`jax.set_mesh`): each layer's parameters, and the embedding's and the head's,
      made whole on every device where they are used, as ZeRO-3 gathers them (Rajbhandari et
      al., 2020, https://arxiv.org/abs/1910.02054); else XLA may move activations instead.
    update_impl: "pallas": `lowbit.adamw_8bit`'s update with ``bfloat16_params`` as one
      kernel a leaf, in place (`fused_update`); else as `lowmem_jax.ops.dispatch` says.
    keep_part_inputs: the forward keeps each part's input, not only the layer's (at
      ``saved_inputs``): the backward runs each part's forward once, not the earlier parts'
      twice, for one more ``[batch, length, dim]`` a layer and later part (a one-part layer:
      the same step; a Llama layer cut at its MLP's hidden layer: two ``[b, l, ffn_dim]``).

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
  s = _streamer(stack, tx, state, saved_inputs, slice_elements, prefetch, gather_params,
                update_impl, keep_part_inputs)
  return LayerStreamed(s.init, s.step, s.abstract)


def _streamer(stack, tx, state, saved_inputs, slice_elements, prefetch, gather_params,
              update_impl, keep_part_inputs):
  """`layer_streamed`'s arguments checked, each refused by name (`check_args`), as a
  `_Streamer`."""
  state, saved_inputs = check_args(stack, tx, state, saved_inputs, slice_elements, prefetch,
                                   gather_params, update_impl, keep_part_inputs)
  return _Streamer(stack, optax.with_extra_args_support(tx), state, saved_inputs,
                   slice_elements, prefetch,
                   _sharding.gathered if gather_params else lambda tree: tree,
                   getattr(tx, "fused", None), update_impl, keep_part_inputs)


def _last_first(out: tuple) -> tuple:
  """``(a, b, c) -> (b, c, a)``: `slicing.scan_slices`' carry moved last."""
  return (*out[1:], out[0])


def _kept_in_write(new: jax.Array, p: jax.Array) -> bool:
  """Whether a device stack's new state leaf is kept where the update is finite in its write,
  after the barrier (`_Streamer.update_leaf`): a float array not of ``p``'s shape (8-bit
  scales), whose select XLA makes a kernel; scalars and keys `hoisted` picks after the loop."""
  return (jnp.issubdtype(new.dtype, jnp.floating) and jnp.ndim(new) > 0
          and jnp.shape(new) != jnp.shape(p))


class _Backward(NamedTuple):
  """What each layer's backward reads besides its slices: the batch, the leaves of one layer
  each part reads (``part_reads[j][k]``), the part after whose backward leaf ``k`` is
  updated (``owner[k]``), the layers' leaves' positions and `_Streamer.layer_tables`."""
  batch: Any
  part_reads: list
  owner: list
  layers_at: Any
  tables: list


@dataclasses.dataclass(frozen=True, eq=False)
class _Streamer(streamed_state.StateMaking):
  """`layer_streamed`'s ``init`` and ``step``, in stages: the forward (`forward`), the
  head's parameters' update (`update_head`), which part of a layer reads and updates which
  leaves (`backward_plan`), the layers' backward a layer at a time (`layer_backward`: its
  parts' inputs recomputed or brought over by `part_inputs`, each part's backward
  `part_backward`), the
  embedding's update (`update_embedding`); each leaf updated by `update_leaf`, in slices
  where it is big; the state made and checked by `streamed_state.StateMaking`."""
  stack: LayerStack
  tx: optax.GradientTransformationExtraArgs
  state: str  # where the optimizer state lives: "device" or "host"
  saved_inputs: str  # where the forward keeps each layer's input
  slice_elements: int  # the most elements a leaf is updated in at once
  prefetch: int  # how many layers ahead a host state is brought over: the layers' banks
  gather: Callable  # a tree made whole on every device (FSDP), or left as it is
  fused: lowbit.FusedAdamW8bit | None  # ``tx``'s, where a leaf's update can be one kernel
  update_impl: str | None  # `layer_streamed`'s
  keep_part_inputs: bool  # the forward keeps each part's input, not only the layer's

  def update(self, g, s, p, where, ok, defer=False):
    """``(p, s, ok)``: ``tx`` on one leaf (or slice), given as the only leaf of its path
    (`layer_stack.Where.nest`), where ``ok`` (bool[]) and the gradient are finite; else the leaf and
    its state as they were, and ``ok`` False. ``defer``: the state's `_kept_in_write` leaves
    come back as made, for the caller to keep where ``ok``."""
    ok = lowbit.all_finite(g, ok, by_block=self.state == "device")
    updates, new_s = self.tx.update(where.nest(g), s, where.nest(p),
                                    positions=where.nest(where.at))
    kept = lambda new, old: jnp.where(ok, new, old)
    kept_s = lambda new, old: new if defer and _kept_in_write(new, p) else kept(new, old)
    return (kept(optax.apply_updates(p, where.leaf(updates)), p),
            jax.tree.map(kept_s, new_s, s), ok)

  def kernel(self, p, shape):
    """The fused update kernel's options where leaf ``p`` (or a stack of them), whose part
    of ``shape`` is updated at a time (`slices`), runs it (``update_impl``); else None."""
    n = slices(shape, self.slice_elements)
    part = (shape[0] // n, *shape[1:]) if shape else shape
    options = None if self.fused is None else dispatch.kernel_options(self.update_impl,
                                                                      "adamw_8bit")
    if options is None or not fused_update.takes(self.fused, p, part):
      return None
    if _sharding.in_auto_mesh():
      raise ValueError("`update_impl` picks a kernel of one device's arrays, under a mesh "
                       "(jax.set_mesh) gathered onto each device; give update_impl='xla'.")
    return options

  def layer_tables(self, layers, states, layers_at):
    """Each layer leaf's table, made before the layers' backward where the states are
    stacked on the device and updated in place (not under a mesh: `layer_backward`):
    `fused_update.layer_table` where the kernel updates the leaf (`kernel`),
    `hoisted.stack_table` of `update` where XLA updates it whole; else None."""
    treedef = jax.tree.structure(layers)
    if self.state != "device" or _sharding.in_auto_mesh():
      return [None] * treedef.num_leaves
    tables = []
    for p, s, at in zip(jax.tree.leaves(layers), treedef.flatten_up_to(states),
                        treedef.flatten_up_to(layers_at)):
      shape = jnp.shape(p)[1:]
      if self.kernel(p, shape) is not None:
        tables.append(fused_update.layer_table(self.fused, p, s, at.at, self.slice_elements))
      elif slices(shape, self.slice_elements) == 1:
        update = lambda i, g, s, p, ok, at=at: self.update(g, s, p, at.index(i), ok, True)
        # The state's leaves kept or stepped on the gradient's finiteness alone (the count,
        # the rounding key) picked after the loop, for every layer at once (`picked_states`).
        tables.append(hoisted.stack_table(update, p, s, later=(False, True, False)))
      else:
        tables.append(None)
    return tables

  def update_leaf(self, g, s, p, place, at, ok, outer=(), state_outer=(), table=None):
    """``(p, s, ok, flags)``: one leaf's update, its state in ``place`` before and after;
    ``at``: its `lowbit.Position` in the whole params tree; ``ok``: `update`'s, checked a
    slice at a time where the leaf is updated in slices (a slice whose gradient is not
    finite keeps its values; the returned ``ok`` is False). ``p`` may be a stack of such
    leaves, this one at ``p[*outer]`` (leading indices), and ``s`` on the device a stack of
    states, this one's at ``s[*state_outer]``: they come back updated in place; ``table``: the
    stack's (`layer_tables`), or None. ``flags``: a `hoisted.Table`'s flags (bool ``[F]``),
    the state's leaves it leaves out not written (`picked_states` writes them); else None."""
    shape = jnp.shape(p)[len(outer):]
    n = slices(shape, self.slice_elements)
    part = (shape[0] // n, *shape[1:]) if shape else shape
    options = self.kernel(p, shape)
    if options is not None:
      return (*fused_update.update_leaf(self.fused, options, g, s, p, place, at.at, ok,
                                        self.slice_elements, outer, state_outer, table), None)
    if n == 1:
      # Read once ``g`` is made. In the device's stacks the stacks wait for it, not the index,
      # which XLA must see written at to read a slice in place (at a barrier's copy, it
      # copies the slice out); beside a host row, the index (the stack held more memory).
      if state_outer:
        p, s, p_at = *slicing.late((p, s), g), outer
      else:
        p_at = slicing.late(outer, g)
      args = (g, slicing.to("device", slicing.at(s, *state_outer)), slicing.at(p, *p_at))
      (new_p, new_s, ok), flags = (
          (self.update(*args, at, ok, bool(state_outer)), None) if table is None else
          hoisted.apply(table, state_outer[0], *args, ok))
      if state_outer:  # made in one multi-output kernel, then copied into the stacks: XLA
        # fuses no two in-place writes, and each would make the shared work again
        new_p, new_s = jax.lax.optimization_barrier((new_p, new_s))
        kept = lambda old, new: slicing.put(old, jnp.where(
            ok, new, slicing.at(old, *state_outer)) if _kept_in_write(new, new_p) else new,
            *state_outer)
        new_s = hoisted.made(new_s, s, kept)
      new_p = slicing.put(p, new_p, *outer) if outer else new_p
      return new_p, new_s if state_outer else slicing.to(place, new_s), ok, flags

    def fn(all_ok, i, p, s, g):
      p, s, slice_ok = self.update(g, s, p, at.part(i, part), ok)
      return jnp.logical_and(all_ok, slice_ok), p, s

    if outer:
      return (*_last_first(slicing.scan_slices(fn, ok, p, s, slicing.sliced(g, n), place,
                                               outer=outer, state_outer=state_outer,
                                               rows=part[0])), None)
    ok, p, s = slicing.scan_slices(fn, ok, slicing.sliced(p, n), s, slicing.sliced(g, n), place)
    return p.reshape(shape), s, ok, None

  def update_tree(self, grads, states, params, place, where, ok, which=None, outer=(),
                  state_outer=(), row=None, tables=None, flags=None):
    """``(params, states, ok)``: each leaf's update (those ``which`` selects), the new params
    and states as trees; each leaf (or slice) updated where ``ok`` (bool[]) and its own
    gradient are finite, else kept, the returned ``ok`` False if any was kept (`update`);
    ``where``: each leaf's `lowbit.Position`; ``outer``, ``state_outer``: `update_leaf`'s.
    With ``row`` (a `packed_rows.Row` of the states), each leaf's state is unpacked from it
    once the selected gradients, then the leaf before it, are done, not from ``states``: the
    copies out of a host row are made one leaf at a time, not all at the row's arrival.
    ``tables``: each leaf's `update_leaf` ``table`` (a list), or None; ``flags``: a list
    over the leaves, each updated leaf's `update_leaf` flags set in it, or None."""
    treedef = jax.tree.structure(params)
    leaves = zip(treedef.flatten_up_to(grads), treedef.flatten_up_to(states),
                 jax.tree.leaves(params), treedef.flatten_up_to(where))
    leaves = list(leaves)
    out, done = [], [g for i, (g, *_) in enumerate(leaves) if which is None or which[i]]
    # Each leaf's state's leaf indices in the row.
    parts = None if row is None else treedef.flatten_up_to(
        jax.tree.unflatten(row.layout.treedef, range(len(row.layout.leaves))))
    for i, (g, s, p, at) in enumerate(leaves):
      if which is not None and not which[i]:
        out.append((p, s, ok, None))
        continue
      if row is not None:
        s = treedef.flatten_up_to(row.read_after(done, set(jax.tree.leaves(parts[i]))))[i]
      out.append(self.update_leaf(g, s, p, place, at, ok, outer, state_outer,
                                  None if tables is None else tables[i]))
      done = out[-1][:2]
      if flags is not None:
        flags[i] = out[-1][3]
    return (jax.tree.unflatten(treedef, [p for p, *_ in out]),
            jax.tree.unflatten(treedef, [s for _, s, *_ in out]),
            functools.reduce(jnp.logical_and, [o for *_, o, _ in out], ok))

  def step(self, params, opt_state, batch):
    if not isinstance(opt_state, StreamedState):
      raise TypeError(f"`opt_state` must be the StreamedState `init` makes, got "
                      f"{type(opt_state).__name__}.")
    rest, layers, one_layer = self.checked(params)
    check_state(jax.eval_shape(self.init, params), opt_state, self.state)
    embed_reads = jax.tree.leaves(reads(lambda r: self.stack.embed(r, batch), rest))
    rest_at, layers_at = wheres(params, self.stack.key)
    embed_vjp, saved, loss, head_grads, dh, inputs = self.forward(rest, layers, one_layer,
                                                                  batch)
    new_rest, rest_states, dh, head_ok = self.update_head(
        head_grads, opt_state.rest, rest, rest_at, embed_reads, dh, jnp.isfinite(loss))
    plan = self.backward_plan(one_layer, inputs, batch, layers_at,
                              self.layer_tables(layers, opt_state.layers, layers_at))
    flag_rows = jnp.zeros((layer_count(layers), sum(
        hoisted.flag_count(t) for t in plan.tables if isinstance(t, hoisted.Table))), bool)
    (dh, ok, flag_rows), layers, layer_states = slicing.scan_slices(
        functools.partial(self.layer_backward, plan), (dh, head_ok, flag_rows), layers,
        opt_state.layers, saved, self.state, reverse=True, whole=True, fence=True)
    layer_states = self.picked_states(plan.tables, flag_rows, layers, layer_states)
    grads = jax.tree.map(jnp.add, head_grads, embed_vjp(dh)[0])
    new_rest, rest_states, ok = self.update_embedding(grads, rest_states, rest, new_rest,
                                                      rest_at, embed_reads, ok)
    total_notfinite = slicing.to(self.state, slicing.to("device", opt_state.total_notfinite)
                                 + jnp.logical_not(ok).astype(jnp.int32))
    return ({**new_rest, self.stack.key: layers},
            StreamedState(layer_states, rest_states, total_notfinite),
            {"loss": loss, "finite": ok})

  def picked_states(self, tables, flag_rows, layers, states):
    """The layers' ``states`` with the leaves each `hoisted.Table` left out of the loop
    picked for every layer (`hoisted.picked`) from ``flag_rows`` (bool ``[L, F]``: each
    layer's tables' flags, in the leaves' order); with none, ``states`` as they are."""
    if not any(isinstance(t, hoisted.Table) for t in tables):
      return states
    treedef = jax.tree.structure(layers)
    out, start = [], 0
    for s, table in zip(treedef.flatten_up_to(states), tables):
      if isinstance(table, hoisted.Table):
        n = hoisted.flag_count(table)
        _, new_s, _ = hoisted.picked(table, flag_rows[:, start:start + n])
        start += n
        s = hoisted.made(new_s, s)
      out.append(s)
    return jax.tree.unflatten(treedef, out)

  def forward(self, rest, layers, one_layer, batch):
    """``(embed_vjp, saved, loss, head_grads, dh, inputs)``: the forward, each layer's input
    kept in `saved_inputs` (with `keep_part_inputs`, a tuple: each part's), the head's
    backward, and each part's input shapes (`part_input_shapes`: the parts checked on
    ``one_layer``, a layer's params)."""
    stack, gather = self.stack, self.gather
    h, embed_vjp = jax.vjp(lambda r: stack.embed(gather(r), batch), rest)
    inputs = part_input_shapes(stack, one_layer, h, batch)

    def layer(h, p):
      p, kept = gather(p), []
      for part in stack.parts if self.keep_part_inputs else (stack.run_layer,):
        if self.keep_part_inputs and self.saved_inputs == "device":
          # Made once, then kept and read: a matmul's output XLA would write into the saved
          # stack and make again for the next part (the h100's 8B: 39 ms a step).
          h = jax.lax.optimization_barrier(h)
        kept.append(slicing.to(self.saved_inputs, h))
        h = part(p, h, batch)
      return h, tuple(kept) if self.keep_part_inputs else kept[0]

    h, saved = jax.lax.scan(layer, h, layers)
    loss, head_vjp = jax.vjp(lambda r, h: stack.head(gather(r), h, batch), rest, h)
    if jnp.shape(loss) != () or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
      raise TypeError("`LayerStack.head` must return a float scalar loss (as jax.grad needs), "
                      f"got {jax.typeof(loss).str_short()}; average a per-example loss first.")
    head_grads, dh = head_vjp(jnp.ones_like(loss))
    return embed_vjp, saved, loss, head_grads, dh, inputs

  def update_head(self, head_grads, states, rest, rest_at, embed_reads, dh, ok):
    """``(new_rest, states, dh, ok)``: the parameters the embedding does not read, updated
    where ``ok`` (`update_tree`)."""
    new_rest, states, ok = self.update_tree(head_grads, states, rest, self.state, rest_at, ok,
                                            [not r for r in embed_reads])
    # The head's own update, its new state written where it is kept, before the layers'
    # backward: dh waits on the new states. On the device, the head's gradient (the output
    # kernel's, vocab x dim) is then gone by the layers' backward; on the host, the last
    # slice's row (Llama-3.1-8B: 32 MiB) is not held through it until the step's end.
    done = [s for s, r in zip(jax.tree.structure(rest).flatten_up_to(states), embed_reads)
            if not r]
    dh, _ = jax.lax.optimization_barrier((dh, done))
    return new_rest, states, dh, ok

  def update_embedding(self, grads, states, rest, new_rest, rest_at, embed_reads, ok):
    """``(new_rest, states, ok)``: the parameters the embedding reads updated (where ``ok``,
    `update_tree`), once the first layer's backward has made their whole gradient (a tied
    head's plus the embedding's)."""
    embedded, states, ok = self.update_tree(grads, states, rest, self.state, rest_at, ok,
                                            embed_reads)
    new_rest = jax.tree.map(lambda reads, old, new: new if reads else old,
                            jax.tree.unflatten(jax.tree.structure(rest), embed_reads),
                            new_rest, embedded)
    return new_rest, states, ok

  def backward_plan(self, one_layer, inputs, batch, layers_at, tables) -> _Backward:
    """Which leaves each part of a layer reads (its input shapes ``inputs``), and after
    which part's backward each is updated: the first part that reads it (a leaf no part
    reads: part 0's, with a zero gradient)."""
    part_reads = [jax.tree.leaves(reads(lambda p, x: part(p, x, batch), one_layer, x))
                  for part, x in zip(self.stack.parts, inputs)]
    owner = [next((j for j, r in enumerate(part_reads) if r[k]), 0)
             for k in range(len(part_reads[0]))]
    return _Backward(batch, part_reads, owner, layers_at, tables)

  def part_inputs(self, p, h, batch):
    """Each part's input in layer ``p``: those the forward kept (``h``, a tuple, with
    `keep_part_inputs`), or from the layer's input ``h``, the forward recomputed."""
    if self.keep_part_inputs:
      return [slicing.to("device", x) for x in h]
    inputs = [slicing.to("device", h)]
    for part in self.stack.parts[:-1]:
      inputs.append(part(self.gather(p), inputs[-1], batch))
    return inputs

  def layer_backward(self, plan, carry, i, stacked, states, h, fence):
    """Layer i's backward, each part's parameters updated in ``stacked`` (all layers')
    once its backward is done, where the gradients so far are finite (``carry``: the
    output's gradient, that flag, and the ``flag_rows`` that get layer i's tables' flags,
    `picked_states`); ``states``: the device's whole stack, updated, or layer i's from the
    host, packed (a `packed_rows.Row`), returned updated as a tree. The first update waits
    at ``fence`` (`slicing.scan_slices`): host rows cross the link under the backward
    before it and the updates after."""
    dh, ok, flag_rows = carry
    p = slicing.at(stacked, i)
    treedef, old = jax.tree.structure(p), jax.tree.leaves(p)
    at = jax.tree.map(lambda at: at.index(i), plan.layers_at)
    # The updates write into the stacks in place; under a mesh, where a slice of a leaf
    # along a sharded axis would move the whole stack, into layer i's copy, put back after.
    in_place = not _sharding.in_auto_mesh()
    new_p = stacked if in_place else p
    # On the host, each leaf's state unpacked from the row as it is updated (`update_tree`).
    row = states if self.state == "host" else None
    new_s = (jax.tree.unflatten(treedef, [None] * treedef.num_leaves) if row is not None
             else states if in_place else None)  # a copy once a gradient is made
    outer = (i,) if in_place else ()
    state_outer = (i,) if in_place and self.state == "device" else ()
    inputs = self.part_inputs(p, h, plan.batch)
    grads, flags = [None] * len(old), [None] * len(old)
    for j in reversed(range(len(self.stack.parts))):
      dh = self.part_backward(plan, j, treedef, old, inputs[j], dh, grads)
      mine = [o == j for o in plan.owner]
      if any(mine):
        full = [g if g is not None else jnp.zeros_like(x) for g, x in zip(grads, old)]
        if fence:
          full, fence = fence(full), None
        if new_s is None:
          new_s = slicing.at(states, *slicing.late((i,), [g for g, m in zip(full, mine) if m]))
        new_p, new_s, ok = self.update_tree(jax.tree.unflatten(treedef, full), new_s, new_p,
                                            "device", at, ok, mine, outer, state_outer, row,
                                            plan.tables if state_outer else None, flags)
      if j:  # this part's update, then the part before: its forward recomputed, not kept
        dh, inputs[j - 1], new_p, new_s = jax.lax.optimization_barrier(
            (dh, inputs[j - 1], new_p, new_s))
        # Its parameters read again, where they lie: the copies read at the layer's start are
        # not held through this part's backward. None of them has changed: a leaf is updated
        # after the backward of the earliest part that reads it.
        old = jax.tree.leaves(slicing.at(new_p, *outer))
    flags = [f for f in flags if f is not None]
    if flags:
      flag_rows = slicing.put(flag_rows, jnp.concatenate(flags), i)
    carry = dh, ok, flag_rows
    if in_place:
      return carry, new_p, new_s
    return (carry, slicing.put(stacked, new_p, i),
            new_s if self.state == "host" else slicing.put(states, new_s, i))

  def part_backward(self, plan, j, treedef, old, h, dh, grads):
    """Part ``j``'s backward from its input ``h``: adds its gradient of each leaf it reads
    into ``grads`` (a list over the layer's leaves ``old``) and returns its input's."""
    read = [k for k, r in enumerate(plan.part_reads[j]) if r]

    def part_of(sub, h):
      leaves = list(old)
      for k, x in zip(read, sub):
        leaves[k] = x
      return self.stack.parts[j](self.gather(jax.tree.unflatten(treedef, leaves)), h,
                                 plan.batch)

    _, vjp = jax.vjp(part_of, [old[k] for k in read], h)
    sub, dh = vjp(dh)
    for k, g in zip(read, sub):
      grads[k] = g if grads[k] is None else grads[k] + g
    return dh
