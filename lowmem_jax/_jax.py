"""The one place where lowmem-jax meets JAX below its public API, or where JAX's API differs
between the versions the project supports (jax 0.10.2 to the newest release).

Every reach into ``jax._src`` and every difference between JAX versions lives here, each
with what needs it and what would retire it; the rest of the project imports these names.
The tests run on both ends of the range (`.ci/run`).

* `scan_counts`: a scan equation's consts and carry counts. jax 0.10 gives ``num_consts``
  and ``num_carry``; jax 0.11 and later give ``ft_in``/``ft_out`` groups. Retire the first
  branch when the lower bound reaches 0.11.
* `COST_ANALYSIS_ERRORS`: what ``Compiled.cost_analysis`` raises for a compile-only
  device: `NotImplementedError` up to jax 0.10, `jax.errors.JaxRuntimeError` from 0.11.
* `abstract_device`: Pallas' Triton lowering reads the GPU it compiles for from the default
  device; with none (a compile-only target) it reads the abstract mesh's
  `jax.sharding.AbstractDevice` (jax 0.11 and later require it).
* `OWN_HOST_TRANSFER_STREAMS`: XLA runs each transfer to or from host memory on a stream of
  its own each way from jaxlib 0.12; before, the transfers take turns with the other
  asynchronous starts on XLA's four compute streams (`lowmem_jax.compile.memory.streams`).
  Retire when the lower bound reaches 0.12.
* Private, no public API yet: `source_info_util` (an equation's traceback and name stack,
  which `lm.lowmem` keeps on what it rebinds and reports lines from), `eval_context` (a
  pattern evaluated on concrete test points while its function is traced; jax 0.12's
  `jax.ensure_compile_time_eval` only folds constants, it no longer leaves the trace),
  `saved_residuals`
  (what `jax.ad_checkpoint.print_saved_residuals` prints, as data), `hlo_cost_analysis`
  and `hlo_module_from_text` (XLA's HLO cost analysis on the host, for a compile-only
  target's FLOPs), `compile_stablehlo` (a program compiled for a compile-only device with
  arguments in host memory, which `jax.jit` cannot place there), `attached_config` (the
  attached GPU's target config) and `tracing` (whether a function is being traced, where
  `jax.set_mesh` is refused: the layer-streamed state's ``init``).
"""

import contextlib
from typing import Any

import jax
import jaxlib.version
from jax._src import ad_checkpoint as _ad_checkpoint
from jax._src import core as _core
from jax._src import compiler as _compiler
from jax._src.core import eval_context  # noqa: F401  (re-exported: see the module docstring)
from jax._src import source_info_util  # noqa: F401  (re-exported: see the module docstring)
from jax._src.lib import _jax as _xla
from jax._src.lib import hlo as _hlo
from jax._src.lib import xla_client as _xla_client

OWN_HOST_TRANSFER_STREAMS = jaxlib.version.__version_info__ >= (0, 12)
"""Whether the installed XLA runs host transfers on streams of their own: the strings of
jax-cuda12-plugin 0.12.0.1 name ``MemcpyStreamId``, those of 0.10.2 and 0.11.2 do not."""
COST_ANALYSIS_ERRORS = (NotImplementedError, jax.errors.JaxRuntimeError)
"""What a compiled program's ``cost_analysis()`` raises where its backend gives none."""


def tracing() -> bool:
  """Whether JAX is tracing a function now (``jax.jit``, ``jax.eval_shape``, ``jax.vmap``):
  arrays the function closes over are concrete there, yet ``jax.set_mesh`` is refused."""
  return not _core.trace_state_clean()


def scan_counts(params: dict) -> tuple[int, int]:
  """``(num_consts, num_carry)`` of a ``scan`` equation's ``params``: its body reads consts,
  then carry, then xs, and writes carry, then ys, in both forms."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(carry)


@contextlib.contextmanager
def abstract_device(device_kind: str):
  """Within the block, Pallas' Triton lowering compiles for the GPU ``device_kind`` (as
  ``"NVIDIA H100 80GB HBM3"``): an empty abstract mesh that names the device, so no
  sharding changes. Where a mesh is already set, it is left as it is."""
  if not jax.sharding.get_abstract_mesh().empty:
    yield
    return
  device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
    yield


def saved_residuals(fn, *args, **kwargs) -> list[tuple[Any, str]]:
  """``(aval, source)`` of each array autodiff saves for ``fn``'s backward at ``args``."""
  return _ad_checkpoint.saved_residuals(fn, *args, **kwargs)


def hlo_module_from_text(text: str) -> Any:
  """An XLA HLO module parsed from its text."""
  return _hlo.hlo_module_from_text(text)


def hlo_cost_analysis(module: Any) -> dict:
  """XLA's HLO cost analysis of ``module`` (an HLO module, before optimisation) on the host."""
  return _xla.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)


def compile_stablehlo(device: Any, module: Any, options: dict) -> Any:
  """``module`` (StableHLO) compiled for ``device`` alone with the XLA ``options``: an
  executable with ``get_compiled_memory_stats()`` and ``hlo_modules()``."""
  compile_options = _compiler.get_compile_options(
      num_replicas=1, num_partitions=1, device_assignment=[device],
      env_options_overrides=options)
  return _compiler.backend_compile_and_load(
      device.client, module, _xla_client.DeviceList((device,)), compile_options, [])


def attached_config(devices: list) -> str:
  """The text ``GpuTargetConfigProto`` of the attached GPUs ``devices``."""
  return _xla_client.get_topology_for_devices(devices).target_config
