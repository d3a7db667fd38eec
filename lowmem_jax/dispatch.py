"""Which implementation runs an op that has a Pallas kernel: ``impl=``.

Every public function with a kernel in `pallas_kernels` takes ``impl``:

- ``"xla"``: the pure-JAX reference, fused by XLA; any backend.
- ``"pallas"``: the Pallas kernel, compiled for the GPU (Triton backend); an
  error that says why where it cannot run (no GPU, an input it cannot take).
- ``"pallas_interpret"``: the same kernel in Pallas interpret mode; any
  backend, slow; what the tests run on CPU.
- ``"auto"``: the kernel for a GPU where `docs/benchmarks.md` measured it no
  slower than XLA's fusion (the families in `MEASURED_NO_SLOWER`), else XLA.

``impl=None`` (the default) reads the environment variable ``LOWMEM_JAX_IMPL``
when the function is traced, and is ``"auto"`` where it is unset or empty, so
one variable switches a whole program.

``"On a GPU"`` means the compile target (`lowmem_jax.targets.compiling_for`): a
step compiled for the H100 target on a machine without a GPU takes the
kernels' Triton path, and ptxas builds them for sm_90a.
"""

import os

from lowmem_jax import targets
from pallas_kernels import _blocks

IMPLS = ("auto", "xla", "pallas", "pallas_interpret")
ENV_VAR = "LOWMEM_JAX_IMPL"

# Kernel families a GPU benchmark (benchmarks/kernels.py, figures in
# docs/benchmarks.md) measured no slower than XLA's fusion of the reference.
# Empty: no GPU has run the benchmark yet, so "auto" means XLA everywhere.
MEASURED_NO_SLOWER: frozenset[str] = frozenset()


def kernel_options(impl: str | None, kernel: str, unsupported: str | None = None):
  """The `pallas_kernels._blocks.Options` to run ``kernel`` with, or ``None`` for XLA.

  Args:
    impl: ``"auto"``, ``"xla"``, ``"pallas"``, ``"pallas_interpret"`` or
      ``None`` (``$LOWMEM_JAX_IMPL``, else ``"auto"``).
    kernel: the kernel family, e.g. ``"approx_activation"``.
    unsupported: why the kernel cannot take this input, or ``None``.

  Raises:
    ValueError: an unknown ``impl``, or a kernel asked for where it cannot run.
  """
  source = "impl"
  if impl is None:
    impl, source = os.environ.get(ENV_VAR) or "auto", f"${ENV_VAR}"
  if impl not in IMPLS:
    raise ValueError(f"{source} must be one of {IMPLS}, got {impl!r}.")
  platform = targets.compiling_for()
  on_gpu = platform == "gpu"
  if impl == "xla" or (impl == "auto" and not (on_gpu and kernel in MEASURED_NO_SLOWER
                                               and unsupported is None)):
    return None
  if unsupported is not None:
    raise ValueError(f"{source}={impl!r} cannot run the {kernel} kernel: {unsupported}; "
                     f"use impl='xla'.")
  if impl == "pallas" and not on_gpu:
    raise ValueError(
        f"{source}='pallas' needs a GPU: the {kernel} kernel compiles with Pallas' Triton "
        f"backend and the compile target is {platform!r}. Compile for a GPU target "
        f"(lowmem_jax.targets), use impl='pallas_interpret' to run the kernel in interpret "
        f"mode, or impl='xla'.")
  return _blocks.Options(interpret=impl == "pallas_interpret")
