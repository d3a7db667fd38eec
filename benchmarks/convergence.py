"""Convergence of the memory-saving switches on real data: scikit-learn's digits.

Data: `sklearn.datasets.load_digits`, 1797 grayscale 8x8 images of 10 digits,
pixels scaled to [0, 1], shape [N, 8, 8, 1]; a fixed stratified split of
1437 training and 360 test images (``random_state=0``). Model: WRN-10-2
(`lowmem_jax.models.WideResNet(depth=10, widen=2)`; spatial sizes 8, 4, 2).

Every variant starts from the same initial params (``--seed``) and trains for
the same ``--steps`` on the same sequence of batches of ``--batch`` (epochs of
a seeded permutation) with Adam at the same fixed ``--lr``, batch norm in
training mode (batch statistics; the running averages are not carried). The
rows, one switch each unless stated:

  baseline         float32, exact ReLU, plain convs, optax.adam
  1bit-relu        activation="1bit": lowmem_jax.relu saves a 1-bit mask; exact gradient
  pooled-conv      conv="pooled": weight gradients from 2x2-average-pooled inputs
  int8-conv        conv="int8": conv inputs saved as int8 rows
  bf16             lowmem_jax.optim.precision.flax_dtypes("bfloat16"): float32 params, bfloat16 compute
  fp16+loss-scale  float16 compute, precision.loss_scaled_step with dynamic_loss_scale()
  sparse-0.2       optax.chain(adam, masked_sparsity.dynamic_sparsity(0.2, update_every=50))
  stored-0.2       WideResNet(density=0.2): the blocks' kernels stored sparse, trained with
                   sparse.sparse_storage(adam, update_every=50) (a budget per kernel)
  adama-k4         lowmem_jax.microbatch_step with chain(adama(4), scale_by_learning_rate):
                   4 micro-batches of 16, so batch norm normalises per micro-batch
  remat            remat=True on every block; exact
  all              approx + pooled + bf16 + sparse-0.2 + adama-k4 + remat; dynamic_sparsity
                   under optax.conditionally_transform so that it counts optimizer steps
                   (the adama docstring's rule for per-step transformations)

Evaluation is the same for every variant: float32 compute, exact ReLU and
plain convs (the switches change only what the backward pass sees), and
"precise" batch-norm statistics recomputed from the trained params: one
forward pass in training mode over all 1437 training images as one batch,
so every batch norm normalises with, and records, the mean and (biased)
variance of its input over the whole training set. Flax's running averages
start at zero there, so each is (1 - momentum) times the statistic; dividing
by (1 - momentum) gives it. Micro-batching (whose running averages would
average micro-batch statistics) is thus judged on the same footing.

Per variant it reports the mean training loss of the last 50 steps, the test
accuracy and its difference from the baseline's in percentage points; for the
exact variants the largest difference of the final params from the
baseline's, for fp16 the skipped (non-finite) steps and the final loss scale,
for the sparse ones the share of kernel entries active in the masks and the
share nonzero: where the last step is a multiple of 50 it has just moved 20%
of the active entries, regrown at zero, so only 80% of them are nonzero.

    python benchmarks/convergence.py                 # writes docs/convergence_digits.md
    python benchmarks/convergence.py --quick         # smoke test: 2 steps, 3 rows; prints only
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import tree_utils as otu
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import lowmem_jax as lm
from lowmem_jax.models import WideResNet, Workload
from lowmem_jax.models.wrn import BN_MOMENTUM

import _quick  # beside this script in benchmarks/

VARIANTS = {
    "baseline": {},
    "1bit-relu": dict(activation="1bit"),
    "pooled-conv": dict(conv="pooled"),
    "int8-conv": dict(conv="int8"),
    "bf16": dict(policy="bfloat16"),
    "fp16+loss-scale": dict(policy="float16", loss_scale=True),
    "sparse-0.2": dict(density=0.2),
    "stored-0.2": dict(stored=0.2),
    "adama-k4": dict(k=4),
    "remat": dict(remat=True),
    "all": dict(activation="1bit", conv="pooled", policy="bfloat16", density=0.2, k=4,
                remat=True),
}
EXACT = ("1bit-relu", "remat")  # exact gradients: expected to match the baseline
MODEL_SWITCHES = ("activation", "conv", "remat", "policy", "stored")
UPDATE_EVERY = 50  # steps between dynamic_sparsity's mask moves
TAIL = 50  # the final train loss is the mean over these last steps
# --quick: a smoke test (each variant compiles for seconds); its figures are not results.
QUICK = dict(steps=2, batch=8, variants=["baseline", "1bit-relu", "fp16+loss-scale"])
DEFAULT_OUT = "docs/convergence_digits.md"


def data():
  digits = load_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]
  return train_test_split(x, digits.target.astype(np.int32), test_size=360, random_state=0,
                          stratify=digits.target)


def batch_indices(n, steps, batch, seed):
  """``int[steps, batch]``: consecutive batches of epochs of a seeded permutation of ``n``."""
  order = np.random.default_rng(seed)
  epochs = -(-steps * batch // n)
  return np.concatenate([order.permutation(n) for _ in range(epochs)])[:steps * batch].reshape(
      steps, batch)


def model(activation="exact", conv="plain", remat=False, policy="float32", stored=None):
  return WideResNet(depth=10, widen=2, num_classes=10, activation=activation, conv=conv,
                    remat=remat, density=stored, **lm.precision.flax_dtypes(policy))


def optimizer(lr, k=1, density=None):
  tx = optax.adam(lr) if k == 1 else optax.chain(lm.adama(k), optax.scale_by_learning_rate(lr))
  if density is None:
    return tx
  sparse = lm.masked_sparsity.dynamic_sparsity(density, update_every=UPDATE_EVERY)
  if k > 1:  # it counts its calls: under AdamA, call it on each step's last micro-batch only
    sparse = optax.conditionally_transform(sparse, lambda micro_step: micro_step % k == k - 1)
  return optax.chain(tx, sparse)


def train(name, params, x, y, order, lr):
  """Trains a copy of ``params``; returns the final params, the step losses and notes."""
  switches = VARIANTS[name]
  k = switches.get("k", 1)
  net = model(**{key: switches[key] for key in MODEL_SWITCHES if key in switches})
  work = Workload(name, net, jax.ShapeDtypeStruct((order.shape[1], *x.shape[1:]), net.dtype),
                  jax.ShapeDtypeStruct((order.shape[1],), jnp.int32))
  tx = optimizer(lr, k, switches.get("density"))
  if "stored" in switches:  # the baseline's initial params at the positions kept
    dense = params
    tx = lm.sparse.sparse_storage(tx, dense, update_every=UPDATE_EVERY)
    positions = tx.init(jax.jit(net.init)(jax.random.key(0), x[:1])["params"]).positions
    params = lm.sparse.to_values(dense, positions)
  params = jax.tree.map(jnp.copy, params)  # the steps donate their params
  opt_state = tx.init(params)
  scale, skipped = None, 0
  if switches.get("loss_scale"):
    scale = lm.precision.dynamic_loss_scale()
    step = jax.jit(lm.precision.loss_scaled_step(lambda p, b: work.loss(p, *b), tx),
                   donate_argnums=(0, 1))
  else:
    step = jax.jit(work.train_step(tx, k), donate_argnums=(0, 1))
  losses = []
  for take in tqdm(order, desc=name):
    batch = (x[take], y[take])
    if scale is None:
      params, opt_state, metrics = step(params, opt_state, batch)
    else:
      params, opt_state, scale, metrics = step(params, opt_state, scale, batch)
      skipped += not bool(metrics["grads_finite"])
    losses.append(float(metrics["loss"]))
  notes = []
  if scale is not None:
    notes.append(f"{skipped} steps skipped (non-finite), final loss scale "
                 f"{float(scale.loss_scale):g}")
  if "density" in switches:
    kernels = [p for p in jax.tree.leaves(params) if p.ndim >= 2]
    size = sum(p.size for p in kernels)
    masks = [m for m in jax.tree.leaves(opt_state) if m.dtype == jnp.bool_]
    notes.append(f"kernel entries active {sum(int(m.sum()) for m in masks) / size:.1%}, "
                 f"nonzero {sum(int(jnp.count_nonzero(p)) for p in kernels) / size:.1%}")
  if "stored" in switches:
    positions = lm.sparse.find_state(opt_state).positions
    pairs = [(p, d) for p, d in zip(jax.tree.leaves(positions, is_leaf=lambda p: p is None),
                                    jax.tree.leaves(dense)) if p is not None]
    params = lm.sparse.to_dense(params, positions, dense)
    share = sum(p.size for p, _ in pairs) / sum(d.size for _, d in pairs)
    notes.append(f"block kernel entries stored {share:.1%} (the stem dense)")
  if k > 1:
    notes.append(f"batch norm per micro-batch of {order.shape[1] // k}")
  return params, losses, notes


def evaluator(net, zero_stats, x_train, x_test, y_test):
  """``accuracy(params)`` on the test set with precise batch-norm statistics (module docstring)."""
  @jax.jit
  def accuracy(params):
    _, new = net.apply({"params": params, "batch_stats": zero_stats}, x_train,
                       mutable=["batch_stats"])
    stats = jax.tree.map(lambda s: s / (1 - BN_MOMENTUM), new["batch_stats"])
    logits = net.apply({"params": params, "batch_stats": stats}, x_test, train=False)
    return jnp.mean(jnp.argmax(logits, -1) == y_test)
  return accuracy


def max_diff(a, b):
  return float(otu.tree_max(jax.tree.map(lambda u, v: jnp.abs(u - v), a, b)))


def main(argv=None):
  """Prints the table (and writes it to --out); returns ``{variant: (train loss, test
  accuracy %, notes)}``."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                      help="rows to run; the first is the reference for the differences")
  parser.add_argument("--quick", action="store_true",
                      help=f"{QUICK['steps']} steps of batch {QUICK['batch']}, the rows "
                           f"{' '.join(QUICK['variants'])}: a smoke test, its figures not results; "
                           "writes nothing unless --out")
  parser.add_argument("--out", help=f"the Markdown file to write (default {DEFAULT_OUT}, "
                                    "none with --quick)")
  args = _quick.parse_args(parser, argv, QUICK)
  steps = args.steps
  out = args.out or (None if args.quick else DEFAULT_OUT)
  start = time.perf_counter()
  x_train, x_test, y_train, y_test = data()
  net = model()
  variables = jax.jit(net.init)(jax.random.key(args.seed), x_train[:1])
  accuracy = evaluator(net, jax.tree.map(jnp.zeros_like, variables["batch_stats"]), x_train,
                       x_test, y_test)
  order = batch_indices(len(x_train), steps, args.batch, args.seed)
  results, finals = {}, {}
  for name in args.variants:
    params, losses, notes = train(name, variables["params"], x_train, y_train, order, args.lr)
    finals[name] = params
    if name in EXACT and "baseline" in finals:
      diff = max_diff(params, finals["baseline"])
      notes.insert(0, f"final params max abs diff vs baseline {diff:.2g}")
    results[name] = (np.mean(losses[-TAIL:]), 100 * float(accuracy(params)), notes)
  reference = results[args.variants[0]][1]
  lines = [
      f"Convergence on scikit-learn's digits (1797 8x8 images, 10 classes; pixels / 16): "
      f"stratified split of {len(x_train)} train / {len(x_test)} test images (random_state=0). "
      f"WRN-10-2 (`lowmem_jax.models.WideResNet(depth=10, widen=2)`), {steps} steps of batch "
      f"{args.batch}, the same initial params (seed {args.seed}) and batch sequence for every "
      f"variant, Adam at a fixed lr {args.lr:g} (AdamA with k = 4 for the micro-batched rows), "
      f"batch norm in training mode. Evaluation: float32, exact ReLU, plain convs, with precise "
      f"batch-norm statistics recomputed after training in one training-mode pass over all "
      f"{len(x_train)} training images (the same for every variant). JAX {jax.__version__}, "
      f"backend {jax.default_backend()}; {time.perf_counter() - start:.0f} s in all. One seed; "
      f"one test image is {100 / len(x_test):.2f} percentage points (pp).",
      "",
      f"| variant | train loss (last {min(TAIL, steps)} steps) | test accuracy (%) | "
      f"vs {args.variants[0]} (pp) | notes |",
      "|---|---:|---:|---:|---|",
  ]
  for name, (loss, acc, notes) in results.items():
    lines.append(f"| {name} | {loss:.4f} | {acc:.2f} | {acc - reference:+.2f} | "
                 f"{'; '.join(notes)} |")
  lines += ["", "    " + " ".join(["python", "benchmarks/convergence.py", *sys.argv[1:]])]
  text = "\n".join(lines)
  print(text)
  if out:
    with open(out, "w") as f:
      f.write(text + "\n")
  return results


if __name__ == "__main__":
  main()
