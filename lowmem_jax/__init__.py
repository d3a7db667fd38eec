"""lowmem-jax: train bigger JAX/Flax models on smaller accelerators.

The functions and transformations below import with the package; its
submodules (``lm.linen``, ``lm.models``, ``lm.memory``, ...) import on first
use, so ``import lowmem_jax`` loads neither Flax's module systems nor the
Pallas kernels nor the ``lowmem-jax`` application (`lowmem_jax.app`).
"""

import importlib as _importlib

from lowmem_jax.activations import approx_activation, regelu2, relu, resilu2
from lowmem_jax.attention_ops import attention, attention_reference
from lowmem_jax.lowbit import adamw_8bit, scale_by_adam_8bit
from lowmem_jax.norms import ms_layer_norm, ms_rms_norm
from lowmem_jax.optim import MomentFold, adama, adamaw, microbatch_step
from lowmem_jax.planner import BudgetError, Plan, plan
from lowmem_jax.transform import Rewrite, Rewrites, lowmem

SUBMODULES = ("affine_folding", "attention_ops", "compress", "embedding", "linen", "losses",
              "lowbit", "masked_sparsity", "memory", "models", "names", "nnx", "offload", "optim",
              "policies", "precision", "sparse", "targets", "transform")
"""The library's modules, each ``lm.<name>``, imported on first use."""


def __getattr__(name: str):
  if name in SUBMODULES:
    return _importlib.import_module(f"lowmem_jax.{name}")
  raise AttributeError(f"module 'lowmem_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(__all__) | set(SUBMODULES))


__all__ = [
    "BudgetError", "MomentFold", "Plan", "Rewrite", "Rewrites", "adama", "adamaw", "adamw_8bit",
    "approx_activation", "attention", "attention_reference", "lowmem", "microbatch_step",
    "ms_layer_norm", "ms_rms_norm", "plan", "regelu2", "relu", "resilu2", "scale_by_adam_8bit",
]
