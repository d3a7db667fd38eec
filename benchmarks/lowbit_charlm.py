"""8-bit Adam moments and bfloat16 parameters against float32 Adam on the character LLaMA.

The model, corpus and batches of ``examples/llama_charlm.py`` (dim 128, 4
layers, float32 compute, 16 windows of 64 characters a step, lr 1e-3, every
matrix 8-bit: at least 4,096 elements), ``--steps`` steps from the initial
parameters of each seed (the init key and the batches' seed); the validation
loss (nats a character, the example's 128 fixed windows) after the last step.
Rows: `optax.adam`; `lowmem_jax.scale_by_adam_8bit`; the same with bfloat16
parameters and no float32 copy, the new parameters rounded to nearest (plain
``optax.apply_updates``) or stochastically (`lowmem_jax.optim.lowbit.stochastic_rounding`).

    python benchmarks/lowbit_charlm.py [--steps 800] [--seeds 3]
    python benchmarks/lowbit_charlm.py --quick     # the example's quick model, 2 steps: that it runs
"""

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from lowbit_digits import add_row, seed_table  # benchmarks/, beside this script
from rich.console import Console

import lowmem_jax as lm
from lowmem_jax.models import Llama

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import llama_charlm  # noqa: E402  (examples/ is not a package)

import _quick  # beside this script in benchmarks/

LR = 1e-3
BATCH, SEQ = 16, 64
# --quick: the reference row and the one with every switch (each row compiles for seconds)
QUICK_ROWS = ("Adam, float32", "8-bit, bfloat16 params rounded stochastically")


def rows() -> dict:
  """``{row: (optimizer, parameter dtype)}``."""
  adam8 = lambda *rest: optax.chain(lm.scale_by_adam_8bit(), optax.scale_by_learning_rate(LR),
                                    *rest)
  return {
      "Adam, float32": (optax.adam(LR), jnp.float32),
      "Adam, 8-bit moments": (adam8(), jnp.float32),
      "8-bit, bfloat16 params rounded to nearest": (adam8(), jnp.bfloat16),
      "8-bit, bfloat16 params rounded stochastically": (
          adam8(lm.lowbit.stochastic_rounding()), jnp.bfloat16),
  }


def validation_loss(tx: optax.GradientTransformation, param_dtype, seed: int, steps: int,
                    data: tuple, config=llama_charlm.CONFIG) -> float:
  val = data[1]
  net = Llama(config)
  loss = lambda params, tokens: net.apply({"params": params}, tokens[:, :-1], tokens[:, 1:])
  params = jax.jit(net.init)(jax.random.key(seed), val[:1, :-1])["params"]
  params = jax.tree.map(lambda p: p.astype(param_dtype), params)
  state = tx.init(params)

  @jax.jit
  def step(params, state, tokens):
    grads = jax.grad(loss)(params, tokens)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return trained_loss(step, params, state, loss, seed, steps, data)


def trained_loss(step, params, state, loss, seed: int, steps: int, data: tuple) -> float:
  """``steps`` calls of ``step(params, state, tokens) -> (params, state)`` on seed ``seed``'s
  batches, then ``loss(params, tokens)`` averaged over the validation windows."""
  train, val = data
  for i in range(steps):
    tokens = llama_charlm.windows(train, BATCH, SEQ + 1, np.random.default_rng([seed, i]))
    params, state = step(params, state, tokens)
  evaluate = jax.jit(loss)
  return float(np.mean([evaluate(params, val[i:i + BATCH]) for i in range(0, len(val), BATCH)]))


def seed_rows(doc: str, names: list[str], quick_rows: tuple, loss_of, steps: int,
              argv=None) -> dict:
  """The command line of a script of this kind: each row's ``loss_of(name, seed, steps, data,
  config)`` for each seed, printed as a table against the first row's; returns
  ``{row: [validation loss of each seed]}``."""
  parser = argparse.ArgumentParser(description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=steps)
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--quick", action="store_true",
                      help="the example's quick model (dim 64, 2 layers), 2 steps, one seed, "
                           "16 validation windows of a 200,000-character corpus, the rows "
                           f"{' and '.join(quick_rows)}: checks that the script runs; its "
                           "figures are not results")
  args = _quick.parse_args(parser, argv, dict(steps=2, seeds=1))
  config = llama_charlm.QUICK_CONFIG if args.quick else llama_charlm.CONFIG
  train, validation, _ = llama_charlm.corpus(200_000 if args.quick else 4_000_000)
  val = llama_charlm.windows(validation, 16 if args.quick else 128, SEQ + 1,
                             np.random.default_rng(0))
  table = seed_table(f"character LLaMA, validation loss after {args.steps} steps (relative to "
                     f"{names[0]})", args.seeds)
  base, found = None, {}
  for name in names:
    if args.quick and name not in quick_rows:
      continue
    values = found[name] = [loss_of(name, seed, args.steps, (train, val), config)
                            for seed in range(args.seeds)]
    base = base or values
    add_row(table, name, values, base)
    Console(stderr=True).print(f"  {name}: done", highlight=False)
  Console(width=160).print(table)
  return found


def main(argv=None):
  """Prints the table; returns ``{row: [validation loss of each seed]}``."""
  table = rows()
  return seed_rows(__doc__, list(table), QUICK_ROWS,
                   lambda name, *run: validation_loss(*table[name], *run), 800, argv)


if __name__ == "__main__":
  main()
