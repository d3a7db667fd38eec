import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowmem_jax as lm
from lowmem_jax import models, names
from lowmem_jax.compile import memory
from lowmem_jax.models import WideResNet


def small(**switches):
  """WRN-10-1 on 8x8 images: the same blocks, quick to run."""
  return WideResNet(depth=10, widen=1, **switches)


def data(batch=8, image=8):
  """Spatially smooth random images (as images are) and labels."""
  kx, ky = jax.random.split(jax.random.key(0))
  coarse = jax.random.normal(kx, (batch, image // 4, image // 4, 3))
  return (jax.image.resize(coarse, (batch, image, image, 3), "linear"),
          jax.random.randint(ky, (batch,), 0, 10))


@pytest.fixture(scope="module")
def variables():
  """WRN-10-1's variables, made once (Flax's eager init is slow); any image size fits them."""
  return small().init(jax.random.key(1), data()[0])


def train_loss(model, params, x, y):
  logits, _ = model.apply({"params": params}, x, mutable=["batch_stats"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@functools.partial(jax.jit, static_argnums=0)
def grad(model, params, x, y):
  """The jitted gradient of `train_loss` (eager Flax runs op by op: slow), compiled once a
  model and shape."""
  return jax.grad(train_loss, argnums=1)(model, params, x, y)


def test_wrn_28_2_size_and_outputs():
  wl = models.workload("wrn-28-2", batch=4, dtype=jnp.float32)
  params = wl.abstract_params()
  assert sum(p.size for p in jax.tree.leaves(params)) == 1_467_610  # the paper's 1.47M
  assert wl.inputs.shape == (4, 32, 32, 3)
  out = jax.eval_shape(wl.loss, params, wl.inputs, wl.labels)
  assert out.shape == () and out.dtype == jnp.float32
  variables = jax.eval_shape(wl.model.init, jax.random.key(0), wl.inputs)
  logits = jax.eval_shape(lambda v, x: wl.model.apply(v, x, train=False), variables, wl.inputs)
  assert logits.shape == (4, 10) and logits.dtype == jnp.float32


@pytest.mark.slow
def test_1bit_relu_gives_the_same_gradient_and_saves_bits(variables):
  x, y = data()
  params = variables["params"]
  g = grad(small(), params, x, y)
  g_1bit = grad(small(activation="1bit"), params, x, y)
  chex.assert_trees_all_close(g_1bit, g, rtol=1e-5, atol=1e-6)  # ReLU's derivative is a step
  saved = memory.saved_residuals(lambda p: train_loss(small(activation="1bit"), p, x, y),
                                 params)
  assert saved.by_name()[names.ACT_CODE] > 0


def test_approx_is_the_transformers_term_and_the_relu_takes_its_own(variables):
  """"approx" is ReGELU2/ReSiLU2, an approximate gradient; the WideResNet's exact 1-bit ReLU is
  "1bit", and "approx" on it is refused with the choices it takes."""
  x, y = data()
  with pytest.raises(ValueError, match=r"activation must be one of \('exact', '1bit'\), got 'approx'"):
    jax.make_jaxpr(lambda p: train_loss(small(activation="approx"), p, x, y))(variables["params"])
  with pytest.raises(ValueError, match=r"activation must be one of \('exact', '1bit'\)"):
    models.workload("wrn-28-2", batch=1, activation="approx")
  assert models.workload("wrn-28-2", batch=1, activation="1bit").model.activation == "1bit"


@pytest.mark.slow
@pytest.mark.parametrize("conv", ["pooled", "int8"])
def test_compressed_convs_same_forward_smaller_residuals(conv, variables):
  x, y = data(image=16)
  plain, compressed = small(), small(conv=conv)
  np.testing.assert_array_equal(compressed.apply(variables, x, train=False),
                                plain.apply(variables, x, train=False))
  params = variables["params"]
  g = grad(plain, params, x, y)
  g_c = grad(compressed, params, x, y)
  flat, flat_c = (jnp.concatenate([a.ravel() for a in jax.tree.leaves(t)]) for t in (g, g_c))
  rel = float(jnp.linalg.norm(flat_c - flat) / jnp.linalg.norm(flat))
  assert 0 < rel < (0.6 if conv == "pooled" else 0.01)  # measured: 0.43 and 0.004
  saved = memory.saved_residuals(lambda p: train_loss(compressed, p, x, y), params)
  plain_saved = memory.saved_residuals(lambda p: train_loss(plain, p, x, y), params)
  assert names.COMPRESSED_IN in saved.by_name()
  assert saved.activation_bytes < plain_saved.activation_bytes


def test_remat_same_gradient_fewer_residuals(variables):
  x, y = data()
  params = variables["params"]
  g = grad(small(), params, x, y)
  g_remat = grad(small(remat=True), params, x, y)
  chex.assert_trees_all_close(g_remat, g, rtol=1e-5, atol=1e-6)
  assert (memory.saved_residuals(lambda p: train_loss(small(remat=True), p, x, y), params)
          .activation_bytes < memory.saved_residuals(
              lambda p: train_loss(small(), p, x, y), params).activation_bytes)


@pytest.mark.slow
def test_micro_batches_normalise_with_their_own_statistics(variables):
  """Under micro-batching batch norm sees each micro-batch: the step is not the
  full-batch step. With the running averages (eval mode) it would be."""
  x, y = data(batch=8)
  model = small()
  params = variables["params"]
  halves = [(x[0::2], y[0::2]), (x[1::2], y[1::2])]  # microbatch_step's strided split
  full = grad(model, params, x, y)
  mean_of_halves = jax.tree.map(lambda a, b: (a + b) / 2, *[
      grad(model, params, *h) for h in halves])
  diff = max(float(jnp.abs(a - b).max()) for a, b in
             zip(jax.tree.leaves(full), jax.tree.leaves(mean_of_halves)))
  assert diff > 1e-3

  def eval_loss(p, x, y):
    logits = model.apply({"params": p, "batch_stats": variables["batch_stats"]}, x, train=False)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  eval_grad = jax.jit(jax.grad(eval_loss))
  full_eval = eval_grad(params, x, y)
  halves_eval = jax.tree.map(lambda a, b: (a + b) / 2,
                             *[eval_grad(params, *h) for h in halves])
  chex.assert_trees_all_close(halves_eval, full_eval, rtol=1e-4, atol=1e-6)

  # lowmem_jax's micro-batch step is the mean of the micro-batch gradients.
  tx = optax.sgd(1.0)
  step = lm.microbatch_step(lambda p, b: train_loss(model, p, *b), tx, 2)
  new_params, _, _ = jax.jit(step)(params, tx.init(params), (x, y))
  chex.assert_trees_all_close(jax.tree.map(jnp.subtract, params, new_params), mean_of_halves,
                              rtol=1e-4, atol=1e-6)


def test_workload_switches_are_checked():
  with pytest.raises(ValueError, match="batch norm"):
    models.workload("wrn-28-2", batch=1, norm="ms")
  with pytest.raises(ValueError, match="conv"):
    models.workload("wrn-28-2", batch=1, conv="fft")
  with pytest.raises(ValueError, match="activation must be one of \\('exact', '1bit'\\)"):
    models.workload("wrn-28-2", batch=1, activation="fast")
  with pytest.raises(ValueError, match="activation must be one of \\('exact', 'approx'\\)"):
    models.workload("vit-tiny", batch=1, activation="1bit")
  with pytest.raises(ValueError, match="conv applies to the WideResNet only"):
    models.workload("vit-tiny", batch=1, conv="pooled")
  with pytest.raises(ValueError, match="image must be a multiple of 8"):
    models.workload("wrn-28-2", batch=1, image=30, conv="pooled")
  with pytest.raises(ValueError, match="image"):
    models.workload("wrn-28-2", batch=1, image=0)
  with pytest.raises(ValueError, match="widen"):
    WideResNet(widen=0).init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))
  with pytest.raises(ValueError, match="depth"):
    WideResNet(depth=12).init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))
