"""`lowmem_jax.ops.token_chunks`: a residual branch over token chunks is its unchunked twin,
the chunk counts are the fewest within the limit, and under a mesh a chunk holds whole
positions of every sequence."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from lowmem_jax.ops import token_chunks


def test_chunked_residual_is_its_unchunked_twin_in_bfloat16():
  """The value and both gradients of ``h + branch(params, h)``, bfloat16 throughout; the
  chunks' parameter gradients summed in bfloat16, so to its rounding."""
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w": (jax.random.normal(k1, (8, 8)) / 3).astype(jnp.bfloat16)}
  h = jax.random.normal(k2, (2, 6, 8)).astype(jnp.bfloat16)
  branch = lambda p, x: jnp.tanh(x @ p["w"])
  loss = lambda out: jnp.sum(out.astype(jnp.float32) ** 2)
  got = jax.value_and_grad(lambda p, h: loss(token_chunks.chunked_residual(branch, p, h, 4)),
                           argnums=(0, 1))(params, h)
  want = jax.value_and_grad(lambda p, h: loss(h + branch(p, h)), argnums=(0, 1))(params, h)
  assert got[1][1].dtype == jnp.bfloat16 and got[1][0]["w"].dtype == jnp.bfloat16
  chex.assert_trees_all_close(jax.tree.map(lambda x: x.astype(jnp.float32), got),
                              jax.tree.map(lambda x: x.astype(jnp.float32), want),
                              rtol=2e-2, atol=2e-2)


def test_mlp_chunks_are_equal_and_within_the_limit():
  assert token_chunks.mlp_chunks(32768, 4096) == 8
  assert token_chunks.mlp_chunks(4096, 4096) == token_chunks.mlp_chunks(4096, None) == 1
  assert token_chunks.mlp_chunks(16, 3) == 8  # 2 tokens each: 16 has no divisor in 6 .. 7
  assert token_chunks.mlp_chunks(10, 4) == 5  # 2 tokens each
  assert token_chunks.mlp_chunks(7, 2) == 7  # prime: a token each


def test_slices_are_the_fewest_equal_slices_of_the_first_axis_within_the_limit():
  assert token_chunks.slices((8, 4), 32) == 1  # within it
  assert token_chunks.slices((8, 4), 16) == 2
  assert token_chunks.slices((8, 4), 12) == 4  # 3 rows would do, but 8 has no divisor 3
  assert token_chunks.slices((7, 4), 8) == 7
  assert token_chunks.slices((8, 4), 3) == 1  # no split brings a row of 4 within 3
  assert token_chunks.slices((64,), 8) == 1  # rank 1: never split


def test_token_chunks_hold_whole_positions_under_a_mesh():
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  h = jnp.arange(8 * 6 * 2, dtype=jnp.float32).reshape(8, 6, 2)
  chunks, unchunk = token_chunks.token_chunks(h, 8 * 2)
  assert chunks.shape == (3, 16, 2)  # without a mesh: the flattened tokens, batch-major
  np.testing.assert_array_equal(unchunk(chunks), h)
  with jax.set_mesh(mesh):
    chunks, unchunk = token_chunks.token_chunks(h, 8 * 2)
    assert chunks.shape == (3, 2, 8, 2)  # 2 positions of all 8 sequences each
    np.testing.assert_array_equal(chunks[1, 0], h[:, 2])
    np.testing.assert_array_equal(unchunk(chunks), h)
    chunks, _ = token_chunks.token_chunks(h, 4)  # 8 sequences exceed 4: a position each
    assert chunks.shape == (6, 1, 8, 2)
