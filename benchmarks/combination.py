"""Memory of each technique alone and combined: the low-memory training report's table.

Sohoni et al. ("Low-Memory Neural Network Training: A Technical Report", 2019,
arXiv:1904.10631) combine sparsity, low precision, micro-batching and
checkpointing to train WideResNet-28-2 on CIFAR-10 in 60.7x less memory than
the float32 baseline (batch 128). This script measures each technique set as
``lowmem-jax report`` does (`lowmem_jax.app.techniques`: a jitted AdamW train step
of `lowmem_jax.models`, AdamA folding each micro-batch in the backward) on
WRN-28-2 at batch 128 of 32x32x3 images and a ViT, and prints, per row:

- compiled peak: XLA's buffer assignment of the step on abstract shapes, params
  and optimizer state donated, for `lowmem_jax.compile.targets.default` (an H100,
  compiled here without one, where the target packages are installed; the CPU
  is a proxy only: it upcasts half-precision dots and adds layout copies);
- at the peak: parameters + optimizer state, and the rest (activations,
  gradients, temporaries), from `lowmem_jax.compile.memory.report`;
- saved activations: autodiff's residuals of one (micro-)batch's loss, backend-free;
- the reduction against the float32 baseline's compiled peak.

The WideResNet's sparse rows store the blocks' conv kernels sparse
(`lowmem_jax.optim.sparse`: values and int32 positions, moments and gradients of the
values' size), measured like the others; the ViT has no sparse rows (sparse
storage is built for the convs).

The float16 rows measure memory only: they use no loss scaling
(`lowmem_jax.optim.precision.loss_scaled_step` changes no buffer of size, and does
not combine with AdamA's micro-batches). Under AdamA with 32 (64)
micro-batches the WideResNet's batch norm normalises over 4 (2) examples at a
time: memory figures, not a recipe.

    python benchmarks/combination.py                    # WRN-28-2 and ViT-B/16
    python benchmarks/combination.py --models wrn-28-2 --out docs/combination.md
    python benchmarks/combination.py --quick            # ViT-Ti/16, three rows: that it runs
"""

import argparse
import time

import jax
from tqdm import tqdm

from lowmem_jax import app
from lowmem_jax.compile import targets

SIZES = {"wrn-28-2": dict(batch=128), "vit-b16": dict(batch=64, image=224),
         "vit-tiny": dict(batch=64, image=32)}  # vit-tiny: --quick's
# --quick: these rows of ViT-Ti/16 (each 8-bit row alone compiles for tens of seconds); not results.
QUICK_ROWS = ("float32 baseline", "remat every block", "compressed residuals + float16")
DENSITY = 0.1  # of the WideResNet's block kernels, stored sparse


def rows(name: str) -> list[tuple[str, str, str]]:
  """``(label, technique set, compute dtype)`` of each row: each technique alone, then
  combinations up to everything on (`lowmem_jax.app.parse`'s sets)."""
  if name.startswith("wrn"):
    compress = "relu-1bit+conv:pooled"
    alone = [("1-bit ReLU", "relu-1bit"), ("pooled conv residuals", "conv:pooled"),
             ("int8 conv residuals", "conv:int8")]
  else:
    compress = "approx+ms-norm+attention"
    alone = [("ReGELU2", "approx"), ("MS-LayerNorm", "ms-norm"),
             ("attention without L×L residual", "attention")]
  f32, f16 = "float32", "float16"
  sparse = f"sparse:{DENSITY}"
  best = f"{compress}+remat:full+adama:32+8bit+bf16-params"
  sparse_rows = [
      (f"sparse {DENSITY:.0%}, stored sparse", sparse, f32),
      (f"+ sparse {DENSITY:.0%} (the row above)", f"{best}+{sparse}", f16),
      ("+ AdamA 64 micro-batches of 2", f"{best.replace('adama:32', 'adama:64')}+{sparse}", f16),
  ] if name.startswith("wrn") else []
  return [
      ("float32 baseline", "baseline", f32),
      ("bfloat16 compute", "bf16", f32),
      ("float16 compute", "baseline", f16),
      *[(label, text, f32) for label, text in alone],
      ("remat every block", "remat:full", f32),
      ("AdamA, 8 micro-batches", "adama:8", f32),
      ("AdamA, 32 micro-batches", "adama:32", f32),
      ("compressed residuals + float16", compress, f16),
      ("+ remat", f"{compress}+remat:full", f16),
      ("+ AdamA 32", f"{compress}+remat:full+adama:32", f16),
      ("+ 8-bit moments", f"{compress}+remat:full+adama:32+8bit", f16),
      ("+ bfloat16 parameters", best, f16),
      *sparse_rows,
  ]


def measure(name: str, label: str, text: str, dtype: str) -> dict:
  job = app.Job(name, dtype=dtype, **SIZES[name])
  b = app.measure(job, app.parse(text), top=0)
  state_bytes = b.at_peak["parameters"] + b.at_peak["optimizer state"]
  return dict(label=label, text=text, dtype=dtype, peak=b.stats.peak_bytes, state=state_bytes,
              rest=b.live_peak_bytes - state_bytes, saved=b.saved.activation_bytes)


def table(name: str, results: list[dict]) -> str:
  base = results[0]["peak"]
  lines = [f"### {name}, batch {SIZES[name]['batch']}, AdamW, target {targets.default().name} "
           f"(jax {jax.__version__})", "",
           "| row | technique set (compute dtype) | compiled peak MiB | reduction | params + opt state at peak MiB "
           "| rest at peak MiB | saved activations MiB |",
           "|---|---|---:|---:|---:|---:|---:|"]
  for r in results:
    lines.append(f"| {r['label']} | `{r['text']}` ({r['dtype']}) | {r['peak'] / 2**20:,.1f} | {base / r['peak']:.1f}x | "
                 f"{r['state'] / 2**20:,.1f} | {r['rest'] / 2**20:,.1f} | "
                 f"{r['saved'] / 2**20:,.1f} |")
  return "\n".join(lines)


def main(argv=None):
  """Prints the tables (and writes them to --out); returns ``{model: [measure's dicts]}``."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", default="wrn-28-2,vit-b16",
                      help=f"comma list of {', '.join(SIZES)}")
  parser.add_argument("--out", help="also write the tables to this markdown file")
  parser.add_argument("--quick", action="store_true",
                      help=f"vit-tiny, the rows {', '.join(QUICK_ROWS)}: checks that the script "
                           "runs; its figures are not results")
  args = parser.parse_args(argv)
  if args.quick:  # the quick model as the default: --models given still wins
    parser.set_defaults(models="vit-tiny")
    args = parser.parse_args(argv)
  names = args.models.split(",")
  for name in names:
    if name not in SIZES:
      parser.error(f"--models: {name!r} is not one of {', '.join(SIZES)}")
  tables, found = [], {}
  start = time.time()
  for name in names:
    results = found[name] = []
    chosen = [row for row in rows(name) if not args.quick or row[0] in QUICK_ROWS]
    for label, text, dtype in tqdm(chosen, desc=name):
      results.append(measure(name, label, text, dtype))
    tables.append(table(name, results))
    print("\n" + tables[-1], flush=True)
    if args.out:  # after each model, so a crash loses at most one
      with open(args.out, "w") as f:
        f.write("\n\n".join(tables) + "\n")
  print(f"\n{time.time() - start:.0f} s")
  return found


if __name__ == "__main__":
  main()
