"""Pallas kernels of lowmem-jax, each file beside its pure-JAX reference.

- `activations`: ReGELU2/ReSiLU2/ReLU fused with packing their residual code;
- `norms`: MS-LayerNorm/MS-RMSNorm, one pass per row block each way;
- `pack`: the bit-packing layout every compressed residual uses.

`lowmem_jax.dispatch` chooses between a kernel and its reference (``impl=``).
"""
