"""lowmem_jax/transform/graph.py: the graph of one jaxpr as the matchers read it."""

import jax
import jax.numpy as jnp

from lowmem_jax.transform import graph


def _graph(f, *args):
  return graph.Graph(jax.make_jaxpr(f)(*args).jaxpr)


def test_producers_consumers_and_layout_followed_back():
  def f(x):
    y = jnp.sin(x)
    return jnp.cos(y.reshape(2, 2).astype(jnp.float32)) + y.reshape(2, 2)

  g = _graph(f, jnp.ones(4, jnp.float32))
  [sin] = [i for i, e in enumerate(g.eqns) if e.primitive.name == "sin"]
  y = g.eqns[sin].outvars[0]
  assert g.prod(y) is g.eqns[sin] and g.prod(g.jaxpr.invars[0]) is None
  assert len(g.consumers[y]) == 2 and g.only_consumer(y) is None
  [cos] = [e for e in g.eqns if e.primitive.name == "cos"]
  assert g.back(cos.invars[0]) is y  # through the reshape (and a cast to its own dtype)
  assert g.closed({sin}, set()) is False  # y is read outside


def test_upstream_and_live_take_only_what_the_outputs_need():
  def f(x):
    a, b = jnp.sin(x), jnp.cos(x)
    return a * 2.0, b

  g = _graph(f, jnp.ones(3))
  out_a = g.jaxpr.outvars[0]
  needed = graph.upstream(g, [out_a], stops=set())
  assert {g.eqns[i].primitive.name for i in needed} == {"sin", "mul"}
  assert graph.live(g.eqns, range(len(g.eqns)), {}, [out_a]) == sorted(needed)


def test_constants_and_fill_values_are_read_from_literals():
  def f(x):
    n = x.shape[0] - 1  # a Python int: a literal
    return jnp.full_like(x, 3.0) / (jnp.float32(n) * 2.0)

  g = _graph(f, jnp.ones(5))
  [div] = [e for e in g.eqns if e.primitive.name == "div"]
  assert graph.fill_value(g, div.invars[0]) == 3.0
  assert graph.constant(g, div.invars[1]) == 8.0  # 4 * 2, through the mul
  assert graph.aval(div.outvars[0]).shape == (5,)
