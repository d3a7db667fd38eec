"""Static metadata inside a state: an int in the tree's structure, not a leaf."""

import importlib.abc
import importlib.util
import sys

import jax

_SERIALIZATION = "flax.serialization"


@jax.tree_util.register_static
class StaticInt(int):
  """An int that is part of a pytree's structure, not a leaf: read at trace time under
  ``jit``, and taken from the template on a restore (`flax.serialization` saves nothing of it;
  orbax sees no leaf)."""


def _register(serialization) -> None:
  serialization.register_serialization_state(StaticInt, lambda _: {},
                                             lambda template, _: template, override=True)


class _OnFlaxSerialization(importlib.abc.MetaPathFinder):
  """Registers `StaticInt` with `flax.serialization` when that module is imported: importing
  Flax here would load it (and rich) with ``import lowmem_jax``."""

  def find_spec(self, name, path=None, target=None):
    if name != _SERIALIZATION:
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(name)
    run = spec.loader.exec_module

    def exec_module(module):
      run(module)
      _register(module)
    spec.loader.exec_module = exec_module
    return spec


if _SERIALIZATION in sys.modules:
  _register(sys.modules[_SERIALIZATION])
else:
  sys.meta_path.insert(0, _OnFlaxSerialization())
