"""Pallas kernels of lowmem-jax, each tested against the library's pure-JAX reference.

- `activations`: ReGELU2/ReSiLU2/ReLU fused with packing their residual code;
- `norms`: MS-LayerNorm/MS-RMSNorm, one pass per row block each way;
- `pack`: the bit-packing layout every compressed residual uses;
- `adam8bit`: the 8-bit AdamW update of a bfloat16 leaf in one pass, written in place.

The references (and the packing layout) are the library's:
`lowmem_jax.ops._activation_reference`, `lowmem_jax.ops._norm_reference`,
`lowmem_jax.ops._packing`, `lowmem_jax.ops._lowbit_reference`; the activation and norm
modules re-export theirs. `Options` says how a kernel is compiled (interpret mode, block sizes,
warps); `lowmem_jax.ops.dispatch` chooses between a kernel and its reference (``impl=``).
"""

from pallas_kernels._blocks import Options

__all__ = ["Options"]
