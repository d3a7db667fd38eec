"""Plain text of rich renderables: how the library's tables print."""

import io


def render(*renderables) -> str:
  """``renderables`` (rich tables, strings) as text 160 columns wide, without colour,
  one after the other, trailing whitespace stripped; a ``[word]`` printed as it is, not read
  as rich's markup (``pip install 'lowmem-jax[target]'``)."""
  from rich.console import Console  # rich loads with the first table printed, not the library
  console = Console(file=io.StringIO(), width=160, color_system=None, markup=False)
  for r in renderables:
    console.print(r)
  return console.file.getvalue().rstrip()
