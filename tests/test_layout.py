"""`lowmem_jax.ops._layout`: the barrier changes no value, shape or gradient."""

import chex
import jax
import jax.numpy as jnp
import pytest

from lowmem_jax.ops import _layout


@pytest.mark.parametrize("shape", [(), (5,), (2, 3, 4), (0, 3), (2, 0, 4)])
def test_barrier_rows_is_the_identity(shape):
  x = jax.random.normal(jax.random.key(0), shape)
  (y,) = jax.jit(_layout.barrier_rows)(x)
  assert y.shape == x.shape and y.dtype == x.dtype
  chex.assert_trees_all_equal(y, x)


def test_barrier_rows_passes_gradients_and_keeps_each_array():
  a, b = jnp.arange(24.0).reshape(2, 3, 4), jnp.arange(6.0).reshape(2, 3)
  loss = lambda a, b: sum(jnp.sum(v ** 2) for v in _layout.barrier_rows(a, b))
  chex.assert_trees_all_close(jax.grad(loss, (0, 1))(a, b), (2 * a, 2 * b))
