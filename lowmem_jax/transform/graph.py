"""The graph of one jaxpr as the matchers read it: producers, consumers, and values.

Names here are shared by the matcher modules of the package (no leading
underscore); each matcher module keeps its own helpers private.
"""

import collections
import importlib.util
import os
import sysconfig

import jax
import numpy as np
from jax.extend import core as jcore

from lowmem_jax import _jaxpr
from lowmem_jax._jax import source_info_util

# Frames of Flax and of installed libraries are skipped in a rewrite's source line while
# the user's own are there; Flax found without importing it.
_FLAX_DIR = os.path.dirname(importlib.util.find_spec("flax").origin) + os.sep
_SITE_DIRS = tuple({sysconfig.get_path(k) + os.sep for k in ("purelib", "platlib")})
_LIBRARY_DIRS = (_FLAX_DIR, *_SITE_DIRS)
# Frames never named: JAX's own and the standard library's (whose directory may hold
# the site-packages).
_JAX_DIR = os.path.dirname(jax.__file__) + os.sep
_STDLIB_DIR = sysconfig.get_path("stdlib") + os.sep

# Equations that only lay an array out again (or cast it).
LAYOUT = frozenset({"broadcast_in_dim", "reshape", "convert_element_type", "copy"})


class Graph:
  """Producers and consumers of the vars of one jaxpr."""

  def __init__(self, jaxpr):
    self.jaxpr = jaxpr
    self.eqns = jaxpr.eqns
    self.producer = {}
    self.consumers = collections.defaultdict(list)
    for i, eqn in enumerate(jaxpr.eqns):
      for v in eqn.outvars:
        self.producer[v] = i
      for v in eqn.invars:
        if isinstance(v, jcore.Var):
          self.consumers[v].append(i)
    self.outvars = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    self.taken = set()  # equations already part of a match
    # (indices, {index: Action}) of each call `interpreter.inline_calls` inlined: the
    # equations it became, and the action binding the call again in their place
    self.inlined = []

  def prod(self, v):
    """The equation that makes ``v``, or None (an input, const or literal)."""
    i = self.producer.get(v) if isinstance(v, jcore.Var) else None
    return None if i is None else self.eqns[i]

  def untaken(self, primitives):
    """Indices of the equations of ``primitives`` not yet part of a match, each checked
    when the iteration reaches it (a match takes equations further on)."""
    return (i for i, e in enumerate(self.eqns)
            if e.primitive.name in primitives and i not in self.taken)

  def index(self, v):
    return self.producer.get(v) if isinstance(v, jcore.Var) else None

  def back(self, v, prims=LAYOUT):
    """``v`` followed back through single-input ``prims``."""
    while True:
      e = self.prod(v)
      if e is None or e.primitive.name not in prims or len(e.invars) != 1:
        return v
      v = e.invars[0]

  def only_consumer(self, v):
    c = self.consumers.get(v, [])
    if len(c) != 1 or v in self.outvars:
      return None
    return c[0]

  def closed(self, indices, outputs) -> bool:
    """True if the vars made by ``indices`` are used only by them (or are ``outputs``)."""
    for i in indices:
      for v in self.eqns[i].outvars:
        if v in outputs:
          continue
        if v in self.outvars or any(c not in indices for c in self.consumers.get(v, [])):
          return False
    return True

  def source(self, i) -> str:
    """``file:line`` of equation i's first frame outside JAX, Flax and other installed
    libraries: the user's call.

    Else its first frame that JAX counts as the user's (in a library); else, where
    every frame is in libraries that JAX skips, the innermost outside JAX and the
    standard library; where there is none, the primitive's name.
    """
    tb = self.eqns[i].source_info.traceback
    frames = list(source_info_util.user_frames(tb))
    frame = next((f for f in frames if not f.file_name.startswith(_LIBRARY_DIRS)), None)
    frame = frame or (frames[0] if frames else None) or _library_frame(tb)
    if frame is None:
      return self.eqns[i].primitive.name
    return f"{frame.file_name.rsplit('/', 1)[-1]}:{frame.start_line}"


def _library_frame(tb):
  """The innermost frame of traceback ``tb`` outside JAX and the standard library, or None."""
  code, lasti = tb.raw_frames() if tb else ([], [])
  return next((source_info_util.raw_frame_to_frame(c, k) for c, k in zip(code, lasti)
               if _nameable(c.co_filename)), None)


def _nameable(file_name) -> bool:
  return not file_name.startswith(_JAX_DIR) and (
      file_name.startswith(_SITE_DIRS) or not file_name.startswith(_STDLIB_DIR))


def upstream(g, outputs, stops):
  """Indices of the equations ``outputs`` depend on, back to the vars ``stops``."""
  seen, todo = set(), [v for v in outputs]
  while todo:
    v = todo.pop()
    i = g.index(v)
    if v in stops or i is None or i in seen:
      continue
    seen.add(i)
    todo.extend(w for w in g.eqns[i].invars if isinstance(w, jcore.Var))
  return seen


def live(eqns, indices, actions, outputs) -> list[int]:
  """The equations of ``indices`` that ``outputs`` need, in order, with
  ``actions`` in place of theirs (an action has no effects)."""
  order = sorted(indices)
  steps = [_jaxpr.Step(actions[i].inputs, actions[i].outputs, False) if i in actions
           else _jaxpr.Step(eqns[i].invars, eqns[i].outvars, bool(eqns[i].effects))
           for i in order]
  return [order[k] for k in _jaxpr.live(steps, outputs)]


def scalar(v):
  """The value of a scalar literal, else None."""
  if isinstance(v, jcore.Literal) and np.ndim(v.val) == 0:
    return float(v.val)
  return None


_SCALAR_OPS = {"add": float.__add__, "sub": float.__sub__, "mul": float.__mul__,
               "div": float.__truediv__, "convert_element_type": float}


def constant(g, v, depth=4):
  """The value of scalar ``v`` if literals alone make it (as ``n - ddof`` in ``jnp.var``), else None."""
  if (c := scalar(v)) is not None or depth == 0:
    return c
  e = g.prod(v)
  if e is None or e.outvars[0].aval.shape != () or e.primitive.name not in _SCALAR_OPS:
    return None
  args = [constant(g, w, depth - 1) for w in e.invars]
  if None in args or e.primitive.name == "div" and args[1] == 0.0:
    return None
  return _SCALAR_OPS[e.primitive.name](*args)


def fill_value(g, v):
  """The scalar ``v`` broadcasts, else None."""
  e = g.prod(v)
  while e is not None and e.primitive.name in ("broadcast_in_dim", "convert_element_type",
                                               "transpose", "reshape"):
    v = e.invars[0]
    e = g.prod(v)
  return scalar(v)


def feature_vector(g, v, n):
  """The ``[n]`` array ``v`` broadcasts along the last axis, else None."""
  src = g.back(v)
  if src.aval.shape != (n,) or not isinstance(src, jcore.Var):
    return None
  while v is not src:  # each step keeps the vector's axis last
    e = g.prod(v)
    x, out = e.invars[0], e.outvars[0]
    if x.aval.shape[-1:] != (n,) or out.aval.shape[-1:] != (n,) or (
        e.primitive.name == "broadcast_in_dim"
        and e.params["broadcast_dimensions"][-1] != out.aval.ndim - 1):
      return None
    v = x
  return src


def aval(v):
  """``v``'s type as a `jax.ShapeDtypeStruct`: shape, dtype, weak type and sharding (which
  explicit mesh axes make part of it)."""
  a = v.aval
  return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type, sharding=a.sharding)


def op_at(g, e) -> str:
  """Equation ``e`` (or its index) for a reason: its primitive and source line."""
  i = e if isinstance(e, int) else g.index(e.outvars[0])
  return f"{g.eqns[i].primitive.name} ({g.source(i)})"


def free_vars(g, indices):
  """The vars equations ``indices`` read that none of them makes, in order."""
  return list(dict.fromkeys(v for i in sorted(indices) for v in g.eqns[i].invars
                            if isinstance(v, jcore.Var) and g.index(v) not in indices))


def shape_in(v, dims, ndim):
  """The shape of ``v`` (a var or an array), whose axes are the axes ``dims`` (in order)
  of a rank ``ndim`` array, in that rank with 1 on the other axes."""
  shape = [1] * ndim
  for j, d in enumerate(dims):
    shape[d] = (v.aval if isinstance(v, jcore.Var) else v).shape[j]
  return tuple(shape)


def scalar_operand(e):
  """Which operand of a binary ``e`` is a scalar, or None."""
  for k, v in enumerate(e.invars):
    if v.aval.ndim == 0 and e.invars[1 - k].aval.ndim > 0:
      return k if e.primitive.name == "mul" or k == 1 else None
  return None


def unit_reshape(e) -> bool:
  """True if reshape ``e`` only adds or drops unit axes."""
  old = [d for d in e.invars[0].aval.shape if d != 1]
  new = [d for d in e.outvars[0].aval.shape if d != 1]
  return old == new and e.params.get("dimensions") is None
