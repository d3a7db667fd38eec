"""Memory accounting for any JAX function, on abstract shapes.

Two figures, and this package is the only place the project takes them from
(`lowmem_jax.compile.memory.analysis`):

* `analyze`: XLA's buffer assignment of the function compiled for a target,
  by default the GPU the user trains on, compiled here without one
  (`lowmem_jax.compile.targets`), on `jax.ShapeDtypeStruct` pytrees if need be.
* `saved_residuals`: what autodiff keeps from the forward pass for the
  backward pass (``jax.vjp``'s residuals), backend-free: what papers count.

Beside them, the step's estimated time on the target, from the same compiled program
(`lowmem_jax.compile.memory.step_time`: each kernel's FLOPs and bytes at the target's speeds,
in XLA's schedule, calibrated against the real GPU measurements on record).

`report` (`lowmem_jax.compile.memory.breakdown`) puts both together for a training
step: the buffers live at the peak split into `COMPONENTS`, each with the op
and source line that made it, the live bytes over program order, and
autodiff's residuals by checkpoint name, and its estimated time. `explain_oom` says the same of a
step that does not fit. XLA's dumps, which the report reads, are parsed in
the private `lowmem_jax.compile.memory._xla_dump`.
"""

from lowmem_jax.compile.memory.analysis import (COLLECTIVES, MemoryStats, Residual, Residuals,
                                                analyze, aot_compile, collective_bytes, flops_of,
                                                loop_flops, saved_residuals, stats_of,
                                                step_flops, tree_bytes)
from lowmem_jax.compile.memory.breakdown import (COMPONENTS, ESTIMATED, Breakdown, Buffer,
                                                 explain_oom, report)
from lowmem_jax.compile.memory.step_time import StepTime

__all__ = [
    "COLLECTIVES", "COMPONENTS", "ESTIMATED", "Breakdown", "Buffer", "MemoryStats", "Residual",
    "Residuals", "StepTime", "analyze", "aot_compile", "collective_bytes", "explain_oom",
    "flops_of", "loop_flops", "report", "saved_residuals", "stats_of", "step_flops",
    "tree_bytes",
]
