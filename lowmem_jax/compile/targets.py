"""Compile targets: memory figures for the accelerator a user trains on.

XLA's GPU pipeline runs without a GPU: given a target config (a text
``stream_executor.GpuTargetConfigProto``: the card's SM count, memory size,
compute capability, ...), JAX's CUDA plugin makes compile-only devices, and
``jax.jit(fn).lower(*args).compile()`` on arguments placed on them runs the
real GPU compiler (cuBLAS and cuDNN custom calls, Triton fusions, ptxas for
the card's architecture) and XLA's buffer assignment for that card. That is
the figure this project reports: exact for XLA's GPU buffer assignment, with
two known gaps while nothing is autotuned (no device to time on): GEMMs go to
cuBLAS rather than Triton tiles, and cuDNN workspaces are counted as 0 bytes.

A `Target` is one of three kinds:

* a compile-only GPU from a shipped config (`get`, `names`) or a user's own
  (`load`; `Target.save` writes one, and `from_devices` reads the config of
  the GPU this process runs on);
* the devices this process runs on (`attached`), compiled for as usual;
* ``"cpu"``: XLA's CPU pipeline, a proxy only. It computes 16-bit dots in
  float32 and keeps float32 copies, about twice a GPU's peak for bfloat16
  steps, and it merges `jax.checkpoint`'s recompute back into the forward
  pass unless told not to (`CPU_KEEPS_REMAT`, applied here).

`default` picks the GPU the process runs on, else ``"h100"`` where the target packages are
installed (``pip install 'lowmem-jax[target]'``), else the CPU with `Target.note` saying so.

Environment: the CUDA plugin checks its CUDA libraries against the driver before it registers
and, with no driver, never registers. Importing this module on a machine without an NVIDIA driver
sets ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` (unless set) so that the plugin registers for
compiling only; the check needs a driver, so skipping it loses nothing there.
"""

import contextlib
import ctypes.util
import dataclasses
import functools
import importlib.resources
import importlib.util
import math
import os
import pathlib
import re
import shutil
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lowmem_jax import _jax, _lane_ops, _sharding
from lowmem_jax.compile import gpu_speeds
from lowmem_jax.ops import dispatch
from lowmem_jax.ops.dispatch import compiling_for  # noqa: F401  (public here too)
from lowmem_jax.optim.offload import HOST, in_host_memory  # noqa: F401  (public here too)

if "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" not in os.environ and ctypes.util.find_library("cuda") is None:
  os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"

INSTALL = "pip install 'lowmem-jax[target]'"
"""What installs the compile-only GPU targets: JAX's CUDA 13 plugin for the installed jaxlib,
ptxas (``nvidia-cuda-nvcc``) and cuDNN. JAX's CUDA 12 plugin, installed by hand, serves too."""

# XLA's CPU pipeline of jax 0.10.2 expands optimization barriers before CSE, which merges
# the recompute of `jax.checkpoint` back into the forward pass: remat then saves nothing on
# CPU. Keeping the barriers compiles remat as accelerators do (jax 0.12's CPU pipeline keeps
# remat without it; the option changes nothing there).
CPU_KEEPS_REMAT = {"xla_disable_hlo_passes": "cse_barrier_expander"}

# With no device there is no autotuning, and XLA's Triton GEMM emitter then
# fails to pick tiles for some dots ("Couldn't find output tile sizes"):
# cuBLAS takes every GEMM unless the user gives autotune results. What that
# costs in truth (docs/gpu_probe.md, an H100, jax 0.11.2): the real compile with
# this option equals the deviceless one; without it the bfloat16 baselines of
# ViT-B/16 and LLaMA-100M take 21% and 27% more; float32 steps and the
# lowmem_jax steps are within 1%.
DEVICELESS_OPTIONS = {"xla_gpu_enable_triton_gemm": False}

UNRUN_CODE_OPTIONS = {"xla_backend_optimization_level": 0,
                      "xla_llvm_disable_expensive_passes": True,
                      "xla_gpu_disable_gpuasm_optimizations": True}
"""XLA options for a program that is compiled and never run (a compile-only GPU's): LLVM and
ptxas without their optimizations. Only the machine code changes: the optimized HLO, its
schedule and XLA's memory analysis stay the same (tests/test_targets.py compares them), and the
compile takes about a quarter less time (llama-tiny's host-state streamed step for the h100,
jax 0.12.0.1 on 2 CPU cores: 100.2 -> 76.0 s)."""

HOST_TRANSFER_OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": True,
                         **({} if _jax.OWN_HOST_TRANSFER_STREAMS else
                            {"xla_disable_hlo_passes": "dynamic-slice-copy-fusion-async-wrapper"})}
"""XLA options for a step moving data between host and device in a loop (the layer-streamed
step, its state or saved inputs on the host): the latency-hiding scheduler (each transfer started
early, waited for late); before jaxlib 0.12, where the host transfers share XLA's compute streams
(`lowmem_jax.compile.memory.streams`), synchronous weight copies, none behind a row's transfer
(h100, 8B ``…+prefetch:2``, jax 0.11.2: 1,046.5 -> 791.6 ms estimated; docs/benchmarks.md,
sessions 27 and 42). For ``jax.jit``'s ``compiler_options``; the CPU ignores them."""

_CONFIGS = importlib.resources.files("lowmem_jax.compile") / "target_configs"


class TargetUnavailable(RuntimeError):
  """The packages a compile-only GPU target needs are missing or cannot load."""


@dataclasses.dataclass(frozen=True)
class Target:
  """An accelerator to compile for.

  Attributes:
    name: ``"h100"``, ``"cpu"``, ``"attached"``, or a loaded config's name.
    platform: ``"cuda"`` for a GPU (compile-only or attached), ``"cpu"``.
    device_kind: the device's name, e.g. ``"NVIDIA H100 80GB HBM3"``.
    memory_bytes: what the device holds (its config's ``device_memory_size``,
      an attached device's ``bytes_limit``), or None where unknown (the CPU).
    config: the text ``GpuTargetConfigProto`` of a compile-only GPU, else None.
    autotune_results: a file of XLA autotune results
      (``xla_gpu_load_autotune_results_from``); with it, Triton GEMMs stay on.
  """
  name: str
  platform: str
  device_kind: str
  memory_bytes: int | None
  config: str | None = dataclasses.field(default=None, repr=False)
  autotune_results: str | None = None

  @property
  def deviceless(self) -> bool:
    """True for a compile-only GPU."""
    return self.config is not None

  @property
  def compute_capability(self) -> tuple[int, int] | None:
    """``(major, minor)`` CUDA compute capability of a compile-only GPU (from its config),
    else None."""
    found = self.config and _COMPUTE_CAPABILITY.search(self.config)
    return (int(found.group(1)), int(found.group(2) or 0)) if found else None

  @property
  def peak_bf16_flops(self) -> float | None:
    """The dense bfloat16 tensor-core peak in FLOP/s (float32 accumulation, as XLA's dots; no
    sparsity) from NVIDIA's specifications, for a shipped GPU and any target of the same
    device kind (`from_devices`, `attached`, `load`); None for other devices and the CPU."""
    return getattr(gpu_speeds.BY_DEVICE_KIND.get(self.device_kind), "peak_bf16_flops", None)

  @property
  def memory_bytes_per_s(self) -> float | None:
    """The device memory's bandwidth in bytes/s: its config's ``memory_bandwidth`` (XLA's
    reading of the memory clock and bus width), else a shipped config's of the same device
    kind (for `attached`); None where neither gives it (the CPU, another GPU)."""
    found = _BANDWIDTH.search(self._spec_config() or "")
    return float(found.group(1)) if found else None

  @property
  def lane_ops_per_s(self) -> dict[str, float] | None:
    """Vector ALU lane operations a second by pipe (`lowmem_jax._lane_ops.rates_of`) of its
    config, or a shipped one of its device kind; None where neither gives them."""
    return _lane_ops.rates_of(self._spec_config() or "")

  def _spec_config(self) -> str | None:  # its own config, else a shipped one of its kind
    shipped = None if self.config else shipped_for(self.device_kind)
    return self.config or (shipped and _CONFIGS.joinpath(f"{shipped}.txtpb").read_text())

  @property
  def host_link_bytes_per_s(self) -> float | None:
    """One direction of the GPU's PCIe link to the host in bytes/s (its generation and lanes
    after line coding; the PCIe link of an SXM part, not NVLink), known as `peak_bf16_flops`
    is; None otherwise."""
    return getattr(gpu_speeds.BY_DEVICE_KIND.get(self.device_kind), "host_link_bytes_per_s", None)

  @property
  def interconnect_bytes_per_s(self) -> float | None:
    """One direction of the GPU's link to the other GPUs in bytes/s: NVLink's where the part
    has it to all its peers (SXM: H100 NVLink 4, 900 GB/s both ways together, so 450 GB/s; the
    H100 datasheet), else `host_link_bytes_per_s` (PCIe); known as `peak_bf16_flops` is."""
    speeds = gpu_speeds.BY_DEVICE_KIND.get(self.device_kind)
    return None if speeds is None else speeds.nvlink_bytes_per_s or speeds.host_link_bytes_per_s

  @property
  def note(self) -> str:
    """One line on what the figures compiled for this target are."""
    if self.deviceless:
      tuned = "with the given autotune results" if self.autotune_results else (
          "without autotuning: cuBLAS GEMMs, cuDNN workspaces not counted")
      refusal = cudnn_refusal(self) if available() is None else None
      attention = "" if refusal is None else (
          f"; cuDNN's attention does not compile here ({refusal}), attention takes lowmem_jax's "
          "chunked kernel")
      return (f"target {self.name} ({self.device_kind}): XLA's GPU buffer assignment, compiled "
              f"here without a GPU, {tuned}{attention}")
    if self.platform == "cpu":
      return ("target cpu: a CPU proxy, not a GPU figure (16-bit dots computed in float32, about "
              f"twice a GPU's peak for bfloat16); for GPU-true figures: {INSTALL}")
    return f"target {self.name} ({self.device_kind}): XLA's buffer assignment on this process's GPU"

  def devices(self, count: int = 1) -> list:
    """``count`` devices to compile for: compile-only ones for a config."""
    if not isinstance(count, int) or count < 1:
      raise ValueError(f"count must be a positive int, got {count!r}.")
    if self.deviceless:
      _check_cuda_compiles_for(self)
      return list(_compile_only_devices(self.config, count))
    found = jax.devices("cpu" if self.platform == "cpu" else None)
    if count > len(found):
      raise ValueError(f"count={count}: target {self.name} has {len(found)} devices.")
    return found[:count]

  def mesh(self, shape: tuple[int, ...], axis_names: tuple[str, ...]) -> Mesh:
    """A `jax.sharding.Mesh` of ``prod(shape)`` of the target's devices."""
    if len(shape) != len(axis_names):
      raise ValueError(f"shape {shape} and axis_names {axis_names} differ in length.")
    devices = self.devices(math.prod(shape))
    return Mesh(np.array(devices, dtype=object).reshape(shape), axis_names)

  def place(self, tree: Any, mesh: Mesh | None = None) -> Any:
    """``tree`` with every array leaf a `jax.ShapeDtypeStruct` on the target.

    A leaf sharded over a mesh by a `NamedSharding` keeps its `PartitionSpec`
    on ``mesh`` (default: a mesh of the target's devices with the leaf's mesh
    shape and axis names), so a step sharded over 8 devices compiles for 8
    target devices; any other leaf is replicated on ``mesh`` (default: one
    device). Leaves that are not arrays stay as they are. For the CPU and an
    attached target, leaves without a mesh keep their own sharding.
    """
    meshes: dict = {}

    def target_mesh(shape, axis_names):
      if mesh is not None:
        return mesh
      key = (tuple(shape), tuple(axis_names))
      if key not in meshes:
        meshes[key] = self.mesh(*key)
      return meshes[key]

    def leaf(x):
      if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        return x
      sharding = getattr(x, "sharding", None)
      if isinstance(sharding, NamedSharding):
        m = target_mesh(sharding.mesh.axis_sizes, sharding.mesh.axis_names)
        sharding = NamedSharding(m, sharding.spec, memory_kind=sharding.memory_kind)
      elif mesh is not None or self.deviceless:
        sharding = NamedSharding(target_mesh((1,), ("_",)), PartitionSpec())
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.tree.map(leaf, tree)

  def compiler_options(self, extra: dict | None = None) -> dict:
    """The XLA options this target compiles with, ``extra`` last."""
    if self.platform == "cpu":
      base = dict(CPU_KEEPS_REMAT)
    elif self.autotune_results:
      base = {"xla_gpu_load_autotune_results_from": self.autotune_results}
    elif self.deviceless:
      base = dict(DEVICELESS_OPTIONS)
    else:
      base = {}
    unrun = UNRUN_CODE_OPTIONS if self.deviceless else {}
    return {**base, **unrun, **(extra or {})}

  def lower(self, fn: Callable, *args, donate_argnums: int | tuple[int, ...] = (),
            mesh: Mesh | None = None, **kwargs) -> jax.stages.Lowered:
    """Lowers ``fn`` for this target on the shapes of ``args`` (see `compile`)."""
    if not callable(fn):
      raise TypeError(f"fn must be callable, got {type(fn).__name__}.")
    if hasattr(fn, "lower"):
      if donate_argnums not in ((), None):
        raise ValueError("donate_argnums is for a plain function; fn is already jitted: give "
                         "donate_argnums to jax.jit.")
      jitted = fn
    else:
      jitted = jax.jit(fn, donate_argnums=donate_argnums)
    with compiling(self):
      if self.deviceless and _in_host_memory((args, kwargs)):
        if mesh is not None:
          raise ValueError("mesh: arguments in host memory compile for one target device.")
        on_cpu = lambda t: jax.tree.map(_on_cpu, t)
        return jitted.trace(*on_cpu(args), **on_cpu(kwargs)).lower(lowering_platforms=("cuda",))
      return jitted.lower(*self.place(args, mesh), **self.place(kwargs, mesh))

  def compile(self, fn: Callable, *args, donate_argnums: int | tuple[int, ...] = (),
              compiler_options: dict | None = None, mesh: Mesh | None = None,
              **kwargs) -> "jax.stages.Compiled | HostArgumentsCompiled":
    """Compiles ``fn`` for this target on the shapes of ``args`` (nothing runs).

    Args:
      fn: a function, or the result of `jax.jit` (whose static arguments,
        shardings and donation are then respected).
      *args, **kwargs: arrays or `jax.ShapeDtypeStruct` pytrees, placed on
        the target by `place`. For a compile-only GPU, leaves whose sharding
        has memory kind ``"pinned_host"`` (arrays put there, or abstract ones
        from `in_host_memory`) stay in host memory: the step is then lowered
        for CUDA on this process's CPU devices, which know host memory, and
        compiled for the target (a `HostArgumentsCompiled`).
      donate_argnums: for a plain ``fn``, the arguments to donate.
      compiler_options: XLA options for this compilation, over the target's
        own (`compiler_options`).
      mesh: where to place the arguments (see `place`).
    """
    lowered = self.lower(fn, *args, donate_argnums=donate_argnums, mesh=mesh, **kwargs)
    return self.compile_lowered(lowered, compiler_options)

  def compile_lowered(self, lowered: jax.stages.Lowered, compiler_options: dict | None = None
                      ) -> "jax.stages.Compiled | HostArgumentsCompiled":
    """Compiles what `lower` gave, with the target's options and ``compiler_options``."""
    options = self.compiler_options(compiler_options)
    if self.deviceless and _HOST_ARGUMENT.search(lowered.as_text()):
      # Compiled outside jax: the jit's own compiler_options (which jax adds) added here, from
      # a private attribute (jax 0.10.2 to 0.12; test_targets fails if it moves).
      own = dict(getattr(getattr(lowered, "_lowering", None), "_compiler_options_kvs", ()))
      return HostArgumentsCompiled(self, lowered, {**own, **options})
    return lowered.compile(compiler_options=options)

  def save(self, path: str | os.PathLike) -> None:
    """Writes this target's config (text ``GpuTargetConfigProto``) to ``path``."""
    if not self.deviceless:
      raise ValueError(f"target {self.name} has no config to save (platform {self.platform}); "
                       "use from_devices() on a GPU.")
    pathlib.Path(path).write_text(self.config)


class HostArgumentsCompiled:
  """A program compiled for a compile-only GPU with some arguments in host memory.

  Compile-only devices have no memories, so JAX drops a ``pinned_host``
  memory kind from their shardings; `Target.compile` lowers such a step on
  the CPU devices for CUDA and compiles the StableHLO for the target's
  device. The memory analysis splits device and host bytes
  (``host_argument_size_in_bytes``, ...) as a GPU's would.
  """

  def __init__(self, target: "Target", lowered: jax.stages.Lowered, options: dict):
    self._executable = _jax.compile_stablehlo(target.devices(1)[0],
                                              lowered.compiler_ir("stablehlo"), options)

  def memory_analysis(self) -> Any:
    """XLA's ``CompiledMemoryStats``, host bytes apart."""
    return self._executable.get_compiled_memory_stats()

  def cost_analysis(self) -> Any:
    """Not given by a compile-only GPU: `lowmem_jax.compile.memory.flops_of` counts the lowered
    program's instead."""
    raise NotImplementedError("a compile-only GPU gives no cost analysis; count the lowered "
                              "program's FLOPs.")

  def as_text(self) -> str:
    """The optimised HLO; ``S(5)`` in a layout marks host memory."""
    return self._executable.hlo_modules()[0].to_string()


_HOST_ARGUMENT = re.compile(r'func\.func public @main\([^\n]*mhlo\.memory_kind = "(?!device")')


def _memory_kind(x: Any) -> str | None:
  return getattr(getattr(x, "sharding", None), "memory_kind", None)


def _in_host_memory(tree: Any) -> bool:
  return any(_memory_kind(x) not in (None, "device") for x in jax.tree.leaves(tree))


def _on_cpu(x: Any) -> Any:
  """An array leaf as a `jax.ShapeDtypeStruct` on the first CPU device, in its memory kind."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    return x
  sharding = getattr(x, "sharding", None)
  if sharding is not None and len(sharding.device_set) > 1:
    raise ValueError("arguments in host memory compile for one target device; got an argument "
                     f"sharded over {len(sharding.device_set)} devices.")
  cpu = _sharding.one_device(jax.devices("cpu")[0], _memory_kind(x))
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu)


def names() -> tuple[str, ...]:
  """The shipped compile-only GPUs, and ``"cpu"``."""
  shipped = sorted(p.name[:-len(".txtpb")] for p in _CONFIGS.iterdir() if p.name.endswith(".txtpb"))
  return (*shipped, "cpu")


def shipped_for(device_kind: str) -> str | None:
  """The shipped target of the GPU whose device kind (CUDA's name, ``jax.Device.device_kind``)
  is ``device_kind``: ``"h200"`` for ``"NVIDIA H200"``; None where none is shipped."""
  kinds = {n: _DEVICE_KIND.search(_CONFIGS.joinpath(f"{n}.txtpb").read_text()).group(1)
           for n in names() if n != "cpu"}
  return next((n for n, kind in kinds.items() if kind == device_kind), None)


def get(name: str, *, autotune_results: str | None = None) -> Target:
  """The target ``name``: a shipped GPU (see `names`), ``"cpu"``, or
  ``"attached"`` (this process's devices).

  Args:
    autotune_results: for a GPU, a file of XLA autotune results to compile
      with (``xla_gpu_load_autotune_results_from``).

  Raises:
    ValueError: an unknown name; the message lists the known ones.
  """
  if name == "cpu":
    return Target("cpu", "cpu", "CPU (XLA's CPU pipeline)", None)
  if name == "attached":
    return attached()
  if name not in names():
    raise ValueError(f"unknown target {name!r}; known: {', '.join(names())}, attached, or "
                     "targets.load(path) for a config file of your own.")
  return _from_config((_CONFIGS / f"{name}.txtpb").read_text(), name, autotune_results)


def load(path: str | os.PathLike, *, name: str | None = None,
         autotune_results: str | None = None) -> Target:
  """A compile-only GPU from a config file (`Target.save`, or one of XLA's
  ``gpu_specs/*.txtpb``); ``name`` defaults to the file's stem."""
  path = pathlib.Path(path)
  return _from_config(path.read_text(), name or path.stem, autotune_results)


def attached() -> Target:
  """The first device this process runs on, compiled for as usual (with
  autotuning on a GPU)."""
  device = jax.devices()[0]
  limit = (device.memory_stats() or {}).get("bytes_limit") if device.platform != "cpu" else None
  platform = "cuda" if device.platform == "gpu" else device.platform
  return Target("attached", platform, device.device_kind, limit)


def from_devices(name: str = "local") -> Target:
  """A compile-only target with the config of the GPU this process runs on,
  to `Target.save` for compiling later on a machine without one."""
  if jax.default_backend() != "gpu":
    raise ValueError(f"from_devices needs a GPU; JAX's backend is {jax.default_backend()!r}.")
  return _from_config(_jax.attached_config(jax.devices()), name, None)


def available() -> str | None:
  """None where compile-only GPU targets can compile here, else why not."""
  if not any(_installed(f"jax_plugins.xla_cuda{v}") for v in (12, 13)):
    return f"JAX's CUDA plugin is not installed ({INSTALL})"
  if _ptxas() is None:
    return f"no ptxas found on PATH or in the nvidia-cuda-nvcc wheel ({INSTALL})"
  return None


def _installed(module: str) -> bool:
  """Whether ``module`` can be imported; False, not an error, where its parent package is
  missing too (a JAX with no plugin at all has no ``jax_plugins``)."""
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:
    return False


def default() -> Target:
  """The GPU this process runs on; else ``"h100"`` where `available`; else the CPU."""
  if jax.default_backend() == "gpu":
    return attached()
  if available() is None:
    return get("h100")
  return get("cpu")


def resolve(target: "Target | str | None") -> Target:
  """A `Target` from a target, a name for `get`, or None for `default`."""
  if target is None:
    return default()
  if isinstance(target, Target):
    return target
  if isinstance(target, str):
    return get(target)
  raise TypeError(f"target must be a Target, a name or None, got {type(target).__name__}.")


@contextlib.contextmanager
def compiling(target: Target):
  """Within the block, `compiling_for` answers for ``target``: ``"gpu"`` for a
  GPU target (for a user who lowers with ``jax.jit(...).lower`` on
  `Target.place`'d arguments). Ops that choose an implementation
  (`lowmem_jax.ops.dispatch`, `lowmem_jax.attention`) decide by it, so a compile
  for the H100 target takes the GPU paths on a machine without a GPU."""
  with contextlib.ExitStack() as stack:
    stack.enter_context(dispatch.compiling_for_platform(
        "gpu" if target.platform == "cuda" else target.platform,
        functools.partial(_cudnn_refusal, target.config) if target.deviceless else None))
    if target.deviceless:
      stack.enter_context(_jax.abstract_device(_pallas_device_kind(target)))
    yield target


# Pallas' Triton lowering knows a GPU by its device kind, from a list of its own, only to
# take the architecture from it: a target whose kind is not on that list (RTX A6000, L40S)
# is named by a listed GPU of the same compute capability.
_PALLAS_KIND_BY_CAPABILITY = {(7, 5): "Tesla T4", (8, 0): "NVIDIA A100", (8, 6): "NVIDIA A10",
                              (8, 9): "NVIDIA L4", (9, 0): "NVIDIA H100", (10, 0): "NVIDIA B200"}


def _pallas_device_kind(target: Target) -> str:
  return _PALLAS_KIND_BY_CAPABILITY.get(target.compute_capability, target.device_kind)


_COMPUTE_CAPABILITY = re.compile(
    r"cuda_compute_capability\s*\{\s*major:\s*(\d+)(?:\s+minor:\s*(\d+))?")
_DEVICE_KIND = re.compile(r'^device_description_str:\s*"([^"]*)"', re.M)
_BANDWIDTH = re.compile(r"^\s*memory_bandwidth:\s*(\d+)", re.M)
_MEMORY = re.compile(r"^\s*device_memory_size:\s*(\d+)", re.M)


def _from_config(config: str, name: str, autotune_results: str | None) -> Target:
  kind, memory = _DEVICE_KIND.search(config), _MEMORY.search(config)
  if kind is None or memory is None or "gpu_device_info" not in config:
    raise ValueError(f"target {name!r}: not a text GpuTargetConfigProto (needs gpu_device_info, "
                     "device_memory_size and device_description_str).")
  if autotune_results is not None and not os.path.isfile(autotune_results):
    raise ValueError(f"autotune_results: no file at {autotune_results!r}.")
  return Target(name, "cuda", kind.group(1), int(memory.group(1)), config, autotune_results)


CUDA13_OLDEST_CAPABILITY = (7, 5)
"""The oldest GPU CUDA 13 compiles for (sm_75, Turing): it dropped Maxwell, Pascal and Volta.
JAX's CUDA 12 plugin, the last for jax 0.12.0.1, still compiles for the V100 (sm_70)."""


def _check_cuda_compiles_for(target: Target) -> None:
  """Raises `TargetUnavailable` for a GPU older than CUDA 13's oldest where JAX's CUDA 12 plugin
  is not installed: ptxas would refuse it deep in XLA's compile."""
  capability = target.compute_capability
  if (capability is not None and capability < CUDA13_OLDEST_CAPABILITY
      and not _installed("jax_plugins.xla_cuda12") and _installed("jax_plugins.xla_cuda13")):
    raise TargetUnavailable(
        f"target {target.name} ({target.device_kind}) is sm_{capability[0]}{capability[1]}, "
        "which CUDA 13 (JAX's CUDA 13 plugin, installed here) no longer compiles for. JAX's "
        "CUDA 12 plugin does (its newest is for jax 0.12.0.1): pip install "
        "'jax[cuda12-local]<0.12.1' nvidia-cuda-nvcc-cu12 nvidia-cudnn-cu12.")


def cudnn_refusal(target: Target) -> str | None:
  """Why XLA here cannot compile cuDNN's fused attention for ``target``, a compile-only GPU
  (`_cudnn_refusal`); None where it can, and for any other target."""
  return _cudnn_refusal(target.config) if target.deviceless else None


@functools.lru_cache(maxsize=None)
def _cudnn_refusal(config: str) -> str | None:
  """None where XLA here compiles cuDNN's fused attention for the compile-only GPU of
  ``config``, else XLA's reason, the first line of its error. A probe: one small attention
  compiled, once a process. jax 0.12.1's XLA builds the cuDNN graph while it compiles, and
  cuDNN's runtime-compiled engines load the CUDA driver (libcuda), absent without a GPU."""
  device = jax.sharding.SingleDeviceSharding(_compile_only_devices(config, 1)[0])
  q = jax.ShapeDtypeStruct((1, 128, 1, 64), jax.numpy.bfloat16, sharding=device)
  attend = jax.jit(lambda q: jax.nn.dot_product_attention(q, q, q, implementation="cudnn"))
  try:
    attend.lower(q).compile({**DEVICELESS_OPTIONS, **UNRUN_CODE_OPTIONS})
  except RuntimeError as e:  # XLA's refusal; JAX's where it finds no cuDNN
    return str(e).split("\n", 1)[0]
  return None


@functools.lru_cache(maxsize=None)
def _compile_only_devices(config: str, count: int) -> tuple:
  why = available()
  if why is not None:
    raise TargetUnavailable(f"cannot compile for a GPU target here: {why}.")
  from jax.experimental import topologies
  try:
    topology = topologies.get_topology_desc(platform="cuda", target_config=config,
                                            topology=f"1x1x{count}")
  except NotImplementedError as e:
    raise TargetUnavailable(
        "JAX's CUDA plugin is installed but did not register: JAX looked for its plugins before "
        "lowmem_jax was imported, and the plugin's CUDA check needs a driver. Import lowmem_jax "
        "before the first jax.devices() call, or set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 (or "
        "JAX_PLATFORMS=cpu) before Python starts.") from e
  return tuple(topology.devices)


def _ptxas() -> str | None:
  """ptxas on PATH, in NVIDIA's nvcc wheel (CUDA 13's layout or 12's) or in /usr/local/cuda."""
  found = shutil.which("ptxas")
  if found:
    return found
  nvidia = importlib.util.find_spec("nvidia") if _installed("nvidia") else None
  wheels = [pathlib.Path(p) for p in nvidia.submodule_search_locations] if nvidia else []
  roots = [wheel / layout for wheel in wheels for layout in ("cu13", "cuda_nvcc")]
  roots.append(pathlib.Path("/usr/local/cuda"))
  for root in roots:
    if (root / "bin" / "ptxas").is_file():
      return str(root / "bin" / "ptxas")
  return None
