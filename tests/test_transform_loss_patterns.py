"""`lm.lowmem`'s loss head when the logits are sliced after it (Hugging Face's shift:
``cross_entropy(logits[:, :-1], tokens[:, 1:])``), each form against its exact twin; the
patterns it leaves, with reasons; and the source line of every pattern it reports."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowmem_jax as lm
from lowmem_jax._jax import source_info_util
from lowmem_jax.transform import graph, interpreter

VOCAB, WIDTH, BATCH, SEQ = 40, 16, 2, 12
TOKENS = jax.random.randint(jax.random.key(7), (BATCH, SEQ), 0, VOCAB)
SHIFTED = BATCH * (SEQ - 1)  # the tokens the loss reads after the shift


def _normal(shape, key, scale=1.0):
  return scale * jax.random.normal(jax.random.key(key), shape)


def _close(a, b, tol=1e-5):
  chex.assert_trees_all_close(a, b, atol=tol, rtol=tol)


def _log_softmax_at(logits, labels):
  return -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), labels[..., None], -1)[..., 0]


def _dense(h, w):
  """A Flax Dense with a bias, as a Hugging Face head with a bias writes it."""
  bias = jnp.linspace(-1.0, 1.0, VOCAB)
  return nn.Dense(VOCAB).apply({"params": {"kernel": w, "bias": bias}}, h)


SHIFTS = {  # form: (the mean loss of (h, w, tokens), w's shape)
    "optax, logits[:, :-1]": (lambda h, w, y: jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels((h @ w)[:, :-1], y[:, 1:])),
        (WIDTH, VOCAB)),
    "log_softmax + take_along_axis, logits[..., :-1, :]": (lambda h, w, y: jnp.mean(
        _log_softmax_at((h @ w)[..., :-1, :], y[:, 1:])), (WIDTH, VOCAB)),
    "reshape to [-1, V] after the slice": (lambda h, w, y: jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(
            (h @ w)[:, :-1].reshape(-1, VOCAB), y[:, 1:].reshape(-1))), (WIDTH, VOCAB)),
    "tied head h @ emb.T": (lambda h, e, y: jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels((h @ e.T)[:, :-1], y[:, 1:])),
        (VOCAB, WIDTH)),
    "tied head contracting the table's second axis": (lambda h, e, y: jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(
            jnp.einsum("btd,vd->btv", h, e)[:, :-1], y[:, 1:])), (VOCAB, WIDTH)),
    "flax Dense with bias, then the slice": (lambda h, w, y: jnp.mean(
        _log_softmax_at(_dense(h, w)[:, :-1], y[:, 1:])), (WIDTH, VOCAB)),
    "dynamic_slice at a constant start": (lambda h, w, y: jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(
            jax.lax.dynamic_slice_in_dim(h @ w, 1, SEQ - 1, axis=1), y[:, :-1])),
        (WIDTH, VOCAB)),
    "optax one-hot, as run_clm_flax.py writes it": (lambda h, w, y: jnp.mean(
        optax.softmax_cross_entropy((h @ w)[:, :-1], jax.nn.one_hot(y[:, 1:], VOCAB))),
        (WIDTH, VOCAB)),
    "one-hot by hand": (lambda h, w, y: -jnp.mean(jnp.sum(
        jax.nn.log_softmax((h @ w)[:, :-1]) * jax.nn.one_hot(y[:, 1:], VOCAB), -1)),
        (WIDTH, VOCAB)),
    "strided slice, then the last position": (lambda h, w, y: jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels((h @ w)[:, ::2][:, -1], y[:, 0])),
        (WIDTH, VOCAB)),
}


def _token_logits(rows, tokens=SHIFTED):
  """The residuals as wide as the vocabulary with at least ``tokens`` rows: logits."""
  return [r for r in rows if r.shape[-1:] == (VOCAB,) and np.prod(r.shape[:-1]) >= tokens]


def _float_residuals(fn, *args):
  return [r for r in lm.memory.saved_residuals(fn, *args).rows
          if jnp.issubdtype(r.dtype, jnp.floating) and not r.is_argument]


@pytest.mark.parametrize("form", list(SHIFTS))
def test_shifted_loss_head_rewritten_on_the_sliced_hidden_states(form):
  loss, w_shape = SHIFTS[form]
  h, w = _normal((BATCH, SEQ, WIDTH), 0), _normal(w_shape, 1, scale=0.3)
  fast = lm.lowmem(loss)
  rewrites = fast.explain(h, w, TOKENS)
  assert rewrites.counts == {"loss": 1}, rewrites
  assert rewrites[0].source.startswith("test_transform_loss_patterns.py:")
  assert ("tied embedding" in rewrites[0].op) == (w_shape == (VOCAB, WIDTH))
  _close(jax.jit(fast)(h, w, TOKENS), jax.jit(loss)(h, w, TOKENS))
  _close(*(jax.jit(jax.grad(f, (0, 1)))(h, w, TOKENS) for f in (fast, loss)))
  tokens = 2 if "last position" in form else SHIFTED
  assert not _token_logits(_float_residuals(fast, h, w, TOKENS), tokens)
  assert _token_logits(_float_residuals(loss, h, w, TOKENS), tokens)  # the plain one keeps them


def test_tied_table_transposed_is_not_kept():
  """``h @ emb.T`` becomes the table's own layout: the ``[d, V]`` transpose is not saved."""
  loss, _ = SHIFTS["tied head h @ emb.T"]
  h, e = _normal((BATCH, SEQ, WIDTH), 0), _normal((VOCAB, WIDTH), 1, scale=0.3)
  transposed = lambda fn: [r for r in _float_residuals(fn, h, e, TOKENS)
                           if r.shape == (WIDTH, VOCAB)]
  assert transposed(loss) and not transposed(lm.lowmem(loss))

  def shared(h, e, y):  # the transpose read again: the head takes it as it is
    t = e.T
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        (h @ t)[:, :-1], y[:, 1:])) + jnp.mean(t[:, :2])
  rewrites = lm.lowmem(shared).explain(h, e, TOKENS)
  assert rewrites.counts == {"loss": 1} and "tied" not in rewrites[0].op
  _close(*(jax.grad(f, (0, 1))(h, e, TOKENS) for f in (lm.lowmem(shared), shared)))


def test_shifted_loss_head_under_jit_and_value_and_grad():
  loss, _ = SHIFTS["optax, logits[:, :-1]"]
  h, w = _normal((BATCH, SEQ, WIDTH), 0), _normal((WIDTH, VOCAB), 1, scale=0.3)
  got, want = (jax.jit(jax.value_and_grad(f, (0, 1)))(h, w, TOKENS)
               for f in (jax.jit(lm.lowmem(loss)), loss))
  _close(got, want)


def test_one_hot_labels_out_of_range_are_rows_of_zeros():
  """``jax.nn.one_hot`` of a label outside ``[0, V)`` is zeros: that token's loss and its
  gradient are 0, in the plain loss and the rewritten one."""
  labels = TOKENS.at[0, 3].set(-1).at[1, 5].set(VOCAB + 2)
  h, w = _normal((BATCH, SEQ, WIDTH), 0), _normal((WIDTH, VOCAB), 1, scale=0.3)
  per_token = lambda h, w: optax.softmax_cross_entropy(h @ w, jax.nn.one_hot(labels, VOCAB))
  assert lm.lowmem(per_token).explain(h, w).counts == {"loss": 1}
  got = lm.lowmem(per_token)(h, w)
  assert got[0, 3] == 0.0 and got[1, 5] == 0.0
  _close(got, per_token(h, w))
  total = lambda f: lambda h, w: jnp.sum(f(h, w))
  _close(jax.grad(total(lm.lowmem(per_token)), (0, 1))(h, w),
         jax.grad(total(per_token), (0, 1))(h, w))


def test_one_hot_smoothed_or_reused_is_not_rewritten():
  h, w = _normal((BATCH, SEQ, WIDTH), 0), _normal((WIDTH, VOCAB), 1, scale=0.3)
  smoothed = lambda h, w: jnp.mean(optax.softmax_cross_entropy(
      h @ w, optax.smooth_labels(jax.nn.one_hot(TOKENS, VOCAB), 0.1)))
  assert len(lm.lowmem(smoothed).explain(h, w)) == 0

  def reused(h, w):
    one_hot = jax.nn.one_hot(TOKENS, VOCAB)
    return jnp.mean(optax.softmax_cross_entropy(h @ w, one_hot)) + jnp.mean(one_hot)
  (left,) = lm.lowmem(reused).explain(h, w)
  assert "used elsewhere" in left.left and left.source.startswith("test_transform_loss_")


def test_slice_of_the_vocabulary_axis_is_left_with_its_reason():
  h, w = _normal((BATCH, SEQ, WIDTH), 0), _normal((WIDTH, VOCAB), 1, scale=0.3)
  fewer = lambda h, w: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      (h @ w)[..., :VOCAB - 1], TOKENS % (VOCAB - 1)))
  (left,) = lm.lowmem(fewer).explain(h, w)
  assert left.kind == "loss" and left.left is not None, left
  assert "`slice` (test_transform_loss_patterns.py:" in left.left
  assert "over the vocabulary axis" in left.left
  assert left.source.startswith("test_transform_loss_patterns.py:")
  _close(lm.lowmem(fewer)(h, w), fewer(h, w))


def test_logits_picked_by_an_index_array_are_left_naming_the_gather():
  h, w = _normal((BATCH, SEQ, WIDTH), 0), _normal((WIDTH, VOCAB), 1, scale=0.3)
  rows = jnp.array([3, 0, 5])
  picked = lambda h, w: jnp.mean(_log_softmax_at((h @ w)[:, rows], TOKENS[:, :3]))
  (left,) = lm.lowmem(picked).explain(h, w)
  assert left.left.startswith("the logits are a `gather` (test_transform_loss_patterns.py:")
  assert left.source.startswith("test_transform_loss_patterns.py:")


def test_logits_of_no_matmul_are_left_naming_their_op():
  logits = _normal((BATCH, SEQ, VOCAB), 0)
  (left,) = lm.lowmem(lambda x: jnp.mean(_log_softmax_at(jnp.tanh(x), TOKENS))).explain(logits)
  assert left.left.startswith("the logits are a `tanh` (test_transform_loss_patterns.py:")
  (left,) = lm.lowmem(lambda x: jnp.mean(_log_softmax_at(x, TOKENS))).explain(logits)
  assert left.left.startswith("the logits are an input of the function")


def _head_graph():
  h, w = _normal((BATCH, SEQ, WIDTH), 0), _normal((WIDTH, VOCAB), 1)
  jaxpr = jax.make_jaxpr(lambda h, w: h @ w)(h, w).jaxpr
  return jaxpr, next(i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "dot_general")


def test_source_without_a_user_frame_is_a_library_frame(monkeypatch):
  """Where JAX counts no frame as the user's (every one in a library it skips), the
  innermost frame outside JAX and the standard library."""
  jaxpr, i = _head_graph()
  assert graph.Graph(jaxpr).source(i).startswith("test_transform_loss_patterns.py:")
  monkeypatch.setattr(source_info_util, "user_frames", lambda tb: iter(()))
  assert graph.Graph(jaxpr).source(i).startswith("test_transform_loss_patterns.py:")


def test_source_without_a_traceback_is_the_primitive():
  jaxpr, i = _head_graph()
  eqns = [e.replace(source_info=source_info_util.new_source_info()) for e in jaxpr.eqns]
  assert graph.Graph(jaxpr.replace(eqns=eqns)).source(i) == "dot_general"


def test_jit_body_equations_take_the_source_of_the_call():
  """A ``jit``'s body is traced from inside it: the equations of jnp's ``take_along_axis``
  (a jit) have no user frame until inlined under the call's."""
  x, idx = _normal((BATCH, VOCAB), 0), TOKENS[:, :1]
  closed = jax.make_jaxpr(lambda x: jnp.take_along_axis(x, idx, -1))(x)
  (call,) = closed.jaxpr.eqns
  body = call.params["jaxpr"].jaxpr
  gather = next(i for i, e in enumerate(body.eqns) if e.primitive.name == "gather")
  assert graph.Graph(body).source(gather) == "gather"  # no frame outside JAX
  jaxpr, _ = interpreter.inline_jit(closed.jaxpr, closed.consts)
  gather = next(i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "gather")
  assert graph.Graph(jaxpr).source(gather) == graph.Graph(closed.jaxpr).source(0)
  assert graph.Graph(jaxpr).source(gather).startswith("test_transform_loss_patterns.py:")
