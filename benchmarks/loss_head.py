"""The LLM loss head: `losses.linear_cross_entropy` against the plain head.

Memory: the gradient of the head (``dh`` and ``dw``) of a Llama-3-sized model
(vocabulary 128,256, width 4,096) at 8 x 4,096 tokens, bfloat16, compiled for
the target (default: `lowmem_jax.compile.targets.default`); XLA's peak and temp
bytes. Time: the same gradient, float32 (``--time-dtype``), at a CPU-sized
shape (``--time``), median of ``--repeats`` after a warm-up, as a ratio to the
plain head in the same run. `benchmarks/gpu_validate.py` runs it on a GPU at
the Llama-3 size in bfloat16, which decides whether a Pallas kernel is worth it.
``--chunks`` gives the blocks to compare (token_chunk x vocab_chunk).

    python benchmarks/loss_head.py [--target h100] [--time 2048,16384,256] [--repeats 5]
    python benchmarks/loss_head.py --chunks 1024x8192,512x4096,2048x16384
    python benchmarks/loss_head.py --quick    # 256 tokens, vocabulary 2,048: that it runs
"""

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
from rich.console import Console
from rich.table import Table

import lowmem_jax as lm
from lowmem_jax.ops import losses

import _quick  # beside this script in benchmarks/

PLAIN = "plain (log_softmax of the logits)"
# --quick (and benchmarks/gpu_validate.py's dry run): tiny sizes, one timed run; not results.
QUICK = dict(tokens=256, vocab=2048, width=64, time="256,2048,64", repeats=1, chunks="128x512")


def heads(chunks: str) -> dict:
  """The plain head and `linear_cross_entropy` at each ``TCxVC`` block of ``chunks``."""
  out = {PLAIN: losses.linear_cross_entropy_reference}
  for pair in chunks.split(","):
    tc, vc = (int(v) for v in pair.split("x"))
    out[f"linear_cross_entropy {tc}x{vc}"] = functools.partial(
        losses.linear_cross_entropy, token_chunk=tc, vocab_chunk=vc)
  return out


def head_grad(fn):
  return jax.jit(jax.grad(lambda h, w, y: fn(h, w, y), (0, 1)))


def main(argv=None):
  """Prints the tables; returns ``{head: (compiled peak bytes, median seconds)}``."""
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--target", default=None)
  parser.add_argument("--tokens", type=int, default=8 * 4096)
  parser.add_argument("--vocab", type=int, default=128256)
  parser.add_argument("--width", type=int, default=4096)
  parser.add_argument("--time", default="2048,16384,256", help="CPU timing size: tokens,vocab,width")
  parser.add_argument("--time-dtype", default="float32", choices=("float32", "bfloat16"),
                      help="dtype of h and w in the timing")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--chunks", default="1024x8192",
                      help="comma list of token_chunk x vocab_chunk blocks (default: the defaults)")
  parser.add_argument("--quick", action="store_true",
                      help=f"{QUICK['tokens']} tokens, vocabulary {QUICK['vocab']}, width "
                           f"{QUICK['width']}, one timed run: checks that the script runs; its "
                           "figures are not results")
  args = _quick.parse_args(parser, argv, QUICK)
  candidates = heads(args.chunks)
  target = lm.targets.resolve(args.target)
  console = Console(width=160)
  console.print(target.note, highlight=False)
  h = jax.ShapeDtypeStruct((args.tokens, args.width), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((args.width, args.vocab), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((args.tokens,), jnp.int32)
  table = Table(title=f"loss head gradient, {args.tokens:,} tokens, vocabulary {args.vocab:,}, "
                      f"width {args.width:,}, bfloat16 (MiB; ratio to plain)")
  for col in ("head", "compiled peak", "ratio", "temp", "ratio"):
    table.add_column(col, justify="left" if col == "head" else "right")
  base, peaks = None, {}
  for name, fn in candidates.items():
    stats = lm.memory.analyze(head_grad(fn), h, w, y, target=target)
    peaks[name] = stats.peak_bytes
    base = base or stats
    table.add_row(name, f"{stats.peak_bytes / 2**20:,.0f}", f"{stats.peak_bytes / base.peak_bytes:.4f}",
                  f"{stats.temp_bytes / 2**20:,.0f}", f"{stats.temp_bytes / base.temp_bytes:.4f}")
  console.print(table)

  tokens, vocab, width = (int(v) for v in args.time.split(","))
  k = jax.random.split(jax.random.key(0), 3)
  dtype = jnp.dtype(args.time_dtype)
  real = (jax.random.normal(k[0], (tokens, width), dtype),
          (jax.random.normal(k[1], (width, vocab)) * 0.05).astype(dtype),
          jax.random.randint(k[2], (tokens,), 0, vocab))
  samples = {name: [] for name in candidates}
  steps = {name: head_grad(fn) for name, fn in candidates.items()}
  for step in steps.values():
    jax.block_until_ready(step(*real))
  for _ in range(args.repeats):  # interleaved, so drift hits both alike
    for name, step in steps.items():
      start = time.perf_counter()
      jax.block_until_ready(step(*real))
      samples[name].append(time.perf_counter() - start)
  table = Table(title=f"time, median of {args.repeats}: the head's gradient, {dtype}, {tokens:,} "
                      f"tokens, vocabulary {vocab:,}, width {width} on {jax.devices()[0].device_kind}")
  for col in ("head", "step s", "ratio to plain"):
    table.add_column(col, justify="left" if col == "head" else "right")
  plain = statistics.median(samples[PLAIN])
  for name in candidates:
    t = statistics.median(samples[name])
    table.add_row(name, f"{t:.3f}", f"{t / plain:.3f}")
  console.print(table)
  return {name: (peaks[name], statistics.median(samples[name])) for name in candidates}


if __name__ == "__main__":
  main()
