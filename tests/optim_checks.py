"""Tiny models and checks shared by the optimizer tests (test_optim.py, test_in_backward.py)."""

import flax.linen
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np

import lowmem_jax as lm


def exact(a, b):
  """Bit-identical pytrees."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


PARAMS = {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}


# A tiny model whose loss is the mean over its micro-batch.
def mlp_init(seed=0, d=8, h=16):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w1": jax.random.normal(k1, (d, h)) / np.sqrt(d), "w2": jax.random.normal(k2, (h, 1)) / np.sqrt(h)}


def mlp_loss(params, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def mlp_batch(n=16, d=8, seed=1):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return jax.random.normal(k1, (n, d)), jax.random.normal(k2, (n, 1))


def three_steps(steps, params, tx):
  """``[(params, opt_state, metrics)]`` of each step after three jitted calls from the same
  start, on the batches of seeds 0, 1, 2."""
  runs = [(params, tx.init(params))] * len(steps)
  for seed in range(3):
    runs = [jax.jit(step)(p, s, mlp_batch(seed=seed)) for step, (p, s, *_) in zip(steps, runs)]
  return runs


class LinenMLP(flax.linen.Module):
  @flax.linen.compact
  def __call__(self, x):
    x = jnp.tanh(flax.linen.Dense(16)(x))
    return flax.linen.Dense(1)(jnp.tanh(flax.linen.Dense(16)(x)))


def stateful_loss(params, state, batch):
  """mlp_loss with the prediction scaled by a running state, which each micro-batch updates."""
  x, y = batch
  loss = jnp.mean(((1 + state) * (jnp.tanh(x @ params["w1"]) @ params["w2"]) - y) ** 2)
  return loss, 0.5 * state + jnp.mean(x)


# A scanned model: stacked residual layers between an input and an output matrix.
def scanned_init(layers=3, d=8, h=16, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  return {"inp": jax.random.normal(ks[0], (d, d)) / np.sqrt(d),
          "layers": {"w1": jax.random.normal(ks[1], (layers, d, h)) / np.sqrt(d),
                     "w2": jax.random.normal(ks[2], (layers, h, d)) / np.sqrt(h)},
          "out": jax.random.normal(ks[3], (d, 1)) / np.sqrt(d)}


def layer(p, h):
  return h + jnp.tanh(h @ p["w1"]) @ p["w2"]


def scanned_loss(params, batch, moments=None):
  x, y = batch
  h = lm.optim.scan_layers(layer, x @ params["inp"], params["layers"], moments)
  return jnp.mean((h @ params["out"] - y) ** 2)
