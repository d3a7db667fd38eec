"""Which implementation runs an op: the one vocabulary of ``impl=`` and ``implementation=``.

Every op with more than one implementation takes one of these names (the
ops with a Pallas kernel as ``impl``, `lowmem_jax.attention` as
``implementation``, after `jax.nn.dot_product_attention`):

- ``"xla"``: the op in plain JAX, compiled by XLA; any backend. For the
  kernels, their pure-JAX reference; for attention, its chunked `custom_vjp`
  with no L×L residual (not `jax.nn`'s ``"xla"``, which keeps the
  probabilities: that is `lowmem_jax.ops.attention.attention_reference`).
- ``"cudnn"``: cuDNN's fused kernel (attention only, through
  `jax.nn.dot_product_attention`); NVIDIA GPU.
- ``"pallas"``: the Pallas kernel, compiled for the GPU (Triton backend); an
  error that says why where it cannot run (no GPU, an input it cannot take).
- ``"pallas_interpret"``: the same kernel in Pallas interpret mode; any
  backend, slow; what the tests run on CPU.
- ``"auto"``: per op, by the compile target: a kernel for a GPU where
  `docs/benchmarks.md` measured it no slower than XLA's fusion (the families
  in `MEASURED_NO_SLOWER`); cuDNN attention on a GPU where cuDNN takes the
  call; else ``"xla"``. `MEASURED_NO_SLOWER` is empty today, so for the
  activations and the norms ``"auto"`` means ``"xla"`` on every target; only
  attention's ``"auto"`` leaves XLA (for cuDNN, on a GPU).

An op offers some of them (`KERNEL_IMPLS`, `lowmem_jax.ops.attention.IMPLS`);
asking it for another raises. ``None`` (the default) reads the environment
variable ``LOWMEM_JAX_IMPL`` when the op is traced, so one variable switches
a whole program; an op that does not offer the variable's value runs
``"auto"``, and an unset or empty variable means ``"auto"``.

``"On a GPU"`` means the compile target, `compiling_for`: the platform that
`lowmem_jax.compile.targets` sets (`compiling_for_platform`) while it compiles for a
target, else JAX's default backend. A step compiled for the H100 target on a
machine without a GPU takes the kernels' Triton path, and ptxas builds them
for sm_90a.

The choice is made when an op is traced, and jit's caches do not see it:
neither ``$LOWMEM_JAX_IMPL`` nor the compile target is part of the key under
which JAX caches a traced function. After changing the variable, call
`jax.clear_caches()`; a function traced before is then traced again at its
next call and takes the new choice. A new ``jax.jit`` of the same function is
not enough (JAX caches the trace by the function), and neither is
`jax.make_jaxpr`. The same holds for a function lowered with
``jax.jit(f).lower`` inside `lowmem_jax.compile.targets.compiling` on arguments it was
traced with before. `lowmem_jax.compile.targets.Target.compile` for a compile-only GPU
needs none of this: it places the arguments on the target's devices, so the
function is traced afresh.
"""

import contextlib
import contextvars
import os
from typing import Callable

import jax


IMPLS = ("auto", "xla", "cudnn", "pallas", "pallas_interpret")
KERNEL_IMPLS = ("auto", "xla", "pallas", "pallas_interpret")  # what the ops with a kernel offer
ENV_VAR = "LOWMEM_JAX_IMPL"

# Kernel families a GPU benchmark (benchmarks/kernels.py, figures in
# docs/benchmarks.md) measured no slower than XLA's fusion of the reference.
# Empty: the H100 run found the norm kernels faster (docs/kernels.md), but
# adding them changes every GPU-target memory figure, so they wait for a
# change that re-measures those; until then a kernel's "auto" is XLA.
MEASURED_NO_SLOWER: frozenset[str] = frozenset()

# The implementation `using` set; None: ``$LOWMEM_JAX_IMPL``.
_using: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "lowmem_jax_impl", default=None)

# The platform `compiling_for_platform` set; None: JAX's default backend.
_platform: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "lowmem_jax_compile_platform", default=None)

# `compiling_for_platform`'s ``cudnn_refusal``: a function giving why cuDNN's attention cannot
# compile for the target, or None where it can; None: no refusal known.
_cudnn_refusal: contextvars.ContextVar[Callable[[], str | None] | None] = contextvars.ContextVar(
    "lowmem_jax_cudnn_refusal", default=None)


def compiling_for() -> str:
  """The platform being compiled for: ``"gpu"``, ``"cpu"``, ... .

  The platform `compiling_for_platform` set (`lowmem_jax.compile.targets.Target.compile`
  sets ``"gpu"`` for a GPU target), else `jax.default_backend`. The ops that
  choose an implementation decide by it when they are traced.
  """
  chosen = _platform.get()
  return jax.default_backend() if chosen is None else chosen


@contextlib.contextmanager
def compiling_for_platform(name: str, cudnn_refusal: Callable[[], str | None] | None = None):
  """Within the block, `compiling_for` answers ``name`` (``"gpu"``, ``"cpu"``, ...).

  What `lowmem_jax.compile.targets.compiling` enters for a target; see the module
  docstring for when a function traced before needs `jax.clear_caches`. ``cudnn_refusal``,
  asked only where an op would take cuDNN, gives why cuDNN cannot compile for the target
  (`check_cudnn_compiles`), or None where it can.
  """
  if not isinstance(name, str) or not name:
    raise TypeError(f"name must be a platform name such as 'gpu', got {name!r}.")
  with _setting(_platform, name), _setting(_cudnn_refusal, cudnn_refusal):
    yield name


# The list `recording_cudnn_refusals` collects into; None: no recording.
_refusals: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "lowmem_jax_cudnn_refusals", default=None)


def check_cudnn_compiles() -> None:
  """Raises RuntimeError, with the reason, where cuDNN cannot compile for the compile target:
  jax 0.12.1's XLA builds cuDNN's attention graph while it compiles, which needs the CUDA
  driver, so a compile-only GPU on a machine without one cannot take it."""
  refusal = _cudnn_refusal.get()
  reason = refusal() if refusal is not None else None
  if reason is None:
    return
  if (found := _refusals.get()) is not None:
    found.append(reason)
  raise RuntimeError("cuDNN's attention does not compile for this target here (XLA builds its "
                     f"graph while compiling, which needs the CUDA driver): {reason}. "
                     "implementation='xla' compiles lowmem_jax's chunked kernel.")


@contextlib.contextmanager
def recording_cudnn_refusals():
  """Within the block, each refusal `check_cudnn_compiles` raises (an op that would have taken
  cuDNN and took its other implementation, or raised) appends its reason to the list yielded."""
  found = []
  with _setting(_refusals, found):
    yield found


@contextlib.contextmanager
def using(name: str):
  """Within the block, ``impl=None`` means ``name`` (one of `IMPLS`), as
  ``$LOWMEM_JAX_IMPL=name`` would, and over it: e.g. ``using("xla")`` for a step
  sharded over several devices, whose cuDNN attention needs q, k and v sharded alike.
  Read when an op is traced, as the variable is."""
  if name not in IMPLS:
    raise ValueError(f"name must be one of {IMPLS}, got {name!r}.")
  with _setting(_using, name):
    yield name


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value):
  """``var`` set to ``value`` within the block, reset after it."""
  token = var.set(value)
  try:
    yield
  finally:
    var.reset(token)


def choose(impl: str | None, op: str, offered: tuple[str, ...],
           argument: str = "impl") -> tuple[str, str]:
  """The implementation of `IMPLS` to run ``op`` with, and where it was named.

  Read when ``op`` is traced: a function traced before ``$LOWMEM_JAX_IMPL``
  changed keeps its old choice until `jax.clear_caches` (module docstring).

  Args:
    impl: a name in `IMPLS`, or ``None``: `using`'s name, else ``$LOWMEM_JAX_IMPL``,
      where ``op`` offers it, else ``"auto"``.
    op: what runs, for errors, e.g. ``"attention"``.
    offered: the names ``op`` offers.
    argument: the keyword that takes ``impl``, for errors.

  Returns:
    ``(impl, source)``: a name in ``offered``, and ``argument``, ``"using"`` or
    ``"$LOWMEM_JAX_IMPL"``, whichever named it.

  Raises:
    ValueError: a name not in `IMPLS`, or an explicit one ``op`` does not offer.
  """
  if impl is None:
    value, source = (_using.get(), "using") if _using.get() else (os.environ.get(ENV_VAR),
                                                                   f"${ENV_VAR}")
    if not value:
      return "auto", argument
    if value not in IMPLS:
      raise ValueError(f"${ENV_VAR} must be one of {IMPLS}, got {value!r}.")
    return (value, source) if value in offered else ("auto", argument)
  if impl not in IMPLS:
    raise ValueError(f"{argument} must be one of {IMPLS}, got {impl!r}.")
  if impl not in offered:
    raise ValueError(f"{op} has no {impl!r} implementation: {argument} must be one of "
                     f"{offered}, got {impl!r}.")
  return impl, argument


def kernel_options(impl: str | None, kernel: str,
                   unsupported: Callable[[], str | None] = lambda: None):
  """The `pallas_kernels.Options` to run ``kernel`` with, or ``None`` for XLA.

  Pallas is imported here, where a kernel is chosen: not with the library.

  Args:
    impl: a name in `KERNEL_IMPLS`, or ``None`` (see `choose`).
    kernel: the kernel family, e.g. ``"approx_activation"``.
    unsupported: gives why the kernel cannot take this input, or ``None``; called
      only where the kernel would run.

  Raises:
    ValueError: an unknown ``impl``, one the op does not offer, or a kernel
      asked for where it cannot run.
  """
  impl, source = choose(impl, f"the {kernel} op", KERNEL_IMPLS)
  target = compiling_for()
  on_gpu = target == "gpu"
  if impl == "xla" or (impl == "auto" and not (on_gpu and kernel in MEASURED_NO_SLOWER)):
    return None
  why = unsupported()
  if why is not None:
    if impl == "auto":
      return None
    raise ValueError(f"{source}={impl!r} cannot run the {kernel} kernel: {why}; "
                     f"use impl='xla'.")
  if impl == "pallas" and not on_gpu:
    raise ValueError(
        f"{source}='pallas' needs a GPU: the {kernel} kernel compiles with Pallas' Triton "
        f"backend and the compile target is {target!r}. Compile for a GPU target "
        f"(lowmem_jax.compile.targets), use impl='pallas_interpret' to run the kernel in interpret "
        f"mode, or impl='xla'.")
  from pallas_kernels import Options  # Pallas loads with the first kernel chosen
  return Options(interpret=impl == "pallas_interpret")
