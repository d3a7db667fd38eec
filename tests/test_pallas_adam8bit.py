"""The fused 8-bit AdamW kernel against the optax chain it fuses (interpret mode on CPU), and
compiled for GPU targets."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend.random import threefry2x32_p

import lowmem_jax as lm
from lowmem_jax.compile.memory import step_time
from lowmem_jax.optim import lowbit
from pallas_kernels import _blocks, adam8bit
from third_party_promotion import OPTAX_APPLY_UPDATES, OPTAX_BIAS_CORRECTION

INTERPRET = _blocks.Options(interpret=True)
# XLA's default keeps a bfloat16 result in float32 where it fuses it with its user; off, the
# chain is computed as written, each bfloat16 result rounded, as the kernel computes it.
EXACT = {"xla_allow_excess_precision": False}
LR, SEED, LEAF = 1e-3, 7, 3
HYPER = lowbit.adamw_8bit(LR, seed=SEED, bfloat16_params=True).fused


def test_threefry_is_jaxs_bit_for_bit():
  words = jax.random.bits(jax.random.key(0), (4, 4096), jnp.uint32)
  key = (words[0, 0], words[1, 0])
  want = threefry2x32_p.bind(*key, words[2], words[3])
  got = adam8bit.threefry2x32(*key, words[2], words[3])
  for w, g in zip(want, got):
    np.testing.assert_array_equal(g, w)


def _inputs(state, at: lowbit.Position, ok: bool = True, first_rows=(0, 0, 0, 0)):
  """The kernel's ``count, key, words, numbers, row, ok`` for the step after ``state`` (the
  chain's) of the leaf at ``at``, whose first rows in the kernel's buffers are ``first_rows``:
  a stack of one slice."""
  adam, rounding = state[0][0], state[1]
  count = optax.safe_int32_increment(adam.count)
  key = lowbit.step_key(SEED, count)
  folded = lambda k: jax.random.key_data(jax.random.fold_in(k, at.leaf))
  next_key, step = jax.random.split(jax.random.wrap_key_data(rounding.key, impl="threefry2x32"))
  words = jnp.concatenate([folded(jax.random.fold_in(key, True)), folded(step),
                           jnp.array([at.row, at.offset, *first_rows, count], jnp.uint32),
                           jax.random.key_data(next_key), jnp.zeros(1, jnp.uint32)])
  numbers = jnp.array([1 - HYPER.b1 ** count, 1 - HYPER.b2 ** count], jnp.float32)
  return (adam.count[None], rounding.key[None], words[None], numbers[None], jnp.int32(0),
          jnp.asarray(ok))


def _steps(shape, at: lowbit.Position, steps: int, options: _blocks.Options = INTERPRET):
  """``steps`` steps of the chain on a bfloat16 leaf of ``shape`` at ``at``; yields each
  step's kernel output and the chain's, the kernel starting from the chain's values, and the
  parameter both started from."""
  tx = lowbit.adamw_8bit(LR, seed=SEED, bfloat16_params=True)
  params = {"w": jax.random.normal(jax.random.key(1), shape).astype(jnp.bfloat16)}
  state = tx.init(params)
  kernel = jax.jit(lambda *a: adam8bit.update(*a, hyper=HYPER, shape=shape, rows=at.rows,
                                              options=options), compiler_options=EXACT)

  def chain(g, s, p):
    updates, s = tx.update(g, s, p, positions={"w": at})
    return optax.apply_updates(p, updates), s

  chain = jax.jit(chain, compiler_options=EXACT)
  for k in range(steps):
    g = (0.1 * jax.random.normal(jax.random.key(10 + k), shape)).astype(jnp.bfloat16)
    moments = state[0][0]
    before = params["w"]
    got = kernel(before, g, moments.mu["w"], moments.nu["w"], *_inputs(state, at))
    params, state = chain({"w": g}, state, params)
    yield got, (params["w"], state[0][0].mu["w"], state[0][0].nu["w"], state[0][0].count[None],
                state[1].key[None]), before


def _assert_equal(got, want):
  """The kernel's step and the chain's, both compiled with `EXACT`: the parameter and the
  codes bit for bit, the scales to float32 roundings (XLA makes the chain's in a pass of
  their own, whose sums it may round otherwise); the count and key exactly."""
  (p, mu, nu, *steps), (p_want, mu_want, nu_want, *steps_want) = got, want
  np.testing.assert_array_equal(p, p_want)
  for x, x_want in zip(steps, steps_want, strict=True):
    np.testing.assert_array_equal(x, x_want)
  for q, q_want in ((mu, mu_want), (nu, nu_want)):
    np.testing.assert_array_equal(q.codes, q_want.codes)
    np.testing.assert_allclose(q.scales, q_want.scales, rtol=1e-6, atol=0)


@OPTAX_BIAS_CORRECTION
@OPTAX_APPLY_UPDATES
def test_the_kernel_is_the_optax_chain_compiled_as_written():
  for got, want, _ in _steps((40, 512), lowbit.Position(LEAF, 5, 0), steps=3):
    _assert_equal(got, want)


@pytest.mark.slow
@OPTAX_BIAS_CORRECTION
@OPTAX_APPLY_UPDATES
@pytest.mark.parametrize(("shape", "at"), [
    ((3, 5, 768), lowbit.Position(LEAF, 2, 0)),
    ((4096,), lowbit.Position(LEAF, 9, 0)),
    ((17, 512), lowbit.Position(LEAF, 4, 1024, rows=False)),
    ((2, 4096), lowbit.Position(LEAF, 0, 0))])
def test_the_kernel_is_the_optax_chain_on_each_shape_and_position(shape, at):
  for got, want, _ in _steps(shape, at, steps=2):
    _assert_equal(got, want)


def _units_allowed(before, after) -> np.ndarray:
  """Bfloat16 units of ``after`` (bfloat16) that a step from ``before`` may move by where its
  direction is off by a bfloat16 unit: a unit of the update both in the direction and in the
  learning rate's product (2 * 2**-7 of the step, in units of ``after``), one for the
  stochastic rounding, one for the step's size read from the rounded result."""
  before, after = (np.asarray(x, np.float32) for x in (before, after))
  exponent = np.where(after == 0, -125, np.maximum(np.frexp(after)[1], -125))
  unit = np.ldexp(1.0, exponent - 8)  # bfloat16's ulp at after (at 0: the smallest)
  return 2 + np.ceil(np.abs(after - before) * 2.0 ** -6 / unit)


def _units_apart(a, b) -> np.ndarray:
  """Bfloat16 values between ``a`` and ``b`` (bfloat16 arrays), across zero too: the bits
  (sign and magnitude) made an ordered integer."""
  def ordered(x):
    v = np.asarray(x).view(np.int16).astype(np.int32)
    return np.where(v < 0, -32768 - v, v)

  return np.abs(ordered(a) - ordered(b))


@pytest.mark.gpu
@OPTAX_BIAS_CORRECTION
@OPTAX_APPLY_UPDATES
def test_on_gpu_the_kernel_is_the_chain_but_for_a_unit_of_the_update_in_few_places():
  """Compiled by Triton on the GPU, where a float32 division is approximate (PTX's
  ``div.full.f32``, within 2 ulp) and XLA's is rounded correctly. The direction is rounded
  to bfloat16 before the step, so an ulp can move it, and the update, by a bfloat16 unit of
  theirs: the parameter by that much more than its own unit, many of its units where the
  update dwarfs it (a parameter near zero). So: under 1% of the parameters off the chain's,
  none by more than `_units_allowed`; under 1% of the moments a code from it; the counts
  and keys exactly. (On an H100 under jax 0.11.2 a parameter was 4 units off, against an
  earlier bound of 1.)"""
  for got, want, before in _steps((1024, 4096), lowbit.Position(LEAF, 5, 0), steps=3,
                                  options=_blocks.Options()):
    (p, mu, nu, *steps), (p_want, mu_want, nu_want, *steps_want) = got, want
    for x, x_want in zip(steps, steps_want, strict=True):
      np.testing.assert_array_equal(x, x_want)
    units = _units_apart(p, p_want)
    assert np.all(units <= _units_allowed(before, p_want)) and np.mean(units > 0) < 0.01
    for q, q_want, signed in ((mu, mu_want, True), (nu, nu_want, False)):
      a, b = (np.asarray(lowbit.dequantize(x, signed=signed)) for x in (q, q_want))
      assert np.mean(a != b) < 0.01
      np.testing.assert_allclose(a, b, rtol=0.25, atol=float(np.abs(b).max()) * 2 ** -10)


@OPTAX_BIAS_CORRECTION
@OPTAX_APPLY_UPDATES
def test_a_slice_is_updated_where_it_lies_in_bigger_buffers_and_nothing_else():
  """Rows 8 to 23 of layer 1 of a stack of 3 layers of 40 x 512, as the layer-streamed step
  updates a slice: the slice as the chain updates it alone, every other value kept."""
  tx = lowbit.adamw_8bit(LR, seed=SEED, bfloat16_params=True)
  stack = jax.random.normal(jax.random.key(1), (3, 40, 512)).astype(jnp.bfloat16)
  stacked = lambda q: jax.tree.map(lambda x: jnp.stack([x] * 3), q)
  moments = lowbit.moments_zeros(stack[0])
  moments = [stacked(lowbit.quantize(jax.random.normal(jax.random.key(k), (40, 512)) ** k,
                                     signed=k == 1)) for k in (1, 2)]
  at = lowbit.Position(LEAF, 8, 0)
  part = stack[1, 8:24]
  state = tx.init({"w": part})
  adam = state[0][0]._replace(mu={"w": jax.tree.map(lambda x: x[1, 8:24], moments[0])},
                              nu={"w": jax.tree.map(lambda x: x[1, 8:24], moments[1])})
  state = ((adam, *state[0][1:]), state[1])
  g = (0.1 * jax.random.normal(jax.random.key(5), part.shape)).astype(jnp.bfloat16)
  got = jax.jit(lambda *a: adam8bit.update(*a, hyper=HYPER, shape=part.shape, options=INTERPRET),
                compiler_options=EXACT)(jnp.copy(stack), g, *jax.tree.map(jnp.copy, moments),
                                        *_inputs(state, at, first_rows=(48, 0, 48, 48)))
  updates, new = tx.update({"w": g}, state, {"w": part}, positions={"w": at})
  want = (optax.apply_updates({"w": part}, updates)["w"], new[0][0].mu["w"], new[0][0].nu["w"])
  inside = lambda x: x[1, 8:24]
  _assert_equal(jax.tree.map(inside, got[:3]), want)
  outside = lambda x: jnp.concatenate([x[0].ravel(), x[1, :8].ravel(), x[1, 24:].ravel(),
                                       x[2].ravel()])
  for x, y in zip(jax.tree.leaves(got[:3]), jax.tree.leaves((stack, *moments))):
    np.testing.assert_array_equal(outside(x), outside(y))


def test_a_step_that_is_not_ok_keeps_every_value():
  shape = (20, 256)
  p = jax.random.normal(jax.random.key(1), shape).astype(jnp.bfloat16)
  mu = lowbit.quantize(jax.random.normal(jax.random.key(2), shape), signed=True)
  nu = lowbit.moments_zeros(p)[1]
  count, key = jnp.array([4, 9], jnp.int32), jnp.arange(4, dtype=jnp.uint32).reshape(2, 2)
  words = jnp.stack([jnp.arange(14, dtype=jnp.uint32).at[6:10].set(0)] * 2)
  numbers = jnp.array([[0.1, 0.001]] * 2, jnp.float32)
  got = adam8bit.update(jnp.copy(p), jnp.ones(shape, jnp.bfloat16), jax.tree.map(jnp.copy, mu),
                        jax.tree.map(jnp.copy, nu), jnp.copy(count), jnp.copy(key), words,
                        numbers, jnp.int32(1), jnp.bool_(False), hyper=HYPER, shape=shape,
                        options=INTERPRET)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves((p, mu, nu, count, key))):
    np.testing.assert_array_equal(x, y)


def test_the_step_writes_its_rows_count_and_key_and_no_other():
  """Words for a stack of 3 slices' states, the step at row 1: its count and key set to the
  words' new count and next key, rows 0 and 2 kept; the slice updated from row 1's words."""
  shape = (16, 256)
  p = jax.random.normal(jax.random.key(1), shape).astype(jnp.bfloat16)
  mu, nu = lowbit.moments_zeros(p)
  count, key = jnp.array([4, 9, 2], jnp.int32), jnp.arange(6, dtype=jnp.uint32).reshape(3, 2)
  words = jnp.zeros((3, 14), jnp.uint32).at[:, 10:13].set(
      jnp.array([[5, 70, 71], [10, 80, 81], [3, 90, 91]], jnp.uint32))
  numbers = jnp.array([[0.1, 0.001], [0.5, 0.01], [0.2, 0.002]], jnp.float32)
  run = lambda row: adam8bit.update(
      jnp.copy(p), jnp.ones(shape, jnp.bfloat16), jax.tree.map(jnp.copy, mu),
      jax.tree.map(jnp.copy, nu), jnp.copy(count), jnp.copy(key), words, numbers,
      jnp.int32(row), jnp.bool_(True), hyper=HYPER, shape=shape, options=INTERPRET)
  got = run(1)
  np.testing.assert_array_equal(got[3], [4, 10, 2])
  np.testing.assert_array_equal(got[4], [[0, 1], [80, 81], [4, 5]])
  assert not np.array_equal(got[0], p)
  other = run(2)  # another row's bias corrections: another step
  assert not np.array_equal(other[0], got[0])


@pytest.mark.parametrize("target", ["h100", "rtx4090"])
def test_the_kernel_compiles_for_gpu_targets_in_one_pass_of_10_bytes_a_parameter(target):
  """Triton and ptxas build it for sm_90a and sm_89 here, without a GPU; the compiled step
  is the one kernel, writing a layer of a stack in place, which the step-time estimate
  charges 10 bytes an element and 16 a block of 256 of the layer, besides the 89 bytes of
  its row, ``ok``, its row's words and numbers, and the count and key it writes, and whose
  integer work takes longer than those bytes (no GPU has run it yet)."""
  target = lm.targets.get(target)
  shape, layers = (1024, 4096), 4
  stack = jax.ShapeDtypeStruct((layers, *shape), jnp.bfloat16)
  mu, nu = jax.eval_shape(lambda: lowbit.moments_zeros(jnp.zeros(stack.shape, jnp.bfloat16)))
  compiled = target.compile(
      lambda *a: adam8bit.update(*a, hyper=HYPER, shape=shape), stack,
      jax.ShapeDtypeStruct(shape, jnp.bfloat16), mu, nu,
      *[jax.ShapeDtypeStruct(s, d) for s, d in (
          ((layers,), jnp.int32), ((layers, 2), jnp.uint32), ((layers, 14), jnp.uint32),
          ((layers, 2), jnp.float32), ((), jnp.int32), ((), jnp.bool_))],
      donate_argnums=(0, 2, 3, 4, 5))
  text = compiled.as_text()
  assert 'custom_call_target="__gpu$xla.gpu.triton"' in text
  estimate = step_time.estimate(text, target)
  assert estimate.kernels == 1
  layer = shape[0] * shape[1]
  assert estimate.device_bytes == 10 * layer + 2 * 2 * 4 * layer // lowbit.BLOCK + 81
  # Its declared integer work, two Threefry evaluations of 77 operations an element (the
  # moments' codes share one) and the codes', bounds it: the step-time estimate charges it at
  # the integer pipe's rate, scaled by the calibrated efficiency of a Pallas kernel's.
  declared = int(re.search(r"int_ops\\22: \\22(\d+)", text).group(1))
  assert 2 * 77 * layer < declared < 300 * layer
  assert estimate.bound == "ALU"
  assert estimate.seconds_by_bound["ALU"] >= 0.999 * declared / (
      target.lane_ops_per_s["int"] * step_time.CALIBRATION.pallas_alu_efficiency)


def test_bad_inputs_are_refused_by_name():
  p = jnp.zeros((16, 256), jnp.bfloat16)  # min_size elements: 8-bit moments
  mu, nu = lowbit.moments_zeros(p)
  args = (jnp.zeros(1, jnp.int32), jnp.zeros((1, 2), jnp.uint32), jnp.zeros((1, 14), jnp.uint32),
          jnp.zeros((1, 2), jnp.float32), jnp.int32(0), jnp.bool_(True))
  run = lambda *a, **k: adam8bit.update(*a, *args, options=INTERPRET, **k)
  with pytest.raises(ValueError, match="`p` must be bfloat16"):
    run(p.astype(jnp.float32), p, mu, nu, hyper=HYPER, shape=(16, 256))
  with pytest.raises(ValueError, match="`g` holds 2 rows, fewer than the slice"):
    run(p, p[:2], mu, nu, hyper=HYPER, shape=(16, 256))
  with pytest.raises(ValueError, match="hyper.block must be a power of two"):
    run(p, p, mu, nu, hyper=dataclasses.replace(HYPER, block=100), shape=(16, 256))
  with pytest.raises(ValueError, match="not whole blocks of 256"):
    run(p, p, mu, nu, hyper=HYPER, shape=(8, 128))
  with pytest.raises(ValueError, match=r"`words` must be of shape \(1, 14\)"):
    adam8bit.update(p, p, mu, nu, *args[:2], jnp.zeros((1, 8), jnp.uint32), *args[3:],
                    hyper=HYPER, shape=(16, 256), options=INTERPRET)
