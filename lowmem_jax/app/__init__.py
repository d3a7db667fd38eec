"""The ``lowmem-jax`` application, on top of the library.

`techniques` declares each technique once and parses technique sets; `job` says what a
set is measured on (a reference model, or a step of the user's own); `measurement`
compiles one set's step and reads its memory; `fits` walks the sets cheapest first to
the first that fits a budget; `code` prints the Python that builds a step; `cli` is the
``lowmem-jax`` command (``report`` and ``plan``). ``import lowmem_jax`` does not load this
package: the command does, and so does whoever imports it.

    from lowmem_jax import app
    job = app.Job("llama-1b", batch=8, seq=2048, target="h100")
    b = app.measure(job, app.parse("all+fused-ce"))
"""

from lowmem_jax.app.fits import Fit, cheapest_fit, ladder, ladder_of, planned
from lowmem_jax.app.job import FSDP, Job, fsdp_spec
from lowmem_jax.app.measurement import (
                                        arguments,
                                        check,
                                        device_argument_bytes,
                                        measure,
                                        row,
                                        user_step,
)
from lowmem_jax.app.techniques import TECHNIQUES, TechniqueError, TechniqueSet, parse

__all__ = ["FSDP", "Fit", "Job", "TECHNIQUES", "TechniqueError", "TechniqueSet", "arguments",
           "cheapest_fit", "check", "device_argument_bytes", "fsdp_spec", "ladder", "ladder_of",
           "measure", "parse", "planned", "row", "user_step"]
