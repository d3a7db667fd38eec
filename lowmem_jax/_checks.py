"""Input checks shared by the public functions: errors name the argument."""

import numbers
from typing import Any

import jax.numpy as jnp

FLOAT_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def check_float_array(x, name: str = "x") -> None:
  """Raises unless ``x`` is a float16/bfloat16/float32 array of rank >= 1."""
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"{name} must be a JAX array, got {type(x).__name__}.")
  if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
    raise TypeError(
        f"{name} must be float16, bfloat16 or float32, got {x.dtype}; "
        f"cast it first, e.g. {name}.astype(jnp.float32).")
  if x.ndim < 1:
    raise ValueError(
        f"{name} must have rank >= 1 (the last axis is the feature axis), "
        f"got a scalar; use {name}[None].")


def check_out_dtype(dtype, name: str = "dtype"):
  """Returns ``jnp.dtype(dtype)`` if it is a supported float dtype, else raises."""
  if dtype is None:
    return None
  try:
    dtype = jnp.dtype(dtype)
  except TypeError as e:
    raise TypeError(f"{name} must be a float dtype, got {dtype!r}.") from e
  if dtype not in FLOAT_DTYPES:
    raise TypeError(f"{name} must be float16, bfloat16 or float32, got {dtype}.")
  return dtype


def is_int(x: Any) -> bool:
  """Whether ``x`` is an integer (Python's or NumPy's) and not a bool: a count, a seed,
  a static size."""
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
  """Whether ``x`` is a real number (Python's or NumPy's) and not a bool: an epsilon, a
  rate."""
  return isinstance(x, numbers.Real) and not isinstance(x, bool)
