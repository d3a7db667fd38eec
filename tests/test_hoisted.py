"""`lowmem_jax.optim.hoisted`: an update's small work split off to run before the loop."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowmem_jax as lm
from lowmem_jax import _jaxpr
from lowmem_jax.optim import hoisted
from lowmem_jax.optim.lowbit import Position
from third_party_promotion import OPTAX_BIAS_CORRECTION

pytestmark = OPTAX_BIAS_CORRECTION
S = jax.ShapeDtypeStruct


def _primitives(fn, *args):
  return [e.primitive.name for e, _ in _jaxpr.walk(jax.make_jaxpr(fn)(*args).jaxpr)]


def test_a_split_function_is_the_function_bit_for_bit_with_its_scalar_work_before():
  def fn(i, count, g):
    c = count + 1  # integer work: before the loop
    correction = 1 - 0.9 ** c.astype(jnp.float32)
    key = jax.random.fold_in(jax.random.key(0), c + i)
    noise = jax.random.uniform(key, g.shape)
    return {"g": g / correction + noise,
            "count": jnp.where(jnp.all(jnp.isfinite(g)), c, count)}

  cut = hoisted.split(fn, [S((), jnp.int32)] * 2, [S((64, 8), jnp.float32)])
  layers = 5
  residuals = jax.vmap(cut.known)(jnp.arange(layers), jnp.arange(layers) * 3)
  assert all(jnp.size(r) <= hoisted.SMALL * layers for r in residuals)  # no element's noise
  g = jax.random.normal(jax.random.key(1), (64, 8)).at[0, 0].set(jnp.nan)
  for i in range(layers):
    got, _ = jax.jit(lambda r, g: cut.rest(r, g))([r[i] for r in residuals], g)
    want = jax.tree.leaves(jax.jit(fn)(jnp.int32(i), jnp.int32(3 * i), g))
    for a, b in zip(got, want):
      np.testing.assert_array_equal(a, b)
  # The count and the key's folding run before; the float correction and the noise's bits
  # in the rest.
  rest = _primitives(lambda r, g: cut.rest(r, g)[0], [r[0] for r in residuals], g)
  assert "random_fold_in" not in rest and "pow" in rest
  assert "threefry2x32" in rest or "random_bits" in rest


def _8bit_layers(layers=3, shape=(16, 256)):
  """``(p, s, g, update)``: a stack of ``layers`` bfloat16 leaves, their 8-bit states, a
  gradient, and ``update(i, g, s_i, p_i, ok)``, `lowmem_jax.adamw_8bit`'s update of layer i
  (bfloat16 parameters, rounded stochastically), kept where ``ok``."""
  tx = lm.adamw_8bit(1e-2, bfloat16_params=True, min_size=256)
  p = jax.random.normal(jax.random.key(0), (layers, *shape)).astype(jnp.bfloat16)
  at = Position(0)

  def update(i, g, s_i, p_i, ok):
    u, new_s = tx.update(g, s_i, p_i, positions=at.index(i))
    return (jnp.where(ok, optax.apply_updates(p_i, u), p_i),
            jax.tree.map(lambda a, b: jnp.where(ok, a, b), new_s, s_i))

  g = jax.random.normal(jax.random.key(1), (layers, *shape)).astype(jnp.bfloat16)
  return p, jax.vmap(tx.init)(p), g, update


def test_a_stacked_leafs_8bit_update_from_its_table_is_each_layers_update():
  """The table's update of each layer of a stacked leaf, against the chain's own update of
  that layer (`lowmem_jax.adamw_8bit`, bfloat16 parameters, rounded stochastically: the
  step's keys and bias corrections are what moves before the loop)."""
  p, s, g, update = _8bit_layers()
  table = hoisted.stack_table(update, p, s)
  assert any(table.small) and not all(table.small)  # the count and key known, not the moments
  _assert_each_layer_is_its_update(table, update, g, s, p)
  rest = _primitives(lambda i, g, s_i, p_i: hoisted.apply(table, i, g, s_i, p_i, True)[0],
                     jnp.int32(0), g[0], jax.tree.map(lambda x: x[0], s), p[0])
  assert "random_fold_in" not in rest and "random_split" not in rest
  assert "pow" in rest  # float work stays in the loop, as XLA would fuse it there


def test_the_state_the_flag_keeps_is_picked_after_the_loop_bit_for_bit():
  """With ``later``, the 8-bit chain's count and key, which the update steps or keeps on
  ``ok`` alone, are left out of each layer's update (None) and picked after the loop from
  the flags it returns, every layer at once: bit for bit the unsplit update's, in layers
  whose update is kept and in those whose is not; the moments stay in the loop."""
  p, s, g, update = _8bit_layers()
  table = hoisted.stack_table(update, p, s, later=(False, True))
  assert hoisted.flag_count(table) == 1  # both kept on the one ``ok``
  # The count and the key are picked later; nothing else is (not the moments' scales, small
  # here too, but made from the gradient).
  assert [x is not None for x in table.split.later] == [False, *(
      k and jnp.issubdtype(x.dtype, jnp.integer) for x, k in zip(jax.tree.leaves(s), table.small))]
  from_table = jax.jit(lambda r, i, g, s_i, p_i, ok: hoisted.apply(
      table._replace(residuals=r), i, g, s_i, p_i, ok))
  flags, wanted = [], []
  for i, ok in enumerate([True, False, True]):
    s_i = jax.tree.map(lambda x: x[i], s)
    args = (jnp.int32(i), g[i], s_i, p[i], jnp.bool_(ok))
    got, layer_flags = from_table(table.residuals, *args)
    want = jax.tree.leaves(jax.jit(update)(*args))
    got = jax.tree.leaves(got, is_leaf=lambda x: x is None)
    for a, b in zip(got, want, strict=True):
      if a is not None:
        np.testing.assert_array_equal(*map(_data, (a, b)))
    flags.append(layer_flags)
    wanted.append([b for a, b in zip(got, want) if a is None])
  picked = jax.tree.leaves(hoisted.picked(table, jnp.stack(flags)))
  assert len(picked) == 2
  for i in range(len(p)):
    for a, b in zip(picked, wanted[i], strict=True):
      np.testing.assert_array_equal(*map(_data, (a[i], b)))
  assert not all(np.array_equal(*map(_data, (a[0], a[1]))) for a in picked)  # ok moved them


def _assert_each_layer_is_its_update(table, update, g, s, p, ok=True):
  """Each layer's update from ``table`` (its residuals passed in, not folded as constants)
  against ``update`` on that layer, both compiled, bit for bit."""
  def from_table(residuals, i, g, s_i, p_i):
    return hoisted.apply(table._replace(residuals=residuals), i, g, s_i, p_i, ok)[0]

  for i in range(jnp.shape(p)[0]):
    s_i = jax.tree.map(lambda x: x[i], s)
    got = jax.jit(from_table)(table.residuals, jnp.int32(i), g[i], s_i, p[i])
    want = jax.jit(update)(jnp.int32(i), g[i], s_i, p[i], jnp.bool_(ok))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(*map(_data, (a, b)))


def _data(x):
  return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


@pytest.mark.parametrize("prng", ["threefry2x32", "rbg"])
def test_float_work_and_other_prngs_stay_in_the_loop_bit_for_bit(prng):
  """A small leaf's float state (momentum: ``0.9 * mu + g``, which XLA fuses into one
  multiply-add where it sees it whole) and noise from a PRNG other than Threefry (whose bits
  differ under ``jax.vmap``) stay in the loop's part: the same bits as the unsplit update."""
  tx = optax.chain(optax.add_noise(0.1, 0.55, 0), optax.sgd(1e-2, momentum=0.9))
  layers, shape = 3, (8, 8)
  with jax.default_prng_impl(prng):
    p = jax.random.normal(jax.random.key(0), (layers, *shape))
    s = jax.vmap(tx.init)(p)

    def update(i, g, s_i, p_i, ok):
      u, new_s = tx.update(g, s_i, p_i)
      return optax.apply_updates(p_i, u), new_s

    table = hoisted.stack_table(update, p, s)
    g = jax.random.normal(jax.random.key(1), (layers, *shape))
    _assert_each_layer_is_its_update(table, update, g, s, p)


def test_effects_run_and_callbacks_stay_in_the_loop():
  """A callback in the update (a schedule through ``jax.pure_callback``, which ``jax.vmap``
  refuses by default) is not moved before the loop, and an effect still runs in it."""
  lr = lambda count: jax.pure_callback(lambda c: np.float32(1e-2), jax.ShapeDtypeStruct(
      (), jnp.float32), count)
  tx = optax.adam(lr)
  p = jnp.ones((2, 8), jnp.float32)
  s = jax.vmap(tx.init)(p)
  seen = []

  def update(i, g, s_i, p_i, ok):
    jax.debug.callback(lambda i: seen.append(int(i)), i)
    u, new_s = tx.update(g, s_i, p_i)
    return optax.apply_updates(p_i, u), new_s

  table = hoisted.stack_table(update, p, s)
  _assert_each_layer_is_its_update(table, update, jnp.ones_like(p), s, p)
  assert seen == [0, 0, 1, 1]  # each layer's effect, split and unsplit


def test_apply_refuses_inputs_other_than_the_split_ones():
  p = jnp.zeros((2, 8), jnp.float32)
  tx = optax.adam(1e-3)
  s = jax.vmap(tx.init)(p)
  table = hoisted.stack_table(
      lambda i, g, s_i, p_i, ok: tx.update(g, s_i, p_i), p, s)
  try:
    hoisted.apply(table, jnp.int32(0), jnp.zeros((8,), jnp.bfloat16),
                  jax.tree.map(lambda x: x[0], s), p[0], jnp.bool_(True))
  except ValueError as e:
    assert "was split for inputs" in str(e)
  else:
    raise AssertionError("a bfloat16 gradient was taken by a float32 split")
