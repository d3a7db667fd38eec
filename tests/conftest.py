"""Test configuration: 8 CPU devices and strict dtype promotion."""

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

# Strict promotion catches silent upcasts in our functional core. Flax's own
# normalisation layers mix bfloat16 and float32 implicitly, so the tests that
# run Flax models keep JAX's standard promotion.
_STRICT = ("test_activations", "test_norms", "test_pack", "test_fold", "test_pallas_activations",
           "test_pallas_norms", "test_dispatch")


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
  mode = "strict" if request.module.__name__.rsplit(".", 1)[-1] in _STRICT else "standard"
  with jax.numpy_dtype_promotion(mode):
    yield


def pytest_collection_modifyitems(config, items):
  """Tests marked ``gpu`` skip, with the reason shown, where JAX has no GPU backend."""
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason=f"needs a GPU; JAX's backend is {jax.default_backend()}")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
