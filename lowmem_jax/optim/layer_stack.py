"""The model the layer-streamed step takes and the state it keeps: `LayerStack` (stacked
layers between an embedding and a head), `StreamedState`, `LayerStreamed` (``init``,
``step``, ``abstract``), and the checks that name what does not fit them (`split`,
`layer_count`, `check_state`, `part_input_shapes`, `check_args`), and where each leaf lies in the
whole tree (`Where`, `wheres`). The step itself:
`lowmem_jax.optim.streamed.layer_streamed`."""

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowmem_jax._checks import is_int
from lowmem_jax.choices import Place, checked
from lowmem_jax.ops import dispatch
from lowmem_jax.optim.packed_rows import PackedRows
from lowmem_jax.optim.rounding import Position


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
      (`run_layer` composes them). A part may hand the next any pytree of arrays (the
      hidden state and more), as long as the layer takes and returns ``h``.
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
  """State of a `layer_streamed` step: ``tx``'s state of each parameter leaf, at its place,
  and the count of steps a non-finite loss or gradient stopped (`layer_streamed`).

  A leaf's state is ``tx.init`` of the leaf alone, or of each of its slices,
  stacked, where it is updated in slices (`slices`); a layer leaf's is that of
  each layer, stacked. In host memory a stack is held as
  `lowmem_jax.optim.packed_rows.PackedRows` (``layers``: one byte row a layer, all its
  leaves' states; ``unstacked()`` gives the tree), so it crosses the host link in one
  transfer a layer each way.
  """
  layers: Any  # params[key]'s structure, each leaf's state [layers, ...]; PackedRows on the host
  rest: dict  # the other params' structure, each leaf's place: its state
  total_notfinite: jax.Array  # int32[]: the steps not applied whole (as optax.apply_if_finite's)


@dataclasses.dataclass(frozen=True)
class LayerStreamed:
  """A layer-streamed train step and the state it takes (`layer_streamed`).

  Attributes:
    init: ``params -> StreamedState``, placed where the step keeps it; for params sharded
      over a mesh, on that mesh's devices (as under ``jax.set_mesh`` of it).
    step: ``(params, state, batch) -> (params, state, {"loss": loss, "finite": ok})``,
      one call per (micro-)batch; ``ok`` (bool[]) where the loss and every gradient were
      finite, the whole update applied. Jit it with ``donate_argnums=(0, 1)`` so the
      parameters and the state are updated in place; with the state or the saved inputs on
      the host, also ``compiler_options=lm.compile.targets.HOST_TRANSFER_OPTIONS`` (XLA's
      latency-hiding scheduler: it changed the rtx4090 target's program, not the h100's).
    abstract: ``params -> StreamedState`` of ``jax.ShapeDtypeStruct``, each in the memory
      where ``init`` puts it (one device's; params sharded over a mesh refused): the
      target to restore a saved state into (orbax's ``restore(path, target)``). A host
      state's targets are on a one-device mesh, where orbax types what it restores as host
      memory; the step's new state is not, so the step compiles once more after a restore.
      ``jax.eval_shape(init, params)`` keeps no memory kind: a host state restored through
      it lands in device memory, which ``step`` refuses by name (a donating step would abort
      the process); ``jax.device_put(state, jax.memory.Space.Host)`` moves it back.
  """
  init: Callable[[Any], StreamedState]
  step: Callable[[Any, StreamedState, Any], tuple[Any, StreamedState, dict]]
  abstract: Callable[[Any], StreamedState]


def split(params: Any, key: str) -> tuple[dict, Any]:
  """``(rest, params[key])``: the params dict without the stacked layers, and the layers."""
  if not isinstance(params, dict) or key not in params:
    raise ValueError(f"`params` must be a dict with the stacked layers at {key!r} "
                     f"(`LayerStack.key`), got {type(params).__name__} with "
                     f"{list(params) if isinstance(params, dict) else 'no keys'}.")
  return {k: v for k, v in params.items() if k != key}, params[key]


def _key(entry: Any) -> Any:
  """A key path entry as a dict key: a dict's key, a sequence's index, an attribute's name."""
  for field in ("key", "idx", "name"):
    if hasattr(entry, field):
      return getattr(entry, field)
  raise TypeError(f"a parameter tree's key path entry {entry!r} is not a key, index or name.")


@dataclasses.dataclass(frozen=True)
class Where:
  """Where a leaf, or a part of one, lies in the whole params tree: its
  `lowmem_jax.optim.rounding.Position` (a seeded rounding draws the whole tree's bits there)
  and its path. Not a pytree: trees of them have them as leaves."""
  at: Position
  path: tuple  # the leaf's keys in the whole params tree

  def index(self, i: Any) -> "Where":
    return Where(self.at.index(i), self.path)

  def part(self, i: Any, shape: tuple[int, ...]) -> "Where":
    return Where(self.at.part(i, shape), self.path)

  def nest(self, x: Any) -> Any:
    """``x`` as the only leaf of nested dicts along the path: what ``tx`` is given, so a
    mask or partition by path (`optax.masked`, `optax.partition`, ``adamw(mask=...)``)
    sees the leaf where it sees it in the whole tree."""
    for key in reversed(self.path):
      x = {key: x}
    return x

  def leaf(self, tree: Any) -> Any:
    """The leaf of a tree `nest` made."""
    for key in self.path:
      tree = tree[key]
    return tree


def wheres(params: Any, key: str) -> tuple[Any, Any]:
  """Each leaf's `Where` in the whole tree, split as `split` splits ``params``."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  where = [Where(Position(i), tuple(map(_key, path)))
           for i, (path, _) in enumerate(leaves)]
  return split(jax.tree.unflatten(treedef, where), key)


def check_state(expected: StreamedState, opt_state: StreamedState, place: str) -> None:
  """Raises a ValueError naming the first leaf where ``opt_state`` is not the state `init`
  makes for these params (``expected``, its shapes): another layer count, another ``tx``,
  or a leaf outside ``place`` (``"host"`` or ``"device"`` memory), where a donating step
  would abort the process."""
  def described(tree):  # packed rows as one [rows, row bytes] array, and their banks
    leaves = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, PackedRows))[0]
    return [(jax.tree_util.keystr(p),
             f"uint8{[x.count, x.layout.row_bytes]} in {len(x.banks)} bank(s)"
             if isinstance(x, PackedRows) else f"{jnp.result_type(x)}{list(jnp.shape(x))}")
            for p, x in leaves]

  want, got = described(expected), described(opt_state)
  for w, g in zip(want, got):
    if w != g:
      raise ValueError(
          f"`opt_state` is not the state `init` makes for these params: at {w[0]} it should "
          f"be {w[1]}, got {g[0]} {g[1]}. Make it with `init(params)` (the same layer count, "
          "leaves, transformation and `prefetch`).")
  if len(want) != len(got) or jax.tree.structure(expected) != jax.tree.structure(opt_state):
    raise ValueError(f"`opt_state` is not the state `init` makes for these params: its "
                     f"structure ({len(got)} leaves) differs from `init(params)`'s "
                     f"({len(want)} leaves).")
  space = jax.memory.Space.Host if place == "host" else jax.memory.Space.Device
  for path, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
    if jax.typeof(x).memory_space != space:
      why = ("A checkpoint restored into `jax.eval_shape(init, params)` (which keeps no "
             "memory kind) or from bytes (NumPy arrays) lands on the device: restore into "
             "`abstract(params)` (shapes for a compile: `abstract(params)` too), or move it "
             "with `jax.device_put(opt_state, jax.memory.Space.Host)`." if place == "host"
             else "Move it with `jax.device_put(opt_state, jax.memory.Space.Device)`, or "
             "make the step with `state='host'`.")
      raise ValueError(
          f"`opt_state` at {jax.tree_util.keystr(path)} is in "
          f"{jax.typeof(x).memory_space.name.lower()} memory; this step keeps its state in "
          f"{place} memory (`state='{place}'`). {why}")


def check_args(stack: Any, tx: Any, state: Any, saved_inputs: Any, slice_elements: Any,
               prefetch: Any, gather_params: Any, update_impl: Any,
               keep_part_inputs: Any) -> tuple[str, str]:
  """`lowmem_jax.optim.streamed.layer_streamed`'s arguments checked, each refused by name:
  ``(state, saved_inputs)``, the places named."""
  if not isinstance(stack, LayerStack):
    raise TypeError(f"`stack` must be a LayerStack, got {type(stack).__name__}.")
  if isinstance(tx, optax.MultiSteps):
    raise TypeError("`tx` is an optax.MultiSteps, which sums the whole tree's gradients over "
                    "steps: the streamed step holds one layer's gradient at a time. For "
                    "micro-batches give AdamA (`lowmem_jax.adama`, `lowmem_jax.adamaw`), whose "
                    "moments take each micro-batch's gradient in turn.")
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(f"`tx` must be an optax.GradientTransformation, got {type(tx).__name__}.")
  state = checked(Place, state, "`state`")
  saved_inputs = checked(Place, saved_inputs, "`saved_inputs`")
  for name, flag in (("gather_params", gather_params), ("keep_part_inputs", keep_part_inputs)):
    if not isinstance(flag, bool):
      raise TypeError(f"`{name}` must be a bool, got {type(flag).__name__}.")
  if not is_int(slice_elements) or slice_elements < 1:
    raise ValueError(f"`slice_elements` must be a positive int, got {slice_elements!r}.")
  if not is_int(prefetch) or prefetch not in (1, 2):
    raise ValueError(f"`prefetch` must be 1 or 2, got {prefetch!r}.")
  impl, _ = dispatch.choose(update_impl, "layer_streamed's update", dispatch.KERNEL_IMPLS,
                            "`update_impl`")
  fused = getattr(tx, "fused", None)
  if impl in ("pallas", "pallas_interpret") and fused is None:
    raise ValueError(f"`update_impl`={impl!r} runs lowmem_jax.optim.lowbit.adamw_8bit(..., "
                     "bfloat16_params=True) as one kernel a leaf, with no mask and constant "
                     f"hyperparameters; `tx` is another transformation ({type(tx).__name__}).")
  if impl in ("pallas", "pallas_interpret") and gather_params:
    raise ValueError(f"`update_impl`={impl!r} runs a kernel on one device's whole arrays; "
                     "parameters sharded with `gather_params` need update_impl='xla'.")
  return state, saved_inputs


def part_input_shapes(stack: LayerStack, one_layer: Any, h: Any, batch: Any) -> list:
  """Each part's input in a layer of params ``one_layer`` (arrays or
  ``jax.ShapeDtypeStruct``) that takes ``h``, as ``jax.ShapeDtypeStruct`` trees. Raises a
  TypeError naming `LayerStack.layer` where a part does not take ``(params, x, batch)``, or
  where the layer does not return the hidden state as it takes it (a scan's carry error
  otherwise)."""
  want = jax.ShapeDtypeStruct(jnp.shape(h), jnp.result_type(h))
  inputs = [want]
  for j, part in enumerate(stack.parts):
    name = "`LayerStack.layer`" + (f"[{j}]" if isinstance(stack.layer, tuple) else "")
    try:
      inputs.append(jax.eval_shape(lambda p, x: part(p, x, batch), one_layer, inputs[-1]))
    except TypeError as e:
      raise TypeError(f"{name} must take (layer_params, x, batch), x the layer's h or the "
                      f"part before's output: {e}") from e
  x = inputs.pop()
  if not hasattr(x, "shape") or (x.shape, x.dtype) != (want.shape, want.dtype):
    raise TypeError(f"`LayerStack.layer`{'[-1]' if isinstance(stack.layer, tuple) else ''} "
                    f"must return the hidden state as the layer takes it, "
                    f"{shape_text(want)}; got {jax.tree.map(shape_text, x)}.")
  return inputs


def shape_text(a) -> str:
  """``a``'s dtype and shape, as ``float32[2, 3]``."""
  return f"{jnp.dtype(a.dtype)}{list(a.shape)}"


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


def _hyperparams(x: Any) -> bool:
  """Whether ``x`` is an ``optax.inject_hyperparams`` state (its ``hyperparams`` a dict)."""
  return isinstance(getattr(x, "hyperparams", None), dict) and hasattr(x, "_replace")


def with_hyperparams(state: StreamedState, **values: Any) -> StreamedState:
  """``state`` with hyperparameters of ``optax.inject_hyperparams`` set in every leaf's state
  (as ``optax.tree_utils.tree_set`` sets them on a whole tree's), where it lives: a state in
  host memory is rewritten there, each leaf's bytes in place in its packed rows (those rows
  donated: use the state returned). Call it between steps, outside ``jax.jit``.

  Args:
    state: a `StreamedState` of a transformation made with ``optax.inject_hyperparams``.
    **values: each hyperparameter's new value, a scalar (``learning_rate=1e-4``).

  Returns:
    The state, every array of the same shape, dtype and place.

  Raises:
    KeyError: naming a hyperparameter no leaf's state has, and those it has.
  """
  seen = set()

  def updated(x):
    if not _hyperparams(x):
      return x
    seen.update(x.hyperparams)
    new = {k: (_placed(jnp.full(jnp.shape(v), values[k], jnp.result_type(v)), v) if k in values
               else v)
           for k, v in x.hyperparams.items()}
    return x._replace(hyperparams=new)

  def packed(t):
    if not isinstance(t, PackedRows):
      return updated(t)
    indices = jax.tree.unflatten(t.layout.treedef, list(range(len(t.layout.leaves))))
    for x in jax.tree.leaves(indices, is_leaf=_hyperparams):
      if _hyperparams(x):
        seen.update(x.hyperparams)
        for k in values.keys() & x.hyperparams.keys():
          t = t.with_leaf(x.hyperparams[k], values[k])
    return t

  new = jax.tree.map(packed, state._replace(total_notfinite=None),
                     is_leaf=lambda x: isinstance(x, PackedRows) or _hyperparams(x))
  new = new._replace(total_notfinite=state.total_notfinite)
  if values.keys() - seen:
    raise KeyError(f"No leaf's state has the hyperparameter(s) {sorted(values.keys() - seen)}; "
                   f"they have {sorted(seen)} (make `tx` with optax.inject_hyperparams).")
  return new


def _placed(new: jax.Array, old: jax.Array) -> jax.Array:
  """``new`` where ``old`` lives (its sharding, memory kind included)."""
  if isinstance(old, jax.core.Tracer):
    raise TypeError("`with_hyperparams` sets a state between steps, outside `jax.jit`.")
  return jax.device_put(new, old.sharding)
