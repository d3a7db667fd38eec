"""Test configuration: strict dtype promotion catches silent upcasts."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402  (XLA_FLAGS must be set before jax starts its backend)
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")


def pytest_collection_modifyitems(config, items):
  has_gpu = any(d.platform == "gpu" for d in jax.devices())
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords and not has_gpu:
      item.add_marker(skip)
