"""`lowmem`: the project's techniques applied to a function's jaxpr.

A model the user already has (plain JAX, Flax linen or NNX, equinox) traces to
a jaxpr. `lowmem(fn)` traces ``fn``, finds the patterns below in the jaxpr and
evaluates it again with each pattern replaced by the project's own op, whose
forward is the same function (to float tolerance) and whose backward keeps
less (LowMemoryBP, Yang et al., ICML 2024, arXiv:2406.16282; Rabe & Staats
2021 for attention):

- ``activations``: an elementwise function of one array that equals, on a grid
  of test points, the erf GELU (→ `regelu2`), the tanh GELU (exact forward,
  ReGELU2's 2-bit backward), SiLU (→ `resilu2`) or ReLU (→ `relu`, exact).
- ``norms``: LayerNorm / RMSNorm (mean and variance, ``jnp.var`` with
  ``ddof=0``, or E[x²] − E[x]²; times ``rsqrt`` or over ``sqrt``; optional scale ``g`` and bias ``b`` on the last axis) → `ms_layer_norm` /
  `ms_rms_norm`. Each linear map it feeds (a ``dot_general`` contracting the
  feature axis, through reshapes and casts) gets the affine folded in inside
  the step: ``y @ (g[:, None] * W) + b @ W`` forward, and a backward that
  recomputes the activation-sized ``y * g + b`` from ``y``, so the norm and the
  matmul save one array, no weight-sized product is kept or made in the
  backward, and the parameter tree does not change. Other consumers get
  ``y * g + b`` (the models' ``keep_affine``).
- ``attention``: ``dot_general(q, k)`` → optional scalar scale, additive bias,
  ``where`` mask → softmax over keys → ``dot_general(p, v)``, in any layout
  that transposes and unit axes reach, grouped-query heads included (a group
  axis right after the kv-head axis, as ``jax.nn.dot_product_attention``
  writes them) → `lowmem_jax.attention`.
- ``loss``: ``h @ w`` (optionally ``+ bias``), its log-softmax over the last
  axis (``jax.nn.log_softmax``, or ``jax.nn.logsumexp`` less the label's logit
  as ``optax.softmax_cross_entropy_with_integer_labels`` writes it) taken at
  integer labels (``take_along_axis``) → `losses.linear_cross_entropy`, where
  the vocabulary is wider than ``h``, so the logits are the larger array.
- ``"layout"`` (with attention): a matmul whose input is the attention output
  ``[.., h, d]`` only reshaped to ``[.., h * d]`` contracts over ``(h, d)``
  instead, so autodiff saves one array, not two.

Nested jaxprs are rewritten too: ``jit`` calls are inlined (so a pattern may
span them), ``scan``, ``cond`` and ``jax.checkpoint`` are rebuilt around their
rewritten bodies (policies keep working). ``custom_jvp`` and ``custom_vjp``
functions keep their own derivative rules and are left as they are, except
`jax.nn.relu`. What the matchers miss: layout redundancies other than the
attention output's, and grouped queries laid out group-major (``[.., G, K, ..]``). A jaxpr
rewrite sees hand-written code as well as framework modules; Qwix's approach
(intercepting framework calls by module path) sees only the modules it knows.
"""

import collections
import dataclasses
import functools
import math
import os
from typing import Callable

import jax
import jax.numpy as jnp
import flax
import numpy as np
import rich.table
from jax import lax
from jax._src import core as jax_core  # eval_context: test points evaluate while tracing
from jax._src import source_info_util
from jax.extend import core as jcore

from lowmem_jax import _text, activations, attention_ops, losses, memory, names, norms

_FLAX_DIR = os.path.dirname(flax.__file__) + os.sep

OPTIONS = {
    "activations": ("approx", None),
    "norms": ("ms", None),
    "attention": ("recompute", None),
    "loss": ("fused", None),
}

# One elementwise function of one array: what an activation region may hold.
_ELEMENTWISE = frozenset({
    "abs", "add", "convert_element_type", "copy", "div", "erf", "erfc", "exp", "exp2",
    "expm1", "integer_pow", "log", "log1p", "logistic", "max", "min", "mul", "neg", "pow",
    "rsqrt", "sign", "sqrt", "square", "sub", "tanh", "custom_jvp_call",
})
_LAYOUT = frozenset({"broadcast_in_dim", "reshape", "convert_element_type", "copy"})


@dataclasses.dataclass(frozen=True)
class Rewrite:
  """One pattern `lowmem` replaced (``left`` False) or recognised and left.

  Attributes:
    kind: "activation", "norm", "attention", "loss" or "layout" (a matmul over an
      array as saved rather than over its reshape; logged beside the
      attention rewrite it belongs to).
    op: what it became, e.g. "regelu2", "ms_layer_norm + fold into 3 matmuls".
    source: "file.py:line" of the original op.
    saved_bytes: bytes it removes from autodiff's residuals, counted on the
      pattern alone (its inputs to its outputs); 0 for a pattern left.
    left: the reason it was left, or None.
  """
  kind: str
  op: str
  source: str
  saved_bytes: int = 0
  left: str | None = None


class Rewrites(list):
  """The `Rewrite`s of one trace, in program order; ``str()`` is a table."""

  @property
  def counts(self) -> dict[str, int]:
    """Patterns replaced, by kind."""
    return dict(collections.Counter(r.kind for r in self if r.left is None))

  @property
  def saved_bytes(self) -> int:
    return sum(r.saved_bytes for r in self)

  def __str__(self) -> str:
    table = rich.table.Table(title=f"lm.lowmem: {sum(self.counts.values())} rewrites, "
                             f"{self.saved_bytes / 2**20:.1f} MiB fewer residuals")
    for col in ("kind", "became", "source", "MiB saved", "left because"):
      table.add_column(col)
    for r in self:
      table.add_row(r.kind, r.op if r.left is None else "-", r.source,
                    f"{r.saved_bytes / 2**20:.2f}", r.left or "")
    return _text.render(table)


def _check_options(options: dict) -> dict:
  for key, value in options.items():
    if key not in OPTIONS:
      raise TypeError(f"lowmem got an unknown option {key}={value!r}; the options are "
                      f"{sorted(OPTIONS)}.")
    if value not in OPTIONS[key]:
      raise ValueError(f"lowmem's {key} must be one of {OPTIONS[key]}, got {value!r}.")
  return options


def lowmem(fn: Callable, *, activations: str | None = "approx", norms: str | None = "ms",
           attention: str | None = "recompute", loss: str | None = "fused") -> Callable:
  """``fn`` with its GELU/SiLU/ReLU, norms, softmax attention and LM head's loss rewritten.

  Args:
    fn: any function of arrays (pytrees of them, NNX modules included; other
      leaves are static) that traces to a jaxpr: a loss, a model's apply. Give
      the function the step differentiates (``jax.grad(lowmem(loss))``,
      ``nnx.value_and_grad(lowmem(loss))``), not the step: a step's jaxpr
      already holds its backward, which the rewrites do not reach.
    activations: "approx" (2-bit backward for GELU and SiLU, 1-bit exact ReLU)
      or None to leave them.
    norms: "ms" (memory-sharing norms, affine folded into the matmuls they
      feed) or None.
    attention: "recompute" (`lowmem_jax.attention`: no L×L residual) or None.
    loss: "fused" (a matmul's logits wider than its input, their log-softmax
      taken at integer labels → `lowmem_jax.losses.linear_cross_entropy`: no
      ``[tokens, vocab]`` logits) or None.

  Returns:
    A function with ``fn``'s signature and outputs (to float tolerance) whose
    backward keeps less. ``.explain(*args, **kwargs)`` (arrays or
    `jax.ShapeDtypeStruct`s) returns the `Rewrites` of that trace. Composes
    with ``jit``, ``grad``, ``vmap``, ``jax.checkpoint`` and ``scan``.
  """
  if not callable(fn):
    raise TypeError(f"fn must be callable, got {type(fn).__name__}.")
  options = _check_options(
      {"activations": activations, "norms": norms, "attention": attention, "loss": loss})

  def traced(args, kwargs):
    leaves, treedef = jax.tree.flatten((args, kwargs))
    is_array = [_is_array(x) for x in leaves]

    def flat_fn(*arrays):
      it = iter(arrays)
      full = [next(it) if a else x for x, a in zip(leaves, is_array)]
      a, kw = jax.tree.unflatten(treedef, full)
      return fn(*a, **kw)

    arrays = [x for x, a in zip(leaves, is_array) if a]
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*arrays)
    return closed, arrays, out_shape

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    closed, arrays, out_shape = traced(args, kwargs)
    log = Rewrites()
    jax.make_jaxpr(lambda *a: _evaluate(closed.jaxpr, closed.consts, a, options, log))(*arrays)
    if not any(r.left is None for r in log):
      return fn(*args, **kwargs)  # nothing to rewrite: fn's own jaxpr
    # Evaluated again under the caller's trace rather than replayed from the
    # jaxpr above: ops that choose an implementation when differentiated
    # (lm.attention's cuDNN fallback) choose under the caller's transformations.
    outs = _evaluate(closed.jaxpr, closed.consts, arrays, options, Rewrites())
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  def explain(*args, **kwargs) -> Rewrites:
    closed, arrays, _ = traced(args, kwargs)
    log = Rewrites()
    jax.make_jaxpr(lambda *a: _evaluate(closed.jaxpr, closed.consts, a, options, log,
                                        count=True))(*arrays)
    return log

  wrapped.explain = explain
  return wrapped


def _is_array(x) -> bool:
  """Arrays (tracers included) and abstract arrays; other leaves are static."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


# --- the interpreter ---------------------------------------------------------


@dataclasses.dataclass
class _Action:
  """Replaces equation ``index``: reads ``inputs`` (vars or tokens), writes ``outputs``."""
  inputs: list
  outputs: list
  fn: Callable[..., list]


def _inline_jit(jaxpr, consts):
  """``jaxpr`` with its ``jit`` calls inlined, recursively, as a ClosedJaxpr."""
  if not any(e.primitive.name in ("jit", "pjit") for e in jaxpr.eqns):
    return jaxpr, list(consts)

  def run(*args):
    return _run(jaxpr, consts, args, {}, None, None, inline_only=True)

  avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
           for v in jaxpr.invars]
  closed = jax.make_jaxpr(run)(*avals)
  return closed.jaxpr, list(closed.consts)


def _evaluate(jaxpr, consts, args, options, log, count=False):
  """Evaluates ``jaxpr`` with its patterns rewritten; appends to ``log``."""
  jaxpr, consts = _inline_jit(jaxpr, consts)
  actions = _match(jaxpr, options, log, count)
  return _run(jaxpr, consts, args, actions, options, log, count=count)


def _run(jaxpr, consts, args, actions, options, log, inline_only=False, count=False):
  env = {}

  def read(v):
    return v.val if isinstance(v, jcore.Literal) else env[v]

  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  for i in _live(jaxpr.eqns, range(len(jaxpr.eqns)), actions, jaxpr.outvars):
    eqn = jaxpr.eqns[i]
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
      if i in actions:
        action = actions[i]
        outs = action.fn(*map(read, action.inputs))
        env.update(zip(action.outputs, outs))
        continue
      invals = list(map(read, eqn.invars))
      if inline_only:
        outs = _bind_inlining(eqn, invals)
      else:
        outs = _bind_nested(eqn, invals, options, log, count)
    env.update(zip(eqn.outvars, outs))
  return list(map(read, jaxpr.outvars))


def _live(eqns, indices, actions, outputs) -> list[int]:
  """The equations of ``indices`` that ``outputs`` need, in order, with
  ``actions`` in place of theirs."""
  needed = {v for v in outputs if not isinstance(v, jcore.Literal)}
  keep = []
  for i in sorted(indices, reverse=True):
    ins, outs = ((actions[i].inputs, actions[i].outputs) if i in actions
                 else (eqns[i].invars, eqns[i].outvars))
    if any(o in needed for o in outs) or (i not in actions and eqns[i].effects):
      keep.append(i)
      needed.update(v for v in ins if not isinstance(v, jcore.Literal))
  return keep[::-1]


def _bind(eqn, invals):
  params = eqn.primitive.get_bind_params(eqn.params)
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*invals, **params)
  return out if eqn.primitive.multiple_results else [out]


def _bind_inlining(eqn, invals):
  if eqn.primitive.name in ("jit", "pjit"):
    inner = eqn.params["jaxpr"]
    return _run(inner.jaxpr, inner.consts, invals, {}, None, None, inline_only=True)
  return _bind(eqn, invals)


def _bind_nested(eqn, invals, options, log, count):
  """Binds ``eqn``, rewriting the jaxprs inside scan, cond and checkpoint."""
  name = eqn.primitive.name
  rec = functools.partial(_evaluate, options=options, log=log, count=count)
  params = eqn.params
  if name == "scan":
    body = params["jaxpr"]
    nc, nk = params["num_consts"], params["num_carry"]
    consts, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]

    def step(carry, x):
      outs = rec(body.jaxpr, body.consts, [*consts, *carry, *x])
      return outs[:nk], outs[nk:]

    carry, ys = lax.scan(step, init, xs, length=params["length"], reverse=params["reverse"],
                         unroll=params["unroll"])
    return [*carry, *ys]
  if name == "cond":
    branches = [functools.partial(lambda br, *ops: rec(br.jaxpr, br.consts, ops), br)
                for br in params["branches"]]
    return lax.switch(invals[0], branches, *invals[1:])
  if name in ("remat2", "checkpoint"):
    body = params["jaxpr"]
    fn = jax.checkpoint(lambda *a: rec(body, [], a), prevent_cse=params["prevent_cse"],
                        policy=params["policy"])
    return fn(*invals)
  return _bind(eqn, invals)


# --- matching ----------------------------------------------------------------


class _Graph:
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

  def prod(self, v):
    """The equation that makes ``v``, or None (an input, const or literal)."""
    i = self.producer.get(v) if isinstance(v, jcore.Var) else None
    return None if i is None else self.eqns[i]

  def index(self, v):
    return self.producer.get(v) if isinstance(v, jcore.Var) else None

  def back(self, v, prims=_LAYOUT):
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
    """``file:line`` of equation i's first frame outside JAX and Flax: the user's call."""
    frames = list(source_info_util.user_frames(self.eqns[i].source_info.traceback))
    frame = next((f for f in frames if not f.file_name.startswith(_FLAX_DIR)), None)
    frame = frame or (frames[0] if frames else None)
    return "?" if frame is None else f"{frame.file_name.rsplit('/', 1)[-1]}:{frame.start_line}"


def _scalar(v):
  """The value of a scalar literal, else None."""
  if isinstance(v, jcore.Literal) and np.ndim(v.val) == 0:
    return float(v.val)
  return None


_SCALAR_OPS = {"add": float.__add__, "sub": float.__sub__, "mul": float.__mul__,
               "div": float.__truediv__, "convert_element_type": float}


def _constant(g, v, depth=4):
  """The value of scalar ``v`` if literals alone make it (as ``n - ddof`` in ``jnp.var``), else None."""
  if (c := _scalar(v)) is not None or depth == 0:
    return c
  e = g.prod(v)
  if e is None or e.outvars[0].aval.shape != () or e.primitive.name not in _SCALAR_OPS:
    return None
  args = [_constant(g, w, depth - 1) for w in e.invars]
  if None in args or e.primitive.name == "div" and args[1] == 0.0:
    return None
  return _SCALAR_OPS[e.primitive.name](*args)


def _always_true(g, pred) -> bool:
  """True if scalar ``pred`` is ``c > 0`` for a positive `_constant` c (or a literal True)."""
  if isinstance(pred, jcore.Literal):
    return np.ndim(pred.val) == 0 and bool(pred.val)
  e = g.prod(pred)
  if e is None or e.primitive.name != "gt" or _scalar(e.invars[1]) != 0.0:
    return False
  c = _constant(g, e.invars[0])
  return c is not None and c > 0


def _slice(g, outputs, stops):
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


def _match(jaxpr, options, log, count):
  g = _Graph(jaxpr)
  actions = {}
  if options["loss"]:
    for i, e in enumerate(g.eqns):
      if e.primitive.name == "gather" and i not in g.taken:
        _match_loss(g, i, actions, log, count)
  if options["attention"]:
    for i, e in enumerate(g.eqns):
      if e.primitive.name in ("div", "custom_vjp_call") and i not in g.taken:
        _match_attention(g, i, actions, log, count)
  if options["norms"]:
    for i, e in enumerate(g.eqns):
      if e.primitive.name in ("rsqrt", "sqrt") and i not in g.taken:
        _match_norm(g, i, actions, log, count)
  if options["activations"]:
    _match_activations(g, actions, log, count)
  return actions


def _residual_bytes(fn, avals) -> int:
  """Bytes of autodiff's residuals of ``fn``, differentiated in its float args."""
  diff = [i for i, a in enumerate(avals) if jnp.issubdtype(a.dtype, jnp.floating)]

  def f(*d):
    full = [jnp.zeros(a.shape, a.dtype) for a in avals]
    for i, x in zip(diff, d):
      full[i] = x
    return fn(*full)

  return memory.saved_residuals(f, *[avals[i] for i in diff]).total_bytes


def _record(log, g, kind, op, anchor, count, orig=None, new=None, avals=None):
  saved = 0
  if count and orig is not None:
    saved = _residual_bytes(orig, avals) - _residual_bytes(new, avals)
  log.append(Rewrite(kind, op, g.source(anchor), saved))


def _left(log, g, kind, anchor, why):
  log.append(Rewrite(kind, "-", g.source(anchor), 0, why))


def _sub_fn(g, indices, inputs, outputs, actions=None):
  """The equations ``indices`` as a function of ``inputs``, with ``actions`` in place."""
  actions = {i: a for i, a in (actions or {}).items() if i in indices}
  run = _live(g.eqns, indices, actions, outputs)

  def fn(*vals):
    env = dict(zip(inputs, vals))
    rd = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
    for i in run:
      if i in actions:
        env.update(zip(actions[i].outputs, actions[i].fn(*map(rd, actions[i].inputs))))
      else:
        e = g.eqns[i]
        env.update(zip(e.outvars, _bind(e, [rd(v) for v in e.invars])))
    return [rd(v) for v in outputs]
  return fn


def _aval(v):
  return jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)


# --- activations -------------------------------------------------------------

_TEST_X = np.concatenate([np.linspace(-8.0, 8.0, 321), [-30.0, -12.0, 12.0, 30.0]])


_ACTIVATIONS = {  # name: (primitive hint, exact twin, replacement)
    "regelu2": ({"erf", "erfc"}, lambda x: jax.nn.gelu(x, approximate=False),
                activations.regelu2),
    "tanh-gelu → regelu2 backward": ({"tanh"}, jax.nn.gelu, activations.regelu2_tanh),
    "resilu2": ({"logistic", "exp"}, jax.nn.silu, activations.resilu2),
    "relu": ({"max", "custom_jvp_call"}, jax.nn.relu, activations.relu),
}
_TOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2e-2,
        jnp.dtype(jnp.float16): 3e-3}


def _relu_call(e) -> bool:
  """True for a custom_jvp_call whose function is one elementwise max (jax.nn.relu)."""
  inner, _ = _inline_jit(e.params["call_jaxpr"].jaxpr, e.params["call_jaxpr"].consts)
  return (len(inner.eqns) == 1 and inner.eqns[0].primitive.name == "max"
          and any(_scalar(v) == 0.0 for v in inner.eqns[0].invars))


def _regions(g):
  """Each var made by elementwise ops from one array ``x``: var -> (x, eqn indices)."""
  root = {}
  for i, e in enumerate(g.eqns):
    if i in g.taken or e.primitive.name not in _ELEMENTWISE or len(e.outvars) != 1:
      continue
    if e.primitive.name == "custom_jvp_call" and not _relu_call(e):
      continue
    out = e.outvars[0]
    srcs = set()
    for v in e.invars:
      if _scalar(v) is not None:
        continue
      if not isinstance(v, jcore.Var) or v.aval.shape != out.aval.shape:
        srcs = None
        break
      srcs.add(root[v][0] if v in root else v)
    if srcs is None or len(srcs) != 1:
      continue
    (x,) = srcs
    if not jnp.issubdtype(x.aval.dtype, jnp.floating) or x.aval.ndim < 1:
      continue
    idx = {i}.union(*(root[v][1] for v in e.invars if isinstance(v, jcore.Var) and v in root))
    root[out] = (x, idx)
  return root


def _eval_region(g, indices, x, z, xval):
  env = {x: xval}
  rd = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
  for i in sorted(indices):
    e = g.eqns[i]
    ins = [rd(v) for v in e.invars]
    if e.primitive.name == "custom_jvp_call":
      out = lax.max(ins[0], jnp.zeros((), ins[0].dtype))
    else:
      out = e.primitive.bind(*ins, **e.params)
    env[e.outvars[0]] = out
  return env[z]


def _reduced(g):
  """Vars computed from reductions alone by elementwise and layout ops (norm statistics)."""
  out = set()
  for e in g.eqns:
    name = e.primitive.name
    arrays = [v for v in e.invars if isinstance(v, jcore.Var)]
    if name.startswith("reduce_") or (name in _ELEMENTWISE | _LAYOUT and arrays and all(
        v in out for v in arrays)):
      out.update(e.outvars)
  return out


def _match_activations(g, actions, log, count):
  root = _regions(g)
  reduced = _reduced(g)
  for z, (x, idx) in root.items():
    if idx & g.taken or x in reduced or not g.closed(idx, {z}):
      continue
    prims = {g.eqns[i].primitive.name for i in idx}
    name = _identify(g, idx, x, z, prims)
    if name is None:
      continue
    anchor = g.index(z)
    replacement = _ACTIVATIONS[name][2]
    out_dtype = z.aval.dtype

    def fn(xv, replacement=replacement, out_dtype=out_dtype):
      return [replacement(xv).astype(out_dtype)]

    actions[anchor] = _Action([x], [z], fn)
    g.taken |= idx
    _record(log, g, "activation", name, anchor, count,
            _sub_fn(g, idx, [x], [z]), fn, [_aval(x)])


def _identify(g, idx, x, z, prims):
  """The name in ``_ACTIVATIONS`` equal to the region on the test points, or None."""
  dtype = jnp.dtype(x.aval.dtype)
  if dtype not in _TOL:
    return None
  xs = jnp.asarray(_TEST_X, dtype)
  with jax_core.eval_context():
    got = np.asarray(_eval_region(g, idx, x, z, xs), np.float32)
    for name, (hint, twin, _) in _ACTIVATIONS.items():
      if not prims & hint:
        continue
      want = np.asarray(twin(xs.astype(jnp.float32)).astype(z.aval.dtype), np.float32)
      if np.all(np.abs(got - want) <= _TOL[dtype] * (1 + np.abs(want))):
        return name
  return None


# --- norms -------------------------------------------------------------------


def _mean_of(g, v):
  """``w`` if ``v`` is the mean of ``w`` over its last axis, else None."""
  e = g.prod(g.back(v))
  if e is None or e.primitive.name not in ("div", "mul"):
    return None
  a, b = e.invars
  c = _constant(g, b)
  if c is None:
    return None
  s = g.prod(g.back(a))
  if s is None or s.primitive.name != "reduce_sum":
    return None
  w = s.invars[0]
  n = w.aval.shape[-1] if w.aval.ndim else 0
  if tuple(s.params["axes"]) != (w.aval.ndim - 1,):
    return None
  ok = math.isclose(c, n) if e.primitive.name == "div" else math.isclose(c, 1 / n)
  return w if ok else None


def _square_of(g, v):
  e = g.prod(g.back(v, {"convert_element_type"}))
  if e is None:
    return None
  name = e.primitive.name
  if name == "square" or (name == "integer_pow" and e.params["y"] == 2):
    return e.invars[0]
  if name == "mul" and e.invars[0] is e.invars[1]:
    return e.invars[0]
  return None


def _is_zeros(g, v):
  return _fill_value(g, v) == 0.0


def _centered(g, v, x, mu):
  """True if ``v`` is ``x - mu`` (LayerNorm) or ``x`` itself (``mu`` None: RMSNorm)."""
  v = g.back(v, {"convert_element_type", "copy"})
  e = g.prod(v)
  if e is not None and e.primitive.name == "sub":
    a, b = e.invars
    if g.back(a, {"convert_element_type", "copy"}) is not x:
      return False
    if mu is None:
      return _is_zeros(g, b)
    return g.back(b) is g.back(mu) or _mean_of(g, b) is not None and g.back(
        _mean_of(g, b), {"convert_element_type", "copy"}) is x
  return mu is None and v is x


def _feature_vector(g, v, n):
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


def _stats(g, r_eqn):
  """``(x, mu or None, eps)`` of ``rsqrt(var(x) + eps)`` or ``sqrt(...)``, else None."""
  u = g.back(r_eqn.invars[0])
  e = g.prod(u)
  if e is None or e.primitive.name != "add":
    return None
  eps = [_scalar(v) for v in e.invars]
  if eps[0] is None and eps[1] is None:
    return None
  eps_val = eps[0] if eps[0] is not None else eps[1]
  var = g.back(e.invars[1] if eps[0] is not None else e.invars[0])
  clip = g.prod(var)
  if clip is not None and clip.primitive.name == "max" and 0.0 in map(_scalar, clip.invars):
    var = g.back(next(v for v in clip.invars if _scalar(v) is None))
  guard = g.prod(var)  # jnp.var's where(n - ddof > 0, var, nan), true for ddof < n
  if guard is not None and guard.primitive.name == "select_n" and len(guard.invars) == 3 and (
      _always_true(g, guard.invars[0]) and np.isnan(_fill_value(g, guard.invars[1]) or 0.0)):
    var = g.back(guard.invars[2])
  ve = g.prod(var)
  if ve is not None and ve.primitive.name == "sub":  # E[x^2] - E[x]^2
    sq, m2 = ve.invars
    mean_sq = _mean_of(g, sq)
    x = None if mean_sq is None else _square_of(g, mean_sq)
    mu = _square_of(g, m2)
    if x is None or mu is None or _mean_of(g, mu) is None:
      return None
    if g.back(_mean_of(g, mu), {"convert_element_type", "copy"}) is not g.back(
        x, {"convert_element_type", "copy"}):
      return None
    return g.back(x, {"convert_element_type", "copy"}), mu, eps_val
  w = _mean_of(g, var)
  d = None if w is None else _square_of(g, w)
  if d is None:
    return None
  de = g.prod(g.back(d, {"convert_element_type", "copy"}))
  if de is not None and de.primitive.name == "sub":
    a, b = de.invars
    x = g.back(a, {"convert_element_type", "copy"})
    if _is_zeros(g, b):
      return x, None, eps_val
    m = _mean_of(g, b)
    if m is None or g.back(m, {"convert_element_type", "copy"}) is not x:
      return None
    return x, b, eps_val
  return g.back(d, {"convert_element_type", "copy"}), None, eps_val


def _match_norm(g, ri, actions, log, count):
  st = _stats(g, g.eqns[ri])
  if st is None:
    return
  x, mu, eps = st
  if x.aval.ndim < 1 or not jnp.issubdtype(x.aval.dtype, jnp.floating):
    return
  n = x.aval.shape[-1]
  cur, scale, bias, centered = g.eqns[ri].outvars[0], None, None, False
  if g.eqns[ri].primitive.name == "sqrt":  # (x - mu) / sqrt(var + eps)
    while (c := g.only_consumer(cur)) is not None and g.eqns[c].primitive.name in _LAYOUT and (
        len(g.eqns[c].invars) == 1):
      cur = g.eqns[c].outvars[0]
    e = None if c is None else g.eqns[c]
    if e is None or e.primitive.name != "div" or e.invars[1] is not cur or not _centered(
        g, e.invars[0], x, mu):
      return
    cur, centered = e.outvars[0], True
  while True:  # walk the product chain forward
    c = g.only_consumer(cur)
    if c is None:
      break
    e = g.eqns[c]
    name = e.primitive.name
    if name in _LAYOUT and len(e.invars) == 1:
      cur = e.outvars[0]
      continue
    if name == "mul":
      other = e.invars[1] if e.invars[0] is cur else e.invars[0]
      if not centered and _centered(g, other, x, mu):
        centered = True
      elif scale is None and _feature_vector(g, other, n) is not None:
        scale = _feature_vector(g, other, n)
      else:
        break
      cur = e.outvars[0]
      continue
    if name == "add" and centered and bias is None:
      other = e.invars[1] if e.invars[0] is cur else e.invars[0]
      b = _feature_vector(g, other, n)
      if b is None:
        break
      bias, cur = b, e.outvars[0]
      while (c := g.only_consumer(cur)) is not None and g.eqns[c].primitive.name in (
          "convert_element_type",):
        cur = g.eqns[c].outvars[0]
      break
    break
  if not centered or cur.aval.shape != x.aval.shape:
    return
  z = cur
  stops = {x} | {p for p in (scale, bias) if p is not None}
  idx = _slice(g, [z], stops)
  if not g.closed(idx, {z}):
    _left(log, g, "norm", g.index(z), "an intermediate of the norm is used elsewhere")
    return
  if any(g.eqns[i].primitive.name in ("dot_general", "reduce_max") for i in idx):
    return
  folds, others = _foldable(g, z, n)
  op = "ms_layer_norm" if mu is not None else "ms_rms_norm"
  norm_fn = norms.ms_layer_norm if mu is not None else norms.ms_rms_norm
  affine = scale is not None or bias is not None
  y_dtype = z.aval.dtype
  if folds and not others:
    dtypes = {g.eqns[d].invars[side].aval.dtype for d, side, _ in folds}
    if len(dtypes) == 1:
      y_dtype = dtypes.pop()
  token = ("norm_out", z)
  inputs = [x] + [p for p in (scale, bias) if p is not None]

  keep_z = others or not folds

  def norm(xv, *pv):
    y = norm_fn(xv, eps=eps, dtype=y_dtype)
    return [y, _affine(y, scale, bias, pv, z.aval.dtype)] if keep_z else [y]

  anchor = g.index(z)
  actions[anchor] = _Action(inputs, [token, z] if keep_z else [token], norm)
  g.taken |= idx
  for d, side, chain in folds:
    _fold_action(g, d, side, chain, token, scale, bias, actions)
    g.taken.add(d)
  where = f" + fold into {len(folds)} matmul{'s' * (len(folds) != 1)}" if affine and folds else ""
  kept = " (affine kept for other users)" if affine and others else ""
  dots = sorted(d for d, _, _ in folds)
  outs = [z] * keep_z + [g.eqns[d].outvars[0] for d in dots]
  weights = [g.eqns[d].invars[1 - side] for d, side, _ in folds]
  ins = list(dict.fromkeys(inputs + [w for w in weights if isinstance(w, jcore.Var)]))
  sub_idx = idx | set(dots) | {i for _, _, chain in folds for i in chain}
  _record(log, g, "norm", op + where + kept, anchor, count, _sub_fn(g, sub_idx, ins, outs),
          _sub_fn(g, sub_idx, ins, outs, actions), [_aval(v) for v in ins])


def _affine(y, scale, bias, pv, dtype):
  """``y * g + b`` in y's dtype, so the scale's gradient needs only the saved ``y``."""
  it = iter(pv)
  z = y
  if scale is not None:
    z = z * lax.broadcast_to_rank(next(it).astype(y.dtype), z.ndim)
  if bias is not None:
    z = z + lax.broadcast_to_rank(next(it).astype(y.dtype), z.ndim)
  return z.astype(dtype)


def _apply_layout(e, x, own_name):
  """Layout equation ``e`` (reshape, cast, checkpoint name) applied to ``x``.

  A checkpoint name the replacement already gives its output is not given
  twice, which would make autodiff count the array twice.
  """
  name = e.primitive.name
  if name == "convert_element_type":
    return x.astype(e.params["new_dtype"])
  if name == "name" and e.params["name"] == own_name:
    return x
  return _bind(e, [x])[0]


def _foldable(g, z, n):
  """The matmuls ``z`` feeds over its last axis: ``[(index, side, chain)]``, and other users."""
  folds, others = [], False
  todo = [(z, [])]
  while todo:
    v, chain = todo.pop()
    for c in g.consumers.get(v, []):
      e = g.eqns[c]
      name = e.primitive.name
      if name in ("convert_element_type", "name") or (
          name == "reshape" and e.outvars[0].aval.shape[-1:] == (n,)):
        todo.append((e.outvars[0], chain + [c]))
      elif (name == "dot_general" and _contracts_last(e, v) and c not in g.taken
            and _holds_folded_scale(e.invars[1 - e.invars.index(v)], v)):
        folds.append((c, e.invars.index(v), chain))
      else:
        others = True
    if v in g.outvars:
      others = True
  return folds, others


def _holds_folded_scale(w, y) -> bool:
  """Whether ``g[:, None] * w`` in w's dtype loses nothing against ``y * g``: w is
  floating point and at least as wide as y (not an int8 or narrower weight)."""
  return (jnp.issubdtype(w.aval.dtype, jnp.floating)
          and jnp.finfo(w.aval.dtype).bits >= jnp.finfo(y.aval.dtype).bits)


def _contracts_last(e, v) -> bool:
  (lc, rc), (lb, rb) = e.params["dimension_numbers"]
  if e.invars[0] is e.invars[1]:
    return False
  side = e.invars.index(v)
  contract, batch = (lc, lb) if side == 0 else (rc, rb)
  other_contract = rc if side == 0 else lc
  return (tuple(contract) == (v.aval.ndim - 1,) and not batch and len(other_contract) == 1)


def _fold_action(g, d, side, chain, token, scale, bias, actions):
  """Matmul ``d`` of the norm's affine output, from the shared output ``y``.

  Forward: ``dot(y, g[:, None] * W) + b @ W``, the affine folded into the
  weight. Backward: the plain form's, ``dot(y * g + b, W)``, with the
  activation-sized affine recomputed from ``y`` and the sums for ``g`` and
  ``b`` in float32, so the residuals are ``y`` and the parameters (no folded
  weight kept) and no weight-sized product is made in the backward. Measured
  on the stock-NNX ViT-B/16 (docs/benchmarks.md): folding both ways gave a
  CPU step ratio of 1.092 at batch 2 (now 1.035); the plain form both ways (``jax.checkpoint``
  of the affine and the matmul) cost 0.355 → 0.434 of the per-block memory
  for the H100 target, as XLA merged the q, k, v matmuls that then shared
  one operand and kept their merged output.
  """
  e = g.eqns[d]
  (lc, rc), _ = e.params["dimension_numbers"]
  kd = (rc if side == 0 else lc)[0]
  chain_eqns = [g.eqns[i] for i in chain]
  inputs = [token, e.invars[1 - side]] + [p for p in (scale, bias) if p is not None]

  def dot(y, wv):
    return _bind(e, [y, wv] if side == 0 else [wv, y])[0]

  @jax.custom_vjp
  def folded_dot(y, wv, pv):
    it = iter(pv)
    gv = next(it) if scale is not None else None
    bv = next(it) if bias is not None else None
    w32 = wv.astype(jnp.float32)
    if gv is not None:
      wv = (w32 * lax.broadcast_in_dim(gv.astype(jnp.float32), w32.shape, (kd,))).astype(
          wv.dtype)
    res = dot(y, wv)
    if bv is not None:
      bw = lax.dot_general(bv.astype(jnp.float32), w32, (((0,), (kd,)), ((), ())),
                           preferred_element_type=jnp.float32)
      dims = list(range(res.ndim))
      dims = dims[res.ndim - bw.ndim:] if side == 0 else dims[:bw.ndim]
      res = (res.astype(jnp.float32) + lax.broadcast_in_dim(bw, res.shape, dims)).astype(
          res.dtype)
    return res

  def backward(res, dout):
    y, wv, pv = res
    z = _affine(y, scale, bias, pv, y.dtype)
    dz, dw = jax.vjp(dot, z, wv)[1](dout)
    dz32 = dz.astype(jnp.float32)
    axes = tuple(range(y.ndim - 1))  # the parameters' sums over tokens, in float32
    it = iter(pv)
    dp = []
    if scale is not None:
      gv = next(it)
      dp.append(jnp.sum(dz32 * y.astype(jnp.float32), axes).reshape(gv.shape).astype(gv.dtype))
      dz32 = dz32 * lax.broadcast_to_rank(gv.astype(jnp.float32), dz32.ndim)
    if bias is not None:
      bv = next(it)
      dp.append(jnp.sum(dz.astype(jnp.float32), axes).reshape(bv.shape).astype(bv.dtype))
    return dz32.astype(y.dtype), dw, tuple(dp)

  folded_dot.defvjp(lambda y, wv, pv: (folded_dot(y, wv, pv), (y, wv, pv)), backward)

  def fn(y, wv, *pv):
    for ce in chain_eqns:
      y = _apply_layout(ce, y, names.NORM_OUT)
    return [folded_dot(y, wv, tuple(pv))]

  actions[d] = _Action(inputs, [e.outvars[0]], fn)


# --- attention ---------------------------------------------------------------

_SOFTMAX_BACK = frozenset({"broadcast_in_dim", "reshape", "stop_gradient", "convert_element_type"})
_MASK_FILL = -1e4  # a `where` fill at or below this masks a key out


def _softmax_of(g, i):
  """``s`` if equation ``i`` is ``exp(s - max(s)) / sum(exp(...))`` over the last axis,
  or a ``custom_vjp`` function of ``s`` that computes only that."""
  e = g.eqns[i]
  if e.primitive.name == "custom_vjp_call":
    inner, _ = _inline_jit(e.params["call_jaxpr"].jaxpr, e.params["call_jaxpr"].consts)
    ig = _Graph(inner)
    last = len(inner.eqns) - 1
    if (len(inner.invars) == 1 and len(inner.outvars) == 1 and last >= 0
        and inner.outvars[0] is inner.eqns[last].outvars[0]
        and inner.eqns[last].primitive.name == "div"
        and _softmax_of(ig, last) is inner.invars[0]):
      return e.invars[0]
    return None
  num, den = e.invars
  ex = g.prod(num)
  red = g.prod(g.back(den, _SOFTMAX_BACK))
  if ex is None or ex.primitive.name != "exp" or red is None:
    return None
  last = (num.aval.ndim - 1,)
  if red.primitive.name != "reduce_sum" or g.back(red.invars[0], {"convert_element_type"}) is not num or tuple(
      red.params["axes"]) != last:
    return None
  sub = g.prod(ex.invars[0])
  if sub is None or sub.primitive.name != "sub":
    return None
  s, m = sub.invars
  m = g.back(m, _SOFTMAX_BACK | {"transpose"})
  me = g.prod(m)
  if me is not None and me.primitive.name == "max" and any(
      _scalar(v) == -math.inf for v in me.invars):
    m = g.back(next(v for v in me.invars if _scalar(v) is None), _SOFTMAX_BACK | {"transpose"})
    me = g.prod(m)
  if me is None or me.primitive.name != "reduce_max" or tuple(me.params["axes"]) != (
      me.invars[0].aval.ndim - 1,):
    return None
  if _untransposed(g, me.invars[0]) is not _untransposed(g, s):
    return None
  return s


def _untransposed(g, v):
  """``v`` followed back through transposes that keep the last axis last."""
  while (e := g.prod(v)) is not None and e.primitive.name == "transpose" and (
      e.params["permutation"][-1] == len(e.params["permutation"]) - 1):
    v = e.invars[0]
  return v


def _fill_value(g, v):
  """The scalar ``v`` broadcasts, else None."""
  e = g.prod(v)
  while e is not None and e.primitive.name in ("broadcast_in_dim", "convert_element_type",
                                               "transpose", "reshape"):
    v = e.invars[0]
    e = g.prod(v)
  return _scalar(v)


def _scores_chain(g, s):
  """Walks back from the softmax input to ``dot_general(q, k)``.

  Returns ``(dot_index, steps)``, steps in forward order as ``(kind, eqn, operand)``
  with kind one of "layout", "scale", "bias", "mask", "mask_not"; else a reason (str).
  """
  steps = []
  v = s
  while True:
    i = g.index(v)
    if i is None:
      return "the scores are not a matmul of queries and keys"
    e = g.eqns[i]
    name = e.primitive.name
    if name == "dot_general":
      return i, steps[::-1]
    if name in ("convert_element_type", "transpose", "copy") or (
        name == "reshape" and _unit_reshape(e)):
      steps.append(("layout", e, None))
      v = e.invars[0]
    elif name in ("mul", "div") and _scalar_operand(e) is not None:
      k = _scalar_operand(e)
      steps.append(("scale", e, e.invars[k]))
      v = e.invars[1 - k]
    elif name == "add":
      side = 0 if _leads_to_dot(g, e.invars[0]) else 1
      bias = e.invars[1 - side]
      steps.append(_additive_mask(g, e, bias) or ("bias", e, bias))
      v = e.invars[side]
    elif name == "select_n" and len(e.invars) == 3:
      kind = _mask_kind(g, e.invars[1], e.invars[2])
      if kind is None:
        return "a select in the scores that is not a mask"
      steps.append((kind, e, e.invars[0]))
      v = e.invars[2] if kind == "mask" else e.invars[1]
    else:
      return f"the scores pass through {name}"


def _mask_kind(g, on_false, on_true):
  """"mask" if ``select_n(pred, on_false, on_true)`` keeps where pred, "mask_not" if it
  keeps where not pred (the other case a fill at or below ``_MASK_FILL``), else None."""
  f, t = _fill_value(g, on_false), _fill_value(g, on_true)
  if f is not None and f <= _MASK_FILL:
    return "mask"
  if t is not None and t <= _MASK_FILL:
    return "mask_not"
  return None


def _additive_mask(g, e, bias):
  """A bias ``where(keep, 0, fill)`` as the mask step it is, else None."""
  sel = g.prod(g.back(bias))
  if sel is None or sel.primitive.name != "select_n" or len(sel.invars) != 3:
    return None
  kind = _mask_kind(g, sel.invars[1], sel.invars[2])
  zero = sel.invars[2] if kind == "mask" else sel.invars[1]
  if kind is None or _fill_value(g, zero) != 0.0:
    return None
  return kind, e, sel.invars[0]


def _scalar_operand(e):
  """Which operand of a binary ``e`` is a scalar, or None."""
  for k, v in enumerate(e.invars):
    if v.aval.ndim == 0 and e.invars[1 - k].aval.ndim > 0:
      return k if e.primitive.name == "mul" or k == 1 else None
  return None


def _leads_to_dot(g, v, depth=8):
  for _ in range(depth):
    e = g.prod(v)
    if e is None:
      return False
    if e.primitive.name == "dot_general":
      return True
    v = e.invars[0] if len(e.invars) == 1 else max(e.invars, key=lambda w: w.aval.ndim)
  return False


def _unit_reshape(e) -> bool:
  old = [d for d in e.invars[0].aval.shape if d != 1]
  new = [d for d in e.outvars[0].aval.shape if d != 1]
  return old == new and e.params.get("dimensions") is None


def _relabel(e, labels):
  """Labels of ``e``'s output from its (first) input's ``labels``."""
  name = e.primitive.name
  if name == "transpose":
    return [labels[p] for p in e.params["permutation"]]
  if name == "reshape":
    shape = e.invars[0].aval.shape
    kept = [lab for lab, d in zip(labels, shape) if d != 1]
    if any(lab != "U" and d == 1 for lab, d in zip(labels, shape)):
      return None
    it = iter(kept)
    return [next(it) if d != 1 else "U" for d in e.outvars[0].aval.shape]
  return labels


def _operand_labels(e, side, free_label):
  """Labels of operand ``side`` of ``dot_general`` ``e``: B0.., "D", and its free axes.

  Two free axes are grouped-query attention's queries: the one right after
  the second batch axis (the kv heads) is the group axis "G".
  """
  (lc, rc), (lb, rb) = e.params["dimension_numbers"]
  contract, batch = (lc, lb) if side == 0 else (rc, rb)
  v = e.invars[side]
  labels = [None] * v.aval.ndim
  for j, d in enumerate(batch):
    labels[d] = f"B{j}"
  for d in contract:
    labels[d] = "D"
  free = [d for d in range(v.aval.ndim) if labels[d] is None]
  big = free if len(free) == 1 else [d for d in free if v.aval.shape[d] != 1]
  if len(big) == 2 and len(batch) == 2 and batch[1] + 1 in big:
    labels[batch[1] + 1] = "G"
    big.remove(batch[1] + 1)
  if len(big) != 1:
    return None
  for d in free:
    if labels[d] is None:
      labels[d] = free_label if d == big[0] else "U"
  return labels if len(contract) == 1 else None


def _merge_groups(x, order):
  """``x`` on ``order``'s axes with "B1", "G" adjacent: those two as one heads axis, kv-major."""
  i = order.index("B1")
  return x.reshape(x.shape[:i] + (x.shape[i] * x.shape[i + 1],) + x.shape[i + 2:])


def _out_labels(e, lhs, rhs):
  (lc, rc), (lb, _) = e.params["dimension_numbers"]
  free_l = [lab for d, lab in enumerate(lhs) if d not in lc and d not in lb]
  free_r = [lab for d, lab in enumerate(rhs) if d not in rc and not lab.startswith("B")]
  return [f"B{j}" for j in range(len(lb))] + free_l + free_r


def _to_canonical(x, labels, order):
  """``x`` (axes ``labels``) as the axes ``order``; an absent label becomes a unit axis."""
  keep = [d for d, lab in enumerate(labels) if lab != "U"]
  x = x.reshape([x.shape[d] for d in keep])
  labels = [labels[d] for d in keep]
  present = [lab for lab in order if lab in labels]
  x = jnp.transpose(x, [labels.index(lab) for lab in present])
  return x.reshape([x.shape[present.index(lab)] if lab in present else 1 for lab in order])


def _from_canonical(x, order, labels, shape):
  """Inverse of `_to_canonical` onto ``labels`` and ``shape``."""
  present = [lab for lab in labels if lab != "U"]
  x = x.reshape([x.shape[order.index(lab)] for lab in order if lab in present])
  have = [lab for lab in order if lab in present]
  x = jnp.transpose(x, [have.index(lab) for lab in present])
  return x.reshape(shape)


def _match_attention(g, i, actions, log, count):
  s = _softmax_of(g, i)
  if s is None:
    return
  p = g.eqns[i].outvars[0]
  chain = _scores_chain(g, s)
  if isinstance(chain, str):
    _left(log, g, "attention", i, chain)
    return
  qk_i, steps = chain
  # the probabilities feed one matmul with v, through casts
  pp = p
  while (c := g.only_consumer(pp)) is not None and g.eqns[c].primitive.name == (
      "convert_element_type"):
    pp = g.eqns[c].outvars[0]
  if c is None or g.eqns[c].primitive.name != "dot_general":
    _left(log, g, "attention", i, "the probabilities feed something other than one matmul "
          "(dropout on them, or returned)")
    return
  reason = _build_attention(g, qk_i, steps, i, pp, c, actions, log, count)
  if reason:
    _left(log, g, "attention", i, reason)


def _build_attention(g, qk_i, steps, sm_i, pp, pv_i, actions, log, count):
  qk = g.eqns[qk_i]
  lhs = _operand_labels(qk, 0, "L")
  rhs = _operand_labels(qk, 1, "R")
  if lhs is None or rhs is None:
    return ("the query-key matmul has more than one query or key axis (and no group axis "
            "right after the kv heads)")
  nb = len(qk.params["dimension_numbers"][1][0])
  if nb > 2:
    return "more than two batch axes in the scores"
  labels = _out_labels(qk, lhs, rhs)
  stage = []  # (kind, eqn, operand index, labels at that op)
  for kind, e, k in steps:
    if kind == "layout":
      labels = _relabel(e, labels)
      if labels is None:
        return "a reshape of the scores merges or splits axes"
    else:
      stage.append((kind, e, k, list(labels)))
  if labels[-1] not in ("L", "R"):
    return "the softmax is not over the keys"
  k_side = 0 if labels[-1] == "L" else 1
  kinds = [st[0] for st in stage]
  if "scale" in kinds and any(kd in ("bias", "mask", "mask_not") for kd in
                              kinds[:kinds.index("scale")]):
    return "the scores are scaled after a bias or mask"
  if kinds.count("scale") > 1 or kinds.count("bias") > 1 or len(
      [kd for kd in kinds if kd.startswith("mask")]) > 1:
    return "more than one scale, bias or mask"
  to_canon = {"L" if k_side == 1 else "R": "T", "L" if k_side == 0 else "R": "S", "D": "D",
              "U": "U", "B0": "B0", "B1": "B1", "G": "G"}
  order_qkv = ["B0", "T", "B1", "D"]
  order_mask = ["B0", "B1", "T", "S"]
  if "G" in labels:  # grouped-query attention: q's heads are (B1, G), k's and v's B1
    if "G" in (lhs if k_side == 0 else rhs):
      return "the keys, not the queries, have the group axis"
    order_q, order_mask = ["B0", "T", "B1", "G", "D"], ["B0", "B1", "G", "T", "S"]
  else:
    order_q = order_qkv
  pv = g.eqns[pv_i]
  p_side = pv.invars.index(pp)
  (lc, rc), (lb, rb) = pv.params["dimension_numbers"]
  p_contract, p_batch = (lc, lb) if p_side == 0 else (rc, rb)
  v_contract, v_batch = (rc, rb) if p_side == 0 else (lc, lb)
  p_labels = [to_canon[lab] for lab in labels]
  if [p_labels[d] for d in p_contract] != ["S"] or sorted(
      p_labels[d] for d in p_batch) != [f"B{j}" for j in range(nb)]:
    return "the probabilities' matmul does not contract the keys"
  v_var = pv.invars[1 - p_side]
  v_labels = [None] * v_var.aval.ndim
  for dp, dv in zip(p_batch, v_batch):
    v_labels[dv] = p_labels[dp]
  v_labels[v_contract[0]] = "T"  # v's key axis plays the length axis of its layout
  free_v = [d for d in range(v_var.aval.ndim) if v_labels[d] is None]
  big = [d for d in free_v if v_var.aval.shape[d] != 1]
  if len(big) != 1 or len(v_contract) != 1:
    return "the values have more than one feature axis"
  for d in free_v:
    v_labels[d] = "D" if d == big[0] else "U"
  p_free = [p_labels[d] for d in range(len(p_labels)) if d not in p_contract and d not in p_batch]
  v_free = [v_labels[d] for d in free_v]
  out_labels = [f"B{j}" for j in range(nb)] + (v_free + p_free if p_side == 1 else p_free + v_free)
  q_side = 1 - k_side
  q_labels = [to_canon[lab] for lab in (lhs if q_side == 0 else rhs)]
  k_labels = [to_canon[lab] for lab in (rhs if q_side == 0 else lhs)]
  k_labels = ["T" if lab == "S" else lab for lab in k_labels]
  q_var, k_var = qk.invars[q_side], qk.invars[k_side]
  if q_var.aval.dtype != k_var.aval.dtype or q_var.aval.dtype != v_var.aval.dtype:
    return "q, k and v differ in dtype"
  head_dim = q_var.aval.shape[q_labels.index("D")]
  extras, shapes = [], []
  for kind, e, var, lab in stage:
    var, shape = (var, None) if kind == "scale" else _unbroadcast(g, var)
    if kind != "scale" and len(shape or var.aval.shape) != len(lab):
      return "a mask or bias of another rank than the scores"
    extras.append(var)
    shapes.append(shape)
  out, tags = pv.outvars[0], []
  while (c := g.only_consumer(out)) is not None and (
      g.eqns[c].primitive.name in ("transpose", "convert_element_type", "copy", "name")
      or g.eqns[c].primitive.name == "reshape" and _unit_reshape(g.eqns[c])):
    relabelled = _relabel(g.eqns[c], out_labels)
    if relabelled is None:
      break
    out_labels, out = relabelled, g.eqns[c].outvars[0]
    tags += [g.eqns[c]] if g.eqns[c].primitive.name == "name" else []

  dynamic = [v for v in extras if isinstance(v, jcore.Var)]
  merged = _merged_matmul(g, out)  # the output projection, on out's own layout
  final = out if merged is None else g.eqns[merged[1]].outvars[0]

  def fn(qv, kv, vv, *dv):
    if merged is not None:
      *dv, wv = dv
    it = iter(dv)
    ev = [next(it) if isinstance(v, jcore.Var) else v.val for v in extras]
    qc = _to_canonical(qv, q_labels, order_q)
    kc = _to_canonical(kv, k_labels, order_qkv)
    vc = _to_canonical(vv, v_labels, order_qkv)
    factor, bias, mask = math.sqrt(head_dim), None, None
    for (kind, e, _, lab), x, shape in zip(stage, ev, shapes):
      lab = [to_canon[t] for t in lab]
      if shape is not None:
        x = x.reshape(shape)
      if kind == "scale":
        factor = (factor * x) if e.primitive.name == "mul" else (factor / x)
      elif kind == "bias":
        bias = _to_canonical(x, lab, order_mask)
      else:
        m = _to_canonical(x, lab, order_mask)
        mask = m if kind == "mask" else jnp.logical_not(m)
    if order_q is not order_qkv:
      kv_heads, groups = qc.shape[2], qc.shape[3]
      qc = _merge_groups(qc, order_q)

      def grouped(x):
        if x is not None and x.shape[1:3] not in ((1, 1), (kv_heads, groups)):
          x = jnp.broadcast_to(x, x.shape[:1] + (kv_heads, groups) + x.shape[3:])
        return None if x is None else _merge_groups(x, order_mask)
      bias, mask = grouped(bias), grouped(mask)
    if not (isinstance(factor, (float, np.generic)) and float(factor) == 1.0):
      qc = (qc.astype(jnp.float32) * factor).astype(qc.dtype)
    o = attention_ops.attention(qc, kc, vc, mask=mask, bias=bias)
    if order_q is not order_qkv:
      o = o.reshape(o.shape[:2] + (kv_heads, groups) + o.shape[3:])
    o = _from_canonical(o, order_q, out_labels, out.aval.shape).astype(out.aval.dtype)
    for tag in tags:
      o = _apply_layout(tag, o, names.ATTN_OUT)
    if merged is not None:
      o = _contract_merged(g.eqns[merged[1]], merged[2], o, wv)
    return [o]

  inputs = [q_var, k_var, v_var] + dynamic + ([] if merged is None else [merged[0]])
  indices = _slice(g, [final], set(inputs))
  if not g.closed(indices, {final}):
    return "the scores or probabilities are used elsewhere"
  actions[g.index(final)] = _Action(inputs, [final], fn)
  g.taken |= indices
  op = "lm.attention" + ("" if merged is None else " + output projection on its layout")
  if count:
    orig = _sub_fn(g, indices, inputs, [final])
    _record(log, g, "attention", op, sm_i, True, orig, fn, [_aval(v) for v in inputs])
  else:
    _record(log, g, "attention", op, sm_i, False)
  if merged is not None:
    _record(log, g, "layout", "matmul over the attention output's heads and features", merged[1],
             False)
  return None


# --- the loss head -----------------------------------------------------------


def _row_back(g, v):
  """``v`` followed back through casts, stop_gradient and the reshapes and broadcasts of a
  per-row value that keep its rows in place (``[...] <-> [..., 1] -> [..., V]``)."""
  while (e := g.prod(v)) is not None and len(e.invars) == 1:
    x, out = e.invars[0].aval.shape, e.outvars[0].aval.shape
    name, n = e.primitive.name, len(out) - 1
    if name in ("convert_element_type", "stop_gradient", "copy") or (
        name == "reshape" and (x == out + (1,) or out == x + (1,))) or (
        name == "broadcast_in_dim" and x[:n] == out[:n] and len(x) in (n, n + 1)
        and tuple(e.params["broadcast_dimensions"]) == tuple(range(len(x)))):
      v = e.invars[0]
    else:
      break
  return v


def _row_max_of(g, m):
  """``l`` if ``m`` is ``max(l)`` over l's last axis, through the guards log_softmax and
  logsumexp put on it (``max(-inf, .)``, ``where(isfinite(.), ., 0)``, stop_gradient,
  broadcasts), else None."""
  m = _row_back(g, m)
  e = g.prod(m)
  if e is not None and e.primitive.name == "select_n" and len(e.invars) == 3:
    fin = g.prod(e.invars[0])
    if (fin is None or fin.primitive.name != "is_finite" or fin.invars[0] is not e.invars[2]
        or _fill_value(g, e.invars[1]) != 0.0):
      return None
    m = _row_back(g, e.invars[2])
    e = g.prod(m)
  if e is not None and e.primitive.name == "max" and any(
      _scalar(v) == -math.inf for v in e.invars):
    m = _row_back(g, next(v for v in e.invars if _scalar(v) is None))
    e = g.prod(m)
  if e is None or e.primitive.name != "reduce_max" or tuple(e.params["axes"]) != (
      e.invars[0].aval.ndim - 1,):
    return None
  return e.invars[0]


def _shifted_of(g, s):
  """``l`` if ``s`` is ``l - max(l)`` (`_row_max_of`), else None."""
  e = g.prod(s)
  if e is None or e.primitive.name != "sub":
    return None
  return e.invars[0] if _row_max_of(g, e.invars[1]) is e.invars[0] else None


def _log_sum_exp_of(g, v):
  """``(l, shifted)`` if ``v`` is ``log(sum(exp(l - max(l))))`` over l's last axis
  (shifted True: log_softmax's) or that plus ``max(l)`` (False: ``logsumexp``), else None."""
  v = _row_back(g, v)
  e = g.prod(v)
  if e is not None and e.primitive.name == "add":
    for a, b in (e.invars, e.invars[::-1]):
      inner = _log_sum_exp_of(g, a)
      if inner is not None and inner[1] and _row_max_of(g, b) is inner[0]:
        return inner[0], False
    return None
  if e is None or e.primitive.name != "log":
    return None
  r = e.invars[0]
  if (a := g.prod(_row_back(g, r))) is not None and a.primitive.name == "abs":
    r = a.invars[0]
  r = g.prod(_row_back(g, r))
  if r is None or r.primitive.name != "reduce_sum" or tuple(r.params["axes"]) != (
      r.invars[0].aval.ndim - 1,):
    return None
  ex = g.prod(g.back(r.invars[0], {"convert_element_type"}))
  if ex is None or ex.primitive.name != "exp":
    return None
  l = _shifted_of(g, ex.invars[0])
  return None if l is None else (l, True)


_GATHER_MODES = (lax.GatherScatterMode.FILL_OR_DROP, lax.GatherScatterMode.CLIP,
                 lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def _takes_last(e) -> bool:
  """True if gather ``e`` is ``take_along_axis(x, idx[..., None], -1)``: one element of x's
  last axis per row, ``[..., V] -> [..., 1]``."""
  x, idx = e.invars
  n, dn = x.aval.ndim, e.params["dimension_numbers"]
  batching = tuple(dn.operand_batching_dims)  # the lead axes but unit ones (offset axes)
  units = [a for a in range(n - 1) if a not in batching]
  return (n >= 1 and tuple(dn.collapsed_slice_dims) == (n - 1,)
          and tuple(dn.start_index_map) == (n - 1,) and batching == tuple(sorted(batching))
          and tuple(dn.start_indices_batching_dims) == tuple(range(len(batching)))
          and all(x.aval.shape[a] == 1 for a in units)
          and idx.aval.size == math.prod(x.aval.shape[:-1])
          and all(size == 1 for size in e.params["slice_sizes"])
          and e.outvars[0].aval.shape == x.aval.shape[:-1] + (1,)
          and e.params["mode"] in _GATHER_MODES
          and (e.params["mode"] != lax.GatherScatterMode.FILL_OR_DROP
               or e.params["fill_value"] is None or np.isnan(e.params["fill_value"])))


def _log_prob_at_label(g, gi):
  """``(l, out, sign, via_lse)`` if gather ``gi`` starts ``out = sign * cross_entropy(l,
  labels)``: ``log_softmax(l)`` taken at the labels (``out`` the gather's output, sign -1,
  via_lse False), or ``logsumexp(l)`` less ``l`` taken at the labels (``out`` the
  difference, sign +1, or -1 for ``picked - logsumexp``; via_lse True); else None."""
  x = g.back(g.eqns[gi].invars[0], {"convert_element_type"})
  e = g.prod(x)
  if e is not None and e.primitive.name == "sub":
    lse = _log_sum_exp_of(g, e.invars[1])
    l = _shifted_of(g, e.invars[0])
    if lse is not None and lse[1] and lse[0] is l:
      return l, g.eqns[gi].outvars[0], -1, False
  cur = g.eqns[gi].outvars[0]
  while (c := g.only_consumer(cur)) is not None:
    e = g.eqns[c]
    if e.primitive.name in ("squeeze", "reshape", "convert_element_type", "copy") or (
        e.primitive.name == "gather" and e.invars[0] is cur and e.invars[0].aval.shape[-1] == 1
        and e.outvars[0].aval.shape == cur.aval.shape[:-1]):  # optax's [..., 0]
      cur = e.outvars[0]
      continue
    if e.primitive.name != "sub":
      return None
    side = 1 if e.invars[1] is cur else 0
    lse = _log_sum_exp_of(g, e.invars[1 - side])
    if lse is None or lse[1] or g.back(lse[0], {"convert_element_type"}) is not x:
      return None
    return lse[0], e.outvars[0], 1 if side == 1 else -1, True
  return None


def _head_matmul(g, l):
  """``(h, w, w_layout, bias)`` if ``l`` is ``h @ w`` (+ a ``[V]`` bias) through casts and
  reshapes that keep the last axis, ``w`` ``[d, V]`` ("dv") or ``[V, d]`` ("vd"); else None."""
  vocab, bias, v = l.aval.shape[-1], None, l
  while (e := g.prod(v)) is not None:
    name = e.primitive.name
    if name in ("convert_element_type", "copy") or (
        name == "reshape" and e.invars[0].aval.shape[-1:] == (vocab,)):
      v = e.invars[0]
    elif name == "add" and bias is None:
      side = next((k for k in (0, 1) if _feature_vector(g, e.invars[1 - k], vocab) is not None),
                  None)
      if side is None:
        return None
      bias, v = _feature_vector(g, e.invars[1 - side], vocab), e.invars[side]
    else:
      break
  if e is None or e.primitive.name != "dot_general":
    return None
  (ca, cb), (ba, bb) = e.params["dimension_numbers"]
  h, w = e.invars
  if ba or bb or w.aval.ndim != 2 or h.aval.ndim < 1 or tuple(ca) != (h.aval.ndim - 1,) or (
      tuple(cb) not in ((0,), (1,))) or w.aval.shape[1 - cb[0]] != vocab:
    return None
  return h, w, "dv" if tuple(cb) == (0,) else "vd", bias


def _match_loss(g, gi, actions, log, count):
  if not _takes_last(g.eqns[gi]):
    return
  found = _log_prob_at_label(g, gi)
  if found is None:
    return
  l, out, sign, via_lse = found
  head = _head_matmul(g, l)
  if head is None:
    _left(log, g, "loss", gi, "the logits are not a matmul of the hidden states (+ a bias)")
    return
  h, w, layout, bias = head
  if not {h.aval.dtype, w.aval.dtype} <= {jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16,
                                                                 jnp.float16)}:
    _left(log, g, "loss", gi, f"the matmul's inputs are {h.aval.dtype} and {w.aval.dtype}: "
          "linear_cross_entropy takes float32, bfloat16 and float16")
    return
  lead, vocab, d = l.aval.shape[:-1], l.aval.shape[-1], h.aval.shape[-1]
  if vocab <= d:
    _left(log, g, "loss", gi, f"the logits ({vocab} wide) are no wider than the hidden "
          f"states ({d}): nothing to save")
    return
  gather = g.eqns[gi]
  idx = gather.invars[1]
  inputs = [h, w, idx] + ([] if bias is None else [bias])
  indices = _slice(g, [out], set(inputs))
  made = {v for i in indices for v in g.eqns[i].outvars}
  free = {v for i in indices for v in g.eqns[i].invars if isinstance(v, jcore.Var)} - made
  if indices & g.taken or not free <= set(inputs) or not g.closed(indices, {out}):
    _left(log, g, "loss", gi, "the logits or their log-softmax are used elsewhere")
    return
  mode = gather.params["mode"]
  dtype = jnp.result_type(h.aval.dtype, w.aval.dtype)

  def fn(hv, wv, iv, *bv):
    labels = iv.reshape(lead)
    if mode == lax.GatherScatterMode.CLIP:
      labels = jnp.clip(labels, 0, vocab - 1)
    ce = losses.linear_cross_entropy(hv.reshape(lead + (d,)).astype(dtype), wv.astype(dtype),
                                     labels, bias=bv[0] if bv else None, reduction="none",
                                     w_layout=layout)
    ce = sign * ce
    if mode == lax.GatherScatterMode.FILL_OR_DROP:  # out of range: the gather's NaN
      valid = (labels >= 0) & (labels < vocab)
      # through logsumexp the NaN is added to lse, whose gradient stays; else it replaces all
      ce = ce + jnp.where(valid, 0.0, jnp.nan) if via_lse else jnp.where(valid, ce, jnp.nan)
    return [ce.reshape(out.aval.shape).astype(out.aval.dtype)]

  actions[g.index(out)] = _Action(inputs, [out], fn)
  g.taken |= indices
  op = "linear_cross_entropy" + (" (tied embedding)" if layout == "vd" else "")
  matmul = min(i for i in indices if g.eqns[i].primitive.name == "dot_general")  # the user's line
  if count:
    _record(log, g, "loss", op, matmul, True, _sub_fn(g, indices, inputs, [out]), fn,
            [_aval(v) for v in inputs])
  else:
    _record(log, g, "loss", op, matmul, False)


def _merged_matmul(g, out):
  """``(w, dot index, side)`` where ``out`` [..., h, d] is only reshaped to
  [..., h * d] for one ``dot_general`` contracting that axis with ``w``'s; else None.

  Contracting over ``out``'s two axes instead keeps one array for backward, not
  ``out`` and its reshape: autodiff counts them apart.
  """
  r = g.only_consumer(out)
  if r is None or g.eqns[r].primitive.name != "reshape" or out.aval.ndim < 2:
    return None
  merged = g.eqns[r].outvars[0]
  *lead, h, d = out.aval.shape
  if merged.aval.shape != (*lead, h * d) or g.eqns[r].params.get("dimensions") is not None:
    return None
  c = g.only_consumer(merged)
  if c is None or g.eqns[c].primitive.name != "dot_general":
    return None
  e = g.eqns[c]
  (lc, rc), (lb, rb) = e.params["dimension_numbers"]
  side = e.invars.index(merged)
  if lb or rb or e.invars[0] is e.invars[1] or list((lc, rc)[side]) != [len(lead)]:
    return None
  return e.invars[1 - side], c, side


def _contract_merged(e, side, o, w):
  """``dot_general`` ``e`` with its operand on ``side`` given as ``o`` [..., h, d],
  unmerged, and the other operand ``w`` split to match: the same result."""
  (lc, rc), _ = e.params["dimension_numbers"]
  axis = (rc, lc)[side][0]  # w's contracted axis
  h, d = o.shape[-2:]
  w = w.reshape(*w.shape[:axis], h, d, *w.shape[axis + 1:])
  o_axes, w_axes = (o.ndim - 2, o.ndim - 1), (axis, axis + 1)
  lhs, rhs, dims = (o, w, (o_axes, w_axes)) if side == 0 else (w, o, (w_axes, o_axes))
  return lax.dot_general(lhs, rhs, (dims, ((), ())),
                         precision=e.params.get("precision"),
                         preferred_element_type=e.params.get("preferred_element_type"),
                         out_sharding=e.params.get("out_sharding"))


def _unbroadcast(g, var):
  """``(source, shape)``: ``var`` is ``source`` broadcast; ``shape`` has 1 on new axes."""
  e = g.prod(var)
  if e is None or e.primitive.name != "broadcast_in_dim" or not isinstance(
      e.invars[0], jcore.Var) or list(e.params["broadcast_dimensions"]) != sorted(
          e.params["broadcast_dimensions"]):
    return var, None
  shape = [1] * var.aval.ndim
  for j, d in enumerate(e.params["broadcast_dimensions"]):
    shape[d] = e.invars[0].aval.shape[j]
  return e.invars[0], tuple(shape)
