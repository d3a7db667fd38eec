"""The ``lowmem-jax`` command: memory of a reference model's training step.

    lowmem-jax report --model vit-b16 --batch 64
    lowmem-jax report --model llama-100m --batch 8 --seq 512 --activation approx --norm ms \
        --attention recompute --json
"""

import argparse
import json
import sys

import jax
import jax.numpy as jnp
from rich.console import Console
from rich.table import Table

from lowmem_jax import memory, models
from lowmem_jax.models.vit import ACTIVATIONS, ATTENTIONS, NORMS


def _report(args) -> dict:
  wl = models.workload(args.model, batch=args.batch, seq=args.seq, image=args.image,
                       dtype=jnp.dtype(args.dtype), activation=args.activation, norm=args.norm,
                       attention=args.attention)
  params = wl.abstract_params()
  grad = jax.grad(wl.loss)
  stats = memory.analyze(grad, params, wl.inputs, wl.labels)
  labels = jnp.zeros(wl.labels.shape, jnp.int32)
  saved = memory.saved_residuals(lambda p, x: wl.loss(p, x, labels), params, wl.inputs)
  peak = memory.live_buffers_at_peak(grad, params, wl.inputs, wl.labels, top=args.top)
  return {
      "model": args.model, "batch": args.batch, "dtype": args.dtype,
      "activation": args.activation, "norm": args.norm,
      "attention": args.attention, "backend": jax.default_backend(),
      "parameter_bytes": memory.tree_bytes(params),
      "compiled": {k: getattr(stats, k) for k in stats.__dataclass_fields__},
      "saved_activation_bytes": saved.activation_bytes,
      "saved_activation_bytes_by_name": {str(k): v for k, v in saved.by_name().items()},
      "live_at_peak_bytes": peak.peak_bytes,
      "largest_live_at_peak": [
          {"bytes": b.nbytes, "shape": b.shape, "op": b.op_name, "source": b.source}
          for b in peak.buffers],
  }


def _print(report: dict) -> None:
  console = Console()
  mib = lambda b: f"{b / 2**20:,.1f}"
  title = (f"{report['model']} gradient step, batch {report['batch']}, {report['dtype']} compute, "
           f"activation={report['activation']}, norm={report['norm']}, "
           f"attention={report['attention']} ({report['backend']})")
  table = Table(title=title)
  table.add_column("what")
  table.add_column("MiB", justify="right")
  table.add_column("from")
  c = report["compiled"]
  table.add_row("parameters", mib(report["parameter_bytes"]), "shapes")
  for key in ("argument_bytes", "output_bytes", "temp_bytes", "peak_bytes"):
    table.add_row(f"compiled {key.removesuffix('_bytes')}", mib(c[key]), "XLA memory analysis")
  table.add_row("live at peak", mib(report["live_at_peak_bytes"]), "XLA buffer live ranges")
  table.add_row("saved activations", mib(report["saved_activation_bytes"]), "autodiff residuals")
  for name, nbytes in sorted(report["saved_activation_bytes_by_name"].items(), key=lambda kv: -kv[1]):
    table.add_row(f"  named {name}" if name != "None" else "  unnamed", mib(nbytes), "autodiff residuals")
  console.print(table)
  top = Table(title="largest buffers live at the compiled peak")
  for col in ("MiB", "shape", "op", "source"):
    top.add_column(col, justify="right" if col == "MiB" else "left")
  for b in report["largest_live_at_peak"]:
    top.add_row(mib(b["bytes"]), b["shape"], b["op"] or "(made by XLA: no JAX op)", b["source"])
  console.print(top)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="lowmem-jax", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  rep = sub.add_parser("report", help="where the memory of a reference model's gradient step goes")
  rep.add_argument("--model", default="vit-b16", choices=models.NAMES)
  rep.add_argument("--batch", type=int, default=64)
  rep.add_argument("--seq", type=int, default=512, help="tokens per example (LLaMA)")
  rep.add_argument("--image", type=int, default=224, help="image side (ViT)")
  rep.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="compute dtype; parameters stay float32")
  rep.add_argument("--activation", default="exact", choices=ACTIVATIONS)
  rep.add_argument("--norm", default="plain", choices=NORMS)
  rep.add_argument("--attention", default="plain", choices=ATTENTIONS,
                   help="recompute: lowmem_jax.attention, which keeps no L×L residual")
  rep.add_argument("--top", type=int, default=10, help="largest live buffers to list")
  rep.add_argument("--json", action="store_true", help="print JSON instead of tables")
  args = parser.parse_args(argv)
  if args.batch < 1:
    parser.error(f"--batch must be >= 1, got {args.batch}")
  report = _report(args)
  if args.json:
    json.dump(report, sys.stdout, indent=2)
    print()
  else:
    _print(report)
  return 0


if __name__ == "__main__":
  sys.exit(main())
