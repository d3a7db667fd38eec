"""lowmem-jax: train bigger JAX/Flax models on smaller accelerators."""

from lowmem_jax import fold, linen, memory, models, names, nnx, optim
from lowmem_jax.activations import approx_activation, regelu2, relu, resilu2
from lowmem_jax.norms import ms_layer_norm, ms_rms_norm
from lowmem_jax.optim import adama, adamaw, microbatch_step

__all__ = [
    "adama", "adamaw", "approx_activation", "fold", "linen", "memory", "microbatch_step",
    "models", "ms_layer_norm", "ms_rms_norm", "names", "nnx", "optim",
    "regelu2", "relu", "resilu2",
]
