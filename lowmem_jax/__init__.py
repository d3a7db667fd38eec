"""lowmem-jax: train bigger JAX/Flax models on smaller accelerators."""

from lowmem_jax import (attention_ops, compress, embedding, fold, linen, losses, lowbit, memory,
                        models, names, nnx, offload, optim, policies, precision, sparse, sparsity,
                        targets,
                        techniques, transform)
from lowmem_jax.activations import approx_activation, regelu2, relu, resilu2
from lowmem_jax.attention_ops import attention, attention_reference
from lowmem_jax.lowbit import scale_by_adam_8bit
from lowmem_jax.norms import ms_layer_norm, ms_rms_norm
from lowmem_jax.optim import MomentFold, adama, adamaw, microbatch_step
from lowmem_jax.planner import Plan, plan
from lowmem_jax.transform import Rewrite, Rewrites, lowmem

__all__ = [
    "MomentFold", "Plan", "Rewrite", "Rewrites", "adama", "adamaw", "approx_activation", "attention", "attention_ops",
    "attention_reference", "compress", "embedding",
    "fold", "linen", "losses", "lowbit", "lowmem", "memory", "microbatch_step", "models", "ms_layer_norm", "ms_rms_norm", "names",
    "nnx", "offload", "optim", "plan", "policies", "precision", "regelu2", "relu", "resilu2", "scale_by_adam_8bit",
    "sparse", "sparsity",
    "targets", "techniques", "transform",
]
