"""AdamA against Adam with gradient accumulation on scikit-learn's digits.

A small MLP (64 -> 256 -> 10) trained with batches of 64 split into k = 4
micro-batches of 16, the same steps and learning rate for every optimizer:

  adam+accumulation  optax.adam on the mean of the k micro-batch gradients
  adama mean_sq      lowmem_jax.adama(k, nu_scale="mean_sq")
  adama mean         lowmem_jax.adama(k, nu_scale="mean")

It prints the held-out accuracy every --every steps, averaged over --seeds
seeds, and the final accuracies; --out writes the curves as a Markdown table.

    pip install -e ".[examples]"
    python examples/adama_digits.py --out docs/adama_digits.md
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import lowmem_jax as lm


def data(seed):
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  return train_test_split(x, digits.target.astype(np.int32), test_size=0.2, random_state=seed,
                          stratify=digits.target)


def init(rng, hidden=256):
  k1, k2 = jax.random.split(rng)
  return {"w1": jax.random.normal(k1, (64, hidden)) * np.sqrt(2 / 64), "b1": jnp.zeros(hidden),
          "w2": jax.random.normal(k2, (hidden, 10)) * np.sqrt(1 / hidden), "b2": jnp.zeros(10)}


def logits(params, x):
  return jax.nn.relu(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def loss(params, batch):
  x, y = batch
  return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()


def optimizers(k, lr):
  return {
      "adam+accumulation": optax.adam(lr),
      "adama mean_sq": optax.chain(lm.adama(k, nu_scale="mean_sq"), optax.scale_by_learning_rate(lr)),
      "adama mean": optax.chain(lm.adama(k, nu_scale="mean"), optax.scale_by_learning_rate(lr)),
  }


def train(tx, k, seed, steps, batch, every):
  x_train, x_test, y_train, y_test = data(seed)
  params = init(jax.random.key(seed))
  state = tx.init(params)
  step = jax.jit(lm.microbatch_step(loss, tx, k), donate_argnums=(0, 1))
  accuracy = jax.jit(lambda p: jnp.mean(jnp.argmax(logits(p, x_test), -1) == y_test))
  order = np.random.default_rng(seed)
  indices = np.empty(0, np.int64)
  curve = []
  for i in range(1, steps + 1):
    if len(indices) < batch:
      indices = np.concatenate([indices, order.permutation(len(x_train))])
    take, indices = indices[:batch], indices[batch:]
    params, state, _ = step(params, state, (x_train[take], y_train[take]))
    if i % every == 0:
      curve.append(float(accuracy(params)))
  return curve


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--k", type=int, default=4)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--every", type=int, default=50)
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--out", help="write the curves to this Markdown file")
  args = parser.parse_args()
  curves = {}
  runs = [(name, tx, seed) for name, tx in optimizers(args.k, args.lr).items()
          for seed in range(args.seeds)]
  for name, tx, seed in tqdm(runs, desc="training"):
    curves.setdefault(name, []).append(train(tx, args.k, seed, args.steps, args.batch, args.every))
  mean = {name: np.mean(c, axis=0) for name, c in curves.items()}
  steps = [args.every * (i + 1) for i in range(len(next(iter(mean.values()))))]
  lines = [f"Held-out accuracy on digits, mean of {args.seeds} seeds; batch {args.batch} as "
           f"k={args.k} micro-batches, lr {args.lr} (`python examples/adama_digits.py`).", "",
           "| step | " + " | ".join(mean) + " |", "|---:|" + "---:|" * len(mean)]
  for i, s in enumerate(steps):
    lines.append(f"| {s} | " + " | ".join(f"{m[i]:.4f}" for m in mean.values()) + " |")
  base = mean["adam+accumulation"][-1]
  lines += ["", "Final accuracy, each seed, and the gap to Adam with accumulation (mean):", ""]
  for name, c in curves.items():
    finals = ", ".join(f"{run[-1]:.4f}" for run in c)
    lines.append(f"- {name}: {finals}; gap {mean[name][-1] - base:+.4f}")
  text = "\n".join(lines)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()
