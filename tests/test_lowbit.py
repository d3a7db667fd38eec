"""8-bit optimizer state: one quantise/dequantise within its stated bound, Adam over it;
bfloat16 parameters rounded stochastically."""

import functools

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import lowbit_digits  # benchmarks/, on sys.path in conftest.py
import optimizer_bytes
import lowmem_jax as lm
from lowmem_jax.optim import lowbit
from third_party_promotion import (OPTAX_APPLY_UPDATES, OPTAX_BIAS_CORRECTION,
                                   OPTAX_UPDATE_MOMENT)


def _wide(shape, seed=0, signed=True):
  """Values over 14 decades, with a zero block (the first row's first) and partial blocks."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  x = 10.0 ** jax.random.uniform(k1, shape, minval=-12, maxval=2)
  x = x * jax.random.uniform(k2, shape, minval=0.5, maxval=1.0)
  if signed:
    x = x * jnp.where(jax.random.bernoulli(k3, 0.5, shape), 1.0, -1.0)
  return x.at[0, :lowbit.BLOCK].set(0.0)


@pytest.mark.parametrize("signed", [True, False])
def test_one_round_trip_is_within_the_error_bound(signed):
  x = _wide((37, 301), signed=signed)  # rows of a full block and a partial one
  q = lowbit.quantize(x, signed=signed)
  assert q.codes.dtype == jnp.uint8 and q.codes.shape == x.shape
  assert q.scales.shape == (37, 2)
  back = lowbit.dequantize(q, signed=signed)
  scale = jnp.repeat(q.scales, lowbit.BLOCK, axis=-1)[:, :301]
  bound = lowbit.error_bound(x, scale, signed=signed)
  err = jnp.abs(back - x)
  # 0 where the bound is (the zero block: scale 0), not 0 / 0: XLA's CPU max skipped NaNs
  # before jax 0.12.1 and propagates them from 0.12.1.
  ratio = jnp.where(bound > 0, err / bound, 0.0)
  assert bool(jnp.all(err <= bound * (1 + 1e-6))), float(jnp.max(ratio))
  assert float(jnp.max(ratio)) > 0.5  # the bound is nearly reached: it is the real one
  np.testing.assert_array_equal(back[0, :lowbit.BLOCK], 0.0)
  if not signed:
    assert bool(jnp.all((back > 0) == (x > 0)))  # no positive value becomes zero


@pytest.mark.parametrize("signed", [True, False])
def test_stochastic_rounding_is_within_its_bound_and_unbiased(signed):
  x = _wide((4, 256), signed=signed)
  scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  x = jnp.where(jnp.abs(x) >= 2.0 ** -10 * scale, x, 0.0)  # the normal range
  keys = jax.random.split(jax.random.key(1), 2000)
  back = jax.vmap(lambda k: lowbit.dequantize(lowbit.quantize(x, signed=signed, key=k),
                                              signed=signed))(keys)
  bound = lowbit.error_bound(x, scale, signed=signed, stochastic=True)
  assert bool(jnp.all(jnp.abs(back - x[None]) <= bound[None] * (1 + 1e-6)))
  # the mean of 2,000 roundings: within 4 standard errors of an ulp's Bernoulli spread
  np.testing.assert_array_less(jnp.abs(back.mean(0) - x), 4 * bound / np.sqrt(2000) + 1e-30)


@pytest.mark.parametrize("signed", [True, False])
def test_every_code_up_to_one_is_a_fixed_point(signed):
  top = 15 if signed else 31  # the exponent of 1.0; codes above it are never made
  codes = [0] + [e << 3 | m for e in range(1, top) for m in range(8)] + [top << 3]
  codes = codes + [c | 128 for c in codes[1:]] if signed else codes
  codes = jnp.asarray(codes, jnp.uint8)
  values = lowbit.dequantize(lowbit.QuantizedArray(codes, jnp.ones(1)), signed=signed)
  assert float(jnp.max(jnp.abs(values))) == 1.0 and len(set(np.asarray(values))) == len(codes)
  again = lowbit.quantize(values, signed=signed)
  np.testing.assert_array_equal(again.codes, codes)


def _grads(params, steps, seed=0):
  keys = jax.random.split(jax.random.key(seed), steps)
  return [jax.tree.map(lambda p: jax.random.normal(k, p.shape) * (1 + jnp.abs(p)), params)
          for k in keys]


PARAMS = {"big": jnp.linspace(-1, 1, 64 * 80).reshape(64, 80), "small": jnp.ones((3, 5))}


def _non_finite_poisons_its_block():
  """quantize, and the 8-bit update (where XLA fuses the scale's reduction), on the default
  device: a NaN or an infinity makes its block's scale non-finite, and the whole block
  decodes as non-finite; the other blocks stay finite."""
  quantize = jax.jit(lowbit.quantize, static_argnames="signed")
  for shape, (row, col) in [((8, 1024), (0, 0)), ((8, 1024), (3, 111)), ((3, 300), (2, 299))]:
    for bad in (jnp.nan, jnp.inf):
      x = jnp.ones(shape).at[row, col].set(bad)
      for signed in (True, False):
        q = quantize(x, signed=signed)
        decoded = lowbit.dequantize(q, signed=signed)
        start = col // lowbit.BLOCK * lowbit.BLOCK
        assert not bool(jnp.isfinite(q.scales[row, col // lowbit.BLOCK])), (shape, col, bad)
        assert not bool(jnp.any(jnp.isfinite(decoded[row, start:start + lowbit.BLOCK])))
        assert int(jnp.sum(~jnp.isfinite(decoded))) == min(lowbit.BLOCK, shape[-1] - start)
  tx = lowbit.scale_by_adam_8bit()
  params = {"w": jnp.ones((64, 512))}
  grads = {"w": jax.random.normal(jax.random.key(0), (64, 512)).at[10, 255].set(jnp.nan)}
  _, state = jax.jit(tx.update)(grads, tx.init(params))
  for moment, signed in ((state.mu["w"], True), (state.nu["w"], False)):
    decoded = lowbit.dequantize(moment, signed=signed)
    assert int(jnp.sum(jnp.isnan(decoded))) == lowbit.BLOCK
    assert bool(jnp.all(jnp.isnan(decoded[10, :lowbit.BLOCK])))


@pytest.mark.parametrize("signed", [True, False])
def test_zero_moments_are_quantized_zeros_made_without_a_float32_array(signed):
  """`tree_zeros` equals `quantize` of float32 zeros, and its program holds no float32 array
  the leaf's size (under jit XLA spent minutes folding those constants for an 8B)."""
  params = {"w": jnp.ones((4, 3, 700), jnp.bfloat16), "v": jnp.ones(5000), "b": jnp.ones(3)}
  got = lowbit.tree_zeros(params, signed=signed, min_size=1000, block=256, dtype=jnp.float32)
  for name in ("w", "v"):
    want = lowbit.quantize(jnp.zeros(params[name].shape), signed=signed, block=256)
    for g, w in zip(got[name], want):
      assert g.dtype == w.dtype and g.shape == w.shape
      np.testing.assert_array_equal(g, w)
  np.testing.assert_array_equal(got["b"], jnp.zeros(3))
  made = jax.make_jaxpr(lambda p: lowbit.tree_zeros(p, signed=signed, min_size=1000,
                                                    block=256))(params)
  sizes = [v.aval.size for e in made.eqns for v in e.outvars if v.aval.dtype == jnp.float32]
  assert max(sizes, default=0) < 1000, sizes


@pytest.mark.parametrize("shape", [(3, 5), (4, 1024), (3, 1500), (5000,)],
                         ids=["small", "whole-blocks", "padded-block", "one-row"])
def test_all_finite_is_ok_and_every_element_finite(shape):
  """`all_finite` against ``ok and np.all(np.isfinite(x))`` with one NaN or infinity at the
  first, a middle and the last element (in a padded last block too), and ``ok`` False; a
  leaf of 8-bit moments' size holds its blocks' results (``[..., blocks]``) at a barrier."""
  check = jax.jit(lowbit.all_finite)
  x = jax.random.normal(jax.random.key(0), shape)
  assert bool(check(x, True)) and not bool(check(x, False))
  for bad in (np.nan, np.inf, -np.inf):
    for at in (0, x.size // 2, x.size - 1):
      y = x.reshape(-1).at[at].set(bad).reshape(shape)
      assert not bool(check(y, True)), (bad, at)
  assert not bool(lowbit.all_finite(jnp.zeros((0,)), False, min_size=0))  # no elements
  held = [e.outvars[0].aval.shape for e in jax.make_jaxpr(lowbit.all_finite)(x).eqns
          if e.primitive.name == "optimization_barrier"]
  blocks = (*shape[:-1], -(-shape[-1] // lowbit.BLOCK))
  assert held == ([blocks] if x.size >= lowbit.MIN_SIZE else []), held
  one = jax.make_jaxpr(functools.partial(lowbit.all_finite, by_block=False))(x)
  assert "optimization_barrier" not in str(one)  # one reduction (the host rows')


@OPTAX_BIAS_CORRECTION
@OPTAX_UPDATE_MOMENT
def test_non_finite_poisons_its_block_on_cpu():
  """XLA:CPU's float max may drop a NaN: the scale must not."""
  with jax.default_device(jax.devices("cpu")[0]):
    _non_finite_poisons_its_block()


@pytest.mark.gpu
@OPTAX_BIAS_CORRECTION
@OPTAX_UPDATE_MOMENT
def test_non_finite_poisons_its_block_on_gpu():
  _non_finite_poisons_its_block()


@OPTAX_BIAS_CORRECTION
def test_adam_8bit_is_adam_for_small_leaves_and_close_for_big_ones():
  tx, ref = lowbit.scale_by_adam_8bit(), optax.scale_by_adam()
  s, r = tx.init(PARAMS), ref.init(PARAMS)
  assert isinstance(s.mu["big"], lowbit.QuantizedArray) and s.mu["small"].dtype == jnp.float32
  for g in _grads(PARAMS, 20):
    u, s = tx.update(g, s)
    v, r = ref.update(g, r)
    np.testing.assert_array_equal(u["small"], v["small"])
    rel = jnp.linalg.norm(u["big"] - v["big"]) / jnp.linalg.norm(v["big"])
    assert float(rel) < 0.1, float(rel)  # to first order 2^-4 from m, 2^-5 from sqrt(v)


@OPTAX_BIAS_CORRECTION
def test_min_size_0_quantizes_every_leaf_but_an_empty_one():
  """``min_size=0``: each leaf's moments 8-bit, an empty leaf's float32 and empty (a block
  scale of nothing divided by zero); its update is empty, the others' as with ``min_size=1``."""
  params = {"w": jnp.ones((4, 8)), "empty": jnp.zeros((0, 8))}
  tx = lowbit.scale_by_adam_8bit(block=8, min_size=0)
  state = tx.init(params)
  assert lowbit.is_quantized(state.mu["w"]) and state.mu["empty"].dtype == jnp.float32
  updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
  assert updates["empty"].shape == (0, 8) and bool(jnp.all(jnp.isfinite(updates["w"])))
  assert lowbit.adamw_8bit(1e-3, block=8, min_size=0, bfloat16_params=True).fused.min_size == 1


@OPTAX_BIAS_CORRECTION
def test_adamw_8bit_is_the_adamw_chain_with_8bit_moments():
  params = {"w": jnp.linspace(-1, 1, 8192).reshape(32, 256), "b": jnp.ones(4)}
  grads = jax.tree.map(lambda p: jnp.cos(3 * p), params)
  chain = optax.chain(lowbit.scale_by_adam_8bit(), optax.add_decayed_weights(0.1),
                      optax.scale_by_learning_rate(1e-2))
  tx = lowbit.adamw_8bit(1e-2, weight_decay=0.1)
  updates, _ = tx.update(grads, tx.init(params), params)
  expected, _ = chain.update(grads, chain.init(params), params)
  for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(a, b)
  # the mask keeps the bias out of the decay: with zero gradients only the kernel moves
  masked = lowbit.adamw_8bit(1e-2, weight_decay=0.1, mask={"w": True, "b": False})
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = masked.update(zeros, masked.init(params), params)
  np.testing.assert_array_equal(updates["b"], 0)
  np.testing.assert_allclose(updates["w"], -1e-3 * params["w"], rtol=1e-6)


@OPTAX_BIAS_CORRECTION
@OPTAX_UPDATE_MOMENT
def test_the_two_pass_8bit_update_is_its_one_pass_twin_bit_for_bit():
  """`moments_step` makes the moments twice (scales, then codes and direction): the state
  and direction equal those of one pass over the dequantised moments, each moment rounded
  with its own word of one Threefry evaluation at the leaf's place."""
  params = {"a": jnp.zeros((8, 512)), "b": jnp.zeros((40, 300)), "small": jnp.zeros(7)}
  tx = lowbit.scale_by_adam_8bit(seed=4)

  def twin(g, state):
    mu, nu = lowbit.moments_load(state.mu, state.nu)
    mu = optax.tree_utils.tree_update_moment(g, mu, 0.9, 1)
    nu = optax.tree_utils.tree_update_moment_per_elem_norm(g, nu, 0.999, 2)
    count = state.count + 1
    direction = lowbit.adam_direction(mu, nu, count, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
                                      like=g)
    key = lowbit.step_key(4, count)

    def store(m, v, at):
      if m.size < lowbit.MIN_SIZE:
        return m, v
      return tuple(lowbit.quantize(x, signed=signed, key=jax.random.fold_in(key, True),
                                   position=lowbit.Position(at), word=word)
                   for x, signed, word in ((m, True, 0), (v, False, 1)))

    leaves = [store(m, v, at) for at, (m, v) in
              enumerate(zip(jax.tree.leaves(mu), jax.tree.leaves(nu)))]
    treedef = jax.tree.structure(g)
    return direction, (jax.tree.unflatten(treedef, [m for m, _ in leaves]),
                       jax.tree.unflatten(treedef, [v for _, v in leaves]))

  state = tx.init(params)
  for g in _grads(params, 3):
    want_direction, want_moments = jax.jit(twin)(g, state)
    direction, state = jax.jit(tx.update)(g, state)
    for got, want in ((direction, want_direction), ((state.mu, state.nu), want_moments)):
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
  assert np.any(np.asarray(state.mu["a"].codes) != 0)


@OPTAX_BIAS_CORRECTION
@OPTAX_UPDATE_MOMENT
@OPTAX_APPLY_UPDATES
@pytest.mark.parametrize("name, most_bytes, threefry", [
    ("lowbit.adamw_8bit (parameters rounded to nearest)", 16, 1),
    ("lowbit.adamw_8bit + lowbit.stochastic_rounding (8bit+bf16-params)", 16, 2)])
def test_an_8bit_update_compiled_for_the_h100_moves_at_most_16_bytes_a_parameter(
    name, most_bytes, threefry):
  """The update of a bfloat16 weight, compiled for the h100, keeps no float32 moment in HBM
  (`moments_step`): codes, gradient and parameter in and out, 14.2 bytes an element where
  one pass made 26.2; one Threefry evaluation an element for both moments (a word each), one
  for a stochastically rounded parameter."""
  found = optimizer_bytes.measure(optimizer_bytes.optimizers()[name], 1024, 1024,
                                  lm.targets.get("h100"))
  assert found["bytes"] <= most_bytes, found
  assert found["threefry"] == threefry, found


@OPTAX_BIAS_CORRECTION
@OPTAX_UPDATE_MOMENT
def test_updates_keep_the_gradients_dtype():
  params = {"w": jnp.ones((64, 128), jnp.bfloat16)}
  grads = {"w": jnp.full((64, 128), 0.5, jnp.bfloat16)}
  for tx in (lowbit.scale_by_adam_8bit(), lm.adama(1, state_bits=8)):
    updates, _ = tx.update(grads, tx.init(params))
    assert updates["w"].dtype == jnp.bfloat16


DIGITS_ROWS = lowbit_digits.rows()
_microbatch_step = functools.cache(lm.microbatch_step)  # one step function a row


@functools.cache
def _digits_validation_loss(name: str, seed: int) -> float:
  """`lowbit_digits.validation_loss` of the row ``name``, once a process (a float32 row is
  the reference of two tests); the row's seeds share one step function, compiled once."""
  tx, k, dtype = DIGITS_ROWS[name]
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(lm, "microbatch_step", _microbatch_step)
    return lowbit_digits.validation_loss(tx, seed, k, param_dtype=dtype)


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    "Adam, 8-bit, stochastic rounding", "AdamA k=4, 8-bit moments",
    pytest.param("Adam, 8-bit, bfloat16 params rounded stochastically",
                 marks=[OPTAX_UPDATE_MOMENT, OPTAX_APPLY_UPDATES]),
    pytest.param("AdamA k=4, 8-bit, bfloat16 params rounded stochastically",
                 marks=[OPTAX_APPLY_UPDATES])])
@OPTAX_BIAS_CORRECTION
def test_training_on_digits_within_1_percent_of_float32(name):
  """Validation loss on digits against the same optimizer's 32-bit moments and float32
  parameters, 3 seeds."""
  tx, k, _ = DIGITS_ROWS[name]
  reference = "Adam, float32 moments" if k == 1 else "AdamA k=4, 32-bit moments"
  if k > 1:
    state = lm.optim.find_adama_state(tx.init(lowbit_digits.init(0)))
    assert isinstance(state.mu["w1"], lowbit.QuantizedArray)
  for seed in range(3):
    got = _digits_validation_loss(name, seed)
    want = _digits_validation_loss(reference, seed)
    assert abs(got - want) / want < 0.01, (seed, got, want)


@pytest.mark.slow
@OPTAX_BIAS_CORRECTION
@OPTAX_UPDATE_MOMENT
def test_bfloat16_params_rounded_to_nearest_stall():
  """Without stochastic rounding bfloat16 parameters lose Adam's small steps: the same
  optimizer ends more than 3% worse (what `stochastic_rounding` is for)."""
  got = _digits_validation_loss("Adam, 8-bit, bfloat16 params rounded to nearest", 0)
  want = _digits_validation_loss("Adam, float32 moments", 0)
  assert (got - want) / want > 0.03, (got, want)


def test_the_second_word_is_the_evaluations_other_and_bad_words_are_refused():
  """``words=2`` gives the first word (what one word gives) and the second of the same
  evaluation: bits of their own, which `moments_store` rounds ``nu`` with."""
  key, at = jax.random.key(3), lowbit.Position(leaf=2)
  first, second = lowbit.rounding_bits(key, (64, 256), at, words=2)
  np.testing.assert_array_equal(first, lowbit.rounding_bits(key, (64, 256), at))
  assert second.dtype == jnp.uint32 and np.mean(np.asarray(first) == np.asarray(second)) < 0.01
  x = jax.random.uniform(jax.random.key(1), (64, 256))
  codes = [lowbit.quantize(x, signed=False, key=key, position=at, word=w).codes for w in (0, 1)]
  assert np.mean(np.asarray(codes[0]) != np.asarray(codes[1])) > 0.1
  for words in (3, True):
    with pytest.raises(ValueError, match="`words` must be 1 or 2"):
      lowbit.rounding_bits(key, (4,), at, words=words)
  for word in (2, True):
    with pytest.raises(ValueError, match="`word` must be 0 or 1"):
      lowbit.quantize(x, signed=False, key=key, word=word)


def test_rounding_bits_of_a_part_are_the_whole_leafs_there():
  """A layer of a stacked leaf (`Position.index`) and equal parts of it or of a leaf's rows
  (`Position.part`) draw the bits the whole leaf draws at their elements."""
  key = jax.random.key(3)
  at = lowbit.Position(leaf=2)
  whole = lowbit.rounding_bits(key, (3, 8, 5), at)
  assert whole.dtype == jnp.uint32 and whole.shape == (3, 8, 5)
  for layer in range(3):
    np.testing.assert_array_equal(
        lowbit.rounding_bits(key, (8, 5), at.index(layer)), whole[layer])
    for i in range(4):
      traced = jax.jit(lambda i, layer: lowbit.rounding_bits(
          key, (2, 5), at.index(layer).part(i, (2, 5))))(i, layer)
      np.testing.assert_array_equal(traced, whole[layer, 2 * i:2 * i + 2])
  for i in range(4):  # rows of a 2-d leaf, in parts along them
    np.testing.assert_array_equal(lowbit.rounding_bits(key, (2, 5), at.part(i, (2, 5))),
                                  lowbit.rounding_bits(key, (8, 5), at)[2 * i:2 * i + 2])
  other = lowbit.rounding_bits(key, (3, 8, 5), lowbit.Position(leaf=1))
  assert np.mean(np.asarray(other) == np.asarray(whole)) < 0.01  # another leaf, other bits
  uniform = np.asarray(lowbit.rounding_bits(key, (256, 256)), np.float64) / 2 ** 32
  assert abs(uniform.mean() - 0.5) < 0.005 and abs(uniform.var() - 1 / 12) < 0.002
  np.testing.assert_array_equal(  # a raw key is a threefry2x32 key's data
      lowbit.rounding_bits(jax.random.key_data(key), (3, 8, 5), at), whole)
  rbg = lowbit.rounding_bits(jax.random.key(0, impl="rbg"), (3, 8, 5), at)  # made threefry
  assert rbg.shape == (3, 8, 5) and not np.array_equal(rbg, whole)
  with pytest.raises(ValueError, match="two uint32 words"):
    lowbit.rounding_bits(jax.random.key_data(jax.random.key(0, impl="rbg")), (2,))
  rows = jax.vmap(lambda r: lowbit.rounding_bits(key, (8, 5), lowbit.Position(2, r, rows=False)))
  np.testing.assert_array_equal(rows(jnp.arange(3)), whole)  # positions under jax.vmap
  with pytest.raises(ValueError, match="within one row"):
    at.index(0).index(1)


def test_stochastic_round_picks_a_neighbour_unbiased():
  x = _wide((4, 256), seed=3)
  keys = jax.random.split(jax.random.key(0), 2000)
  r = jax.vmap(lambda k: lowbit.stochastic_round(x, key=k))(keys).astype(jnp.float32)
  assert r.dtype == jnp.float32
  lo = jax.lax.bitcast_convert_type(
      (jax.lax.bitcast_convert_type(x, jnp.uint32) >> 16 << 16), jnp.float32)  # toward zero
  hi = jnp.nextafter(lo.astype(jnp.bfloat16), jnp.copysign(jnp.inf, x).astype(
      jnp.bfloat16)).astype(jnp.float32)
  assert bool(jnp.all((r == lo[None]) | (r == hi[None])))
  spacing = jnp.abs(hi - lo)
  assert bool(jnp.all(jnp.abs(r.mean(0) - x) <= 0.1 * spacing))  # 9 standard errors
  edges = jnp.array([jnp.nan, jnp.inf, -jnp.inf, 0.0, -0.0, 1.0], jnp.float32)
  got = lowbit.stochastic_round(edges, key=jax.random.key(1)).astype(jnp.float32)
  np.testing.assert_array_equal(got, edges)


@OPTAX_APPLY_UPDATES
def test_stochastic_rounding_makes_apply_updates_round_stochastically():
  params = {"w": _wide((64, 256), seed=4).astype(jnp.bfloat16), "b": jnp.ones(8)}
  updates = {"w": 1e-3 * _wide((64, 256), seed=5), "b": jnp.full(8, 1e-9)}
  tx = lowbit.stochastic_rounding(seed=7)
  state = tx.init(params)
  out, new_state = tx.update(updates, state, params)
  assert out["w"].dtype == jnp.float32
  applied = optax.apply_updates(params, out)
  assert applied["w"].dtype == jnp.bfloat16
  _, step_key = jax.random.split(jax.random.wrap_key_data(state.key))
  want = lowbit.stochastic_round(params["w"].astype(jnp.float32) + updates["w"], key=step_key,
                                 position=lowbit.Position(1))  # leaves in order: "b", "w"
  np.testing.assert_array_equal(applied["w"], want)
  np.testing.assert_array_equal(out["b"], updates["b"])  # float32 leaves pass through
  jitted = jax.jit(lambda p, u, s: optax.apply_updates(p, tx.update(u, s, p)[0]))
  np.testing.assert_array_equal(jitted(params, updates, state)["w"], want)
  inf = {"w": jnp.array([jnp.inf, -jnp.inf, 1.0], jnp.bfloat16), "b": jnp.ones(8)}
  moved = optax.apply_updates(inf, tx.update({"w": jnp.full(3, 1e-3), "b": jnp.zeros(8)},
                                             state, inf)[0])
  np.testing.assert_array_equal(moved["w"][:2], inf["w"][:2])  # infinite parameters stay
  again, _ = tx.update(updates, new_state, params)
  assert not np.array_equal(again["w"], out["w"])  # the key moved on
  restored = flax.serialization.from_bytes(tx.init(params), flax.serialization.to_bytes(new_state))
  np.testing.assert_array_equal(tx.update(updates, restored, params)[0]["w"], again["w"])


def test_stochastic_rounding_bad_arguments():
  tx = lowbit.stochastic_rounding()
  params = {"w": jnp.ones(3, jnp.bfloat16)}
  with pytest.raises(ValueError, match="params"):
    tx.update(params, tx.init(params))
  with pytest.raises(TypeError, match="float16"):
    half = {"w": jnp.ones(3, jnp.float16)}
    tx.update(half, tx.init(half), half)
  with pytest.raises(ValueError, match="seed"):
    lowbit.stochastic_rounding(seed=0.5)
  with pytest.raises(TypeError, match="float32"):
    lowbit.stochastic_round(jnp.ones(3, jnp.bfloat16), key=jax.random.key(0))


@OPTAX_BIAS_CORRECTION
def test_state_serialises_and_shards_on_8_devices():
  tx = optax.chain(lowbit.scale_by_adam_8bit(), optax.scale_by_learning_rate(1e-2))
  grads = _grads(PARAMS, 3)
  state = tx.init(PARAMS)
  for g in grads[:2]:
    _, state = tx.update(g, state)
  restored = flax.serialization.from_bytes(tx.init(PARAMS), flax.serialization.to_bytes(state))
  jax.tree.map(np.testing.assert_array_equal, restored, state)
  mesh = jax.make_mesh((8,), ("d",))  # the parameters' leading axis over 8 devices
  shard = lambda t: jax.tree.map(lambda a: jax.device_put(a, NamedSharding(
      mesh, P("d") if a.ndim and a.shape[0] % 8 == 0 else P())), t)
  sharded = shard(state)
  assert sharded[0].mu["big"].codes.sharding.spec == P("d")
  with jax.set_mesh(mesh):
    u1, s1 = jax.jit(tx.update)(shard(grads[2]), sharded)
  u2, s2 = jax.jit(tx.update)(grads[2], state)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), (u1, s1),
               (u2, s2))


def test_bad_arguments():
  with pytest.raises(ValueError, match="block"):
    lowbit.scale_by_adam_8bit(block=0)
  with pytest.raises(ValueError, match="min_size"):
    lowbit.scale_by_adam_8bit(min_size=-1)
  with pytest.raises(TypeError, match="float"):
    lowbit.quantize(jnp.arange(3), signed=True)
  with pytest.raises(ValueError, match="state_bits"):
    lm.adama(2, state_bits=4)
  with pytest.raises(ValueError, match="seed"):
    lm.adama(2, state_bits=8, seed=1.5)
  with pytest.raises(ValueError, match="mu_dtype"):
    lm.adama(2, state_bits=8, mu_dtype=jnp.bfloat16)
  params = {"w": jnp.ones((64, 128))}
  tx = lm.adama(2, state_bits=8)
  step = lm.microbatch_step(lambda p, b: jnp.sum(b @ p["w"]), tx, 2, fold_in_backward=True)
  with pytest.raises(ValueError, match="32-bit AdamA moments"):
    step(params, tx.init(params), jnp.ones((4, 64)))


@OPTAX_BIAS_CORRECTION
@OPTAX_UPDATE_MOMENT
def test_states_round_trip_through_orbax_sharded_on_8_devices(tmp_path):
  """8-bit Adam, 8-bit AdamA and stochastic rounding states, sharded along the parameters'
  leading axis, saved and restored by orbax with their shardings."""
  import orbax.checkpoint as ocp
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS)
  mesh = jax.make_mesh((8,), ("d",))
  spec = lambda a: P("d") if a.ndim and a.shape[0] % 8 == 0 else P()
  shard = lambda t: jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec(a))), t)
  for name, tx in (
      ("adam", optax.chain(lowbit.scale_by_adam_8bit(), optax.scale_by_learning_rate(1e-2),
                           lowbit.stochastic_rounding(seed=3))),
      ("adama", optax.chain(lm.adamaw(1e-2, 2, state_bits=8), lowbit.stochastic_rounding()))):
    state = tx.init(params)
    for g in _grads(PARAMS, 3):
      _, state = jax.jit(tx.update)(jax.tree.map(lambda x: x.astype(jnp.bfloat16), g), state,
                                    params)
    state = shard(state)
    with ocp.StandardCheckpointer() as ckpt:
      ckpt.save(tmp_path / name, state)
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          state)
    with ocp.StandardCheckpointer() as ckpt:
      restored = ckpt.restore(tmp_path / name, target)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    jax.tree.map(np.testing.assert_array_equal, restored, state)
    assert jax.tree.map(lambda a: a.sharding.spec, restored) == jax.tree.map(
        lambda a: a.sharding.spec, state)


def test_inject_hyperparams_without_static_args_names_them():
  """optax.inject_hyperparams makes ``block`` an array: the error says which static_args to give."""
  tx = optax.inject_hyperparams(lowbit.adamw_8bit)(learning_rate=1e-2)
  with pytest.raises(ValueError, match=r"static_args=\('block', 'min_size', 'seed'\)"):
    tx.init({"w": jnp.ones((4, 256))})
  optax.inject_hyperparams(lowbit.adamw_8bit, static_args=("block", "min_size", "seed"))(
      learning_rate=1e-2).init({"w": jnp.ones((4, 256))})
