"""Checks shared by the tests of the ``lowmem-jax`` command."""

import re


def errors(err: str) -> str:
  """``err`` without the progress lines (``[1/3] compiling baseline``)."""
  return "".join(line for line in err.splitlines(keepends=True)
                 if not re.match(r"\[\d+/\d+\] compiling ", line))
