"""lowmem_jax.ops.losses.linear_cross_entropy against its exact twin, and what it keeps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import lowmem_jax as lm
from lowmem_jax.ops import losses

D, V = 16, 37  # the vocabulary is a multiple of no chunk below: edge blocks everywhere
OPTIONS = [dict(), dict(with_bias=True), dict(ignore_index=-100),
           dict(label_smoothing=0.1, ignore_index=-100), dict(z_loss=1e-3),
           dict(logit_soft_cap=3.0, with_bias=True), dict(reduction="sum", ignore_index=-100),
           dict(reduction="none", ignore_index=-100), dict(w_layout="vd", with_bias=True)]


def _problem(dtype, options, lead=(2, 13)):
  k = jax.random.split(jax.random.key(0), 4)
  h = jax.random.normal(k[0], (*lead, D), dtype)
  w = (jax.random.normal(k[1], (D, V)) * 0.5).astype(dtype)
  if options.get("w_layout") == "vd":
    w = w.T
  bias = jax.random.normal(k[2], (V,)).astype(dtype)
  labels = jax.random.randint(k[3], lead, 0, V)
  if "ignore_index" in options:
    labels = labels.reshape(-1).at[:3].set(options["ignore_index"]).reshape(lead)
  return h, w, bias, labels


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_matches_the_exact_twin(options, dtype):
  options = dict(options)
  with_bias = options.pop("with_bias", False)
  h, w, bias, labels = _problem(dtype, options)

  def loss(fn, **chunks):
    def f(h, w, bias, value=False):
      out = fn(h, w, labels, bias=bias if with_bias else None, **options, **chunks)
      return out if value else jnp.sum(jnp.sin(out))  # a cotangent that differs per token
    return f

  ours = loss(losses.linear_cross_entropy, token_chunk=4, vocab_chunk=8)
  twin = loss(losses.linear_cross_entropy_reference)
  value_tol, grad_tol = (1e-5, 1e-4) if dtype == jnp.float32 else (1e-2, 2e-2)
  # The losses themselves: the sine of a sum of 26 losses would magnify the sum's rounding.
  np.testing.assert_allclose(ours(h, w, bias, True), twin(h, w, bias, True), rtol=value_tol)
  for got, want in zip(jax.grad(ours, (0, 1, 2))(h, w, bias), jax.grad(twin, (0, 1, 2))(h, w, bias)):
    assert got.dtype == want.dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, atol=grad_tol * np.abs(want).max())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_one_backward_pass_gives_the_two_passes_gradients_to_a_few_ulps(options, dtype):
  """The one-pass backward sums the same products in the same order; a token count and a
  vocabulary that no chunk divides put overlapping edge blocks on both axes. XLA compiles the
  two programs apart, so its CPU code may round a sum differently (jax 0.12.0.1 on an AVX-512
  machine: up to 11 of 416 elements, each within a float32 rounding of the largest; bit for
  bit under jax 0.10.2)."""
  options = dict(options)
  bias = _problem(dtype, options)[2] if options.pop("with_bias", False) else None
  h, w, _, labels = _problem(dtype, options)

  def grads(passes):
    f = lambda h, w, bias: jnp.sum(jnp.sin(losses.linear_cross_entropy(
        h, w, labels, bias=bias, token_chunk=4, vocab_chunk=8, backward_passes=passes,
        **options)))
    return jax.jit(jax.grad(f, (0, 1, 2) if bias is not None else (0, 1)))(h, w, bias)

  one, two = grads(1), grads(2)
  for got, want in zip(one, two):
    assert got.dtype == want.dtype and np.any(np.asarray(want, np.float32) != 0)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    # A few roundings of the gradient's largest element (ulps of tiny elements are tinier).
    np.testing.assert_allclose(got, want, rtol=0,
                               atol=4 * float(jnp.finfo(dtype).eps) * np.abs(want).max())


def test_ignored_tokens_add_nothing():
  h, w, _, labels = _problem(jnp.float32, dict(ignore_index=-1))
  labels = labels.at[0].set(-1)
  per_token = losses.linear_cross_entropy(h, w, labels, ignore_index=-1, reduction="none")
  assert np.all(np.asarray(per_token[0]) == 0)
  dh = jax.grad(lambda h: losses.linear_cross_entropy(h, w, labels, ignore_index=-1))(h)
  assert np.all(np.asarray(dh[0]) == 0) and np.any(np.asarray(dh[1]) != 0)
  mean = losses.linear_cross_entropy(h, w, labels, ignore_index=-1)
  np.testing.assert_allclose(mean, per_token[1].mean(), rtol=1e-6)


def test_keeps_no_logits_sized_residual():
  tokens, vocab, d = 256, 4096, 32
  h = jax.ShapeDtypeStruct((tokens, d), jnp.float32)
  w = jax.ShapeDtypeStruct((d, vocab), jnp.float32)
  labels = jnp.zeros((tokens,), jnp.int32)
  for fn, chunked in ((losses.linear_cross_entropy, True),
                      (losses.linear_cross_entropy_reference, False)):
    saved = lm.memory.saved_residuals(lambda h, w: fn(h, w, labels), h, w)
    largest = max(r.nbytes for r in saved.rows if not r.is_argument)
    assert (largest < tokens * vocab) == chunked, (fn.__name__, largest)


def test_compiled_temp_grows_with_tokens_not_tokens_times_vocab():
  """Gradient step on the H100 target: doubling the tokens adds far less than their logits."""
  vocab, d = 32768, 64

  def temp(tokens, fn):
    h = jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((d, vocab), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    grad = jax.grad(lambda h, w, y: fn(h, w, y), (0, 1))
    return lm.memory.analyze(grad, h, w, labels, target="h100").temp_bytes

  logits_bytes = 1024 * vocab * 4  # float32 logits of the 1,024 added tokens
  chunked = lambda h, w, y: losses.linear_cross_entropy(h, w, y, token_chunk=256, vocab_chunk=4096)
  assert temp(2048, chunked) - temp(1024, chunked) < 0.05 * logits_bytes
  assert temp(2048, losses.linear_cross_entropy_reference) - temp(
      1024, losses.linear_cross_entropy_reference) > logits_bytes


def test_bad_inputs_are_named():
  h, w, bias, labels = _problem(jnp.float32, {})
  f = losses.linear_cross_entropy
  with pytest.raises(ValueError, match="h's last axis"):
    f(h[..., :3], w, labels)
  with pytest.raises(TypeError, match="labels must be an integer"):
    f(h, w, labels.astype(jnp.float32))
  with pytest.raises(ValueError, match="labels must have h's leading shape"):
    f(h, w, labels[:, :2])
  with pytest.raises(TypeError, match="w must be float16"):
    f(h, w.astype(jnp.int32), labels)
  with pytest.raises(ValueError, match="bias must be"):
    f(h, w, labels, bias=bias[:3])
  with pytest.raises(ValueError, match="label_smoothing"):
    f(h, w, labels, label_smoothing=1.0)
  with pytest.raises(ValueError, match="z_loss"):
    f(h, w, labels, z_loss=-1.0)
  with pytest.raises(ValueError, match="logit_soft_cap"):
    f(h, w, labels, logit_soft_cap=0.0)
  with pytest.raises(ValueError, match="reduction"):
    f(h, w, labels, reduction="avg")
  with pytest.raises(ValueError, match="w_layout"):
    f(h, w, labels, w_layout="transposed")
  with pytest.raises(ValueError, match="vocab_chunk"):
    f(h, w, labels, vocab_chunk=0)
  with pytest.raises(ValueError, match="backward_passes must be 1 or 2, got 3"):
    f(h, w, labels, backward_passes=3)
  with pytest.raises(TypeError, match="ignore_index"):
    f(h, w, labels, ignore_index=1.5)
  with pytest.raises(TypeError, match="ignore_index must be an int or None, got True"):
    f(h, w, labels, ignore_index=True)  # not read as label 1


def test_a_numpy_ignore_index_is_the_python_one():
  h, w, _, labels = _problem(jnp.float32, dict(ignore_index=-1))
  f = losses.linear_cross_entropy
  assert f(h, w, labels, ignore_index=np.int64(-1)) == f(h, w, labels, ignore_index=-1)


def test_jit_and_vmap():
  h, w, _, labels = _problem(jnp.float32, {}, lead=(3, 5))
  f = lambda h, y: losses.linear_cross_entropy(h, w, y, token_chunk=2, vocab_chunk=16)
  want = jnp.stack([f(h[i], labels[i]) for i in range(3)])
  np.testing.assert_allclose(jax.jit(jax.vmap(f))(h, labels), want, rtol=1e-6)


SHARDINGS = {  # layout: the specs of the tokens (and labels), of the weight and of the bias
    "tokens and vocabulary": (P("data"), P(None, "model"), P("model")),
    # over "data", the bias would clash with the tokens in the logits, as in plain h @ w + b
    "fsdp": (P("data"), P("data"), P()),
}


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("layout", list(SHARDINGS))
def test_sharded_jit_on_8_devices(axis_type, layout, passes):
  """Tokens over "data" and the vocabulary over "model", or the parameters over "data" too
  (FSDP), on a mesh of automatic or explicit axes: the same loss and gradients, the backward
  in one pass or two."""
  assert jax.device_count() == 8, "conftest forces 8 CPU devices"
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(getattr(AxisType, axis_type),) * 2)
  h, w, bias, labels = _problem(jnp.float32, {}, lead=(8, 6))
  w = jnp.pad(w, ((0, 0), (0, 3)))  # vocabulary 40: 2 shards of 20
  bias = jnp.pad(bias, (0, 3))
  f = lambda h, w, b, y: losses.linear_cross_entropy(h, w, y, bias=b, token_chunk=4,
                                                     vocab_chunk=8, backward_passes=passes)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  with jax.set_mesh(mesh):
    h_spec, w_spec, bias_spec = SHARDINGS[layout]
    args = (put(h, h_spec), put(w, w_spec), put(bias, bias_spec), put(labels, h_spec))
    value, grads = jax.jit(jax.value_and_grad(f, (0, 1, 2)))(*args)
  ref = lambda h, w, b: losses.linear_cross_entropy_reference(h, w, labels, bias=b)
  want, want_grads = jax.value_and_grad(ref, (0, 1, 2))(h, w, bias)
  np.testing.assert_allclose(value, want, rtol=1e-5)
  for got, exp in zip(grads, want_grads):
    np.testing.assert_allclose(got, exp, atol=1e-4 * float(jnp.abs(exp).max()))


def test_per_token_losses_keep_their_order_under_an_auto_mesh():
  """Under `jax.set_mesh` the tokens are blocked position-major; ``reduction="none"`` still
  gives each token its own loss, in ``labels``' order."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  h, w, _, labels = _problem(jnp.float32, {}, lead=(8, 6))
  f = lambda h, y: losses.linear_cross_entropy(h, w, y, reduction="none", token_chunk=4,
                                               vocab_chunk=8)
  data = NamedSharding(mesh, P("data"))
  with jax.set_mesh(mesh):
    got = jax.jit(f)(jax.device_put(h, data), jax.device_put(labels, data))
  want = losses.linear_cross_entropy_reference(h, w, labels, reduction="none")
  assert got.shape == (8, 6)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
