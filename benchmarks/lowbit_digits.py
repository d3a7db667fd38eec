"""8-bit Adam and AdamA moments, and bfloat16 parameters, against float32 on scikit-learn's digits.

A 64-128-10 tanh MLP, full-batch steps on 4 of every 5 images (1,432 of
them, a multiple of k), validation loss on every 5th image, lr 1e-3, the
same initial parameters per seed. Rows: `optax.scale_by_adam`;
`lowmem_jax.scale_by_adam_8bit` rounding stochastically and to nearest
(``min_size=1024``, so both weight matrices are 8-bit); AdamA over 4
micro-batches with 32-bit and 8-bit moments; bfloat16 parameters (no float32
copy) with 8-bit moments, the new parameters rounded to nearest (plain
``optax.apply_updates``) or stochastically (`lowmem_jax.optim.lowbit.stochastic_rounding`).

    python benchmarks/lowbit_digits.py [--steps 150] [--seeds 3]
    python benchmarks/lowbit_digits.py --quick     # 2 steps, one seed: that it runs
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from rich.console import Console
from rich.table import Table

import lowmem_jax as lm

import _quick  # beside this script in benchmarks/

LR = 1e-3
# --quick: each optimizer's float32 row and its row with every switch (each compiles for seconds)
QUICK_ROWS = ("Adam, float32 moments", "Adam, 8-bit, bfloat16 params rounded stochastically",
              "AdamA k=4, 32-bit moments", "AdamA k=4, 8-bit, bfloat16 params rounded stochastically")


def data():
  """``(train, validation)``: each ``(images float32 [n, 64], labels int32 [n])``."""
  from sklearn.datasets import load_digits
  digits = load_digits()
  x, y = jnp.asarray(digits.data / 16.0, jnp.float32), jnp.asarray(digits.target)
  val = np.arange(len(y)) % 5 == 0
  return (x[~val][:1432], y[~val][:1432]), (x[val], y[val])


def init(seed: int) -> dict:
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w1": jax.random.normal(k1, (64, 128)) / 8, "b1": jnp.zeros(128),
          "w2": jax.random.normal(k2, (128, 10)) / 12, "b2": jnp.zeros(10)}


def loss(params, batch):
  """Mean cross-entropy; the forward runs in float32, as the images are, whatever the
  parameters' dtype (bfloat16 parameters are cast up)."""
  p = jax.tree.map(lambda a: a.astype(jnp.float32), params)
  h = jnp.tanh(batch[0] @ p["w1"] + p["b1"][None, :])
  return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] + p["b2"][None, :],
                                                          batch[1]).mean()


def validation_loss(tx: optax.GradientTransformation, seed: int, k: int = 1,
                    steps: int = 150, param_dtype=jnp.float32) -> float:
  """The validation loss after ``steps`` optimizer steps of ``tx`` over k micro-batches,
  the parameters kept in ``param_dtype``."""
  train, validation = data()
  step = jax.jit(lm.microbatch_step(loss, tx, k))
  params = jax.tree.map(lambda p: p.astype(param_dtype), init(seed))
  state = tx.init(params)
  for _ in range(steps):
    params, state, _ = step(params, state, train)
  return float(loss(params, validation))


def rows() -> dict:
  """``{row: (optimizer, k, parameter dtype)}``."""
  chain = lambda *txs: optax.chain(*txs[:1], optax.scale_by_learning_rate(LR), *txs[1:])
  adam8 = lambda: lm.scale_by_adam_8bit(min_size=1024)
  rounding = lm.lowbit.stochastic_rounding
  f32, bf16 = jnp.float32, jnp.bfloat16
  return {
      "Adam, float32 moments": (chain(optax.scale_by_adam()), 1, f32),
      "Adam, 8-bit, stochastic rounding": (chain(adam8()), 1, f32),
      "Adam, 8-bit, rounding to nearest": (
          chain(lm.scale_by_adam_8bit(min_size=1024, stochastic=False)), 1, f32),
      "Adam, 8-bit, bfloat16 params rounded to nearest": (chain(adam8()), 1, bf16),
      "Adam, 8-bit, bfloat16 params rounded stochastically": (
          chain(adam8(), rounding()), 1, bf16),
      "AdamA k=4, 32-bit moments": (lm.adamaw(LR, 4, weight_decay=0.0), 4, f32),
      "AdamA k=4, 8-bit moments": (lm.adamaw(LR, 4, weight_decay=0.0, state_bits=8), 4, f32),
      "AdamA k=4, 8-bit, bfloat16 params rounded stochastically": (
          optax.chain(lm.adamaw(LR, 4, weight_decay=0.0, state_bits=8), rounding()), 4, bf16),
  }


def seed_table(title: str, seeds: int) -> Table:
  """A table of one validation loss a seed, each row beside a reference row (`add_row`)."""
  table = Table(title=title)
  table.add_column("optimizer")
  for seed in range(seeds):
    table.add_column(f"seed {seed}", justify="right")
  return table


def add_row(table: Table, name: str, values: list[float], reference: list[float]) -> None:
  table.add_row(name, *(f"{v:.4f} ({(v - r) / r:+.2%})" for v, r in zip(values, reference)))


def main(argv=None):
  """Prints the table; returns ``{row: [validation loss of each seed]}``."""
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--quick", action="store_true",
                      help="2 steps, one seed, the rows " + "; ".join(QUICK_ROWS) + ": checks "
                           "that the script runs; its figures are not results")
  args = _quick.parse_args(parser, argv, dict(steps=2, seeds=1))
  table = seed_table(f"digits, validation loss after {args.steps} steps (relative to the "
                     "float32 row of the same optimizer)", args.seeds)
  base, found = {}, {}
  for name, (tx, k, dtype) in rows().items():
    if args.quick and name not in QUICK_ROWS:
      continue
    values = found[name] = [validation_loss(tx, seed, k, args.steps, dtype)
                            for seed in range(args.seeds)]
    add_row(table, name, values, base.setdefault(k, values))
  Console(width=160).print(table)
  return found


if __name__ == "__main__":
  main()
