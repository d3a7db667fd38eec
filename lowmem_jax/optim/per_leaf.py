"""Which leaves a function reads, and whether an optimizer's update of one leaf reads
another's: the checks that let `lowmem_jax.optim.layer_streamed` update a model a layer
(and a part of one) at a time. Both follow the jaxpr with `lowmem_jax._jaxpr`, into
nested calls."""

from typing import Any, Callable

import jax
import optax
from jax.extend import core as jcore

from lowmem_jax import _jaxpr
from lowmem_jax._jax import source_info_util


def reads(fn: Callable, tree: Any, *args) -> Any:
  """Bool pytree like ``tree``: whether ``fn(tree, *args)`` reads each leaf."""
  closed = jax.make_jaxpr(fn)(tree, *args)
  n = len(jax.tree.leaves(tree))
  used = set(_jaxpr.used_inputs(closed.jaxpr))
  return jax.tree.unflatten(jax.tree.structure(tree), [i in used for i in range(n)])


def check_per_leaf(tx: optax.GradientTransformation, params: Any) -> None:
  """Raises ValueError if ``tx``'s update of one leaf reads another leaf's gradient or param.

  Traces ``tx.update`` on ``params`` (two copies of it where it has one leaf) and follows
  each output back through the jaxpr to the leaves it reads (into nested calls;
  conservatively through loops and conditionals).

  Args:
    tx: the transformation.
    params: the parameters (arrays or ``ShapeDtypeStruct``), laid out as ``tx`` sees
      them: `lowmem_jax.optim.layer_streamed` gives its whole tree with one layer.
  """
  probe = params if len(jax.tree.leaves(params)) > 1 else {"a": params, "b": params}
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
    inner = _jaxpr.call_body(eqn)
    if inner is not None:
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
