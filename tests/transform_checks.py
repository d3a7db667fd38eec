"""Inputs and checks shared by the tests of `lm.lowmem`'s rewrites (test_transform.py,
test_transform_loss.py)."""

import chex
import jax
import jax.numpy as jnp

import lowmem_jax as lm

KEY = jax.random.key(0)
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 3e-3}


def normal(shape, dtype=jnp.float32, key=KEY, scale=1.0):
  return (scale * jax.random.normal(key, shape)).astype(dtype)


def close(a, b, tol):
  chex.assert_trees_all_close(jax.tree.map(lambda x: x.astype(jnp.float32), a),
                              jax.tree.map(lambda x: x.astype(jnp.float32), b),
                              atol=tol, rtol=tol)


def float_residuals(fn, *args):
  return [r for r in lm.memory.saved_residuals(fn, *args).rows
          if jnp.issubdtype(r.dtype, jnp.floating) and not r.is_argument]


VOCAB, WIDTH = 40, 16
LABELS = jax.random.randint(jax.random.key(7), (2, 24), 0, VOCAB)


def log_softmax_at(logits, labels):
  """``-log softmax(logits)[labels]``: the per-token loss, ``float[*labels.shape]``."""
  return -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), labels[..., None], -1)[..., 0]
