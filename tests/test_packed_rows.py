"""`lowmem_jax.optim.packed_rows`: a stack of trees held as byte rows, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax.optim.packed_rows import Layout, PackedRows, Row


def _tree():
  """Three slices of a state with every kind of leaf: float32 (a NaN's bits among them),
  bfloat16, float16, 8-bit codes signed and not, a bool, typed PRNG keys of two
  implementations and an int32 counter."""
  mu = (jnp.arange(12.0).reshape(3, 4) / 7).at[1, 2].set(jnp.nan)
  return {"mu": mu, "nu": jnp.full((3, 5), 1 / 3, jnp.bfloat16),
          "half": jnp.full((3, 2), -2.5, jnp.float16),
          "codes": jnp.arange(6, dtype=jnp.uint8).reshape(3, 2),
          "signed": -jnp.arange(3, dtype=jnp.int8), "seen": jnp.array([1, 0, 1]) > 0,
          "key": jax.random.split(jax.random.key(0), 3),
          "rbg": jax.random.split(jax.random.key(0, impl="rbg"), 3), "count": jnp.array([1, 2, 3])}


def _bits(tree):
  """Each leaf's bits as NumPy arrays (a key's data; a float's bits as unsigned ints)."""
  out = []
  for x in jax.tree.leaves(tree):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    elif jnp.issubdtype(x.dtype, jnp.floating):
      x = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    out.append(np.asarray(x))
  return out


def test_packing_gives_each_slice_back_bit_for_bit():
  tree = _tree()
  packed = PackedRows.stack(tree, 3, banks=2)
  row_bytes = 4 * 4 + 5 * 2 + 2 * 2 + 2 + 1 + 1 + 2 * 4 + 4 * 4 + 4
  rows = packed.joined()
  assert rows.shape == (3, row_bytes) and rows.dtype == jnp.uint8
  assert [b.shape[0] for b in packed.banks] == [2, 1]  # rows 0 and 2, row 1
  np.testing.assert_array_equal(packed.banks[1][0], rows[1])
  assert packed.layout.row_bytes == row_bytes
  back = packed.unstacked()
  assert jax.tree.structure(back) == jax.tree.structure(tree)
  for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
    assert got.dtype == want.dtype and got.shape == want.shape
  for got, want in zip(_bits(back), _bits(tree)):
    np.testing.assert_array_equal(got, want)
  one = packed.layout.unpack(rows[1])
  for got, want in zip(_bits(one), _bits(jax.tree.map(lambda x: x[1], tree))):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("words", [True, False])
def test_a_row_is_each_leafs_bytes_end_to_end_packed_as_words_where_each_leaf_is_whole_words(
    words):
  """A row is the leaves' memory bytes in order (as NumPy lays them), whether packed in 4-byte
  words (every leaf a whole number of them: XLA's concatenation then runs a quarter of the
  threads) or byte by byte (a leaf of 2 bytes among them)."""
  tree = {"codes": jnp.arange(8, dtype=jnp.int8) - 3, "scale": jnp.array([0.5, -1.25]),
          "nu": jnp.arange(2, dtype=jnp.bfloat16) / 3, "count": jnp.array(7, jnp.int32),
          "key": jax.random.key(1),
          **({} if words else {"half": jnp.array([1.5], jnp.float16)})}
  layout = Layout.of(tree)
  want = b"".join(np.asarray(x).tobytes() for x in _bits(tree))
  row = jax.jit(layout.pack)(tree)
  assert row.dtype == jnp.uint8 and np.asarray(row).tobytes() == want
  concatenated = [e.outvars[0].aval.dtype for e in jax.make_jaxpr(layout.pack)(tree).eqns
                  if e.primitive.name == "concatenate"]
  assert concatenated == [jnp.uint32 if words else jnp.uint8]
  for got, keep in zip(_bits(layout.unpack(row)), _bits(tree)):
    np.testing.assert_array_equal(got, keep)


@pytest.mark.parametrize("tree", [
    {"nu": jnp.arange(4, dtype=jnp.bfloat16)}, {"half": jnp.array([1.5, -2.0], jnp.float16)},
    {"codes": jnp.arange(8, dtype=jnp.int8)}, {"count": jnp.array(3, jnp.int32)},
    {"key": jax.random.key(2)}, {"none": jnp.zeros((0,)), "nu": jnp.ones(8, jnp.bfloat16)}],
    ids=["bfloat16", "float16", "int8", "int32", "key", "empty-beside-bfloat16"])
def test_a_lone_leaf_of_each_width_packs_under_jit_to_its_bytes(tree):
  """Compiled, a row of one leaf (the concatenation elided, its views next to each other) is
  the leaf's bytes: XLA folded a bfloat16-to-word view and a word-to-byte one into one view
  of the wrong shape."""
  row = jax.jit(Layout.of(tree).pack)(tree)
  assert np.asarray(row).tobytes() == b"".join(np.asarray(x).tobytes() for x in _bits(tree))


def test_a_row_read_after_a_value_unpacks_the_same_bits_only_once_it_is_made():
  tree = jax.tree.map(lambda x: x[1], _tree())
  layout = Layout.of(tree)
  row = layout.pack(tree)
  late = jax.jit(lambda row, x: Row(row, layout).read_after(x))
  for got, want in zip(_bits(late(row, jnp.ones(3))), _bits(tree)):
    np.testing.assert_array_equal(got, want)
  eqns = jax.make_jaxpr(lambda row, x: Row(row, layout).read_after(x * 2))(row, jnp.ones(3)).eqns
  names = [e.primitive.name for e in eqns]
  barrier = names.index("optimization_barrier")
  assert names.index("mul") < barrier < names.index("slice")  # no leaf sliced before it
  for got, want in zip(_bits(Row(row, layout).unpack()), _bits(tree)):
    np.testing.assert_array_equal(got, want)
  some = Row(row, layout).read_after(x=jnp.ones(3), keep={0, 3})
  assert [k for k, x in enumerate(jax.tree.leaves(some, is_leaf=lambda x: x is None))
          if x is not None] == [0, 3]
  for got, want in zip(_bits(some), [_bits(tree)[k] for k in (0, 3)]):
    np.testing.assert_array_equal(got, want)


def test_packed_rows_are_a_pytree_of_their_banks_under_jit():
  packed = PackedRows.stack(_tree(), 3)
  assert jax.tree.leaves(packed) == list(packed.banks)
  same = jax.jit(lambda p: p)(packed)
  assert same.layout == packed.layout and hash(same.layout) == hash(packed.layout)
  shaped = jax.eval_shape(lambda t: PackedRows.stack(t, 3), _tree())
  assert jax.tree.structure(shaped) == jax.tree.structure(packed)


def test_a_stateless_stack_packs_to_empty_rows():
  packed = PackedRows.stack((), 4)  # optax.sgd's state a slice: nothing
  assert packed.joined().shape == (4, 0) and packed.count == 4
  assert packed.layout.unpack(packed.joined()[0]) == ()


def test_a_tree_laid_out_otherwise_is_refused():
  layout = Layout.of(_tree(), lead=1)
  one = jax.tree.map(lambda x: x[0], _tree())
  with pytest.raises(ValueError, match="not laid out as the packed rows"):
    layout.pack({**one, "mu": one["mu"][:2]})
  with pytest.raises(ValueError, match="not laid out as the packed rows"):
    layout.pack({**one, "count": one["count"].astype(jnp.float32)})


@pytest.mark.parametrize("name,value", [("nu", 0.25), ("seen", False), ("half", [1.0, -1.0])])
def test_with_leaf_sets_one_leaf_in_every_row_and_keeps_the_others_bit_for_bit(name, value):
  tree = _tree()
  k = sorted(tree).index(name)  # a dict's leaves in its keys' sorted order, one a key
  back = PackedRows.stack(tree, 3).with_leaf(k, value).unstacked()
  want = {**tree, name: jnp.broadcast_to(jnp.asarray(value, tree[name].dtype), tree[name].shape)}
  for got, expected in zip(_bits(back), _bits(want), strict=True):
    np.testing.assert_array_equal(got, expected)
  with pytest.raises(ValueError, match="PRNG key"):
    PackedRows.stack(tree, 3).with_leaf(sorted(tree).index("key"), 0)


def test_flax_restores_rows_dealt_into_the_templates_banks_and_refuses_other_rows():
  """A state saved before the rows were dealt into banks ({"rows": rows}) restores into a
  one-bank template, and into a two-bank one (a state saved with another ``prefetch``) dealt
  again, as two banks into one; rows of another count are refused by name."""
  from flax import serialization
  one, two = PackedRows.stack(_tree(), 3), PackedRows.stack(_tree(), 3, banks=2)
  old = {"rows": np.asarray(one.joined())}
  for template in (one, two):
    restored = serialization.from_state_dict(template, old)
    assert len(restored.banks) == len(template.banks)
    np.testing.assert_array_equal(restored.joined(), one.joined())
  back = serialization.from_state_dict(one, serialization.to_state_dict(two))
  np.testing.assert_array_equal(back.joined(), one.joined())
  with pytest.raises(ValueError, match=r"the template's \(3, \d+\) rows"):
    serialization.from_state_dict(two, {"rows": old["rows"][:2]})
