"""lowmem-jax: train bigger JAX/Flax models on smaller accelerators."""

from lowmem_jax import fold, linen, memory, models, names, nnx
from lowmem_jax.activations import approx_activation, regelu2, relu, resilu2
from lowmem_jax.norms import ms_layer_norm, ms_rms_norm

__all__ = [
    "approx_activation", "fold", "linen", "memory", "models", "ms_layer_norm", "ms_rms_norm",
    "names", "nnx",
    "regelu2", "relu", "resilu2",
]
