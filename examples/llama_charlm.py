"""A LLaMA-style character language model of the Python standard library's own sources.

Data: the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` of the
interpreter that runs this, in sorted path order, without ``site-packages``
and test folders (``test``, ``tests``, ``idle_test``), read as UTF-8, taken
until ``--corpus-mb`` million characters. Every 10th file (the 10th, 20th,
...) is validation, the rest training. Tokens are characters: an ASCII
character is its code (0..127), every other character is token 0 (NUL, which
source files do not contain), so the vocabulary is 128. Training batch ``i``
is ``--batch`` windows of ``--seq`` + 1 characters at offsets drawn by
``np.random.default_rng([seed, i])``: the same for the same ``i``, so a
resumed run sees the batches an uninterrupted one would. Validation is a
fixed set of ``--val-windows`` windows (offsets from ``default_rng(0)``), the
same for every run and seed; its loss is the mean over every predicted
character, in nats per character.

Model: `lowmem_jax.models.Llama`, float32, with
``LlamaConfig(vocab_size=128, dim=128, n_layers=4, n_heads=4, ffn_dim=384)``
(quick: dim 64, 2 layers, 2 heads, ffn 192), next-character cross-entropy.
Every run starts from the same initial params (each model initialised with
the key ``--seed``: every tensor the trees share is equal, which is checked;
MS-RMSNorm holds RMSNorm's scale, so at init all compute the same function) and trains the same ``--steps`` on the same batches at
the same ``--lr`` (fixed, or ``--schedule cosine``: a warm-up and a cosine
decay over the steps, the same for every row). The rows:

  baseline    exact SiLU, RMSNorm, optax.adam on the whole batch
  resilu2     activation="approx": ReSiLU2 on the SwiGLU gate, a 2-bit residual
  ms-rmsnorm  norm="ms": MS-RMSNorm, the norm's output shared with the next matmul
  fused-ce    loss="fused": the head's cross-entropy block by block
              (lowmem_jax.ops.losses.linear_cross_entropy), no logits kept
  adama       lowmem_jax.microbatch_step with lowmem_jax.adamaw(lr, k, weight_decay=0)
              on the same batch in k = 4 micro-batches
              (``--nu-scale``, default "mean_sq": where the micro-batch gradients agree its
              v is Adam's / k, so its steps are up to sqrt(k) times Adam's; "mean" gives
              Adam's v there)
  lowmem      all four: ReSiLU2, MS-RMSNorm, the fused loss and AdamA over k micro-batches
  streamed    the baseline's model with bfloat16 parameters (the same initial params rounded
              to nearest), trained by lowmem_jax.optim.layer_streamed over
              lowmem_jax.models.llama.layer_stack: the optimizer inside the backward, one
              layer at a time, the step called once per micro-batch (k calls a step, on
              microbatch_step's strided micro-batches), with optax.chain(lowmem_jax.adamaw(lr,
              k, weight_decay=0, state_bits=8), lowmem_jax.optim.lowbit.stochastic_rounding(seed)):
              AdamA, 8-bit moments, the bfloat16 sums rounded stochastically

Every row has the same weight decay, none: the baseline's optax.adam is float32 AdamW at
weight decay 0 (optax.adamw adds 0 times the weights), its fair twin, and the adama rows
and streamed's adamaw are AdamA at weight decay 0. Attention is the plain one in every
row (it keeps its float32 probabilities).
Reported per run: validation loss and its difference from the baseline's
(relative), the final training loss (mean of the last 20 steps), and memory:
the compiled peak of the jitted train step (XLA on CPU in float32, a proxy)
and the activations autodiff saves for one micro-batch, at the training batch
and at ``--memory-batch`` windows (abstract shapes). The streamed row's peak is that of
one of its k calls; it has no saved-activations figure (n/a): it differentiates one layer
at a time, keeping each layer's input, so there is no whole-loss autodiff to measure.

    pip install -e ".[examples]"
    python examples/llama_charlm.py --out docs/results   # full: every row, results and plot
    python examples/llama_charlm.py --quick              # smoke test: baseline and lowmem
"""

import argparse
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lowmem_jax.models import Llama, LlamaConfig
from lowmem_jax.models.llama import layer_stack
from lowmem_jax.optim import NU_SCALES
from compare import (TAIL, add_schedule_argument, check_multiple_of_k, check_positive,
                     check_shared, command, memory_lines, run, run_streamed, schedule_text, write)

ROWS = {
    "baseline": {},
    "resilu2": dict(activation="approx"),
    "ms-rmsnorm": dict(norm="ms"),
    "fused-ce": dict(loss="fused"),
    "adama": dict(adama=True),
    "lowmem": dict(activation="approx", norm="ms", loss="fused", adama=True),
    "streamed": dict(adama=True, streamed=True),
}
STEP_KEYS = ("adama", "streamed")  # the keys of ROWS that pick the train step, not Llama's
STREAMED = "layer_streamed, 8-bit moments, bfloat16 params rounded stochastically"
QUICK_ROWS = ("baseline", "lowmem")
CONFIG = LlamaConfig(vocab_size=128, dim=128, n_layers=4, n_heads=4, ffn_dim=384)
QUICK_CONFIG = LlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=2, ffn_dim=192)
SKIP = frozenset({"site-packages", "test", "tests", "idle_test"})
NON_ASCII = 0  # the token of every character outside ASCII


def switches(row: str) -> dict:
  """The `Llama` switches of ``row``: its entries in `ROWS` but `STEP_KEYS`."""
  return {key: value for key, value in ROWS[row].items() if key not in STEP_KEYS}


def source_files() -> list[Path]:
  """The standard library's ``.py`` files in sorted order, without site-packages and tests."""
  root = Path(sysconfig.get_paths()["stdlib"])
  return [p for p in sorted(root.rglob("*.py")) if not SKIP & set(p.relative_to(root).parts)]


def encode(text: str) -> np.ndarray:
  """``uint8[len(text)]`` tokens: ASCII codes, `NON_ASCII` for every other character."""
  codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
  return np.where(codes < 128, codes, NON_ASCII).astype(np.uint8)


def corpus(max_chars: int) -> tuple[np.ndarray, np.ndarray, int]:
  """``(train, validation, files)``: the token streams and the number of files read.

  Files are read in `source_files` order until ``max_chars`` characters; every
  10th of them goes to validation.
  """
  train, validation, total = [], [], 0
  for i, path in enumerate(source_files()):
    if total >= max_chars:
      break
    tokens = encode(path.read_text(encoding="utf-8", errors="replace"))
    (validation if i % 10 == 9 else train).append(tokens)
    total += len(tokens)
  if not validation:
    raise RuntimeError(f"Fewer than 10 source files within {max_chars} characters; "
                       "raise --corpus-mb.")
  return np.concatenate(train), np.concatenate(validation), len(train) + len(validation)


def windows(stream: np.ndarray, n: int, length: int, rng: np.random.Generator) -> np.ndarray:
  """``int32[n, length]``: windows of ``stream`` at offsets drawn from ``rng``."""
  starts = rng.integers(0, len(stream) - length + 1, n)
  return stream[starts[:, None] + np.arange(length)].astype(np.int32)


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
  """The parser and ``argv``'s arguments, the defaults of a full or ``--quick`` run filled in
  and every number checked."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="smoke test: a smaller model, few steps, baseline and lowmem only")
  parser.add_argument("--steps", type=int, default=None, help="default 800, quick 20")
  parser.add_argument("--batch", type=int, default=None, help="windows a step; default 16")
  parser.add_argument("--seq", type=int, default=None, help="characters a window; default 64")
  parser.add_argument("--k", type=int, default=4, help="AdamA micro-batches (adama, lowmem)")
  parser.add_argument("--lr", type=float, default=1e-3)
  add_schedule_argument(parser)
  parser.add_argument("--nu-scale", choices=NU_SCALES, default="mean_sq",
                      help="AdamA's second-moment weight (lowmem_jax.adama)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=None,
                      help=f"the runs to make; default all, quick {' '.join(QUICK_ROWS)}; the "
                           "first is the reference of the differences")
  parser.add_argument("--corpus-mb", type=float, default=None,
                      help="million characters of source to read; default 4, quick 1")
  parser.add_argument("--val-windows", type=int, default=None, help="default 128, quick 16")
  parser.add_argument("--memory-batch", type=int, default=None,
                      help="the larger batch at which memory is also measured; default 128, "
                           "quick: --batch (one compile fewer)")
  parser.add_argument("--eval-every", type=int, default=100)
  parser.add_argument("--checkpoint-dir", help="resume each run from DIR/<run>")
  parser.add_argument("--out", help="write llama_charlm.md and llama_charlm.png to this folder")
  args = parser.parse_args(argv)
  quick = args.quick
  for name, full, small in (("steps", 800, 20), ("batch", 16, 16), ("seq", 64, 64),
                            ("corpus_mb", 4.0, 1.0), ("val_windows", 128, 16)):
    if getattr(args, name) is None:
      setattr(args, name, small if quick else full)
  args.rows = args.rows or list(QUICK_ROWS if quick else ROWS)
  if args.memory_batch is None:
    args.memory_batch = args.batch if quick else 128
  check_positive(parser, args, "steps", "batch", "seq", "k", "val_windows", "memory_batch",
                 "eval_every")
  for name in ("lr", "corpus_mb"):
    if not getattr(args, name) > 0:
      parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
  check_multiple_of_k(parser, args, "batch", "memory_batch")
  return parser, args


def train_rows(args, config: LlamaConfig, train: np.ndarray,
               val: np.ndarray) -> tuple[dict, int]:
  """``(results, shared)``: each row of ``args.rows`` trained from the same initial params on
  ``train``'s batches and evaluated on ``val`` (``int32[windows, seq + 1]``); ``shared`` is the
  number of tensors the rows' initial trees share (each checked equal)."""

  def batch_at(i):
    return windows(train, args.batch, args.seq + 1, np.random.default_rng([args.seed, i]))

  def pair_at(i):  # `layer_stack`'s batch: the inputs and the next-character labels
    tokens = batch_at(i)
    return tokens[:, :-1], tokens[:, 1:]

  def loss_fn(params, tokens, net):  # the model's own head: its loss switch
    return net.apply({"params": params}, tokens[:, :-1], tokens[:, 1:])

  nets, init = {}, {}
  for row in args.rows:  # float32 initial params, rounded for the streamed row
    key = tuple(sorted(switches(row).items()))
    if key not in init:
      init[key] = jax.jit(Llama(config, **switches(row)).init)(
          jax.random.key(args.seed), val[:1, :-1])["params"]
    nets[row] = Llama(config, **switches(row), param_dtype=(
        jnp.bfloat16 if ROWS[row].get("streamed") else jnp.float32))
  first = next(iter(init.values()))
  shared = min(check_shared(params, first) for params in init.values())
  results = {}
  for row in args.rows:
    net = nets[row]
    params = jax.tree.map(lambda p, net=net: p.astype(net.param_dtype),
                          init[tuple(sorted(switches(row).items()))])
    batch_loss = jax.jit(lambda params, tokens, net=net: loss_fn(params, tokens, net))

    def evaluate(state, batch_loss=batch_loss):
      chunks = [batch_loss(state[0], val[i:i + args.batch]) * len(val[i:i + args.batch])
                for i in range(0, len(val), args.batch)]
      return {"val_loss": float(sum(chunks)) / len(val)}

    k = args.k if ROWS[row].get("adama") else 1
    common = dict(args=args, evaluate=evaluate, memory_batch=args.memory_batch)
    if ROWS[row].get("streamed"):
      results[row] = run_streamed(row, layer_stack(net), params, k, pair_at, **common)
    else:
      results[row] = run(row, lambda params, tokens, net=net: loss_fn(params, tokens, net),
                         params, k, batch_at, **common)
  return results, shared


def report(args, argv, config: LlamaConfig, results: dict, corpus_sizes: tuple[int, int, int],
           shared: int, seconds: float) -> str:
  """The markdown report of ``results``: the setting, one table row a run, the memory lines
  and the command; ``corpus_sizes`` is ``(files, training, validation characters)``."""
  n_files, n_train, n_validation = corpus_sizes
  reference = args.rows[0]
  base = results[reference]["val_loss"]
  sizes = {row: sum(p.size for p in jax.tree.leaves(results[row]["params"])) for row in args.rows}
  lines = [
      f"Character-level LLaMA on the Python {sys.version_info.major}.{sys.version_info.minor} "
      f"standard library's sources: {n_files} files, {n_train:,} training and "
      f"{n_validation:,} validation characters (every 10th file), vocabulary 128 (ASCII; "
      f"other characters one token). Llama dim {config.dim}, {config.n_layers} layers, "
      f"{config.n_heads} heads, ffn {config.ffn_dim}, float32; parameters: "
      + ", ".join(f"{row} {n:,}" for row, n in sizes.items())
      + f". {args.steps} steps of {args.batch} windows of {args.seq} + 1 characters, the same "
      f"batches, lr {args.lr:g}{schedule_text(args)} (Adam, or AdamA, nu_scale "
      f"{args.nu_scale}, over k={args.k} "
      f"micro-batches of "
      f"{args.batch // args.k} in the adama rows) and initial params (init key {args.seed}; the "
      f"{shared} tensors the trees share are equal) for every run. Validation: "
      f"{args.val_windows} fixed windows, {args.val_windows * args.seq:,} predicted characters. "
      f"JAX {jax.__version__} on {jax.default_backend()}, {seconds:.0f} s in all."
      + (f" The streamed row: bfloat16 parameters (the initial ones rounded to nearest), "
         f"adamaw (AdamA) at weight decay 0 as Adam's, 8-bit moments, stochastic rounding "
         f"seed {args.seed}, the layer-streamed step called once per micro-batch."
         if "streamed" in results else ""), "",
      f"| run | switches | validation loss (nats/char) | vs {reference} (relative) | "
      f"final training loss (mean of last {TAIL} steps) |", "|---|---|---:|---:|---:|"]
  names = {"adama": f"AdamA k={args.k}", "streamed": STREAMED}
  for row, r in results.items():
    described = ", ".join(names.get(k, f"{k}={v}")
                          for k, v in ROWS[row].items()) or "exact SiLU, RMSNorm, Adam"
    lines.append(f"| {row} | {described} | {r['val_loss']:.4f} | "
                 f"{(r['val_loss'] - base) / base:+.2%} | {r['train_loss']:.4f} |")
  lines += ["", "The parity target: validation loss within 1% of the baseline's.", ""]
  lines += memory_lines(results, args.batch, args.memory_batch,
                        {row: args.k if ROWS[row].get("adama") else 1 for row in args.rows})
  if "streamed" in results:
    lines.append("The streamed row's peak is one of its k calls of the layer-streamed step; it "
                 "differentiates one layer at a time, keeping each layer's input, so there is "
                 "no whole-loss autodiff to measure saved activations of (n/a).")
  lines += ["", "    " + command("llama_charlm.py", argv)]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
  parser, args = parse_args(argv)
  start = time.time()
  config = QUICK_CONFIG if args.quick else CONFIG
  train, validation, n_files = corpus(int(args.corpus_mb * 1e6))
  if min(len(train), len(validation)) <= args.seq + 1:
    parser.error(f"--seq {args.seq} is longer than the corpus; raise --corpus-mb")
  val = windows(validation, args.val_windows, args.seq + 1, np.random.default_rng(0))
  results, shared = train_rows(args, config, train, val)
  seconds = time.time() - start
  text = report(args, argv, config, results, (n_files, len(train), len(validation)), shared,
                seconds)
  print(text)
  write(args.out, "llama_charlm", text, results, "Character LLaMA on stdlib sources: training loss")
  base = results[args.rows[0]]["val_loss"]
  return {"results": results, "relative_diff": {row: (r["val_loss"] - base) / base
                                                for row, r in results.items()},
          "shared_params": shared, "seconds": seconds, "text": text}


if __name__ == "__main__":
  main()
