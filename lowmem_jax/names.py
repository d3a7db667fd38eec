"""The checkpoint-name vocabulary: the one registry of residual names.

Library functions and reference models tag their intermediate values with
`jax.ad_checkpoint.checkpoint_name` using these names, so remat policies and
memory reports can refer to them. Nothing else in the project spells them.
"""

BLOCK_IN = "block_in"  # input of a transformer block (the residual stream)
NORM_OUT = "norm_out"  # output y of a (memory-sharing) norm: also the next matmul's input
NORM_RSTD = "norm_rstd"  # float32 1/sigma per row, saved by the MS norms
QKV = "qkv"  # query, key and value projections
ATTN_PROBS = "attn_probs"  # softmax probabilities of attention
ATTN_OUT = "attn_out"  # attention output before the output projection
MLP_IN = "mlp_in"  # input of the MLP's first matmul
MLP_HIDDEN = "mlp_hidden"  # pre-activation of the MLP's hidden layer
ACT_CODE = "act_code"  # packed 1- or 2-bit code of an approximate activation

