import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import pack


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (3, 9), (2, 3, 16), (2, 0, 5)])
def test_roundtrip_and_layout(bits, shape):
  codes = np.random.default_rng(0).integers(0, 2**bits, size=shape).astype(np.uint8)
  packed = pack.pack(jnp.asarray(codes), bits)
  per_byte = 8 // bits
  assert packed.dtype == jnp.uint8
  assert packed.shape == shape[:-1] + (math.ceil(shape[-1] / per_byte),)
  np.testing.assert_array_equal(pack.unpack(packed, bits, shape[-1]), codes)
  # The layout: element j in byte j // per_byte at bit bits * (j % per_byte).
  flat = codes.reshape(math.prod(shape[:-1]), shape[-1])
  expected = np.zeros(flat.shape[:-1] + (packed.shape[-1],), np.int64)
  for j in range(shape[-1]):
    expected[:, j // per_byte] |= flat[:, j].astype(np.int64) << (bits * (j % per_byte))
  np.testing.assert_array_equal(np.asarray(packed).reshape(expected.shape), expected)


def test_bad_bits():
  with pytest.raises(ValueError, match="bits"):
    pack.pack(jnp.zeros((4,), jnp.uint8), 3)


def test_jit_and_vmap():
  codes = jax.random.randint(jax.random.key(0), (5, 6, 10), 0, 4).astype(jnp.uint8)
  packed = jax.jit(pack.pack, static_argnums=1)(codes, 2)
  np.testing.assert_array_equal(jax.vmap(lambda c: pack.pack(c, 2))(codes), packed)
