"""A residual branch run over token chunks: ``h + branch(params, h)`` for a branch that
works token by token (a transformer's MLP), holding one chunk's activations at a time in
the backward instead of every token's (`chunked_residual`); how many chunks a limit takes
(`slices`, `mlp_chunks`) and how ``[batch, length, dim]`` splits into them
(`token_chunks`)."""

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from lowmem_jax import _sharding


def slices(shape: tuple[int, ...], limit: int) -> int:
  """How many equal slices along its first axis an array of ``shape`` takes to hold at most
  ``limit`` elements each: the fewest (1 for an array within it, or one that no split of
  its first axis brings within it). `lowmem_jax.optim.layer_streamed` updates a leaf in
  that many slices; `mlp_chunks` runs a layer's MLP in that many token chunks."""
  if len(shape) < 2 or math.prod(shape) <= limit:
    return 1
  row = math.prod(shape[1:])
  return next((n for n in range(2, shape[0] + 1) if shape[0] % n == 0
               and shape[0] // n * row <= limit), 1)


def mlp_chunks(tokens: int, chunk_tokens: int | None) -> int:
  """How many equal token chunks a layer runs its MLP in (`lowmem_jax.models.llama.TransformerBlock`) without a mesh
  (`token_chunks`): the fewest of at most ``chunk_tokens`` tokens each
  (`slices`; 1 without ``chunk_tokens`` or within it;
  ``tokens`` chunks of one where ``tokens`` is prime)."""
  return 1 if chunk_tokens is None else slices((tokens, 1), chunk_tokens)


def token_chunks(h: jax.Array, chunk_tokens: int | None) -> tuple[jax.Array, Callable]:
  """``h: [batch, length, dim]`` as ``[n, ..., dim]``, `mlp_chunks`' n chunks of its
  flattened tokens, and the function that takes ``[n, ..., dim]`` back to ``h``'s shape.
  Under a mesh of ``Auto`` axes set for tracing (`jax.set_mesh`) a chunk is instead the
  most whole positions of every sequence within ``chunk_tokens`` (one position where
  ``batch`` exceeds it): ``[n, length / n, batch, dim]``, which stays split over the
  batch's devices, where a chunk of flattened tokens lies on one device and is gathered
  to the others."""
  if not _sharding.in_auto_mesh():
    n = mlp_chunks(math.prod(h.shape[:-1]), chunk_tokens)
    return h.reshape(n, -1, h.shape[-1]), lambda out: out.reshape(h.shape)
  batch, length = h.shape[:2]
  n = 1 if chunk_tokens is None else slices((length, batch), chunk_tokens)
  if n == 1 and chunk_tokens is not None and length * batch > chunk_tokens:
    n = length
  by_position = jnp.swapaxes(h, 0, 1)
  return (by_position.reshape(n, length // n, *by_position.shape[1:]),
          lambda out: jnp.swapaxes(out.reshape(by_position.shape), 0, 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def chunked_residual(branch: Callable, params: Any, h: jax.Array,
                     chunk_tokens: int | None) -> jax.Array:
  """``h + branch(params, h)`` for a ``branch`` that works token by token, run over
  `token_chunks`' chunks of ``h: [batch, length, dim]`` (same shape and dtype out).

  Nothing of the branch is kept for the backward but ``params`` and ``h``: the
  backward runs the chunks again one at a time, and writes each chunk's input
  gradient (the output's gradient plus the branch's) over that chunk of the
  output's gradient, in place, so no second ``[tokens, dim]`` buffer is made
  (under a mesh the position-major chunks are a transposed copy); ``params``'
  gradient is summed over the chunks in their dtype. The same function as the
  unchunked one, for reverse-mode differentiation only (a ``jax.custom_vjp``:
  ``jax.jvp`` of it raises).
  """
  chunks, unchunk = token_chunks(h, chunk_tokens)
  return h + unchunk(jax.lax.map(lambda chunk: branch(params, chunk), chunks))


def _chunked_residual_fwd(branch, params, h, chunk_tokens):
  return chunked_residual(branch, params, h, chunk_tokens), (params, h)


def _chunked_residual_bwd(branch, chunk_tokens, saved, d_out):
  params, h = saved
  chunks, unchunk = token_chunks(h, chunk_tokens)

  def chunk_backward(carry, i):
    d_h, d_params = carry
    d_chunk = jax.lax.dynamic_index_in_dim(d_h, i, keepdims=False)
    _, vjp = jax.vjp(branch, params, jax.lax.dynamic_index_in_dim(chunks, i, keepdims=False))
    d_params_i, d_in = vjp(d_chunk)
    d_h = jax.lax.dynamic_update_index_in_dim(d_h, d_chunk + d_in, i, 0)
    return (d_h, jax.tree.map(jnp.add, d_params, d_params_i)), None

  (d_h, d_params), _ = jax.lax.scan(
      chunk_backward, (token_chunks(d_out, chunk_tokens)[0], jax.tree.map(jnp.zeros_like, params)),
      jnp.arange(len(chunks)))
  return d_params, unchunk(d_h)


chunked_residual.defvjp(_chunked_residual_fwd, _chunked_residual_bwd)
