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


@pytest.mark.parametrize("shape,n", [((64, 1024), 4), ((48, 100), 4), ((64, 1024), 2)],
                         ids=["blocks in rows", "padded rows", "2 slices"])
@pytest.mark.parametrize("name", list(_ELEMENTWISE_TXS) + list(_WHOLE_LEAF_TXS))
def test_an_update_that_reads_across_slices_is_found(name, shape, n):
  """Elementwise updates (8-bit blocks lie within a row, its padding too; a rounding key's
  two words are not the leaf's, in 2 slices too) read one slice each; a statistic of the
  whole leaf reads them all."""
  tx = optax.with_extra_args_support({**_ELEMENTWISE_TXS, **_WHOLE_LEAF_TXS}[name])
  x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  found = per_leaf.check_per_slice(lambda g, s, p: tx.update(g, s, p), x,
                                   jax.eval_shape(tx.init, x), n)
  assert (found is None) == (name in _ELEMENTWISE_TXS), found


@pytest.mark.parametrize("fn,reads_across", [
    (lambda g: g - jnp.pad(g[1:], ((0, 1), (0, 0))), True),  # the next row: across a boundary
    (lambda g: jnp.pad(g, ((1, 0), (0, 0)))[:-1] * g, True),  # the previous row
    (lambda g: jnp.diff(g, axis=0, append=g[:1]), True),
    (lambda g: g - jnp.pad(g[:, 1:], ((0, 0), (0, 1))), False),  # the next column: the same row
    (lambda g: jnp.pad(g, ((0, 2), (0, 0)))[:8] * 2, False),  # padded and cut at the end
], ids=["next row", "previous row", "diff", "next column", "end padding"])
def test_a_shift_along_the_sliced_axis_reads_across_slices(fn, reads_across):
  x = jax.ShapeDtypeStruct((8, 4), jnp.float32)
  found = per_leaf.check_per_slice(lambda g, s, p: (fn(g), s), x, (), 2)
  assert (found is not None) == reads_across, found
