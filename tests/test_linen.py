import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import lowmem_jax as lm


@pytest.mark.parametrize("module,fn,plain", [
    (lm.linen.MSLayerNorm, lm.ms_layer_norm, nn.LayerNorm),
    (lm.linen.MSRMSNorm, lm.ms_rms_norm, nn.RMSNorm)])
def test_linen_norms(module, fn, plain):
  x = jax.random.normal(jax.random.key(0), (2, 5, 16))
  m = module(epsilon=1e-5, dtype=jnp.bfloat16)
  params = jax.tree.map(lambda p: p + jax.random.normal(jax.random.key(1), p.shape),
                        m.init(jax.random.key(0), x))
  assert jax.tree.structure(params) == jax.tree.structure(plain().init(jax.random.key(0), x))
  y = m.apply(params, x)
  assert y.dtype == jnp.bfloat16
  chex.assert_trees_all_close(y, fn(x, **params["params"], eps=1e-5, dtype=jnp.bfloat16))
  loss = lambda m: (lambda p: jnp.sum(jnp.sin(m.apply(p, x).astype(jnp.float32))))
  chex.assert_trees_all_close(jax.grad(loss(module(epsilon=1e-5)))(params),
                              jax.grad(loss(plain(epsilon=1e-5)))(params), atol=1e-4, rtol=1e-4)
  bare = module(epsilon=1e-5, use_scale=False, **({"use_bias": False} if "bias" in params[
      "params"] else {}))
  assert bare.init(jax.random.key(0), x) == {}
  chex.assert_trees_all_close(bare.apply({}, x), fn(x, eps=1e-5))
  kernel = module(epsilon=1e-5, dtype=jnp.bfloat16, impl="pallas_interpret")
  assert "lowmem_ms_norm_fwd" in str(jax.make_jaxpr(lambda x: kernel.apply(params, x))(x))
  with pytest.raises(ValueError, match="impl must be one of"):
    module(impl="cuda").apply(params, x)


@pytest.mark.parametrize("module,plain", [(lm.nnx.MSLayerNorm, nnx.LayerNorm),
                                          (lm.nnx.MSRMSNorm, nnx.RMSNorm)])
def test_nnx_norms_replace_plain(module, plain):
  x = jax.random.normal(jax.random.key(0), (3, 16))
  ours = module(16, epsilon=1e-6, rngs=nnx.Rngs(0))
  theirs = plain(16, epsilon=1e-6, rngs=nnx.Rngs(0))
  state = jax.tree.map(lambda p: p + jax.random.normal(jax.random.key(1), p.shape),
                       nnx.state(theirs, nnx.Param))
  nnx.update(theirs, state)
  nnx.update(ours, state)
  chex.assert_trees_all_close(ours(x), theirs(x), atol=1e-5)
  loss = lambda model, x: jnp.sum(jnp.sin(model(x)))
  chex.assert_trees_all_close(nnx.grad(loss, argnums=(0, 1))(ours, x),
                              nnx.grad(loss, argnums=(0, 1))(theirs, x), atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match="num_features is needed"):
    module()
  with pytest.raises(ValueError, match="num_features"):
    ours(jnp.zeros((3, 8)))
  kernel = module(16, epsilon=1e-6, impl="pallas_interpret", rngs=nnx.Rngs(0))
  nnx.update(kernel, state)
  chex.assert_trees_all_close(kernel(x), ours(x), atol=1e-5)


def test_activation_argument():
  """The activations are plain functions: they go wherever Flax takes one."""
  class Mlp(nn.Module):
    activation: object = nn.gelu

    @nn.compact
    def __call__(self, x):
      return nn.Dense(4)(self.activation(nn.Dense(8)(x)))

  x = jax.random.normal(jax.random.key(0), (2, 4))
  params = Mlp().init(jax.random.key(0), x)
  exact = Mlp(activation=lambda h: nn.gelu(h, approximate=False)).apply(params, x)
  chex.assert_trees_all_close(Mlp(activation=lm.regelu2).apply(params, x), exact, atol=1e-6)
