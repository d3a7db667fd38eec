"""The third-party functions that promote dtypes implicitly, as ``standard_promotion`` marks.

conftest.py runs every test with strict dtype promotion and rank promotion
"raise"; a test (or a module, by ``pytestmark``) that runs one of these keeps
JAX's standard dtype promotion, with rank promotion still "raise". Each reason
names the function and the line that promotes, in the versions pyproject pins
(jax 0.10.2, flax 0.12.8, optax 0.2.8, jmp 0.0.4).
"""

import pytest

OPTAX_BIAS_CORRECTION = pytest.mark.standard_promotion(
    "optax.tree_utils.tree_bias_correction (optax/tree_utils/_tree_math.py:449): "
    "1 - decay**count raises a Python float to an int32 count; optax.scale_by_adam "
    "(optax.adam, adamw) calls it, and so do lowmem_jax's AdamA and 8-bit Adam")
OPTAX_UPDATE_MOMENT = pytest.mark.standard_promotion(
    "optax.tree_utils.tree_update_moment (optax/tree_utils/_tree_math.py:398): "
    "(1 - decay) * g + decay * t adds bfloat16 gradients to float32 moments")
OPTAX_APPLY_UPDATES = pytest.mark.standard_promotion(
    "optax.apply_updates (optax/_src/update.py:42): p + u adds float32 updates to "
    "bfloat16 parameters, then casts back")
FLAX_NORM = pytest.mark.standard_promotion(
    "flax.linen.normalization._compute_stats and _normalize (flax/linen/normalization.py:112, "
    "205, 214): nn.LayerNorm's and nn.RMSNorm's float32 statistics of bfloat16 inputs, "
    "jnp.promote_types(bfloat16, float32), then x - mean and the scale in mixed dtypes")
JMP_LOSS_SCALE = pytest.mark.standard_promotion(
    "jmp.DynamicLossScale.adjust (jmp/_src/loss_scale.py:167): an int32 counter times "
    "the bool grads_finite")
JAX_DOT_PRODUCT_ATTENTION = pytest.mark.standard_promotion(
    "jax.nn.dot_product_attention (jax/_src/nn/functions.py:928): "
    "jnp.promote_types(bfloat16, float32) for its float32 logits")
TRANSFORMERS_FLAX = pytest.mark.standard_promotion(
    "transformers' Flax GPT-2 and BERT (transformers/models/gpt2/modeling_flax_gpt2.py:235-236, "
    "models/bert/modeling_flax_bert.py): the int32 attention_mask meets the boolean causal mask "
    "in flax.linen.combine_masks (jnp.logical_and), and float arrays elsewhere")
