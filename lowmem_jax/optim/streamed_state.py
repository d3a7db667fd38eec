"""The layer-streamed step's state: each parameter leaf's ``tx.init`` alone, at its path in the
whole tree, made where the step keeps it (`StateMaking.init`), its shapes for a restore
(`StateMaking.abstract`), and the checks that refuse a transformation the step cannot run
leaf by leaf or slice by slice (`StateMaking.checked`). The step itself:
`lowmem_jax.optim.streamed.layer_streamed`."""

import math

import jax
import jax.numpy as jnp

from lowmem_jax import _sharding
from lowmem_jax.ops.token_chunks import slices
from lowmem_jax.optim import offload, slicing
from lowmem_jax.optim.layer_stack import StreamedState, layer_count, shape_text, split, wheres
from lowmem_jax.optim.packed_rows import PackedRows
from lowmem_jax.optim.per_leaf import check_per_leaf, check_per_slice


class StateMaking:
  """`lowmem_jax.optim.streamed._Streamer`'s state, made and checked; it reads the streamer's
  ``stack``, ``tx``, ``state``, ``slice_elements`` and ``prefetch``."""

  def checked(self, params):
    """``(rest, layers, one_layer)``, the transformation checked on one layer, and on each
    leaf updated in slices (`check_slices`)."""
    for path, x in jax.tree_util.tree_leaves_with_path(params):
      if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        raise TypeError(f"The parameter at {jax.tree_util.keystr(path)} is {shape_text(x)}: "
                        "the step differentiates every leaf of `params`, so each must be "
                        "floating (as for jax.grad); keep integer and bool values out of "
                        "`params` (in the batch, or closed over by the model).")
    rest, layers = split(params, self.stack.key)
    layer_count(layers)
    one_layer = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], x.dtype), layers)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), rest)
    check_per_leaf(self.tx, {**shapes, self.stack.key: one_layer})  # at the whole tree's paths
    rest_where, layers_where = wheres(params, self.stack.key)
    jax.tree.map(self.check_slices, shapes, rest_where)
    jax.tree.map(lambda x, where: self.check_slices(x, where.index(0)), one_layer, layers_where)
    return rest, layers, one_layer

  def check_slices(self, x, where):
    """Raises a ValueError where leaf ``x`` is updated in slices and ``tx``'s update of a
    slice reads another slice (`per_leaf.check_per_slice`): a statistic of the whole leaf
    would be taken per slice."""
    n = slices(jnp.shape(x), self.slice_elements)
    if n == 1:
      return
    whole = jax.eval_shape(self.tx.init, where.nest(x))
    part = jax.ShapeDtypeStruct((jnp.shape(x)[0] // n, *jnp.shape(x)[1:]), x.dtype)
    kinds = lambda tree: (jax.tree.structure(tree), [a.dtype for a in jax.tree.leaves(tree)])
    if kinds(jax.eval_shape(self.tx.init, where.nest(part))) != kinds(whole):
      raise ValueError(
          f"`tx.init` of a slice of the parameter at {list(where.path)} ({shape_text(x)}, "
          f"updated in {n} slices of at most `slice_elements`={self.slice_elements} elements) "
          "makes another kind of state than the whole leaf's (as 8-bit moments make float32 "
          "ones for a slice below their `min_size`): give `slice_elements` >= "
          f"{math.prod(jnp.shape(x))} to update it whole, or a `min_size` <= "
          f"{math.prod(part.shape)}.")
    update = lambda g, s, p: self.tx.update(where.nest(g), s, where.nest(p),
                                            positions=where.nest(where.at))
    mixed = check_per_slice(update, x, whole, n)
    if mixed is not None:
      raise ValueError(
          f"The optimizer's update of the parameter at {list(where.path)} ({shape_text(x)}, "
          f"updated in {n} slices of at most `slice_elements`={self.slice_elements} elements) "
          f"reads across its slices (first at {mixed}): a statistic of the whole leaf (muon's "
          "orthogonalization, lamb's trust ratio, optax.clip_by_block_rms) would be taken per "
          f"slice. Give `slice_elements` >= {math.prod(jnp.shape(x))} to update it whole, or "
          "a transformation that works element by element.")

  def leaf_init(self, x, where):
    n = slices(jnp.shape(x), self.slice_elements)

    def init(x):
      try:
        return self.tx.init(where.nest(x))
      except (ValueError, TypeError) as e:
        raise type(e)(f"`tx.init` of the parameter at {list(where.path)} alone failed: "
                      "layer_streamed gives `tx` one leaf at a time, at its path, so a mask "
                      "or label tree (not a function of the params) cannot match it; give a "
                      f"function. ({e})") from e

    return init(x) if n == 1 else jax.vmap(init)(slicing.sliced(x, n))

  def init(self, params):
    """`LayerStreamed.init`. Params sharded over a mesh (`_sharding.mesh_of`): the state is
    made on that mesh, as `jax.set_mesh` of it would, not on one device, which the step
    would refuse beside the params; each leaf of a parameter's state then split as the
    parameter is (`_sharding.split_as`; a host state's packed rows whole on each device)."""
    mesh = _sharding.mesh_of(params)
    if mesh is not None:
      with jax.set_mesh(mesh):
        state = self.init(params)
      rest, layers = split(params, self.stack.key)
      return state._replace(layers=_split_as(state.layers, layers, lead=1),
                            rest=_split_as(state.rest, rest, lead=0))
    rest, layers, _ = self.checked(params)
    rest_where, layers_where = wheres(params, self.stack.key)
    init_layer = lambda p: jax.tree.map(self.leaf_init, p, layers_where)
    return StreamedState(slicing.layer_states(init_layer, layers, self.state, self.prefetch),
                         jax.tree.map(self.rest_init, rest, rest_where),
                         slicing.to(self.state, jnp.zeros((), jnp.int32)))

  def abstract(self, params):
    """`LayerStreamed.abstract`."""
    if any(len(getattr(x, "sharding", None) and x.sharding.device_set or ()) > 1
           for x in jax.tree.leaves(params)):
      raise ValueError("`abstract` gives one device's state; for params sharded over a mesh, "
                       "restore into `init(params)` (the state made where it is kept).")
    shapes = jax.eval_shape(self.init, params)
    if self.state == "device":
      return shapes
    # In a one-device mesh: orbax builds the arrays it restores with
    # `jax.make_array_from_single_device_arrays`, which types an array as host memory only
    # under a `NamedSharding` (under a `SingleDeviceSharding` in pinned host memory it is
    # typed as device memory, and the step refuses it). The step gives its new state a
    # `SingleDeviceSharding`, so the first step after a restore compiles once more.
    return offload.in_host_memory(shapes)

  def rest_init(self, x, where):
    """The state of a leaf outside the layers, where it is kept: a stack of its slices'
    states where it is updated in slices (on the host in two banks, so each slice's read and
    write run at once: its update is short)."""
    n = slices(jnp.shape(x), self.slice_elements)
    return (slicing.to(self.state, self.leaf_init(x, where)) if n == 1
            else slicing.stacked(self.state, self.leaf_init(x, where), n, 2))


def _split_as(states, params, lead: int):
  """``states``, a tree of each leaf of ``params``'s state, each leaf split as its parameter
  (`_sharding.split_as` at ``lead``: 1 for the layers' stacks); packed rows (`PackedRows`) as
  they are."""
  if isinstance(states, PackedRows):
    return states
  return jax.tree.map(lambda p, s: s if isinstance(s, PackedRows) else jax.tree.map(
      lambda x: _sharding.split_as(x, p, lead), s), params, states)
