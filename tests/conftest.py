"""Test configuration: 8 CPU devices, strict dtype promotion and rank promotion "raise"."""

import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# With a GPU, each test process (pytest-xdist's -n) takes only the memory it uses.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402  (XLA_FLAGS must be set before jax starts its backend)
import pytest  # noqa: E402

# The examples and benchmarks are scripts, not a package: their tests import them.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

# Strict dtype promotion and rank promotion "raise", for every test, as equinox's
# tests do: they catch silent upcasts (a float32 constant or parameter turning a
# bfloat16 array into float32) and silent broadcasts of unequal ranks. A test that
# runs a third-party function promoting implicitly is marked with one of
# third_party_promotion.py's ``standard_promotion`` marks, naming the function: it
# keeps JAX's standard dtype promotion; rank promotion still raises. The module
# fixture covers the module-scoped fixtures too (the examples' runs); a module's
# ``pytestmark`` reaches both.


def _promotion(node):
  """The context of a test or a module: strict dtype promotion unless marked, rank "raise"."""
  marks = list(node.iter_markers("standard_promotion"))
  for mark in marks:
    if len(mark.args) != 1 or not isinstance(mark.args[0], str) or not mark.args[0]:
      raise ValueError(f"{node.nodeid}: standard_promotion takes one reason naming the "
                       f"third-party function that promotes, got {mark.args!r}")
  mode = "standard" if marks else "strict"
  return jax.numpy_dtype_promotion(mode), jax.numpy_rank_promotion("raise")


@pytest.fixture(scope="module", autouse=True)
def _module_promotion(request):
  dtype, rank = _promotion(request.node)
  with dtype, rank:
    yield


@pytest.fixture(autouse=True)
def _test_promotion(request):
  dtype, rank = _promotion(request.node)
  with dtype, rank:
    yield


def pytest_collection_modifyitems(config, items):
  """Tests marked ``gpu`` skip, with the reason shown, where JAX has no GPU backend."""
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason=f"needs a GPU; JAX's backend is {jax.default_backend()}")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
  """The versions a run tested, beside its counts: CI runs both ends of the supported range."""
  import jaxlib
  terminalreporter.write_line(f"tested: Python {sys.version.split()[0]}, jax {jax.__version__}, "
                              f"jaxlib {jaxlib.__version__}")
