"""`lowmem_jax._jaxpr`, the one jaxpr toolkit: nested jaxprs found by what a parameter holds,
the walk with each equation's run count, and the backward sweep."""

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from lowmem_jax import _jaxpr


def _only(jaxpr, name):
  [eqn] = [e for e in jaxpr.eqns if e.primitive.name == name]
  return eqn


def test_call_body_is_the_body_a_call_runs_once_and_none_for_loops_and_primitives():
  x = jnp.ones(3)
  inner = lambda a, b: jnp.sin(a) * b
  jitted = jax.make_jaxpr(lambda a, b: jax.jit(inner)(a, b))(x, x).jaxpr
  [call] = jitted.eqns
  body = _jaxpr.call_body(call)
  assert isinstance(body, jcore.Jaxpr) and len(body.invars) == 2
  assert {e.primitive.name for e in body.eqns} == {"sin", "mul"}
  remat = jax.make_jaxpr(jax.checkpoint(inner))(x, x).jaxpr
  assert _jaxpr.call_body(remat.eqns[0]) is not None
  custom = jax.make_jaxpr(jax.nn.relu)(x).jaxpr  # a custom_jvp_call
  assert _jaxpr.call_body(custom.eqns[0]) is not None
  scanned = jax.make_jaxpr(lambda a: jax.lax.scan(lambda c, y: (c + y, c), 0.0, a))(x).jaxpr
  assert _jaxpr.call_body(_only(scanned, "scan")) is None  # its body runs 3 times
  assert _jaxpr.call_body(jax.make_jaxpr(jnp.sin)(x).jaxpr.eqns[0]) is None


def test_walk_counts_a_scans_body_as_often_as_it_runs():
  def f(a):
    def outer(c, row):
      inner, _ = jax.lax.scan(lambda d, y: (d + jnp.cos(y), None), c, row)
      return inner, None
    return jax.lax.scan(outer, 0.0, a)[0]

  jaxpr = jax.make_jaxpr(f)(jnp.ones((4, 5))).jaxpr
  cos = [times for eqn, times in _jaxpr.walk(jaxpr) if eqn.primitive.name == "cos"]
  assert cos == [20]
  assert [t for e, t in _jaxpr.walk(jaxpr) if e.primitive.name == "scan"] == [1, 4]


def test_used_inputs_look_into_a_call_and_not_through_a_loop():
  x = jnp.ones(3)
  f = lambda a, b, c: jax.jit(lambda p, q, r: p * 2.0)(a, b, c)  # b and c unread inside
  assert _jaxpr.used_inputs(jax.make_jaxpr(f)(x, x, x).jaxpr) == [0]
  g = lambda a, b: jax.lax.fori_loop(0, 3, lambda i, c: (c[0] + 1.0, c[1]), (a, b))[0]
  assert _jaxpr.used_inputs(jax.make_jaxpr(g)(x, x).jaxpr) == [0, 1]  # a loop reads all


def test_live_keeps_what_the_outputs_need_and_every_effect():
  a, b, c, d = (object() for _ in range(4))
  literal = jcore.Literal(1.0, jax.typeof(1.0))
  steps = [_jaxpr.Step([a], [b], False),  # needed by the output d
           _jaxpr.Step([a], [c], False),  # dead
           _jaxpr.Step([literal], [], True),  # an effect: kept
           _jaxpr.Step([b, literal], [d], False)]
  assert _jaxpr.live(steps, [d]) == [0, 2, 3]
  assert _jaxpr.live(steps, []) == [2]
