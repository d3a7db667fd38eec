"""`lowmem_jax.optim.per_leaf`: which leaves a function reads, into nested calls, and an
update that mixes leaves refused with the equation that mixes them."""

import jax
import jax.numpy as jnp
import optax
import pytest
from third_party_promotion import OPTAX_BIAS_CORRECTION

import lowmem_jax as lm
from lowmem_jax.optim import per_leaf

pytestmark = OPTAX_BIAS_CORRECTION  # the Adams traced here

PARAMS = {"a": jnp.ones(3), "b": jnp.ones(3), "c": jnp.ones(3)}


def test_reads_looks_into_jit_and_remat():
  fn = lambda p, x: jax.checkpoint(lambda q: jax.jit(lambda r: r["a"] * x)(q))(p)
  assert per_leaf.reads(fn, PARAMS, jnp.ones(3)) == {"a": True, "b": False, "c": False}
  both = lambda p: p["a"] + jax.jit(lambda r: r["c"])(p)
  assert per_leaf.reads(both, PARAMS) == {"a": True, "b": False, "c": True}


@pytest.mark.parametrize("tx", [optax.adam(1e-3), optax.chain(optax.clip_by_block_rms(1.0),
                                                                optax.sgd(0.1, momentum=0.9))])
def test_a_leaf_by_leaf_update_passes(tx):
  per_leaf.check_per_leaf(tx, PARAMS)


def test_an_update_that_reads_the_whole_gradient_is_refused_where_it_mixes():
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
  with pytest.raises(ValueError, match=r"reads other leaves' gradients \(first at add"):
    per_leaf.check_per_leaf(tx, PARAMS)


_ELEMENTWISE_TXS = {
    "adamw": optax.adamw(1e-3),
    "8-bit": lm.lowbit.adamw_8bit(1e-3),
    "8-bit, stochastic rounding": optax.chain(lm.lowbit.adamw_8bit(1e-3),
                                              lm.lowbit.stochastic_rounding()),
    "adama 8-bit": lm.adamaw(1e-3, lm.MomentFold(2), state_bits=8),
    "lion": optax.lion(1e-3),
}
_WHOLE_LEAF_TXS = {
    "lamb": optax.lamb(1e-3),
    "muon": optax.contrib.muon(1e-3),
    "clip_by_block_rms": optax.chain(optax.clip_by_block_rms(1.0), optax.adam(1e-3)),
    "adafactor": optax.adafactor(1e-3),
}


@pytest.mark.parametrize("shape", [(64, 1024), (48, 100)], ids=["blocks in rows", "padded rows"])
@pytest.mark.parametrize("name", list(_ELEMENTWISE_TXS) + list(_WHOLE_LEAF_TXS))
def test_an_update_that_reads_across_slices_is_found(name, shape):
  """Elementwise updates (8-bit blocks lie within a row, its padding too) read one slice of
  the four; a statistic of the whole leaf reads them all."""
  tx = optax.with_extra_args_support({**_ELEMENTWISE_TXS, **_WHOLE_LEAF_TXS}[name])
  x = jax.ShapeDtypeStruct(shape, jnp.float32)
  found = per_leaf.check_per_slice(lambda g, s, p: tx.update(g, s, p), x,
                                   jax.eval_shape(tx.init, x), 4)
  assert (found is None) == (name in _ELEMENTWISE_TXS), found
