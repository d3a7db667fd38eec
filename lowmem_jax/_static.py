"""Static metadata inside a state: an int in the tree's structure, not a leaf."""

import functools

import jax


@jax.tree_util.register_static
class StaticInt(int):
  """An int that is part of a pytree's structure, not a leaf: read at trace time under
  ``jit``, and taken from the template on a restore (`flax.serialization` saves nothing of it;
  orbax sees no leaf).

  The first one made registers the type with `flax.serialization` (its public
  ``register_serialization_state``): a state holds one only once it is made, so a restore
  always finds the type registered. ``import lowmem_jax`` loads no Flax; the first state
  holding one (AdamA's, the dynamic loss scale's) loads it, once.
  """

  def __new__(cls, value: int) -> "StaticInt":
    _register_with_flax()
    return super().__new__(cls, value)


@functools.cache
def _register_with_flax() -> None:
  from flax import serialization
  serialization.register_serialization_state(StaticInt, lambda _: {},
                                             lambda template, _: template, override=True)
