"""lowmem-jax: train bigger JAX/Flax models on smaller accelerators.

The folders are the layers, lowest first; a module imports only from its own
folder and the ones before it (`tests/test_imports.py` checks it):

- the top level's own modules: `names` (the checkpoint-name vocabulary) and
  private helpers (`_jax`: the one place below JAX's public API);
- `ops/`: the functions with custom VJPs, their pure-JAX references, `dispatch`;
- `optim/`: optax pieces and train steps (AdamA, 8-bit moments, offload, sparse
  storage, dynamic sparsity, precision, the micro-batch and layer-streamed steps);
- `compile/`: what is measured on abstract shapes (targets, memory, remat
  policies, the planner);
- `transform/`: `lm.lowmem`, the jaxpr rewrite;
- `flax/`: the linen and NNX adapters, affine folding of pretrained parameters;
- `models/`: the reference models and their workloads;
- `app/`: the ``lowmem-jax`` command, which ``import lowmem_jax`` does not load.

The functions and transformations below import with the package; its modules
(``lm.linen``, ``lm.models``, ``lm.memory``, ...) import on first use, so
``import lowmem_jax`` loads neither Flax's module systems nor the Pallas kernels
nor the application.
"""

import importlib as _importlib

from lowmem_jax.compile.planner import BudgetError, Plan, plan
from lowmem_jax.ops.activations import approx_activation, regelu2, relu, resilu2
from lowmem_jax.ops.attention import attention, attention_reference
from lowmem_jax.ops.norms import ms_layer_norm, ms_rms_norm
from lowmem_jax.optim import MomentFold, adama, adamaw, microbatch_step
from lowmem_jax.optim.lowbit import adamw_8bit, scale_by_adam_8bit
from lowmem_jax.transform import Rewrite, Rewrites, lowmem

SUBMODULES = {
    "activations": "ops.activations", "affine_folding": "flax.affine_folding", "choices": "choices",
    "attention_ops": "ops.attention", "compress": "ops.compress", "dispatch": "ops.dispatch",
    "embedding": "ops.embedding", "linen": "flax.linen", "losses": "ops.losses",
    "lowbit": "optim.lowbit", "masked_sparsity": "optim.masked_sparsity",
    "memory": "compile.memory", "models": "models", "names": "names", "nnx": "flax.nnx",
    "norms": "ops.norms", "offload": "optim.offload", "optim": "optim",
    "planner": "compile.planner", "policies": "compile.policies", "precision": "optim.precision",
    "sparse": "optim.sparse", "targets": "compile.targets", "transform": "transform",
}
"""The library's modules, each ``lm.<name>`` (the module ``lowmem_jax.<path>``), imported on
first use."""


def __getattr__(name: str):
  if name in SUBMODULES:
    return _importlib.import_module(f"lowmem_jax.{SUBMODULES[name]}")
  raise AttributeError(f"module 'lowmem_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(__all__) | set(SUBMODULES))


__all__ = [
    "BudgetError", "MomentFold", "Plan", "Rewrite", "Rewrites", "adama", "adamaw", "adamw_8bit",
    "approx_activation", "attention", "attention_reference", "lowmem", "microbatch_step",
    "ms_layer_norm", "ms_rms_norm", "plan", "regelu2", "relu", "resilu2", "scale_by_adam_8bit",
]
