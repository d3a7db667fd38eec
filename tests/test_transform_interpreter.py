"""lowmem_jax/transform/interpreter.py: the one evaluator `lm.lowmem` runs jaxprs with."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowmem_jax.transform import interpreter


def _f(x, w):
  @jax.jit
  def inner(y):
    return jnp.tanh(y @ w)

  def body(c, xi):
    return c + inner(xi).sum(), c

  c, ys = lax.scan(body, 0.0, x)
  return lax.cond(c > 0, lambda: ys * 2.0, lambda: ys)


def test_eval_jaxpr_without_actions_is_the_function():
  x, w = jnp.arange(12.0).reshape(3, 4) / 10, jnp.ones((4, 4)) / 4
  closed = jax.make_jaxpr(_f)(x, w)
  got = interpreter.eval_jaxpr(closed.jaxpr, closed.consts, [x, w], {})
  np.testing.assert_allclose(got[0], _f(x, w), rtol=1e-6)


def test_inline_jit_leaves_no_jit_call_and_computes_the_same():
  x, w = jnp.ones((3, 4)), jnp.ones((4, 4))
  closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x @ w))(x)
  assert any(e.primitive.name in ("jit", "pjit") for e in closed.jaxpr.eqns)
  jaxpr, consts = interpreter.inline_jit(closed.jaxpr, closed.consts)
  assert not any(e.primitive.name in ("jit", "pjit") for e in jaxpr.eqns)
  np.testing.assert_allclose(interpreter.eval_jaxpr(jaxpr, consts, [x], {})[0], jnp.sin(x @ w))


def test_an_action_replaces_its_equation():
  closed = jax.make_jaxpr(lambda x: jnp.sin(x) + 1.0)(jnp.ones(3))
  [i] = [i for i, e in enumerate(closed.jaxpr.eqns) if e.primitive.name == "sin"]
  e = closed.jaxpr.eqns[i]
  actions = {i: interpreter.Action(list(e.invars), list(e.outvars), lambda x: [jnp.cos(x)])}
  got = interpreter.eval_jaxpr(closed.jaxpr, closed.consts, [jnp.zeros(3)], actions)
  np.testing.assert_allclose(got[0], jnp.cos(jnp.zeros(3)) + 1.0)
