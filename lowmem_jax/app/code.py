"""Code that is both run and printed: a technique set's step, built from one description.

A `Program` is a list of assignments ``name = expression``; an expression is a
`Call` of a dotted name (``lm.adamaw``, ``optax.chain``, ``wl.train_step``) or
a `Name` bound earlier, a `Lambda` of one argument, or a plain value (an int,
float, str, tuple, None) or a `Code` (a value that prints as written, e.g.
``jnp.bfloat16``).
`Program.run` makes the values; `Program.source` prints the same lines, so the
code a report shows cannot disagree with the step it measured.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

import lowmem_jax


@dataclasses.dataclass(frozen=True)
class Code:
  """A value and the Python that makes it (``Code(jnp.bfloat16, "jnp.bfloat16")``)."""
  value: Any
  text: str


@dataclasses.dataclass(frozen=True)
class Name:
  """A name bound by an earlier assignment of the program, or a module (``lm``, ``optax``),
  with attributes after dots (``streamed.step``)."""
  name: str


@dataclasses.dataclass(frozen=True)
class Call:
  """``fn(*args, **kwargs)``, ``fn`` a dotted name (its first part a `Name`)."""
  fn: str
  args: tuple = ()
  kwargs: tuple[tuple[str, Any], ...] = ()

  @classmethod
  def of(cls, fn: str, *args, **kwargs) -> "Call":
    return cls(fn, args, tuple(kwargs.items()))


@dataclasses.dataclass(frozen=True)
class Lambda:
  """``lambda arg: body``, ``body`` an expression that may use `Name` ``arg``."""
  arg: str
  body: Any


_MODULES = {"functools": functools, "lm": lowmem_jax, "jax": jax, "jnp": jnp, "optax": optax}
"""The modules a program's names may start with: the printed code imports them."""
IMPORTS = "import functools, jax, jax.numpy as jnp, optax, lowmem_jax as lm"


def _lookup(dotted: str, scope: dict) -> Any:
  head, *attrs = dotted.split(".")
  value = scope[head]
  for attr in attrs:
    value = getattr(value, attr)
  return value


def _run(x: Any, scope: dict) -> Any:
  if isinstance(x, Code):
    return x.value
  if isinstance(x, Name):
    return _lookup(x.name, scope)
  if isinstance(x, Call):
    return _lookup(x.fn, scope)(*(_run(a, scope) for a in x.args),
                                **{k: _run(v, scope) for k, v in x.kwargs})
  if isinstance(x, Lambda):
    return lambda value: _run(x.body, {**scope, x.arg: value})
  if isinstance(x, tuple):
    return tuple(_run(v, scope) for v in x)
  return x


def value(x: Any) -> Any:
  """What expression ``x`` makes, its names the modules' (`IMPORTS`)."""
  return _run(x, dict(_MODULES))


def _source(x: Any) -> str:
  if isinstance(x, Code):
    return x.text
  if isinstance(x, Name):
    return x.name
  if isinstance(x, Call):
    args = [_source(a) for a in x.args] + [f"{k}={_source(v)}" for k, v in x.kwargs]
    return f"{x.fn}({', '.join(args)})"
  if isinstance(x, Lambda):
    return f"lambda {x.arg}: {_source(x.body)}"
  if isinstance(x, str):
    return f'"{x}"'
  if isinstance(x, tuple):  # as `_run` makes it: each element an expression
    return f"({', '.join(map(_source, x))}{',' if len(x) == 1 else ''})"
  return repr(x)


def source(x: Any) -> str:
  """The Python of expression ``x``."""
  return _source(x)


@dataclasses.dataclass(frozen=True)
class Program:
  """Assignments ``(name, expression, comment)`` in order."""
  lines: tuple[tuple[str, Any, str], ...]

  def run(self) -> dict[str, Any]:
    """Each assigned name's value."""
    scope = dict(_MODULES)
    for name, expression, _ in self.lines:
      scope[name] = _run(expression, scope)
    return {name: scope[name] for name, _, _ in self.lines}

  def source(self) -> str:
    """The Python of the same assignments, after `IMPORTS`."""
    return "\n".join([IMPORTS] + [f"{name} = {_source(e)}" + (f"  # {comment}" if comment else "")
                                  for name, e, comment in self.lines])
