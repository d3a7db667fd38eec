import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import lowmem_jax as lm
from third_party_promotion import OPTAX_BIAS_CORRECTION


class DropoutMLP(nnx.Module):
  def __init__(self, rngs):
    self.fc1 = nnx.Linear(4, 16, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.fc2 = nnx.Linear(16, 1, rngs=rngs)

  def __call__(self, x):
    return self.fc2(self.drop(jax.nn.relu(self.fc1(x))))


class BatchNormMLP(nnx.Module):
  def __init__(self, rngs):
    # No bias before the norm: its gradient is rounding noise, which Adam would scale up to lr.
    self.fc1 = nnx.Linear(4, 16, use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(16, momentum=0.5, rngs=rngs)
    self.fc2 = nnx.Linear(16, 1, rngs=rngs)

  def __call__(self, x):
    return self.fc2(jax.nn.relu(self.bn(self.fc1(x))))


def loss_fn(model, batch):
  x, y = batch
  return jnp.mean((model(x) - y) ** 2)


def make_batch(n=16, seed=1):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (n, 4)), jax.random.normal(ky, (n, 1))


TXS = {
    "adam": lambda k: optax.adam(1e-2),
    "adama": lambda k: optax.chain(lm.adama(k), optax.scale_by_learning_rate(1e-2)),
}


def assert_close(a, b, **tolerance):
  """chex.assert_trees_all_close, RNG keys compared by their data."""
  data = lambda tree: jax.tree.map(
      lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x, tree)
  chex.assert_trees_all_close(data(a), data(b), **tolerance)


def by_hand(model, optimizer, batch, k, folded):
  """k eager NNX passes on the strided micro-batches; k updates (AdamA) or one of the mean."""
  grads = []
  for i in range(k):
    g = nnx.grad(loss_fn)(model, jax.tree.map(lambda x: x[i::k], batch))
    if folded:
      optimizer.update(model, g)
    else:
      grads.append(g)
  if not folded:
    optimizer.update(model, jax.tree.map(lambda *g: sum(g) / k, *grads))


@pytest.mark.slow
@pytest.mark.parametrize("tx_name", TXS)
@pytest.mark.parametrize("model_cls", [DropoutMLP, BatchNormMLP])
@OPTAX_BIAS_CORRECTION
def test_step_equals_sequential_micro_batches_by_hand(model_cls, tx_name):
  k = 4
  tx = TXS[tx_name](k)
  model, ref = model_cls(nnx.Rngs(0)), model_cls(nnx.Rngs(0))
  optimizer, ref_optimizer = (nnx.Optimizer(m, tx, wrt=nnx.Param) for m in (model, ref))
  step = nnx.jit(lm.nnx.microbatch_step(loss_fn, k))
  for seed in range(2):
    batch = make_batch(seed=seed)
    metrics = step(model, optimizer, batch)
    by_hand(ref, ref_optimizer, batch, k, folded=tx_name == "adama")
  assert_close(nnx.state(model), nnx.state(ref), rtol=1e-5, atol=1e-6)
  assert_close(optimizer.opt_state, ref_optimizer.opt_state, rtol=1e-5, atol=1e-6)
  assert int(optimizer.step[...]) == 2 and metrics["loss"].shape == ()
  if model_cls is DropoutMLP:
    assert int(model.drop.rngs.count[...]) == 2 * k
  else:
    assert float(jnp.max(jnp.abs(model.bn.mean[...]))) > 0


@pytest.mark.parametrize("model_cls", [DropoutMLP, BatchNormMLP])
@OPTAX_BIAS_CORRECTION
def test_fold_in_backward_equals_folding_after_the_backward_bit_for_bit(model_cls):
  k = 4
  runs = []
  for fold_in_backward in (False, True):
    model = model_cls(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, lm.adamaw(1e-2, k), wrt=nnx.Param)
    step = nnx.jit(lm.nnx.microbatch_step(loss_fn, k, fold_in_backward=fold_in_backward))
    for seed in range(2):
      step(model, optimizer, make_batch(seed=seed))
    runs.append(jax.tree.leaves((nnx.state(model), nnx.state(optimizer.opt_state))))
  raw = lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
  for a, b in zip(*runs):
    np.testing.assert_array_equal(raw(a), raw(b))


def test_dropout_masks_differ_between_micro_batches():
  k = 4
  model = DropoutMLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)  # params fixed within the step
  x = jnp.tile(make_batch(n=2)[0], (k, 1))  # every micro-batch the same rows
  loss = lambda model, batch: (loss_fn(model, batch), model(batch[0]))
  metrics = nnx.jit(lm.nnx.microbatch_step(loss, k, has_aux=True))(model, optimizer, (x, x[:, :1]))
  out = metrics["aux"]
  assert out.shape == (k, 2, 1)
  assert all(not np.allclose(out[i], out[j]) for i in range(k) for j in range(i))
  assert int(model.drop.rngs.count[...]) == 2 * k  # two calls per micro-batch


@OPTAX_BIAS_CORRECTION
def test_plain_jax_jit_over_split_state():
  k = 2
  tx = TXS["adama"](k)
  model, ref = DropoutMLP(nnx.Rngs(0)), DropoutMLP(nnx.Rngs(0))
  optimizer, ref_optimizer = (nnx.Optimizer(m, tx, wrt=nnx.Param) for m in (model, ref))
  step = lm.nnx.microbatch_step(loss_fn, k)
  graphdef, state = nnx.split((model, optimizer))

  @jax.jit
  def train_step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    metrics = step(model, optimizer, batch)
    return nnx.state((model, optimizer)), metrics

  state, _ = train_step(state, make_batch())
  nnx.jit(step)(ref, ref_optimizer, make_batch())
  assert_close(state, nnx.state((ref, ref_optimizer)), rtol=1e-6, atol=1e-7)


def test_errors():
  model = DropoutMLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  step = lm.nnx.microbatch_step(loss_fn, 3)
  with pytest.raises(TypeError, match="`model` must be an nnx.Module, got dict"):
    step({"w": jnp.ones(3)}, optimizer, make_batch(n=15))
  with pytest.raises(TypeError, match="`optimizer` must be an nnx.Optimizer"):
    step(model, optax.adam(1e-2).init(nnx.state(model, nnx.Param)), make_batch(n=15))
  with pytest.raises(ValueError, match="divisible by k=3"):
    step(model, optimizer, make_batch(n=16))
  with pytest.raises(ValueError, match="`k`"):
    lm.nnx.microbatch_step(loss_fn, 0)
