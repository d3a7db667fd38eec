"""A ViT trained from scratch on scikit-learn's digits: the baseline against every lowmem switch.

Data: `sklearn.datasets.load_digits`, 1797 grayscale 8x8 images of 10 digits,
pixels / 16, float32 ``[N, 8, 8, 1]``; the stratified split of
`benchmarks/convergence.py` (``test_size=0.2``, ``random_state=0``): 1437
training and 360 test images.

Model: `lowmem_jax.models.ViT` in float32, patch 2 (16 patches and a class
token: 17 tokens), width 64, depth 4, 4 heads, MLP 128, 10 classes (``--quick``:
patch 4, width 32, depth 2, 2 heads, MLP 64, 30 steps). Two runs,
the same ``--steps`` of the same batches of ``--batch`` (epochs of a seeded
permutation) at the same ``--lr`` (fixed, or ``--schedule cosine``: a warm-up and a
cosine decay over the steps, the same for both):

  baseline  exact GELU, LayerNorm, plain attention, no remat; optax.adam on the whole batch
  lowmem    ReGELU2 (activation="approx"), MS-LayerNorm (norm="ms"), recomputed attention
            (attention="recompute"), every block under remat with --policy (default
            lowmem_jax.compile.policies.compressed: keep the 2-bit codes and 1/sigma, recompute
            the rest), and AdamA: lowmem_jax.microbatch_step with
            lowmem_jax.adamaw(lr, k, weight_decay=0) on the same batch in k = 4
            micro-batches (``--nu-scale``, default "mean_sq")

What the runs share: both models are initialised with the same key
(``--seed``), which gives every parameter the two trees have in common the
same value (checked at start). The trees are the same: the MS-LayerNorms keep
LayerNorm's scale (1 at init) and bias (0 at init) and train them; at init the two
compute the same function.

Reported per run: test accuracy and loss (each run's own model: every lowmem
switch has an exact forward), the final training loss (mean of the last 20
steps), and memory: the compiled peak of the jitted train step
(`lowmem_jax.compile.memory.analyze(step, state, batch).peak_bytes`: XLA's buffer
assignment on CPU in float32, a proxy for an accelerator's) and the
activations autodiff saves for one micro-batch
(`lowmem_jax.compile.memory.saved_residuals(loss, params, micro_batch).activation_bytes`;
the whole batch for the baseline, a k-th of it for lowmem), at the training
batch and at ``--memory-batch`` (abstract shapes: nothing is allocated), since
a batch of 64 8x8 images is too small for the figures to mean much.

    pip install -e ".[examples]"
    python examples/vit_digits.py --out docs/results     # full: results and plot
    python examples/vit_digits.py --quick                # smoke test, about 40 s on 2 cores

"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lowmem_jax as lm
from lowmem_jax.models import ViT
from compare import (TAIL, add_schedule_argument, batch_indices, check_multiple_of_k,
                     check_positive, check_shared, command, memory_lines, run, schedule_text,
                     write)

ROWS = ("baseline", "lowmem")
MODEL = dict(patch_size=2, width=64, depth=4, num_heads=4, mlp_dim=128, num_classes=10)
QUICK_MODEL = dict(patch_size=4, width=32, depth=2, num_heads=2, mlp_dim=64, num_classes=10)


# The digits ViT ----------------------------------------------------------------------------------

def data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """``x_train, x_test``: float32 ``[n, 8, 8, 1]`` in [0, 1]; ``y_train, y_test``: int32 ``[n]``."""
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split
  digits = load_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]
  return train_test_split(x, digits.target.astype(np.int32), test_size=0.2, random_state=0,
                          stratify=digits.target)


def model(row: str, size: dict, policy: str) -> ViT:
  """The ViT of a row of `ROWS`, float32."""
  if row == "lowmem":
    return ViT(**size, activation="approx", norm="ms", attention="recompute", remat=True,
               remat_policy=lm.policies.READY_MADE[policy])
  return ViT(**size)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  """``argv``'s arguments, the defaults of a full or ``--quick`` run filled in and every number
  checked."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="smoke test: a smaller ViT (patch 4, width 32, depth 2), few steps")
  parser.add_argument("--steps", type=int, default=None, help="default 600, quick 30")
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--k", type=int, default=4, help="AdamA micro-batches of the lowmem run")
  parser.add_argument("--lr", type=float, default=1e-3)
  add_schedule_argument(parser)
  parser.add_argument("--nu-scale", choices=lm.optim.NU_SCALES, default="mean_sq",
                      help="AdamA's second-moment weight (lowmem_jax.adama)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--policy", choices=list(lm.policies.READY_MADE), default="compressed",
                      help="remat policy of the lowmem run (lowmem_jax.compile.policies)")
  parser.add_argument("--memory-batch", type=int, default=None,
                      help="the larger batch at which memory is also measured; default 512, "
                           "quick: --batch (one compile fewer)")
  parser.add_argument("--eval-every", type=int, default=100)
  parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS),
                      help="the runs to make (the figures compare lowmem with baseline)")
  parser.add_argument("--checkpoint-dir", help="resume each run from DIR/<run>")
  parser.add_argument("--out", help="write vit_digits.md and vit_digits.png to this folder")
  args = parser.parse_args(argv)
  args.steps = args.steps if args.steps is not None else (30 if args.quick else 600)
  if args.memory_batch is None:
    args.memory_batch = args.batch if args.quick else 512
  check_positive(parser, args, "steps", "batch", "k", "memory_batch", "eval_every")
  if not args.lr > 0:
    parser.error(f"--lr must be > 0, got {args.lr}")
  check_multiple_of_k(parser, args, "batch", "memory_batch")
  return args


def report(args, argv, size: dict, init: dict, results: dict, images: tuple[int, int],
           shared: int | None, seconds: float) -> tuple[str, float | None]:
  """``(text, diff)``: the markdown report of ``results`` and lowmem's accuracy minus
  baseline's in percentage points (None unless both ran); ``images`` is ``(training, test
  images)``, ``init`` each row's initial params."""
  n_train, n_test = images
  rows = list(results)
  n_params = ", ".join(f"{row} {sum(p.size for p in jax.tree.leaves(init[row])):,}" for row in rows)
  lines = [
      f"ViT on scikit-learn's digits, from scratch: {n_train} training and {n_test} "
      f"test images (8x8, stratified split, random_state 0). ViT patch {size['patch_size']}, "
      f"width {size['width']}, depth {size['depth']}, {size['num_heads']} heads, MLP "
      f"{size['mlp_dim']}, float32; parameters: {n_params} (MS norms have no affine). "
      f"{args.steps} steps of batch {args.batch}, the same batches, "
      f"lr {args.lr:g}{schedule_text(args)} and "
      f"initial params (init key {args.seed}"
      + (f"; the {shared} tensors the two trees share are equal" if shared else "")
      + f") for every run. lowmem: ReGELU2, MS-LayerNorm, recomputed attention, remat policy "
      f"`{args.policy}`, AdamA (nu_scale {args.nu_scale}) over k={args.k} micro-batches of "
      f"{args.batch // args.k}; "
      f"baseline: exact GELU, LayerNorm, plain attention, no remat, Adam. JAX {jax.__version__} "
      f"on {jax.default_backend()}, {seconds:.0f} s in all.", "",
      f"| run | test accuracy | test loss | final training loss (mean of last {TAIL} steps) |",
      "|---|---:|---:|---:|"]
  for row, r in results.items():
    lines.append(f"| {row} | {100 * r['accuracy']:.2f}% | {r['test_loss']:.4f} | "
                 f"{r['train_loss']:.4f} |")
  diff = None
  if len(rows) == 2:
    diff = 100 * (results["lowmem"]["accuracy"] - results["baseline"]["accuracy"])
    lines += ["", f"Accuracy lowmem - baseline: {diff:+.2f} percentage points (one test image is "
              f"{100 / n_test:.2f}); the parity target is within 1 point."]
  lines += [""] + memory_lines(results, args.batch, args.memory_batch,
                               {"baseline": 1, "lowmem": args.k})
  lines += ["", "    " + command("vit_digits.py", argv)]
  return "\n".join(lines), diff


def main(argv: list[str] | None = None) -> dict:
  args = parse_args(argv)
  start = time.time()
  size = QUICK_MODEL if args.quick else MODEL
  x_train, x_test, y_train, y_test = data()
  order = batch_indices(len(x_train), args.steps, args.batch, args.seed)

  def batch_at(i):
    return x_train[order[i]], y_train[order[i]]

  rows = [row for row in ROWS if row in args.rows]
  init = {row: jax.jit(model(row, size, args.policy).init)(jax.random.key(args.seed),
                                                          x_train[:1])["params"] for row in rows}
  shared = check_shared(init["lowmem"], init["baseline"]) if len(rows) == 2 else None
  results = {}
  for row in rows:
    net = model(row, size, args.policy)

    def loss_fn(params, batch, net=net):
      x, y = batch
      return optax.softmax_cross_entropy_with_integer_labels(
          net.apply({"params": params}, x), y).mean()

    logits = jax.jit(lambda params, x, net=net: net.apply({"params": params}, x))

    def evaluate(state, logits=logits):
      out = logits(state[0], x_test)
      return {"accuracy": float(jnp.mean(jnp.argmax(out, -1) == y_test)),
              "test_loss": float(optax.softmax_cross_entropy_with_integer_labels(out,
                                                                                 y_test).mean())}

    results[row] = run(row, loss_fn, init[row], args.k if row == "lowmem" else 1, batch_at,
                       args=args, evaluate=evaluate, memory_batch=args.memory_batch)
  seconds = time.time() - start
  text, diff = report(args, argv, size, init, results, (len(x_train), len(x_test)), shared,
                      seconds)
  print(text)
  write(args.out, "vit_digits", text, results, "ViT on digits: training loss")
  return {"results": results, "accuracy_diff_points": diff, "shared_params": shared,
          "seconds": seconds, "text": text}


if __name__ == "__main__":
  main()
