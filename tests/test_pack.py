import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowmem_jax as lm
from pallas_kernels import _blocks, pack

INTERPRET = _blocks.Options(interpret=True)
# Small blocks, so that small arrays already span several programs and edge blocks.
SMALL_BLOCKS = _blocks.Options(interpret=True, block_rows=2, block_cols=2)
IMPLS = {
    "reference": (pack.pack_reference, pack.unpack_reference),
    "kernel": (lambda c, b: pack.pack(c, b, options=INTERPRET),
               lambda p, b, n: pack.unpack(p, b, n, options=INTERPRET)),
    "kernel_small_blocks": (lambda c, b: pack.pack(c, b, options=SMALL_BLOCKS),
                            lambda p, b, n: pack.unpack(p, b, n, options=SMALL_BLOCKS)),
}


SHAPES = [(0,), (1,), (7,), (3, 9), (2, 3, 16), (2, 0, 5), (1, 1, 5, 13)]
# Every shape at the residuals' 2 bits, every other width on the last shape (the kernel is
# shape-generic for a width; interpret mode is slow on CPU).
CASES = [(2, shape) for shape in SHAPES] + [(bits, SHAPES[-1]) for bits in (1, 4, 8)]


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("bits", "shape"), CASES)
def test_roundtrip_and_layout(impl, bits, shape):
  pack_fn, unpack_fn = IMPLS[impl]
  codes = np.random.default_rng(0).integers(0, 2**bits, size=shape).astype(np.uint8)
  packed = pack_fn(jnp.asarray(codes), bits)
  per_byte = 8 // bits
  assert packed.dtype == jnp.uint8
  assert packed.shape == shape[:-1] + (math.ceil(shape[-1] / per_byte),)
  np.testing.assert_array_equal(unpack_fn(packed, bits, shape[-1]), codes)
  # The layout: element j in byte j // per_byte at bit bits * (j % per_byte).
  flat = codes.reshape(math.prod(shape[:-1]), shape[-1])
  expected = np.zeros(flat.shape[:-1] + (packed.shape[-1],), np.int64)
  for j in range(shape[-1]):
    expected[:, j // per_byte] |= flat[:, j].astype(np.int64) << (bits * (j % per_byte))
  np.testing.assert_array_equal(np.asarray(packed).reshape(expected.shape), expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_codes_keep_their_low_bits(impl):
  pack_fn, _ = IMPLS[impl]
  codes = jnp.asarray([[5, 255, 2, 7, 1]], jnp.uint8)
  np.testing.assert_array_equal(pack_fn(codes, 2), pack.pack_reference(codes & 3, 2))


def test_kernel_spans_column_blocks_with_default_blocks():
  # 2-bit rows of 4104 codes: 1026 bytes, over the 1024-byte default block.
  codes = jax.random.randint(jax.random.key(0), (3, 4104), 0, 4).astype(jnp.uint8)
  np.testing.assert_array_equal(pack.pack(codes, 2, options=INTERPRET),
                                pack.pack_reference(codes, 2))


def test_in_bounds_masks_what_overhangs_the_array():
  """Pallas' Triton backend does not mask overhanging blocks: the kernels' loads and stores do."""
  assert _blocks.in_bounds((4, 8), (8, 16), (1, 1)) is None
  mask = _blocks.in_bounds((4, 8), (6, 5), (1, 0))
  want = (np.arange(4, 8)[:, None] < 6) & (np.arange(8)[None, :] < 5)
  np.testing.assert_array_equal(mask, want)
  np.testing.assert_array_equal(_blocks.in_bounds((4, 8, 2), (6, 16, 2), (0, 1, 0)),
                                np.ones((4, 8, 2), bool))


def test_bad_arguments():
  with pytest.raises(ValueError, match="bits"):
    pack.pack_reference(jnp.zeros((4,), jnp.uint8), 3)
  with pytest.raises(ValueError, match="bits"):
    pack.pack(jnp.zeros((4,), jnp.uint8), 3, options=INTERPRET)
  with pytest.raises(ValueError, match="packed's last axis"):
    pack.unpack_reference(jnp.zeros((3,), jnp.uint8), 2, 4)
  with pytest.raises(TypeError, match="packed must be uint8"):
    pack.unpack(jnp.zeros((1,), jnp.int32), 2, 4, options=INTERPRET)
  with pytest.raises(ValueError, match="block_rows"):
    _blocks.Options(block_rows=3)


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_and_vmap(impl):
  pack_fn, unpack_fn = IMPLS[impl]
  codes = jax.random.randint(jax.random.key(0), (5, 6, 10), 0, 4).astype(jnp.uint8)
  packed = jax.jit(pack_fn, static_argnums=1)(codes, 2)
  np.testing.assert_array_equal(jax.vmap(lambda c: pack_fn(c, 2))(codes), packed)
  np.testing.assert_array_equal(jax.vmap(lambda p: unpack_fn(p, 2, 10))(packed), codes)


@pytest.mark.parametrize("target", sorted(set(lm.targets.names()) - {"cpu", "v100", "h100"}))
def test_the_kernel_compiles_for_every_shipped_gpu_with_triton(target):
  """Pallas' Triton lowering knows a GPU by its device kind, from a list of its own (jax 0.12
  refuses one it does not know, an RTX A6000, an L40S): each target compiles for its compute
  capability. (Triton has no sm_70: the V100 is left out.)"""
  target = lm.targets.get(target)
  compiled = target.compile(lambda c: pack.pack(c, 2), jax.ShapeDtypeStruct((8, 4099), jnp.uint8))
  assert 'custom_call_target="__gpu$xla.gpu.triton"' in compiled.as_text()


@pytest.mark.parametrize("target", ["h100", "a100-80gb"])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_kernels_compile_for_gpu_targets(bits, target):
  """Both kernels compile through Triton and ptxas for sm_90a and sm_80, here without a GPU."""
  target = lm.targets.get(target)
  n = 4096 + 3
  codes = jax.ShapeDtypeStruct((8, n), jnp.uint8)
  lowered = target.lower(lambda c: pack.pack(c, bits), codes)
  assert "lowmem_pack" in lowered.as_text()
  packed = jax.ShapeDtypeStruct((8, pack.packed_size(n, bits)), jnp.uint8)
  for compiled in (lowered.compile(target.compiler_options()),
                   target.compile(lambda p: pack.unpack(p, bits, n), packed)):
    assert 'custom_call_target="__gpu$xla.gpu.triton"' in compiled.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", [(64, 1003), (3, 197, 1003)])
def test_kernels_on_gpu(bits, shape):
  """Blocks overhang the rows and the bytes: what lies outside must stay unwritten."""
  codes = jax.random.randint(jax.random.key(0), shape, 0, 2**bits).astype(jnp.uint8)
  packed = pack.pack(codes, bits)
  np.testing.assert_array_equal(packed, pack.pack_reference(codes, bits))
  np.testing.assert_array_equal(pack.unpack(packed, bits, shape[-1]), codes)


def test_bad_codes_and_n():
  with pytest.raises(TypeError, match="codes must be an integer array"):
    pack.pack(jnp.zeros((4,), jnp.float32), 2, options=INTERPRET)
  with pytest.raises(ValueError, match="bits must be one of"):
    pack.pack_reference(jnp.zeros((4,), jnp.uint8), 2.0)
  with pytest.raises(ValueError, match="n must be an int >= 0"):
    pack.unpack_reference(jnp.zeros((1,), jnp.uint8), 2, -1)
