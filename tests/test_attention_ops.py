import functools
import inspect
import re
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import lowmem_jax as lm


def _qkv(dtype=jnp.float32, b=2, lq=5, lk=5, h=4, hk=4, d=8):
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(kq, (b, lq, h, d), dtype), jax.random.normal(kk, (b, lk, hk, d), dtype),
          jax.random.normal(kv, (b, lk, hk, d), dtype))


def _mask(lq, lk, p=0.7, shape=None):
  """A random mask that keeps key 0 of every row (no row is fully masked)."""
  shape = shape or (2, 1, lq, lk)
  return jax.random.bernoulli(jax.random.key(3), p, shape).at[..., 0].set(True)


def _value_and_grads(f, *args):
  loss = lambda *a: jnp.sum(jnp.sin(f(*a)))
  return jax.jit(lambda *a: (f(*a), jax.grad(loss, tuple(range(len(a))))(*a)))(*args)


@pytest.mark.slow
@pytest.mark.parametrize("hk", [4, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("bias_shape", [None, (1, 4, 5, 5), (2, 1, 1, 5)])
def test_plain_twin_matches_jax_attention_and_its_gradient(hk, causal, with_mask, bias_shape):
  q, k, v = _qkv(hk=hk)
  mask = _mask(5, 5) if with_mask else None
  bias = None if bias_shape is None else jax.random.normal(jax.random.key(4), bias_shape)
  ours = lambda q, k, v, bias: lm.attention_reference(q, k, v, bias, mask, is_causal=causal)
  theirs = lambda q, k, v, bias: jax.nn.dot_product_attention(q, k, v, bias, mask,
                                                              is_causal=causal)
  chex.assert_trees_all_close(_value_and_grads(ours, q, k, v, bias),
                              _value_and_grads(theirs, q, k, v, bias), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("hk,causal,lq,lk,chunk_size", [
    (4, False, 13, 13, 4), (2, True, 13, 13, 4), (1, True, 6, 13, 4), (2, False, 13, 6, 4),
    (4, True, 13, 6, 5), (1, False, 6, 13, 5), (2, True, 13, 13, 13), (4, True, 13, 6, 512)])
def test_attention_matches_plain_attention_and_its_gradient(hk, causal, lq, lk, chunk_size):
  """Chunks of 4 and 5 divide neither 13 nor 6; 13 and 512 are one chunk."""
  q, k, v = _qkv(lq=lq, lk=lk, hk=hk)
  mask = _mask(lq, lk)
  bias = jax.random.normal(jax.random.key(4), (1, 4, lq, lk))
  ours = lambda q, k, v, bias: lm.attention(q, k, v, bias, mask, is_causal=causal,
                                            chunk_size=chunk_size)
  theirs = lambda q, k, v, bias: jax.nn.dot_product_attention(q, k, v, bias, mask,
                                                              is_causal=causal)
  twin = lambda q, k, v, bias: lm.attention_reference(q, k, v, bias, mask, is_causal=causal)
  got = _value_and_grads(ours, q, k, v, bias)
  chex.assert_trees_all_close(got, _value_and_grads(theirs, q, k, v, bias), atol=2e-5)
  chex.assert_trees_all_close(got, _value_and_grads(twin, q, k, v, bias), atol=2e-5)


def _mesh(axis_type):
  """4 x 2 CPU devices ("data", "model") of automatic or explicit axes."""
  assert jax.device_count() == 8, "conftest forces 8 CPU devices"
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=(getattr(AxisType, axis_type),) * 2)


SHARDINGS = {  # layout: the specs of query, key and value, of the mask and of the bias
    "batch": (P("data"), P("data"), P()),
    "heads": (P(None, None, "model"), P(), P()),
    "batch and heads": (P("data", None, "model"), P("data"), P(None, "model")),
    "batch, bias over heads": (P("data"), P(), P(None, "model")),
}


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("layout", list(SHARDINGS))
def test_sharded_inputs_give_jax_attentions_output_and_gradient(axis_type, layout):
  """Query, key, value, mask and bias sharded over the batch, the heads or both, on a mesh
  of automatic or explicit axes: jax.nn's output, sharded as its, and gradients."""
  mesh = _mesh(axis_type)
  q, k, v = _qkv(b=8, lq=13, lk=13, hk=2)
  mask = _mask(13, 13, shape=(8, 1, 13, 13))
  bias = jax.random.normal(jax.random.key(4), (1, 4, 13, 13))
  qkv_spec, mask_spec, bias_spec = SHARDINGS[layout]
  ours = lambda q, k, v, bias, mask: lm.attention(q, k, v, bias, mask, is_causal=True,
                                                  chunk_size=4)
  # jax 0.12's own attention refuses a bias sharded over the heads under explicit axes (its
  # batched matmul's operands differ in sharding): the twin reads that bias replicated.
  whole = (lambda b: jax.sharding.reshard(b, P())) if axis_type == "Explicit" else (lambda b: b)
  theirs = lambda q, k, v, bias, mask: jax.nn.dot_product_attention(q, k, v, whole(bias), mask,
                                                                    is_causal=True)

  def value_and_grads(f, *args):
    loss = lambda *a: jnp.sum(jnp.sin(f(*a)))
    return jax.jit(lambda *a: (f(*a), jax.grad(loss, (0, 1, 2, 3))(*a)))(*args)

  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  with jax.set_mesh(mesh):
    args = (*(put(x, qkv_spec) for x in (q, k, v)), put(bias, bias_spec), put(mask, mask_spec))
    got, want = value_and_grads(ours, *args), value_and_grads(theirs, *args)
  assert jax.typeof(got[0]).sharding.spec == jax.typeof(want[0]).sharding.spec
  chex.assert_trees_all_close(got, want, atol=2e-5)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_fsdp_sharded_projections_give_jax_attentions_output_and_gradient(axis_type):
  """Inputs over "data" and the projections' weights too (FSDP: gathered where used), on a
  mesh of automatic or explicit axes: jax.nn's output and gradients, sharded as the weights."""
  mesh = _mesh(axis_type)
  x = jax.random.normal(jax.random.key(0), (8, 13, 16))
  ws = [0.3 * jax.random.normal(jax.random.key(i), (16, 8 * heads))
        for i, heads in ((1, 4), (2, 2), (3, 2))]

  def loss_of(attention):
    def loss(x, ws):
      q, k, v = (jnp.einsum("bld,de->ble", x, jax.sharding.reshard(w, P()))
                 .reshape(*x.shape[:2], -1, 8) for w in ws)
      return jnp.sum(jnp.sin(attention(q, k, v, is_causal=True)))
    return jax.jit(jax.value_and_grad(loss, (0, 1)))

  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
  with jax.set_mesh(mesh):
    args = (put(x), [put(w) for w in ws])
    got = loss_of(functools.partial(lm.attention, chunk_size=4))(*args)
    want = loss_of(jax.nn.dot_product_attention)(*args)
  assert [jax.typeof(g).sharding.spec for g in got[1][1]] == [
      jax.typeof(g).sharding.spec for g in want[1][1]]
  chex.assert_trees_all_close(got, want, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("hk", [4, 1])
def test_a_scale_is_jax_attentions(hk):
  q, k, v = _qkv(lq=7, lk=9, hk=hk)
  bias = jax.random.normal(jax.random.key(4), (1, 4, 7, 9))
  theirs = _value_and_grads(lambda *a: jax.nn.dot_product_attention(*a, bias, scale=0.3), q, k, v)
  for ours in (lambda *a: lm.attention(*a, bias, scale=0.3, chunk_size=4),
               lambda *a: lm.attention_reference(*a, bias, scale=np.float32(0.3))):
    chex.assert_trees_all_close(_value_and_grads(ours, q, k, v), theirs, atol=2e-5)


@pytest.mark.parametrize("bias_shape", [(4, 1, 1), (2, 1, 1, 9), (1, 1, 7, 1)])
def test_a_broadcast_bias_gets_its_own_shape_of_gradient(bias_shape):
  q, k, v = _qkv(lq=7, lk=9)
  bias = jax.random.normal(jax.random.key(4), bias_shape)
  ours = lambda bias: lm.attention(q, k, v, bias, chunk_size=4)
  theirs = lambda bias: jax.nn.dot_product_attention(q, k, v, bias)
  twin = lambda bias: lm.attention_reference(q, k, v, bias)
  got = _value_and_grads(ours, bias)
  chex.assert_trees_all_close(got, _value_and_grads(theirs, bias), atol=2e-5)
  chex.assert_trees_all_close(got, _value_and_grads(twin, bias), atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("with_bias", [False, True])
def test_fully_masked_rows_attend_uniformly_and_pass_no_logit_gradient(with_bias):
  """As in jax.nn: the row's output is the mean of v; q, k and the bias get nothing through it."""
  q, k, v = _qkv(lq=11, lk=11)
  mask = jax.random.bernoulli(jax.random.key(3), 0.4, (2, 1, 11, 11)).at[:, :, 2].set(False)
  bias = jax.random.normal(jax.random.key(4), (1, 4, 11, 11))
  if not with_bias:
    bias = None
  ours = lambda q, k, v: lm.attention(q, k, v, bias, mask, is_causal=True, chunk_size=4)
  theirs = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias, mask, is_causal=True)
  twin = lambda q, k, v: lm.attention_reference(q, k, v, bias, mask, is_causal=True)
  out, grads = _value_and_grads(ours, q, k, v)
  chex.assert_trees_all_close((out, grads), _value_and_grads(theirs, q, k, v), atol=2e-5)
  chex.assert_trees_all_close((out, grads), _value_and_grads(twin, q, k, v), atol=2e-5)
  chex.assert_trees_all_close(out[:, 2], jnp.broadcast_to(v.mean(1), out[:, 2].shape), atol=1e-6)
  assert not jnp.any(grads[0][:, 2])
  if with_bias:
    for f in (functools.partial(lm.attention, chunk_size=4), lm.attention_reference):
      dbias = jax.grad(lambda b: jnp.sum(jnp.sin(f(q, k, v, b, mask))))(bias)
      assert not jnp.any(dbias[:, :, 2])


def test_keys_biased_to_minus_infinity_are_masked():
  """A key biased to -inf is masked; a row of them attends uniformly (in jax.nn: NaN)."""
  q, k, v = _qkv(lq=7, lk=9)
  keep = _mask(7, 9, shape=(1, 1, 7, 9)).at[:, :, 3].set(False)
  bias = jnp.where(keep, 0.0, -jnp.inf)
  masked = _value_and_grads(lambda *a: lm.attention(*a, mask=keep, chunk_size=4), q, k, v)
  for f in (functools.partial(lm.attention, chunk_size=4), lm.attention_reference):
    chex.assert_trees_all_close(_value_and_grads(lambda *a: f(*a, bias), q, k, v), masked,
                                atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_keeps_dtype_and_stays_close_to_the_twin(dtype):
  q, k, v = _qkv(dtype, lq=13, lk=13, hk=2)
  out, grads = _value_and_grads(lambda *a: lm.attention(*a, is_causal=True, chunk_size=4), q, k, v)
  assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
  f32 = [t.astype(jnp.float32) for t in (q, k, v)]
  ref_out, ref_grads = _value_and_grads(lambda *a: lm.attention_reference(*a, is_causal=True), *f32)
  np.testing.assert_allclose(out.astype(jnp.float32), ref_out, atol=3e-2)
  for g, ref in zip(grads, ref_grads):
    np.testing.assert_allclose(g.astype(jnp.float32), ref, atol=6e-2)


def test_the_residuals_hold_nothing_of_size_l_by_l():
  q, k, v = _qkv(lq=64, lk=64, hk=2)
  mask = _mask(64, 64, shape=(2, 1, 1, 64))
  saved = lm.memory.saved_residuals(
      lambda q, k, v: lm.attention(q, k, v, mask=mask, is_causal=True, chunk_size=16), q, k, v)
  assert not [r for r in saved.rows if r.shape[-2:] == (64, 64) or np.prod(r.shape) >= 64 * 64 * 8]
  by_name = saved.by_name()
  assert by_name[lm.names.ATTN_OUT] == q.nbytes
  assert by_name[lm.names.ATTN_LSE] == 2 * 4 * 64 * 4  # float32 per row
  twin = lm.memory.saved_residuals(
      lambda q, k, v: lm.attention_reference(q, k, v, is_causal=True), q, k, v)
  square = [r for r in twin.rows if r.shape[-2:] == (64, 64)]
  assert [r.name for r in square] == [lm.names.ATTN_PROBS] and square[0].dtype == jnp.float32


def test_transient_memory_grows_linearly_in_length():
  """XLA's compiled temp of the gradient at L = 1024 and 2048: ×2 with chunks of 64 keys, ×4 plain.

  On the CPU target: the H100 target's pipeline holds 73 MiB for the chunked
  gradient at L = 1024, more than 2 of the 32 MiB squares (see docs/benchmarks.md)."""
  def temp(f, length):
    spec = jax.ShapeDtypeStruct((2, length, 4, 32), jnp.float32)
    grad = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), (0, 1, 2))
    return lm.memory.analyze(grad, spec, spec, spec, target="cpu").temp_bytes

  chunked = lambda *a: lm.attention(*a, is_causal=True, chunk_size=64)
  plain = lambda *a: lm.attention_reference(*a, is_causal=True)
  square = 2 * 4 * 1024 * 1024 * 4  # one float32 [batch, heads, 1024, 1024]
  # Plain: the saved probabilities and the backward's dlogits at least. Before jax 0.12.1
  # XLA's CPU pipeline also held dprobs, made by its own dot (101,744,640 bytes at 1024 on
  # 0.12.0.1, 3.03 squares); from 0.12.1 its ynn_fusion takes that dot in and holds
  # 69,238,784 (2.06 squares), 272,695,296 at 2048.
  assert temp(chunked, 1024) < 0.6 * square < 2 * square < temp(plain, 1024)
  assert temp(chunked, 2048) < 2.2 * temp(chunked, 1024)
  assert temp(plain, 2048) > 3.5 * temp(plain, 1024)


def test_policies_see_the_names():
  q, k, v = _qkv(lq=16, lk=16)
  policy = lm.policies.save_only(lm.names.ATTN_OUT, lm.names.ATTN_LSE)
  f = jax.checkpoint(lambda q, k, v: lm.attention(q, k, v, chunk_size=4), policy=policy)
  saved = lm.memory.saved_residuals(f, q, k, v)
  assert {lm.names.ATTN_OUT, lm.names.ATTN_LSE} <= set(saved.by_name())
  chex.assert_trees_all_close(_value_and_grads(f, q, k, v),
                              _value_and_grads(lambda *a: lm.attention(*a, chunk_size=4), q, k, v))


def test_the_twin_names_its_output_and_a_second_name_changes_nothing():
  """The models name the plain twin's output again, as they did before it named it itself."""
  q, k, v = _qkv(lq=16, lk=16)
  w = jax.random.normal(jax.random.key(5), (4, 8, 8))

  def block(name_again, q, k, v, w):
    out = lm.attention_reference(q, k, v, is_causal=True)
    out = checkpoint_name(out, lm.names.ATTN_OUT) if name_again else out
    return jnp.sum(jnp.sin(jnp.einsum("bqhd,hde->bqe", out, w)))

  for policy, saves_out in ((None, True), (lm.policies.save_only(lm.names.ATTN_OUT), True),
                           (lm.policies.save_all_but(lm.names.ATTN_OUT), False)):
    once, twice = (functools.partial(block, again) for again in (False, True))
    if policy is not None:
      once, twice = (jax.checkpoint(f, policy=policy) for f in (once, twice))
    saved = [[(r.name, r.shape, r.dtype) for r in lm.memory.saved_residuals(f, q, k, v, w).rows]
             for f in (once, twice)]
    assert saved[0] == saved[1]
    assert ((lm.names.ATTN_OUT, q.shape, q.dtype) in saved[0]) == saves_out
    compiled = [lm.memory.analyze(jax.grad(f, (0, 1, 2, 3)), q, k, v, w, target="cpu")
                for f in (once, twice)]
    assert compiled[0] == compiled[1]


def test_bad_inputs_are_named():
  q, k, v = _qkv()
  for f in (lm.attention, lm.attention_reference):
    with pytest.raises(ValueError, match=r"query must be .*query\[None\]"):
      f(q[0], k, v)
    with pytest.raises(ValueError, match="multiple"):
      f(q, *_qkv(hk=3)[1:])
    with pytest.raises(ValueError, match="key and value"):
      f(q, k, v[:, :3])
    with pytest.raises(TypeError, match="share a dtype"):
      f(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="mask must be"):
      f(q, k, v, mask=jnp.ones((5, 5)))
    with pytest.raises(ValueError, match="mask must broadcast"):
      f(q, k, v, mask=jnp.ones((3, 5), bool))
    with pytest.raises(ValueError, match="mask must broadcast"):
      f(q, k, v, mask=jnp.ones((1, 2, 4, 5, 5), bool))
    with pytest.raises(TypeError, match="bias must be"):
      f(q, k, v, bias=jnp.ones((5, 5), jnp.int32))
    with pytest.raises(ValueError, match="bias must broadcast"):
      f(q, k, v, bias=jnp.ones((3, 5)))
    with pytest.raises(TypeError, match="scale must be"):
      f(q, k, v, scale=jnp.float32(0.5))
  with pytest.raises(ValueError, match=r"implementation must be one of \('auto', 'xla', 'cudnn'"):
    lm.attention(q, k, v, implementation="flash")
  with pytest.raises(ValueError, match="attention has no 'pallas' implementation"):
    lm.attention(q, k, v, implementation="pallas")
  with pytest.raises(ValueError, match="chunk_size"):
    lm.attention(q, k, v, chunk_size=0)
  with pytest.raises(ValueError, match="at least one key"):
    lm.attention(q, k[:, :0], v[:, :0])
  chex.assert_trees_all_close(lm.attention(q, k, v, chunk_size=np.int64(2)), lm.attention(q, k, v),
                              atol=1e-6)


def test_the_signatures_are_jax_attentions():
  """Same names in the same order as jax.nn.dot_product_attention, for what each takes."""
  theirs = list(inspect.signature(jax.nn.dot_product_attention).parameters)
  ours = list(inspect.signature(lm.attention).parameters)
  dropout = ["dropout_rate", "dropout_rng", "broadcast_dropout"]  # flax's names
  assert ours == [n for n in theirs if n != "return_residual"] + ["chunk_size"] + dropout
  assert list(inspect.signature(lm.attention_reference).parameters) == theirs[:7] + dropout
  assert lm.attention_ops.IMPLS == tuple(i for i in lm.dispatch.IMPLS if "pallas" not in i)


@pytest.mark.parametrize("option,value", [
    ("query_seq_lengths", jnp.array([5, 3])), ("key_value_seq_lengths", jnp.array([5, 3])),
    ("local_window_size", 2)])
def test_jax_options_it_lacks_are_refused_by_name(option, value):
  q, k, v = _qkv()
  with pytest.raises(NotImplementedError, match=f"does not support {option};"):
    lm.attention(q, k, v, **{option: value})


def test_key_value_seq_lengths_as_the_mask_its_error_gives():
  q, k, v = _qkv(lk=9)
  lengths = jnp.array([9, 4])
  mask = (jnp.arange(9)[None, :] < lengths[:, None])[:, None, None, :]
  theirs = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths)
  chex.assert_trees_all_close(lm.attention(q, k, v, mask=mask, chunk_size=4), theirs, atol=1e-5)


def test_only_the_jax_nn_names_are_taken_and_they_warn_of_nothing():
  """0.1 was never released: its keywords, "chunked" and dot_product_attention are gone."""
  q, k, v = _qkv(lq=7, lk=9)
  mask = _mask(7, 9)
  for old in ({"q": q}, {"causal": True}, {"impl": "xla"}):
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(old))}'"):
      lm.attention(q, k, v, **old)
  with pytest.raises(ValueError, match="implementation must be one of .* got 'chunked'"):
    lm.attention(q, k, v, implementation="chunked")
  assert not hasattr(lm.attention_ops, "dot_product_attention")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    lm.attention(q, k, v, mask=mask, is_causal=True)  # the names warn of nothing
    lm.attention_reference(q, k, v, mask=mask, is_causal=True)
    lm.linen.attention_fn(q, k, v, mask, is_causal=True)


@pytest.mark.parametrize("op,scope", [(lm.attention, "lowmem/attention"),
                                      (lm.attention_reference, "lowmem/attention_reference")])
def test_the_ops_name_their_hlo(op, scope):
  """The lowered HLO's op_name metadata, which memory reports read, names the op."""
  q, k, v = _qkv()

  def op_names(f):
    return re.findall(r'op_name="([^"]*)"',
                      jax.jit(f).lower(q).as_text(dialect="hlo", debug_info=True))

  assert any(f"/{scope}/" in n for n in op_names(lambda q: op(q, k, v, is_causal=True)))
  grads = op_names(jax.value_and_grad(lambda q: jnp.sum(op(q, k, v, is_causal=True))))
  assert any(f"/jvp({scope})/" in n for n in grads)  # the forward
  assert any(f"/transpose(jvp({scope}))/" in n for n in grads)  # the backward


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU's refusal")
def test_cudnn_is_refused_off_gpu():
  q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
  # No cuDNN wheel: refused in Python; with one (the target extra): no lowering for the CPU.
  with pytest.raises((RuntimeError, NotImplementedError), match="cuDNN|platform cpu"):
    lm.attention(q, q, q, implementation="cudnn")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["auto", "cudnn"])
def test_gpu_impls_match_the_chunked_reference(impl):
  q, k, v = _qkv(jnp.bfloat16, b=2, lq=256, lk=256, h=8, hk=2, d=64)
  ours = lambda *a: lm.attention(*a, is_causal=True, implementation=impl)
  ref = lambda *a: lm.attention(*a, is_causal=True, implementation="xla")
  for got, want in zip(jax.tree.leaves(_value_and_grads(ours, q, k, v)),
                       jax.tree.leaves(_value_and_grads(ref, q, k, v))):
    # Two bfloat16 roundings apart at most: 2**-7 relative (0.125 at 21.4, seen on an H100).
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32),
                               rtol=2**-7, atol=5e-2)


@pytest.mark.slow
def test_linen_modules_keep_flax_params_names_and_function():
  x = jax.random.normal(jax.random.key(0), (2, 6, 16))
  mask = nn.make_causal_mask(jnp.ones((2, 6)))

  class Two(nn.Module):
    ours: bool

    @nn.compact
    def __call__(self, x):
      linen = lm.linen if self.ours else nn
      y = linen.MultiHeadDotProductAttention(num_heads=4)(x, mask=mask)
      return linen.MultiHeadAttention(num_heads=2)(y)

  plain, ours = Two(False), Two(True)
  params = plain.init(jax.random.key(1), x)
  chex.assert_trees_all_equal(ours.init(jax.random.key(1), x), params)
  assert set(params["params"]) == {"MultiHeadDotProductAttention_0", "MultiHeadAttention_0"}
  loss = lambda m: jax.jit(jax.value_and_grad(lambda p: jnp.sum(m.apply(p, x) ** 2)))
  chex.assert_trees_all_close(loss(ours)(params), loss(plain)(params), atol=1e-5)


def test_nnx_module_keeps_flax_state_and_function():
  x = jax.random.normal(jax.random.key(0), (2, 6, 16))
  kw = dict(num_heads=4, in_features=16, decode=False)
  plain = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
  ours = lm.nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
  chex.assert_trees_all_equal(nnx.state(ours, nnx.Param), nnx.state(plain, nnx.Param))
  mask = nnx.make_causal_mask(jnp.ones((2, 6)))
  loss = lambda m: jnp.sum(m(x, mask=mask) ** 2)
  chex.assert_trees_all_close(nnx.value_and_grad(loss)(ours), nnx.value_and_grad(loss)(plain),
                              atol=1e-5)


def test_attention_fn_refuses_what_it_cannot_do():
  q, k, v = _qkv()
  with pytest.raises(NotImplementedError, match="dropout"):
    lm.linen.attention_fn(q, k, v, dropout_rate=0.1, deterministic=False)
  with pytest.raises(NotImplementedError, match="precision"):
    lm.linen.attention_fn(q, k, v, precision=jax.lax.Precision.HIGHEST)
  with pytest.raises(NotImplementedError, match="sow"):
    lm.linen.MultiHeadDotProductAttention(num_heads=4).init(
        jax.random.key(0), jnp.ones((1, 3, 8)), sow_weights=True)


def test_auto_attention_under_remat_compiles_for_a_gpu_target_with_odd_lengths():
  """A ViT's 197 tokens: JAX's cuDNN rule, under jax.checkpoint, refuses odd lengths in the
  backward (it sees a bias where none was given), so "auto" takes the chunked kernel there."""
  qkv = [jax.ShapeDtypeStruct((2, 197, 4, 64), jnp.bfloat16)] * 3
  loss = jax.checkpoint(lambda q, k, v: lm.attention(q, k, v).astype(jnp.float32).sum())
  compiled = lm.memory.aot_compile(jax.grad(loss, argnums=(0, 1, 2)), *qkv, target="h100")
  assert "cudnn" not in compiled.as_text()
