"""Pallas kernels of lowmem-jax, each file beside its pure-JAX reference.

`pack` holds the bit-packing layout every compressed residual uses.
"""
