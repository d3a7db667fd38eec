import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import lowmem_jax as lm


@pytest.mark.parametrize("module,fn", [(lm.linen.MSLayerNorm, lm.ms_layer_norm),
                                       (lm.linen.MSRMSNorm, lm.ms_rms_norm)])
def test_linen_norms(module, fn):
  x = jax.random.normal(jax.random.key(0), (2, 5, 16))
  m = module(epsilon=1e-5, dtype=jnp.bfloat16)
  assert m.init(jax.random.key(0), x) == {}
  y = m.apply({}, x)
  assert y.dtype == jnp.bfloat16
  chex.assert_trees_all_close(y, fn(x, eps=1e-5, dtype=jnp.bfloat16))
  kernel = module(epsilon=1e-5, dtype=jnp.bfloat16, impl="pallas_interpret")
  assert "lowmem_ms_norm_fwd" in str(jax.make_jaxpr(lambda x: kernel.apply({}, x))(x))
  with pytest.raises(ValueError, match="impl must be one of"):
    module(impl="cuda").apply({}, x)


@pytest.mark.parametrize("module,plain", [(lm.nnx.MSLayerNorm, nnx.LayerNorm),
                                          (lm.nnx.MSRMSNorm, nnx.RMSNorm)])
def test_nnx_norms_replace_plain(module, plain):
  x = jax.random.normal(jax.random.key(0), (3, 16))
  ours = module(16, epsilon=1e-6, rngs=nnx.Rngs(0))
  theirs = plain(16, epsilon=1e-6, rngs=nnx.Rngs(0))  # scale 1, bias 0 at init
  chex.assert_trees_all_close(ours(x), theirs(x), atol=1e-5)
  g = jax.grad(lambda x: jnp.sum(jnp.sin(ours(x))))(x)
  chex.assert_trees_all_close(g, jax.grad(lambda x: jnp.sum(jnp.sin(theirs(x))))(x), atol=1e-5)
  with pytest.raises(ValueError, match="num_features"):
    ours(jnp.zeros((3, 8)))
  kernel = module(16, epsilon=1e-6, impl="pallas_interpret", rngs=nnx.Rngs(0))
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
