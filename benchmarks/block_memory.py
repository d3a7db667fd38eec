"""Memory and step time of ViT-B/16 with approximate activations and MS norms.

For each variant (baseline; ReGELU2; MS-LayerNorm with folded affine; both) it
prints, for the gradient step of the loss (parameters float32):
  - compiled peak and temp bytes (XLA's buffer assignment, abstract shapes:
    nothing is allocated; on CPU a proxy, see lowmem_jax.memory);
  - saved-activation bytes (autodiff's residuals, backend-free);
and, at a size a 2-core CPU runs in seconds, the step-time ratio against the
baseline (median of --repeats runs after one warm-up).

    python benchmarks/block_memory.py                  # batch 64, bf16 and f32 compute
    python benchmarks/block_memory.py --explain 8      # + the largest buffers live at the peak
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from rich.console import Console
from rich.table import Table

import lowmem_jax as lm
from lowmem_jax import models

VARIANTS = {
    "baseline": dict(activation="exact", norm="plain"),
    "regelu2": dict(activation="approx", norm="plain"),
    "ms-norm": dict(activation="exact", norm="ms"),
    "both": dict(activation="approx", norm="ms"),
}


def residual_fn(wl):
  labels = jnp.zeros(wl.labels.shape, jnp.int32)
  return lambda params, inputs: wl.loss(params, inputs, labels)


def memory_rows(model, batch, dtype, explain):
  rows = []
  for variant, switches in VARIANTS.items():
    wl = models.workload(model, batch=batch, dtype=dtype, **switches)
    params = wl.abstract_params()
    grad = jax.grad(wl.loss)
    stats = lm.memory.analyze(grad, params, wl.inputs, wl.labels)
    saved = lm.memory.saved_residuals(residual_fn(wl), params, wl.inputs)
    rows.append((variant, stats, saved))
    if explain:
      peak = lm.memory.live_buffers_at_peak(grad, params, wl.inputs, wl.labels, top=None)
      print(f"\n{variant}, {jnp.dtype(dtype).name} compute: live at the peak "
            f"{peak.peak_bytes / 2**20:,.0f} MiB; largest groups by the op that made them:")
      for (op, kind), (nbytes, count) in group_by_op(peak)[:explain]:
        print(f"  {nbytes / 2**20:9,.0f} MiB in {count:4d} {kind} buffers from {op}")
  return rows


def group_by_op(peak):
  """``[((op, element type), (bytes, count))]``, largest first."""
  groups = {}
  for b in peak.buffers:
    key = (b.op_name.rsplit("/", 1)[-1] or "XLA itself (no JAX op)", b.shape.split("[", 1)[0])
    nbytes, count = groups.get(key, (0, 0))
    groups[key] = (nbytes + b.nbytes, count + 1)
  return sorted(groups.items(), key=lambda kv: -kv[1][0])


def time_rows(model, batch, image, dtype, repeats):
  times = {}
  for variant, switches in VARIANTS.items():
    wl = models.workload(model, batch=batch, image=image, dtype=dtype, **switches)
    params = wl.init(jax.random.key(0))
    inputs, labels = wl.batch(jax.random.key(1))
    step = jax.jit(jax.grad(wl.loss))
    jax.block_until_ready(step(params, inputs, labels))
    samples = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(step(params, inputs, labels))
      samples.append(time.perf_counter() - start)
    times[variant] = statistics.median(samples)
  return times


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="vit-b16", choices=tuple(models.VIT_CONFIGS))
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--dtypes", default="bfloat16,float32", help="compute dtypes, comma-separated")
  parser.add_argument("--time-batch", type=int, default=2)
  parser.add_argument("--time-image", type=int, default=112)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--explain", type=int, default=0, metavar="N",
                      help="also list the N largest groups of buffers live at the compiled peak")
  parser.add_argument("--no-timing", action="store_true")
  args = parser.parse_args(argv)
  console = Console()
  mib = lambda b: f"{b / 2**20:,.0f}"
  for dtype in args.dtypes.split(","):
    rows = memory_rows(args.model, args.batch, jnp.dtype(dtype), args.explain)
    base_stats, base_saved = rows[0][1], rows[0][2]
    table = Table(title=f"{args.model}, batch {args.batch}, {dtype} compute, float32 params "
                        f"(gradient step; MiB; ratio to baseline)")
    for col in ("variant", "compiled peak", "ratio", "compiled temp", "ratio",
                "saved activations", "ratio"):
      table.add_column(col, justify="left" if col == "variant" else "right")
    for variant, stats, saved in rows:
      table.add_row(
          variant,
          mib(stats.peak_bytes), f"{stats.peak_bytes / base_stats.peak_bytes:.3f}",
          mib(stats.temp_bytes), f"{stats.temp_bytes / base_stats.temp_bytes:.3f}",
          mib(saved.activation_bytes), f"{saved.activation_bytes / base_saved.activation_bytes:.3f}")
    console.print(table)
  if not args.no_timing:
    times = time_rows(args.model, args.time_batch, args.time_image, jnp.float32, args.repeats)
    table = Table(title=f"step time, {args.model}, batch {args.time_batch}, {args.time_image} px, "
                        f"float32, {jax.devices()[0].device_kind}, median of {args.repeats}")
    for col in ("variant", "seconds", "ratio to baseline"):
      table.add_column(col, justify="left" if col == "variant" else "right")
    for variant, t in times.items():
      table.add_row(variant, f"{t:.3f}", f"{t / times['baseline']:.3f}")
    console.print(table)


if __name__ == "__main__":
  main()
