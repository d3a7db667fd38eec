"""A full fine-tune's memory, technique by technique, in the shape of torchao's table.

A LLaMA-style model (``llama-1b``: 1.2 B parameters; ``llama-7b`` on abstract
shapes) trained on ``--batch`` sequences of ``--seq`` tokens, one optimizer
step, parameters and optimizer state donated, compiled for ``--target``
(default: the h100 target, deviceless). Rows, each adding to the one before
except where it says "instead":

  AdamW float32                float32 compute and parameters, AdamW
  + lowmem activations         bfloat16 compute, ReSiLU2, MS-RMSNorm, attention
                               without an LxL residual, the fused loss head
  + AdamA (k micro-batches)    lm.adamaw over --k micro-batches, each leaf's
                               gradient folded in its backward rule
  + 8-bit moments              lm.adamaw(state_bits=8), folding in the scan body
                               (folding in the backward takes 32-bit moments)
  + bfloat16 parameters        no float32 copy: lm.lowbit.stochastic_rounding ends
                               the chain, so each new parameter rounds stochastically
  8-bit Adam instead of AdamA  lowmem activations, lm.scale_by_adam_8bit, one batch
  + bfloat16 parameters        the same, no float32 parameters (stochastic rounding)
  + moments in host memory     the same, its moments in host memory (lm.offload.offload_state;
                               not AdamA, whose moments would cross every micro-step)
  AdamW offloaded instead      lowmem activations, float32 AdamW's moments in host
                               memory, one batch

    python benchmarks/finetune_memory.py --models llama-1b,llama-7b
    python benchmarks/finetune_memory.py --quick       # llama-tiny, four rows: that it runs
"""

import argparse

import jax
import optax
from rich.console import Console
from rich.table import Table

import lowmem_jax as lm
from lowmem_jax import app

import _quick  # beside this script in benchmarks/

LR = 1e-5
# The model's technique sets (lowmem_jax.app.techniques); the optimizers are the rows' own.
LOWMEM = "all+fused-ce"
# --quick: llama-tiny, 2 x 64 tokens, k = 2, the default target, without the rows of 8-bit
# moments or bfloat16 parameters (each compiles for 10 s or more even so); not results.
QUICK = dict(models="llama-tiny", batch=2, seq=64, k=2, target=None)
QUICK_SKIPS = ("8-bit", "bfloat16 parameters")


def rows(k: int) -> dict:
  """``{row: (the model's technique set, optimizer, micro-batches, fold in backward)}``."""
  lowmem = LOWMEM
  bf16_params = f"{LOWMEM}+8bit+bf16-params"
  return {
      "AdamW float32": ("baseline", optax.adamw(LR), 1, False),
      "+ lowmem activations": (lowmem, optax.adamw(LR), 1, False),
      f"+ AdamA (k={k}, fold in backward)": (lowmem, lm.adamaw(LR, k), k, True),
      "+ 8-bit moments (AdamA in the scan body)": (lowmem, lm.adamaw(LR, k, state_bits=8), k,
                                                   False),
      "+ bfloat16 parameters (stochastic rounding)": (
          bf16_params,
          optax.chain(lm.adamaw(LR, k, state_bits=8), lm.lowbit.stochastic_rounding()), k, False),
      "8-bit Adam instead of AdamA": (lowmem, lm.lowbit.adamw_8bit(LR), 1, False),
      "8-bit Adam, + bfloat16 parameters": (
          bf16_params, optax.chain(lm.lowbit.adamw_8bit(LR), lm.lowbit.stochastic_rounding()), 1, False),
      "8-bit Adam, bf16 parameters, + moments in host memory": (
          bf16_params, optax.chain(lm.offload.offload_state(lm.lowbit.adamw_8bit(LR)),
                                   lm.lowbit.stochastic_rounding()), 1, False),
      "AdamW offloaded instead of AdamA": (lowmem, lm.offload.offload_state(optax.adamw(LR)), 1, False),
  }


def peak(name: str, batch: int, seq: int, text: str, tx, k: int, fold: bool,
         target) -> tuple[int, int, int, int]:
  """Compiled device peak, parameter bytes, optimizer-state bytes and host-memory argument
  bytes of one step."""
  wl = app.parse(text).workload(app.Job(name, batch, seq, target=target))
  params = wl.abstract_params()
  if k == 1:
    step = wl.train_step(tx)
  else:
    step = lm.microbatch_step(lambda p, b: wl.loss(p, *b), tx, k, fold_in_backward=fold)
  state = lm.offload.abstract_state(tx, params)
  stats = lm.memory.analyze(jax.jit(step, donate_argnums=(0, 1)), params, state,
                            (wl.inputs, wl.labels), target=target)
  return (stats.peak_bytes, lm.memory.tree_bytes(params), lm.memory.tree_bytes(state),
          stats.host_argument_bytes)


def main(argv=None):
  """Prints the tables; returns ``{model: {row: (peak, parameter, state, host bytes)}}``."""
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", default="llama-1b")
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=2048)
  parser.add_argument("--k", type=int, default=4, help="AdamA's micro-batches")
  parser.add_argument("--target", default="h100")
  parser.add_argument("--quick", action="store_true",
                      help="llama-tiny, 2 x 64 tokens, k = 2, targets.default() (h100 where the "
                           "target packages are, else the CPU), no 8-bit or bfloat16-parameter "
                           "rows: checks that the script runs; its figures are not results")
  args = _quick.parse_args(parser, argv, QUICK)
  target = lm.targets.resolve(args.target)
  console = Console(width=160)
  console.print(target.note, highlight=False)
  found = {}
  for name in args.models.split(","):
    table = Table(title=f"{name} full fine-tune, batch {args.batch} x {args.seq} tokens, one "
                        f"step (GiB; compiled for {target.name})")
    for col in ("techniques", "parameters", "optimizer state", "in host memory", "compiled peak",
                "× less"):
      table.add_column(col, justify="left" if col == "techniques" else "right")
    base, found[name] = None, {}
    for row, (text, tx, k, fold) in rows(args.k).items():
      if args.quick and any(word in row for word in QUICK_SKIPS):
        continue
      total, params, state, host = found[name][row] = peak(name, args.batch, args.seq, text, tx,
                                                           k, fold, target)
      base = base or total
      table.add_row(row, *(f"{b / 2**30:.2f}" for b in (params, state, host, total)),
                    f"{base / total:.2f}")
      console.print(f"  {name}: {row} compiled", highlight=False)
    console.print(table)
  return found


if __name__ == "__main__":
  main()
