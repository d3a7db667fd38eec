"""Does a technique set train as AdamW does? Each technique added alone to float32 AdamW, and
the set `lowmem-jax plan` picks for Llama-3.1-8B on a 24 GB card, on the character LLaMA.

The model, corpus and batches of ``examples/llama_charlm.py`` (dim 128, 4 layers, 16
windows of 64 characters a step), AdamW at lr 1e-3 and weight decay 1e-4 (the CLI's),
``--steps`` steps from the initial parameters of each seed (the init key and the batches'
seed), the validation loss (nats a character, the example's 128 fixed windows) after the
last step. Every row starts from the same parameters: ``norm="ms"`` holds the RMSNorms'
scales as the plain model does. Rows:

  AdamW, float32            optax.adamw on jax.grad of the whole loss
  8-bit moments             lm.lowbit.adamw_8bit
  + bfloat16 parameters     the same, parameters in bfloat16 rounded stochastically
  bfloat16 compute          Llama(dtype=bfloat16), parameters and state float32
  attention                 attention="recompute": no L×L residual
  fused-ce                  loss="fused": the head's cross-entropy block by block
  ms-norm                   norm="ms": memory-sharing RMSNorms, their scales trained
  approx                    activation="approx": ReSiLU2, an approximate gradient
  plan's set (exact)        bf16+ms-norm+attention+fused-ce+8bit+bf16-params+stream:host+
                            offload-opt: the layer-streamed step, its state on the host
  the former set (approx)   the same with approx: all+fused-ce+8bit+bf16-params+...

    python benchmarks/fine_tune_ablation.py [--steps 200] [--seeds 3]
    python benchmarks/fine_tune_ablation.py --quick   # the quick model, 2 steps: that it runs
"""

import jax
import jax.numpy as jnp
import optax
import lowbit_charlm  # benchmarks/, beside this script: the data, the loop, the table

import lowmem_jax as lm
from lowmem_jax.models import Llama
from lowmem_jax.models.llama import layer_stack

LR, DECAY = 1e-3, 1e-4
EXACT_SET = dict(dtype=jnp.bfloat16, norm="ms", attention="recompute", loss="fused",
                 mlp_chunk_tokens=1024)
ROWS = {  # row: (Llama switches, optimizer, parameter dtype, streamed)
    "AdamW, float32": ({}, "adamw", jnp.float32, False),
    "8-bit moments": ({}, "8bit", jnp.float32, False),
    "8-bit moments, bfloat16 parameters": ({}, "8bit+sr", jnp.bfloat16, False),
    "bfloat16 compute": (dict(dtype=jnp.bfloat16), "adamw", jnp.float32, False),
    "attention": (dict(attention="recompute"), "adamw", jnp.float32, False),
    "fused-ce": (dict(loss="fused"), "adamw", jnp.float32, False),
    "ms-norm": (dict(norm="ms"), "adamw", jnp.float32, False),
    "approx": (dict(activation="approx"), "adamw", jnp.float32, False),
    "plan's set (exact), streamed, state on the host": (EXACT_SET, "8bit+sr", jnp.bfloat16, True),
    "the former set (approx), streamed, state on the host": (
        dict(EXACT_SET, activation="approx"), "8bit+sr", jnp.bfloat16, True),
}
QUICK_ROWS = ("AdamW, float32", "plan's set (exact), streamed, state on the host")


def optimizer(kind: str) -> optax.GradientTransformation:
  if kind == "adamw":
    return optax.adamw(LR, weight_decay=DECAY)
  eight = lm.lowbit.adamw_8bit(LR, weight_decay=DECAY)
  return optax.chain(eight, lm.lowbit.stochastic_rounding()) if kind == "8bit+sr" else eight


def validation_loss(row: str, seed: int, steps: int, data: tuple, config) -> float:
  """The row's validation loss after ``steps`` steps from seed ``seed``'s parameters."""
  switches, kind, param_dtype, streamed = ROWS[row]
  val = data[1]
  net = Llama(config, param_dtype=param_dtype, **switches)
  params = jax.jit(Llama(config).init)(jax.random.key(seed), val[:1, :-1])["params"]
  params = jax.tree.map(lambda p: p.astype(param_dtype), params)
  loss = lambda params, tokens: net.apply({"params": params}, tokens[:, :-1], tokens[:, 1:])
  tx = optimizer(kind)
  if streamed:
    layered = lm.optim.layer_streamed(layer_stack(net), tx, state="host", saved_inputs="host")
    state = layered.init(params)
    step = jax.jit(lambda p, s, t: layered.step(p, s, (t[:, :-1], t[:, 1:]))[:2],
                   donate_argnums=(0, 1))
  else:
    state = tx.init(params)

    @jax.jit
    def step(params, state, tokens):
      updates, state = tx.update(jax.grad(loss)(params, tokens), state, params)
      return optax.apply_updates(params, updates), state

  return lowbit_charlm.trained_loss(step, params, state, loss, seed, steps, data)


def main(argv=None):
  """Prints the table; returns ``{row: [validation loss of each seed]}``."""
  return lowbit_charlm.seed_rows(__doc__, list(ROWS), QUICK_ROWS, validation_loss, 200, argv)


if __name__ == "__main__":
  main()
