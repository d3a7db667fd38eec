"""Flax adapters: linen and NNX substitutes running the library's ops with Flax's
parameters, and affine folding of a pretrained norm into the next linear layer."""
