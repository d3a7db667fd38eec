"""The activation matcher: an elementwise function of one array equal, on test points, to
GELU, SiLU or ReLU becomes `regelu2`, `regelu2_tanh`, `resilu2` or `relu` (Approx-BP,
LowMemoryBP, arXiv:2406.16282).

`relu` (a 1-bit mask) keeps ReLU's gradient exactly; the other three change the gradient
(a 2-bit step function for the derivative) and run only when asked (``approx``). Otherwise
GELU and SiLU keep their gradient: the user's own ops run under `jax.checkpoint`, so the
backward keeps their input alone and recomputes the rest (the next matmul keeps the
output), where autodiff kept up to five more arrays of its size."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from lowmem_jax import _jax
from lowmem_jax.ops import activations as activation_ops
from lowmem_jax.transform.graph import LAYOUT, scalar
from lowmem_jax.transform.interpreter import Action, bind, eqns_fn, inline_jit

# One elementwise function of one array: what an activation region may hold.
_ELEMENTWISE = frozenset({
    "abs", "add", "convert_element_type", "copy", "div", "erf", "erfc", "exp", "exp2",
    "expm1", "integer_pow", "log", "log1p", "logistic", "max", "min", "mul", "neg", "pow",
    "rsqrt", "sign", "sqrt", "square", "sub", "tanh", "custom_jvp_call",
})

_TEST_X = np.concatenate([np.linspace(-8.0, 8.0, 321), [-30.0, -12.0, 12.0, 30.0]])

_ACTIVATIONS = {  # name: (primitive hint, exact twin, replacement, gradient exact)
    "regelu2": ({"erf", "erfc"}, lambda x: jax.nn.gelu(x, approximate=False),
                activation_ops.regelu2, False),
    "tanh-gelu → regelu2 backward": ({"tanh"}, jax.nn.gelu, activation_ops.regelu2_tanh,
                                     False),
    "resilu2": ({"logistic", "exp"}, jax.nn.silu, activation_ops.resilu2, False),
    "relu": ({"max", "custom_jvp_call"}, jax.nn.relu, activation_ops.relu, True),
}
# Without ``approx``, what an activation of an approximate rewrite becomes instead: the user's
# own ops under `jax.checkpoint`, which keeps their input alone (the tanh GELU's autodiff keeps
# five arrays of its size beside it, SiLU's three).
_RECOMPUTED = {"regelu2": "erf GELU", "tanh-gelu → regelu2 backward": "tanh GELU",
               "resilu2": "SiLU"}
_TOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2e-2,
        jnp.dtype(jnp.float16): 3e-3}


def match(g, actions, pass_, approx=False):
  """Replaces each activation region of ``g`` that is not a norm's statistics: ReLU, and
  with ``approx`` GELU and SiLU too (their backward approximate)."""
  root = _regions(g)
  reduced = _reduced(g)
  for z, (x, idx) in root.items():
    if idx & g.taken or x in reduced or not g.closed(idx, {z}):
      continue
    name = _identify(eqns_fn(g, idx, [x], [z], bind_eqn=_bind_pointwise), x, z,
                     {g.eqns[i].primitive.name for i in idx})
    if name is None:
      continue
    anchor = g.index(z)
    _, _, replacement, exact = _ACTIVATIONS[name]
    if not (exact or approx):
      _recompute(g, actions, pass_, x, z, idx, _RECOMPUTED[name])
      continue
    out_dtype = z.aval.dtype

    def fn(xv, replacement=replacement, out_dtype=out_dtype):
      return [replacement(xv).astype(out_dtype)]

    actions[anchor] = Action([x], [z], fn)
    g.taken |= idx
    pass_.rewrote(g, "activation", name, anchor, [x], eqns_fn(g, idx, [x], [z]), fn,
                  exact=exact)


def _recompute(g, actions, pass_, x, z, idx, label):
  """The activation region ``idx`` (``x`` to ``z``) as its own ops under `jax.checkpoint`:
  its input kept, the rest recomputed in the backward, so its gradient is exact. Where
  ``z`` feeds one matmul alone (through layout ops), the matmul joins the region: the
  backward makes ``z`` again for the weight's gradient, and no ``z``-sized array is kept."""
  indices, out, inputs = set(idx), z, [x]
  while (c := g.only_consumer(out)) is not None and c not in g.taken and (
      g.eqns[c].primitive.name in LAYOUT) and len(g.eqns[c].invars) == 1:
    indices.add(c)
    out = g.eqns[c].outvars[0]
  e = g.eqns[c] if c is not None and c not in g.taken else None
  if e is not None and e.primitive.name == "dot_general" and e.invars.count(out) == 1:
    indices.add(c)
    inputs = [x] + [v for v in e.invars if v is not out]
    out, label = e.outvars[0], f"{label} and the matmul it feeds, recomputed from its input"
  else:
    indices, out, label = set(idx), z, f"{label}, recomputed from its input"
  region = eqns_fn(g, indices, inputs, [out])
  fn = jax.checkpoint(region)
  actions[g.index(out)] = Action(inputs, [out], fn)
  g.taken |= indices
  pass_.rewrote(g, "activation", label, g.index(z), inputs, region, fn)


def _bind_pointwise(eqn, invals):
  """`bind` on arrays of any shape: relu's custom_jvp_call, whose function is traced for
  the region's shape, as the ``max(x, 0)`` it is (`_relu_call`)."""
  if eqn.primitive.name == "custom_jvp_call":
    return [lax.max(invals[0], jnp.zeros((), invals[0].dtype))]
  return bind(eqn, invals)


def _relu_call(e) -> bool:
  """True for a custom_jvp_call whose function is one elementwise max (jax.nn.relu)."""
  inner, _ = inline_jit(e.params["call_jaxpr"].jaxpr, e.params["call_jaxpr"].consts)
  return (len(inner.eqns) == 1 and inner.eqns[0].primitive.name == "max"
          and any(scalar(v) == 0.0 for v in inner.eqns[0].invars))


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
      if scalar(v) is not None:
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


def _reduced(g):
  """Vars computed from reductions alone by elementwise and layout ops (norm statistics)."""
  out = set()
  for e in g.eqns:
    name = e.primitive.name
    arrays = [v for v in e.invars if isinstance(v, jcore.Var)]
    if name.startswith("reduce_") or (name in _ELEMENTWISE | LAYOUT and arrays and all(
        v in out for v in arrays)):
      out.update(e.outvars)
  return out


def _identify(region, x, z, prims):
  """The name in ``_ACTIVATIONS`` equal to ``region`` (a function of ``x`` making ``z``)
  on the test points, or None; ``prims`` the region's primitives."""
  dtype = jnp.dtype(x.aval.dtype)
  if dtype not in _TOL:
    return None
  xs = jnp.asarray(_TEST_X, dtype)
  with _jax.eval_context():  # test points evaluate while tracing
    got = np.asarray(region(xs)[0], np.float32)
    for name, (hint, twin, _, _) in _ACTIVATIONS.items():
      if not prims & hint:
        continue
      want = np.asarray(twin(xs.astype(jnp.float32)).astype(z.aval.dtype), np.float32)
      if np.all(np.abs(got - want) <= _TOL[dtype] * (1 + np.abs(want))):
        return name
  return None
