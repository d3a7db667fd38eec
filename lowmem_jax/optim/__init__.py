"""AdamA, optimizer accumulation: micro-batch gradients fold straight into Adam's moments.

Three parts, each a module:

- `lowmem_jax.optim.accumulation`: AdamA as optax transformations (`adama`,
  `adamaw`, `MomentFold`, `on_kth_micro_step`).
- `lowmem_jax.optim.in_backward`: the moments folded inside the backward pass
  (`scan_layers`, `LayerMoments`, `FoldInBackward`).
- `lowmem_jax.optim.steps`: the train steps that drive them (`microbatch_step`,
  `train_step`), and the extra argument `COMPLETES_STEP` they pass.
- `lowmem_jax.optim.streamed`: the layer-streamed step (`layer_streamed` over a
  `LayerStack`, `lowmem_jax.optim.layer_stack`): any leaf-by-leaf optimizer applied
  inside the backward, one layer at a time, its state and the saved layer inputs on
  the device or the host.

References:
  Zhang et al., 2023, "Adam Accumulation to Reduce Memory Footprints of both
  Activations and Gradients for Large-scale DNN Training"
  (https://arxiv.org/abs/2305.19982).
"""

from lowmem_jax.optim.accumulation import (
                                           NU_SCALES,
                                           AdamAState,
                                           KthMicroStepState,
                                           MomentFold,
                                           adama,
                                           adamaw,
                                           find_adama_state,
                                           on_kth_micro_step,
)
from lowmem_jax.optim.in_backward import FoldInBackward, LayerMoments, scan_layers
from lowmem_jax.optim.layer_stack import LayerStack, LayerStreamed, StreamedState, with_hyperparams
from lowmem_jax.optim.per_leaf import check_per_leaf
from lowmem_jax.optim.steps import (
                                           COMPLETES_STEP,
                                           microbatch_step,
                                           takes_completes_step,
                                           train_step,
)
from lowmem_jax.optim.streamed import layer_streamed

__all__ = [
    "COMPLETES_STEP", "NU_SCALES", "AdamAState", "FoldInBackward", "KthMicroStepState",
    "LayerMoments", "LayerStack", "LayerStreamed", "MomentFold", "StreamedState", "adama",
    "adamaw", "check_per_leaf", "find_adama_state", "layer_streamed", "microbatch_step",
    "on_kth_micro_step", "scan_layers", "takes_completes_step", "train_step", "with_hyperparams",
]
