"""Static metadata inside a state: an int in the tree's structure, not a leaf."""

import flax.serialization
import jax


@jax.tree_util.register_static
class StaticInt(int):
  """An int that is part of a pytree's structure, not a leaf: read at trace time under
  ``jit``, and taken from the template on a restore (`flax.serialization` saves nothing of it;
  orbax sees no leaf)."""


flax.serialization.register_serialization_state(StaticInt, lambda _: {},
                                                lambda template, _: template)
