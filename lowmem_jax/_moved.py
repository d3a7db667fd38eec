"""Names that moved keep working for one release, with a `DeprecationWarning`.

The one mechanism for it: a module's ``__getattr__`` is `getattr_of` of its
moved names, each old name mapped to the dotted path of its new home.
"""

import importlib
import warnings
from typing import Any, Callable


def getattr_of(module: str, moved: dict[str, str]) -> Callable[[str], Any]:
  """``__getattr__`` for ``module`` whose names ``moved`` maps to ``"package.module"``
  (a module) or ``"package.module:name"`` (a name in it)."""
  def __getattr__(name: str) -> Any:
    if name not in moved:
      raise AttributeError(f"module {module!r} has no attribute {name!r}")
    path, _, attr = moved[name].partition(":")
    new = f"{path}.{attr}" if attr else path
    warnings.warn(f"{module}.{name} is now {new}; the old name goes in the next release.",
                  DeprecationWarning, stacklevel=2)
    value = importlib.import_module(path)
    return getattr(value, attr) if attr else value
  return __getattr__
