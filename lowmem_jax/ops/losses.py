"""A linear cross-entropy head that never holds the ``[tokens, vocab]`` logits.

The loss of ``softmax(h @ w + bias)`` against integer labels, as Cut
Cross-Entropy (Wijmans et al., ICLR 2025, arXiv:2411.09009) and Liger Kernel's
fused linear cross-entropy compute it: the logits are made block by block,
``[token_chunk, vocab_chunk]`` at a time, for an online float32 log-sum-exp in
the forward and again for the gradients in the backward. Autodiff keeps
``h``, ``w``, the labels and one float32 log-sum-exp a token.

Per token, with logits ``l`` (after the optional soft cap ``c * tanh(l / c)``),
``V`` the vocabulary, ``eps`` the label smoothing and ``z`` the z-loss weight::

    loss = lse(l) - (1 - eps) * l[label] - eps / V * sum(l) + z * lse(l) ** 2
    dloss/dl = softmax(l) * (1 + 2 z lse) - (1 - eps) * onehot(label) - eps / V

Tokens whose label is ``ignore_index`` add nothing, and ``"mean"`` divides by
the others' count. `linear_cross_entropy_reference` is the exact twin: the
plain ``log_softmax`` of the whole logits with the same options.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from lowmem_jax import _checks, _sharding

REDUCTIONS = ("mean", "sum", "none")
W_LAYOUTS = ("dv", "vd")


def linear_cross_entropy(h: jax.Array, w: jax.Array, labels: jax.Array, *,
                         bias: jax.Array | None = None, ignore_index: int | None = None,
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         logit_soft_cap: float | None = None, reduction: str = "mean",
                         w_layout: str = "dv", token_chunk: int = 1024,
                         vocab_chunk: int = 8192, backward_passes: int = 2) -> jax.Array:
  """Cross-entropy of ``h @ w + bias`` against ``labels``, chunked both ways.

  Args:
    h: float ``[..., d]`` hidden states.
    w: float ``[d, vocab]`` (``w_layout="dv"``) or ``[vocab, d]`` (``"vd"``,
      a tied embedding table).
    labels: integer ``[...]``, h's leading shape. A label outside ``[0, vocab)``
      (other than ``ignore_index``) picks no logit: its token's loss is
      ``lse`` alone (the reference's gather gives NaN there).
    bias: optional float ``[vocab]``.
    ignore_index: a label value whose tokens add no loss and no gradient.
    label_smoothing: ``eps`` in ``[0, 1)``: the target is ``1 - eps`` on the
      label plus ``eps / vocab`` everywhere.
    z_loss: weight of ``lse ** 2`` (PaLM's z-loss), >= 0.
    logit_soft_cap: ``c`` > 0: logits become ``c * tanh(l / c)`` (Gemma 2).
    reduction: "mean" (over tokens not ignored), "sum" or "none" (``[...]``).
    token_chunk, vocab_chunk: the block of logits made at once, positive ints.
    backward_passes: how many times the backward makes the logits, block by block: 2 (no
      buffer of ``[tokens, d]`` beside ``dh``) or 1 (``dh`` summed in a float32 ``[tokens, d]``
      over the vocabulary chunks: ``4 * tokens * d`` bytes more, each block's logits made once);
      the same sums in the same order (on CPU bit for bit under jax 0.10.2, within a few
      ulps under jax 0.12, `tests/test_losses.py`; not yet compared on a GPU). Llama-3.1-8B's layer-streamed step at 2 x 2,048 tokens,
      estimated for the ``rtx4090``: 1 is 1.5% faster at the same peak (docs/benchmarks.md).

  Returns:
    float32: a scalar, or ``[...]`` for ``reduction="none"``; equal to
    `linear_cross_entropy_reference` to float tolerance.

  Sharded inputs work under `jax.jit` on meshes of automatic or explicit axes
  (tested: tokens and vocabulary over 8 CPU devices). Under a mesh of ``Auto``
  axes set for tracing (`jax.set_mesh`), ``h: [batch, length, ..., d]`` is taken
  position-major, so each block of tokens stays split over the batch's devices
  where a block of batch-major tokens lies on one device and is gathered to all.
  """
  cfg = _check(h, w, labels, bias, ignore_index, label_smoothing, z_loss, logit_soft_cap,
               reduction, w_layout, token_chunk, vocab_chunk, backward_passes)
  position_major = h.ndim >= 3 and _sharding.in_auto_mesh()
  if position_major:
    h, labels = jnp.swapaxes(h, 0, 1), jnp.swapaxes(labels, 0, 1)
  lead = h.shape[:-1]
  h2 = h.reshape(math.prod(lead), h.shape[-1])
  b = None if bias is None else bias.astype(jnp.float32)
  weights = _token_weights(labels.reshape(-1), ignore_index, reduction)
  losses = _chunked(h2, w, b, labels.reshape(-1).astype(jnp.int32), weights, cfg, w_layout)
  if reduction != "none":
    return jnp.sum(losses)
  losses = losses.reshape(lead)
  return jnp.swapaxes(losses, 0, 1) if position_major else losses


def linear_cross_entropy_reference(h, w, labels, *, bias=None, ignore_index=None,
                                   label_smoothing=0.0, z_loss=0.0, logit_soft_cap=None,
                                   reduction="mean", w_layout="dv") -> jax.Array:
  """The exact twin of `linear_cross_entropy`: the whole float32 logits at once."""
  _check(h, w, labels, bias, ignore_index, label_smoothing, z_loss, logit_soft_cap,
         reduction, w_layout, 1, 1, 2)
  w2 = w if w_layout == "dv" else w.T
  logits = jnp.einsum("...d,dv->...v", h, w2, preferred_element_type=jnp.float32)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32).reshape((1,) * (logits.ndim - 1) + bias.shape)
  if logit_soft_cap is not None:
    logits = logit_soft_cap * jnp.tanh(logits / logit_soft_cap)
  lse = jax.nn.logsumexp(logits, axis=-1)
  label_logit = jnp.take_along_axis(logits, labels[..., None].astype(jnp.int32), -1)[..., 0]
  losses = (lse - (1 - label_smoothing) * label_logit
            - label_smoothing * jnp.mean(logits, axis=-1) + z_loss * lse ** 2)
  weights = _token_weights(labels.reshape(-1), ignore_index, reduction).reshape(labels.shape)
  losses = jnp.where(weights > 0, losses, 0.0) * weights
  return losses if reduction == "none" else jnp.sum(losses)


def _token_weights(labels, ignore_index, reduction):
  """float32 ``[T]``: each token's weight in the reduced loss (0 where ignored)."""
  keep = (jnp.ones(labels.shape, jnp.float32) if ignore_index is None
          else (labels != int(ignore_index)).astype(jnp.float32))  # a NumPy int, weak as Python's
  if reduction == "mean":
    return keep / jnp.maximum(jnp.sum(keep), 1.0)
  return keep


def _check(h, w, labels, bias, ignore_index, label_smoothing, z_loss, logit_soft_cap,
           reduction, w_layout, token_chunk, vocab_chunk, backward_passes):
  _checks.check_float_array(h, "h")
  _checks.check_float_array(w, "w")
  if w.ndim != 2:
    raise ValueError(f"w must be [d, vocab] or [vocab, d], got shape {w.shape}.")
  if w_layout not in W_LAYOUTS:
    raise ValueError(f"w_layout must be one of {W_LAYOUTS}, got {w_layout!r}.")
  d, vocab = w.shape if w_layout == "dv" else w.shape[::-1]
  if h.shape[-1] != d:
    raise ValueError(f"h's last axis ({h.shape[-1]}) must equal w's d ({d}) for "
                     f"w_layout={w_layout!r}; w has shape {w.shape}.")
  if not hasattr(labels, "dtype") or not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"labels must be an integer array, got "
                    f"{getattr(labels, 'dtype', type(labels).__name__)}.")
  if labels.shape != h.shape[:-1]:
    raise ValueError(f"labels must have h's leading shape {h.shape[:-1]}, got {labels.shape}.")
  if bias is not None:
    _checks.check_float_array(bias, "bias")
    if bias.shape != (vocab,):
      raise ValueError(f"bias must be [vocab] = ({vocab},), got {bias.shape}.")
  if ignore_index is not None and not _checks.is_int(ignore_index):
    raise TypeError(f"ignore_index must be an int or None, got {ignore_index!r}.")
  if not 0.0 <= label_smoothing < 1.0:
    raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}.")
  if not z_loss >= 0.0:
    raise ValueError(f"z_loss must be >= 0, got {z_loss!r}.")
  if logit_soft_cap is not None and not logit_soft_cap > 0:
    raise ValueError(f"logit_soft_cap must be > 0 or None, got {logit_soft_cap!r}.")
  if reduction not in REDUCTIONS:
    raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}.")
  for name, value in (("token_chunk", token_chunk), ("vocab_chunk", vocab_chunk)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}.")
  if not _checks.is_int(backward_passes) or backward_passes not in (1, 2):
    raise ValueError(f"backward_passes must be 1 or 2, got {backward_passes!r}.")
  return (float(label_smoothing), float(z_loss),
          None if logit_soft_cap is None else float(logit_soft_cap), token_chunk, vocab_chunk,
          backward_passes)


def _chunks(n: int, size: int) -> tuple[int, int]:
  """``(size, count)``: chunks of at most ``size`` covering ``n``; the last one's start is
  clamped to ``n - size``, so it overlaps the one before (`_start`)."""
  size = max(1, min(size, n))
  return size, -(-n // size)


def _start(j, size: int, n: int):
  """Where chunk ``j`` starts; the elements before ``j * size`` belong to chunk ``j - 1``."""
  return jnp.minimum(j * size, n - size)


class _Head:
  """``h [T, d]``, ``w`` in its layout, float32 ``bias [V]`` or None, and their chunks."""

  def __init__(self, h, w, b, cfg, w_layout):
    self.h, self.w, self.b, self.layout = h, w, b, w_layout
    self.cap, tc, vc = cfg[2:5]
    self.tokens, self.d = h.shape
    self.vocab = w.shape[1] if w_layout == "dv" else w.shape[0]
    self.tc, self.nt = _chunks(self.tokens, tc)
    self.vc, self.nv = _chunks(self.vocab, vc)

  def w_chunk(self, s):
    """``[d, vc]`` columns ``s:s + vc`` of the ``[d, V]`` weight."""
    if self.layout == "dv":
      return lax.dynamic_slice(self.w, (0, s), (self.d, self.vc))
    return lax.dynamic_slice(self.w, (s, 0), (self.vc, self.d)).T

  def logits(self, hc, j, whole=False):
    """float32 ``[tc, vc]`` logits of vocabulary chunk ``j``, -inf on the columns of
    chunk ``j - 1`` unless ``whole``; their column indices; the mask of the others."""
    s = _start(j, self.vc, self.vocab)
    raw = lax.dot_general(hc, self.w_chunk(s), (((1,), (0,)), ((), ())),
                          preferred_element_type=jnp.float32)
    if self.b is not None:
      raw = raw + lax.dynamic_slice(self.b, (s,), (self.vc,))[None, :]
    capped = raw if self.cap is None else self.cap * jnp.tanh(raw / self.cap)
    col = s + lax.broadcasted_iota(jnp.int32, raw.shape, 1)
    valid = col >= (s if whole else j * self.vc)
    return jnp.where(valid, capped, -jnp.inf), col, valid


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _chunked(h, w, b, labels, weights, cfg, w_layout):
  return _forward(h, w, b, labels, weights, cfg, w_layout)[0]


def _forward(h, w, b, labels, weights, cfg, w_layout):
  eps, z = cfg[:2]
  head = _Head(h, w, b, cfg, w_layout)

  def token_chunk(i, out):
    lse_all, loss_all = out
    s = _start(i, head.tc, head.tokens)
    hc = lax.dynamic_slice(h, (s, 0), (head.tc, head.d))
    yc = lax.dynamic_slice(labels, (s,), (head.tc,))

    def vocab_chunk(j, carry):
      m, total_exp, total, picked = carry
      logits, col, valid = head.logits(hc, j)
      m_new = jnp.maximum(m, jnp.max(logits, axis=1))
      total_exp = total_exp * jnp.exp(m - m_new) + jnp.sum(jnp.exp(logits - m_new[:, None]), 1)
      total = total + jnp.sum(jnp.where(valid, logits, 0.0), axis=1)
      picked = picked + jnp.sum(jnp.where(valid & (col == yc[:, None]), logits, 0.0), axis=1)
      return m_new, total_exp, total, picked

    zeros = jnp.zeros_like(hc[:, 0], jnp.float32)  # hc's sharding, under explicit axes too
    m, total_exp, total, picked = lax.fori_loop(0, head.nv, vocab_chunk,
                                                (zeros - jnp.inf, zeros, zeros, zeros))
    lse = m + jnp.log(total_exp)
    loss = lse - (1 - eps) * picked - eps / head.vocab * total + z * lse ** 2
    return (lax.dynamic_update_slice(lse_all, lse, (s,)),
            lax.dynamic_update_slice(loss_all, loss, (s,)))

  empty = jnp.zeros_like(h[:, 0], jnp.float32)
  lse, losses = lax.fori_loop(0, head.nt, token_chunk, (empty, empty))
  return jnp.where(weights > 0, losses, 0.0) * weights, lse


def _chunked_fwd(h, w, b, labels, weights, cfg, w_layout):
  out, lse = _forward(h, w, b, labels, weights, cfg, w_layout)
  return out, (h, w, b, labels, weights, lse)


def _chunked_bwd(cfg, w_layout, res, g):
  """Nothing of size ``[T, V]`` or ``[d, V]`` is made beside the gradients themselves, each
  written once. Two passes over the blocks (``backward_passes=2``): ``dh`` by token chunks
  (vocabulary inside, float32 ``[tc, d]`` accumulators), then ``dw`` and ``dbias`` by
  vocabulary chunks (tokens inside, float32 ``[d, vc]``): the logits made twice more. One pass
  (``1``): vocabulary chunks outside, token chunks inside, each block's logits made once more
  and both gradients taken from it, ``dh`` accumulated in a float32 ``[T, d]``. The sums are
  the same, in the same order: the two give the same bits (on CPU: `tests/test_losses.py`)."""
  h, w, b, labels, weights, lse = res
  head = _Head(h, w, b, cfg, w_layout)
  # The gradients' buffers start from a zero the scheduler cannot make before the forward's
  # log-sum-exp and the cotangent (a broadcast of a constant has no inputs, and XLA would make
  # it at the program's start, live through the forward; as lowmem_jax.ops.embedding.take's).
  zero, gt, lse = lax.optimization_barrier((jnp.zeros((), jnp.float32), g * weights, lse))
  zeros_like = lambda x, dtype=None: jnp.zeros_like(x, dtype) + zero.astype(dtype or x.dtype)
  dlogits = functools.partial(_dlogits, head, labels, lse, gt, cfg)
  db0 = None if b is None else zeros_like(b)
  if cfg[5] == 1:
    dw, db, dh = lax.fori_loop(0, head.nv, functools.partial(_vocab_chunk, head, dlogits),
                               (zeros_like(w), db0, zeros_like(h, jnp.float32)))
    return dh.astype(h.dtype), dw, db, None, None
  dh = lax.fori_loop(0, head.nt, functools.partial(_dh_chunk, head, dlogits), zeros_like(h))
  dw, db, _ = lax.fori_loop(0, head.nv, functools.partial(_vocab_chunk, head, dlogits),
                            (zeros_like(w), db0, None))
  return dh, dw, db, None, None


def _dlogits(head, labels, lse, gt, cfg, hc, i_start, first_row, j, whole):
  """float32 ``[tc, vc]`` d loss / d (uncapped) logits of the block of token chunk ``hc``
  (starting at ``i_start``) and vocabulary chunk ``j`` (`_Head.logits`' columns, ``whole`` or
  not); 0 on rows before ``first_row`` and on the columns left out."""
  eps, z = cfg[:2]
  logits, col, valid = head.logits(hc, j, whole)
  lse_c = lax.dynamic_slice(lse, (i_start,), (head.tc,))
  yc = lax.dynamic_slice(labels, (i_start,), (head.tc,))
  row = i_start + lax.broadcasted_iota(jnp.int32, (head.tc,), 0)
  g_c = jnp.where(row >= first_row, lax.dynamic_slice(gt, (i_start,), (head.tc,)), 0.0)
  p = jnp.exp(logits - lse_c[:, None])
  dl = (p * (1 + 2 * z * lse_c)[:, None] - (1 - eps) * (col == yc[:, None]).astype(jnp.float32)
        - jnp.where(valid, eps / head.vocab, 0.0)) * g_c[:, None]
  if head.cap is not None:
    dl = dl * (1 - jnp.square(jnp.where(valid, logits, 0.0) / head.cap))
  return jnp.where(valid, dl, 0.0)


def _dh_chunk(head, dlogits, i, dh):
  """``dh`` (``[T, d]``, ``h``'s dtype) with token chunk ``i``'s rows written: a float32 sum
  over the vocabulary chunks, each without the columns of the chunk before it."""
  s = _start(i, head.tc, head.tokens)
  hc = lax.dynamic_slice(head.h, (s, 0), (head.tc, head.d))

  def vocab_chunk(j, acc):
    dl = dlogits(hc, s, s, j, whole=False)
    wc = head.w_chunk(_start(j, head.vc, head.vocab))
    return acc + lax.dot_general(dl.astype(wc.dtype), wc, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32,
                                 out_sharding=_sharding.explicit(acc))

  acc = lax.fori_loop(0, head.nv, vocab_chunk, jnp.zeros_like(hc, jnp.float32))
  return lax.dynamic_update_slice(dh, acc.astype(head.h.dtype), (s, 0))


def _vocab_chunk(head, dlogits, j, grads):
  """``(dw, db, dh)`` with vocabulary chunk ``j``'s columns of ``dw`` (``w``'s shape and dtype)
  and ``db`` (float32 ``[V]`` or None) written, float32 sums over the token chunks; and, where
  ``dh`` (float32 ``[T, d]``) is not None, each token chunk's product with the chunk's own
  columns added to it."""
  dw, db, dh = grads
  sv = _start(j, head.vc, head.vocab)
  wc = head.w_chunk(sv)
  own = sv + lax.broadcasted_iota(jnp.int32, (1, head.vc), 1) >= j * head.vc

  def token_chunk(i, acc):
    dwc, dbc, dh = acc
    s = _start(i, head.tc, head.tokens)
    hc = lax.dynamic_slice(head.h, (s, 0), (head.tc, head.d))
    # every column of chunk j, those of chunk j - 1 too: dw's are written whole, twice alike;
    # dh takes chunk j's own columns (those of chunk j - 1 it took there)
    dl = dlogits(hc, s, i * head.tc, j, whole=True)
    if dh is not None:
      dhc = lax.dynamic_slice(dh, (s, 0), (head.tc, head.d))
      dhc = dhc + lax.dot_general(jnp.where(own, dl, 0.0).astype(wc.dtype), wc,
                                  (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                  out_sharding=_sharding.explicit(dhc))
      dh = lax.dynamic_update_slice(dh, dhc, (s, 0))
    dwc = dwc + lax.dot_general(hc, dl.astype(hc.dtype), (((0,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32,
                                out_sharding=_sharding.explicit(dwc))
    return dwc, None if dbc is None else dbc + jnp.sum(dl, 0), dh

  dwc, dbc, dh = lax.fori_loop(0, head.nt, token_chunk,
                               (jnp.zeros_like(wc, jnp.float32),
                                None if db is None else jnp.zeros_like(
                                    lax.dynamic_slice(head.b, (sv,), (head.vc,))), dh))
  dwc = dwc.astype(dw.dtype)
  dw = (lax.dynamic_update_slice(dw, dwc, (0, sv)) if head.layout == "dv"
        else lax.dynamic_update_slice(dw, dwc.T, (sv, 0)))
  return dw, None if db is None else lax.dynamic_update_slice(db, dbc, (sv,)), dh


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
