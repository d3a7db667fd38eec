"""Names that moved keep working for one release, with a `DeprecationWarning`.

The one mechanism for it. `alias_modules` makes an old module path import its
new module (``import lowmem_jax.fold``, ``from lowmem_jax.fold import
fold_all``, ``lm.fold``); a module whose functions were renamed sets its
``__getattr__`` to `getattr_of`. The warning names the user's line, outside
the library and the import machinery, so Python's default filters show it.
"""

import importlib
import importlib.abc
import importlib.util
import os
import sys
import warnings
from typing import Any, Callable

_LIBRARY = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _warn(old: str, new: str) -> None:
  frame = sys._getframe(1)
  while frame is not None and (frame.f_code.co_filename.startswith(_LIBRARY)
                               or "importlib" in frame.f_code.co_filename):
    frame = frame.f_back
  where = frame.f_globals if frame is not None else {}
  warnings.warn_explicit(f"{old} is now {new}; the old name goes in the next release.",
                         DeprecationWarning,
                         frame.f_code.co_filename if frame is not None else "?",
                         frame.f_lineno if frame is not None else 0,
                         module=where.get("__name__", "?"),
                         registry=where.setdefault("__warningregistry__", {}))


class _Aliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Imports each old module path (a key of ``moved``) as its new module."""

  def __init__(self, moved: dict[str, str]):
    self.moved = moved
    self.specs = {}  # the new module's own spec, which the import machinery overwrites

  def find_spec(self, name, path=None, target=None):
    return importlib.util.spec_from_loader(name, self) if name in self.moved else None

  def create_module(self, spec):
    _warn(spec.name, self.moved[spec.name])
    module = importlib.import_module(self.moved[spec.name])
    self.specs[module.__name__] = module.__spec__
    return module

  def exec_module(self, module):
    module.__spec__ = self.specs[module.__name__]  # it ran when it was imported


def alias_modules(moved: dict[str, str]) -> None:
  """Old module path -> new module path, each importable under its old path."""
  if not any(isinstance(f, _Aliases) and f.moved == moved for f in sys.meta_path):
    sys.meta_path.append(_Aliases(moved))


def getattr_of(module: str, moved: dict[str, str]) -> Callable[[str], Any]:
  """``__getattr__`` for ``module``, whose names ``moved`` maps to ``"package.module:name"``."""
  def __getattr__(name: str) -> Any:
    if name not in moved:
      raise AttributeError(f"module {module!r} has no attribute {name!r}")
    path, _, attr = moved[name].partition(":")
    _warn(f"{module}.{name}", f"{path}.{attr}")
    return getattr(importlib.import_module(path), attr)
  return __getattr__
