"""Memory and step time of ViT-B/16 and a LLaMA-style model with each technique.

For each variant (baseline; approximate activation, ReGELU2 or ReSiLU2; MS
norm with folded affine; both; attention that recomputes its probabilities,
`lowmem_jax.attention`; all three; for LLaMA all three with the fused loss head,
`lowmem_jax.ops.losses.linear_cross_entropy`; the baseline's loss through `lm.lowmem`) it prints, for the gradient step of the
loss (parameters float32):
  - compiled peak and temp bytes (XLA's buffer assignment for --target,
    abstract shapes: nothing is allocated; default the H100 target,
    compiled here without a GPU; --target cpu is a proxy only);
  - compiled per-block bytes: the temp bytes of the model at full depth
    minus those at half depth, per block removed, i.e. what each block
    holds from its forward to its backward;
  - saved-activation bytes (autodiff's residuals, backend-free);
and, at a size a 2-core CPU runs in seconds, the step-time ratio against the
baseline (median of --repeats runs after one warm-up).

    python benchmarks/block_memory.py              # ViT-B/16 b64 and LLaMA-100M b4 x 2048, H100 target
    python benchmarks/block_memory.py --models vit-b16 --explain 8   # + largest buffers at the peak
    python benchmarks/block_memory.py --quick      # llama-tiny, three variants: that it runs
"""

import argparse
import dataclasses
import functools
import re
import statistics
import time

import jax
import jax.numpy as jnp
from rich.console import Console
from rich.table import Table

import lowmem_jax as lm
from lowmem_jax import app, models

import _quick  # beside this script in benchmarks/

VARIANTS = {  # the technique set of each (lowmem_jax.app.techniques)
    "baseline": "baseline",
    "approx activation": "approx",
    "ms-norm": "ms-norm",
    "both": "approx+ms-norm",
    "attention": "attention",
    "all three": "approx+ms-norm+attention",
    "all three + fused loss": "approx+ms-norm+attention+fused-ce",  # LLaMA only
    "lm.lowmem(baseline)": "baseline",
    "lm.lowmem(baseline, approx)": "baseline",
}
# --quick: the two-layer LLaMA, three variants (each compiles for seconds), one dtype, one timed
# step; not results.
QUICK = dict(models="llama-tiny", llama_batch=2, seq=64, dtypes="bfloat16", time_llama="1,64",
             repeats=1, variants="baseline,all three + fused loss,lm.lowmem(baseline, approx)")
TRANSFORMED = {  # the baseline model's loss through `lm.lowmem`: its default (exact), approx
    "lm.lowmem(baseline)": lm.lowmem,
    "lm.lowmem(baseline, approx)": functools.partial(lm.lowmem, activations="approx"),
}


def variant_names(text):
  """The comma-separated names of ``text``; a comma in parentheses is a name's own, as in
  ``lm.lowmem(baseline, approx)``."""
  return re.split(r",(?![^(]*\))", text)


def loss_of(wl, variant):
  return TRANSFORMED[variant](wl.loss) if variant in TRANSFORMED else wl.loss


def with_depth(wl, depth):
  """The workload with ``depth`` blocks."""
  if isinstance(wl.model, models.Llama):
    model = wl.model.clone(config=dataclasses.replace(wl.model.config, n_layers=depth))
  else:
    model = wl.model.clone(depth=depth)
  return dataclasses.replace(wl, model=model)


def depth(wl):
  return wl.model.config.n_layers if isinstance(wl.model, models.Llama) else wl.model.depth


def residual_fn(wl, variant):
  labels = jnp.zeros(wl.labels.shape, jnp.int32)
  loss = loss_of(wl, variant)
  return lambda params, inputs: loss(params, inputs, labels)


def memory_rows(wl_of, explain, target, variants=VARIANTS):
  """``[(variant, stats, per_block_bytes, saved)]`` for ``wl_of(technique set)``,
  compiled for ``target``."""
  rows = []
  for variant, text in variants.items():
    wl = wl_of(text)
    params = wl.abstract_params()
    grad = jax.grad(loss_of(wl, variant))
    stats = lm.memory.analyze(grad, params, wl.inputs, wl.labels, target=target)
    half = with_depth(wl, depth(wl) // 2)
    half_stats = lm.memory.analyze(jax.grad(loss_of(half, variant)), half.abstract_params(), half.inputs,
                                   half.labels, target=target)
    per_block = (stats.temp_bytes - half_stats.temp_bytes) / (depth(wl) - depth(half))
    saved = lm.memory.saved_residuals(residual_fn(wl, variant), params, wl.inputs)
    rows.append((variant, stats, per_block, saved))
    if explain:
      peak = lm.memory.report(grad, params, wl.inputs, wl.labels, top=None, target=target)
      print(f"\n{variant}: live at the peak {peak.live_peak_bytes / 2**20:,.0f} MiB; "
            "largest groups by the op that made them:")
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


def time_rows(wl_of, repeats, variants=VARIANTS):
  times = {}
  for variant, text in variants.items():
    wl = wl_of(text)
    params = wl.init(jax.random.key(0))
    inputs, labels = wl.batch(jax.random.key(1))
    step = jax.jit(jax.grad(loss_of(wl, variant)))
    jax.block_until_ready(step(params, inputs, labels))
    samples = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(step(params, inputs, labels))
      samples.append(time.perf_counter() - start)
    times[variant] = statistics.median(samples)
  return times


def main(argv=None):
  """Prints the tables; returns ``{(model, dtype): memory_rows}`` and, unless --no-timing,
  ``{(model, "seconds"): {variant: seconds}}``."""
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", default="vit-b16,llama-100m", help="comma-separated reference models")
  parser.add_argument("--vit-batch", type=int, default=64)
  parser.add_argument("--llama-batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=2048, help="LLaMA tokens per example")
  parser.add_argument("--dtypes", default="bfloat16,float32", help="compute dtypes, comma-separated")
  parser.add_argument("--time-vit", default="2,112", help="ViT timing size: batch,image")
  parser.add_argument("--time-llama", default="1,1024",
                      help="LLaMA timing size: batch,seq (1024: two chunks of attention)")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--explain", type=int, default=0, metavar="N",
                      help="also list the N largest groups of buffers live at the compiled peak")
  parser.add_argument("--no-timing", action="store_true")
  parser.add_argument("--variants", default=",".join(VARIANTS),
                      help=f"comma-separated, the first the baseline of the ratios; of {list(VARIANTS)}")
  parser.add_argument("--target", default=None,
                      help="compile target (lowmem_jax.compile.targets); default: targets.default()")
  parser.add_argument("--quick", action="store_true",
                      help=f"{QUICK['models']}, 2 x 64 tokens, {QUICK['dtypes']}, the variants "
                           f"{QUICK['variants']}, one timed step: checks that the script runs; its "
                           "figures are not results")
  args = _quick.parse_args(parser, argv, QUICK)
  unknown = set(variant_names(args.variants)) - set(VARIANTS)
  if unknown:
    parser.error(f"--variants: unknown {sorted(unknown)}; choose from {list(VARIANTS)}")
  variants = {v: VARIANTS[v] for v in variant_names(args.variants)}
  target = lm.targets.resolve(args.target)
  console = Console(width=200)
  console.print(target.note, highlight=False)
  mib = lambda b: f"{b / 2**20:,.0f}"
  results = {}
  for name in args.models.split(","):
    vit = name in models.VIT_CONFIGS
    model_variants = {v: s for v, s in variants.items() if not (vit and "fused-ce" in s)}
    size = (dict(batch=args.vit_batch) if vit else dict(batch=args.llama_batch, seq=args.seq))
    for dtype in args.dtypes.split(","):
      wl_of = lambda text: app.parse(text).workload(
          app.Job(name, dtype=dtype, target=target, **size))
      if args.explain:
        print(f"\n{name}, {dtype} compute")
      rows = results[name, dtype] = memory_rows(wl_of, args.explain, target, model_variants)
      base = rows[0]
      table = Table(title=f"{name}, {size}, {dtype} compute, float32 params "
                          f"(gradient step; MiB; ratio to baseline)")
      for col in ("variant", "compiled peak", "ratio", "compiled temp", "ratio",
                  "compiled per block", "ratio", "saved activations", "ratio"):
        table.add_column(col, justify="left" if col == "variant" else "right")
      for variant, stats, per_block, saved in rows:
        table.add_row(
            variant,
            mib(stats.peak_bytes), f"{stats.peak_bytes / base[1].peak_bytes:.3f}",
            mib(stats.temp_bytes), f"{stats.temp_bytes / base[1].temp_bytes:.3f}",
            mib(per_block), f"{per_block / base[2]:.3f}",
            mib(saved.activation_bytes), f"{saved.activation_bytes / base[3].activation_bytes:.3f}")
      console.print(table)
    if not args.no_timing:
      b, n = (int(x) for x in (args.time_vit if vit else args.time_llama).split(","))
      small = dict(batch=b, image=n) if vit else dict(batch=b, seq=n)
      times = results[name, "seconds"] = time_rows(lambda text: app.parse(text).workload(
                            app.Job(name, target=target, **small)),
                        args.repeats, model_variants)
      table = Table(title=f"step time, {name}, {small}, float32, "
                          f"{jax.devices()[0].device_kind}, median of {args.repeats}")
      for col in ("variant", "seconds", "ratio to baseline"):
        table.add_column(col, justify="left" if col == "variant" else "right")
      for variant, t in times.items():
        table.add_row(variant, f"{t:.3f}", f"{t / times[next(iter(times))]:.3f}")
      console.print(table)
  return results


if __name__ == "__main__":
  main()
