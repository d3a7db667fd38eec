"""Memory of each technique alone and combined: the low-memory training report's table.

Sohoni et al. ("Low-Memory Neural Network Training: A Technical Report", 2019,
arXiv:1904.10631) combine sparsity, low precision, micro-batching and
checkpointing to train WideResNet-28-2 on CIFAR-10 in 60.7x less memory than
the float32 baseline (batch 128). This script builds each technique set as a
real jitted AdamW train step of `lowmem_jax.models` (WRN-28-2 at batch 128 of
32x32x3 images, and a ViT) and prints, per row:

- compiled peak: XLA's buffer assignment of the step on abstract shapes, params
  and optimizer state donated (on CPU a proxy: the CPU backend upcasts
  half-precision dots and adds layout copies);
- at the peak: parameters + optimizer state, and the rest (activations,
  gradients, temporaries), from `lowmem_jax.memory.report`;
- saved activations: autodiff's residuals of one (micro-)batch's loss, backend-free;
- the reduction against the float32 baseline's compiled peak;
- projected sparse: the compiled peak with the parameters, their gradient and
  the optimizer's two moments stored in a sparse format (values plus a 4-byte
  index per kept entry; `lowmem_jax.sparsity.storage_bytes`). This library
  stores sparse weights dense with a mask, which saves nothing (the mask costs
  a byte a weight more): the measured column shows that, the projected column
  is labelled as a projection.

The float16 rows measure memory only: they use no loss scaling
(`lowmem_jax.precision.loss_scaled_step` changes no buffer of size, and does
not combine with AdamA's micro-batches). Under AdamA with 32 micro-batches
the WideResNet's batch norm normalises over 4 examples at a time.

    python benchmarks/combination.py                    # WRN-28-2 and ViT-B/16
    python benchmarks/combination.py --models wrn-28-2 --out docs/combination.md
"""

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import optax
from tqdm import tqdm

import lowmem_jax as lm
from lowmem_jax import models, sparsity

LEARNING_RATE = 1e-3
SIZES = {"wrn-28-2": dict(batch=128), "vit-b16": dict(batch=64, image=224)}
DENSITY = 0.1  # of the kernels kept by dynamic sparsity
MOMENTS = 2  # AdamW's m and v, stored like the parameters


@dataclasses.dataclass(frozen=True)
class Techniques:
  """One row: the switches of a reference workload and of its optimizer."""
  label: str
  dtype: str = "float32"
  activation: str = "exact"
  conv: str = "plain"
  norm: str = "plain"
  attention: str = "plain"
  remat: bool = False
  k: int = 1
  density: float | None = None

  def workload(self, name: str) -> models.Workload:
    return models.workload(name, **SIZES[name], dtype=jnp.dtype(self.dtype),
                           activation=self.activation, conv=self.conv, norm=self.norm,
                           attention=self.attention, remat=self.remat, remat_policy=None)

  def optimizer(self) -> optax.GradientTransformation:
    tx = lm.adamaw(LEARNING_RATE, self.k) if self.k > 1 else optax.adamw(LEARNING_RATE)
    if self.density is None:
      return tx
    return optax.chain(tx, sparsity.dynamic_sparsity(self.density))


def rows(name: str) -> list[Techniques]:
  """Each technique alone, then combinations up to everything on."""
  t = Techniques
  if name.startswith("wrn"):
    compress = dict(activation="approx", conv="pooled")
    alone = [t("1-bit ReLU", activation="approx"), t("pooled conv residuals", conv="pooled"),
             t("int8 conv residuals", conv="int8")]
  else:
    compress = dict(activation="approx", norm="ms", attention="recompute")
    alone = [t("ReGELU2", activation="approx"), t("MS-LayerNorm", norm="ms"),
             t("attention without L×L residual", attention="recompute")]
  return [
      t("float32 baseline"),
      t("bfloat16 compute", dtype="bfloat16"),
      t("float16 compute", dtype="float16"),
      *alone,
      t("remat every block", remat=True),
      t("AdamA, 8 micro-batches", k=8),
      t("AdamA, 32 micro-batches", k=32),
      t(f"sparse {DENSITY:.0%} (dense + mask)", density=DENSITY),
      t("compressed residuals + float16", dtype="float16", **compress),
      t("+ remat", dtype="float16", remat=True, **compress),
      t("+ AdamA 32", dtype="float16", remat=True, k=32, **compress),
      t(f"everything: + sparse {DENSITY:.0%}", dtype="float16", remat=True, k=32,
        density=DENSITY, **compress),
  ]


def measure(name: str, row: Techniques) -> dict:
  wl = row.workload(name)
  tx = row.optimizer()
  params = wl.abstract_params()
  opt_state = jax.eval_shape(tx.init, params)
  batch = (wl.inputs, wl.labels)
  step = jax.jit(wl.train_step(tx, row.k), donate_argnums=(0, 1))
  micro = [jax.ShapeDtypeStruct((s.shape[0] // row.k, *s.shape[1:]), s.dtype) for s in batch]
  b = lm.memory.report(step, params, opt_state, batch, loss_fn=wl.loss,
                       loss_args=(params, *micro), top=0)
  state_bytes = b.at_peak["parameters"] + b.at_peak["optimizer state"]
  out = dict(label=row.label, peak=b.stats.peak_bytes, state=state_bytes,
             rest=b.live_peak_bytes - state_bytes, saved=b.saved.activation_bytes,
             projected=None)
  if row.density is not None:
    real = wl.init(jax.random.key(0))
    sizes = sparsity.storage_bytes(real, tx.init(real))
    # Parameters, their gradient and AdamW's two moments shrink alike; the mask goes.
    dense_per_copy = sizes["dense"]
    saving = (1 + 1 + MOMENTS) * (dense_per_copy - sizes["projected_sparse"]) + sizes["mask"]
    out["projected"] = b.stats.peak_bytes - saving
  return out


def table(name: str, results: list[dict]) -> str:
  base = results[0]["peak"]
  lines = [f"### {name}, batch {SIZES[name]['batch']}, AdamW, {jax.default_backend()} "
           f"(jax {jax.__version__})", "",
           "| techniques | compiled peak MiB | reduction | params + opt state at peak MiB "
           "| rest at peak MiB | saved activations MiB | projected sparse MiB (reduction) |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for r in results:
    projected = ("" if r["projected"] is None else
                 f"{r['projected'] / 2**20:,.1f} ({base / r['projected']:.1f}x) projected")
    lines.append(f"| {r['label']} | {r['peak'] / 2**20:,.1f} | {base / r['peak']:.1f}x | "
                 f"{r['state'] / 2**20:,.1f} | {r['rest'] / 2**20:,.1f} | "
                 f"{r['saved'] / 2**20:,.1f} | {projected} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", default="wrn-28-2,vit-b16",
                      help=f"comma list of {', '.join(SIZES)}")
  parser.add_argument("--out", help="also write the tables to this markdown file")
  args = parser.parse_args()
  names = args.models.split(",")
  for name in names:
    if name not in SIZES:
      parser.error(f"--models: {name!r} is not one of {', '.join(SIZES)}")
  tables = []
  start = time.time()
  for name in names:
    results = []
    for row in tqdm(rows(name), desc=name):
      results.append(measure(name, row))
    tables.append(table(name, results))
    print("\n" + tables[-1], flush=True)
    if args.out:  # after each model, so a crash loses at most one
      with open(args.out, "w") as f:
        f.write("\n\n".join(tables) + "\n")
  print(f"\n{time.time() - start:.0f} s")


if __name__ == "__main__":
  main()
