"""Memory and step time of AdamA against gradient accumulation.

LLaMA-style reference models with float32 params, GPT-2-small-sized and
BERT-large-sized, trained over k micro-batches per optimizer step. For each
way to accumulate it prints, from XLA's compiled memory analysis of the
jitted step on abstract shapes (params and optimizer state donated; on CPU a
proxy, see lowmem_jax.compile.memory):
  - the peak bytes, and the bytes beyond the params and optimizer state
    (activations, gradients, accumulators, copies);
  - the difference from the baseline's peak (accumulate; for the scanned
    model, AdamA with the scan's own backward), in gradient sizes and in %;
and, at a size a 2-core CPU runs in seconds, the step-time ratio against
scan-accumulate-then-Adam (median of --repeats runs after one warm-up).

The ways to accumulate:
  multisteps     optax.MultiSteps(optax.adam), one jitted call per micro-batch
  accumulate     lowmem_jax.microbatch_step with optax.adam: scan, sum, then Adam
  optax.microbatch  optax.microbatch of the gradient (mean), then Adam
  adama          lowmem_jax.microbatch_step with AdamA: fold in the scan body
  adama+fold-in-backward  AdamA, each param's gradient folded in its backward rule
                 (fold_in_backward=True)
On the same models with stacked layers and per-layer remat ("scanned"):
  adama          AdamA, gradient of the stacked layers from the scan's backward
  adama+fold-in-backward  the layers' gradients folded in their backward rule

``--loss fused`` gives the unscanned model the fused loss head
(``Llama(loss="fused")``). The token embedding is ``Llama(embedding="late")``
(`lowmem_jax.ops.embedding.take`, exact), whose gradient buffer XLA would
otherwise make at the start of each micro-batch's backward; ``--embedding
plain`` measures with `nn.Embed` (the scanned model: ``table[ids]``).
``--plain-step`` prints instead the peak of one AdamW step without
micro-batches, with each embedding (8 x 512 tokens). ``--stack`` prints instead issue 21's example: 8
float32 layers of 1024 x 1024, not scanned, k = 4, batch 4 x 256, AdamW, XLA's
temp and peak bytes for accumulation, AdamA and AdamA folding in the backward.

    python benchmarks/adama.py                 # both models, k = 4 and 8
    python benchmarks/adama.py --models gpt2-small --ks 4 --repeats 3
    python benchmarks/adama.py --models gpt2-small bert-large --ks 4 --loss fused --no-timing
    python benchmarks/adama.py --stack
    python benchmarks/adama.py --quick         # a two-layer model, k = 2: that it runs
"""

import argparse
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from rich.console import Console
from rich.table import Table

import lowmem_jax as lm
from lowmem_jax.models import llama
from lowmem_jax.models.llama import Llama, LlamaConfig, TransformerBlock

import _quick  # beside this script in benchmarks/

CONFIGS = {
    # GPT-2 small's sizes (124M with tied embeddings); SwiGLU width 2048 holds as
    # many weights as GPT-2's 3072-wide MLP.
    "gpt2-small": LlamaConfig(vocab_size=50257, dim=768, n_layers=12, n_heads=12, ffn_dim=2048),
    # BERT-large's sizes (335M), SwiGLU width 2816 ~ its 4096-wide MLP.
    "bert-large": LlamaConfig(vocab_size=30522, dim=1024, n_layers=24, n_heads=16, ffn_dim=2816),
    # for the step-time ratio on CPU
    "small": LlamaConfig(vocab_size=4096, dim=256, n_layers=4, n_heads=4, ffn_dim=688),
    "llama-tiny": llama.CONFIGS["llama-tiny"],  # --quick
}
# --quick: the same tables at sizes that compile and run in seconds; not results.
QUICK = dict(models=["llama-tiny"], ks=[2], micro_batch=1, length=32, repeats=1,
             time_model="llama-tiny", time_length=32, time_methods=["adama"])
LR = 1e-3


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class Scanned:
  """The LLaMA-style model with stacked layers: ``params["layers"]`` leaves are ``[layers, ...]``."""

  def __init__(self, config, embedding="late"):
    self.config = config
    self.lookup = lm.embedding.take if embedding == "late" else lambda table, ids: table[ids]
    self.block = TransformerBlock(config, "exact", "plain", "plain", jnp.float32, jnp.float32)

  def init(self, rng, length):
    cfg = self.config
    keys = jax.random.split(rng, cfg.n_layers + 2)
    x = jnp.zeros((1, length, cfg.dim))
    layers = jax.vmap(lambda key: self.block.init(key, x)["params"])(keys[2:])
    normal = jax.nn.initializers.normal(0.02)
    return {"tok_embeddings": normal(keys[0], (cfg.vocab_size, cfg.dim)), "layers": layers,
            "norm": jnp.ones(cfg.dim), "output": normal(keys[1], (cfg.dim, cfg.vocab_size))}

  def loss(self, params, batch, moments=None):
    tokens, labels = batch
    layer = lambda p, h: self.block.apply({"params": p}, h)
    if moments is None:
      layer = jax.checkpoint(layer)  # per-layer remat, as the fold-in-backward rule does
    h = lm.optim.scan_layers(layer, self.lookup(params["tok_embeddings"], tokens), params["layers"], moments)
    h = nn.RMSNorm(epsilon=self.config.norm_eps).apply({"params": {"scale": params["norm"]}}, h)
    return cross_entropy(h @ params["output"], labels)


def unscanned(config, head="plain", embedding="late"):
  model = Llama(config, loss=head, embedding=embedding)
  init = lambda rng, length: model.init(rng, jnp.zeros((1, length), jnp.int32))["params"]
  loss = lambda params, batch: model.apply({"params": params}, batch[0], batch[1])
  return init, loss


def adama_tx(k):
  return optax.chain(lm.adama(k), optax.scale_by_learning_rate(LR))


def methods(config, k, head="plain", embedding="late"):
  """``{name: (step, tx, per_micro_batch)}`` for the unscanned and scanned models."""
  init, loss = unscanned(config, head, embedding)
  adam = optax.adam(LR)
  multi = optax.MultiSteps(optax.adam(LR), k)

  def multisteps(params, state, micro_batch):
    updates, state = multi.update(jax.grad(loss)(params, micro_batch), state, params)
    return optax.apply_updates(params, updates), state

  out = {
      "multisteps": (init, multisteps, multi, True),
      "accumulate": (init, lm.microbatch_step(loss, adam, k), adam, False),
  }
  if hasattr(optax, "microbatch"):
    def microbatched(params, state, batch):
      grad = optax.microbatch(jax.grad(loss), argnums=1, microbatch_size=batch[0].shape[0] // k,
                              accumulator=optax.microbatching.AccumulationType.MEAN)
      updates, state = adam.update(grad(params, batch), state, params)
      return optax.apply_updates(params, updates), state
    out["optax.microbatch"] = (init, microbatched, adam, False)
  out["adama"] = (init, lm.microbatch_step(loss, adama_tx(k), k), adama_tx(k), False)
  out["adama+fold-in-backward"] = (
      init, lm.microbatch_step(loss, adama_tx(k), k, fold_in_backward=True), adama_tx(k), False)
  scanned = Scanned(config, embedding)
  out["scanned adama"] = (scanned.init, lm.microbatch_step(scanned.loss, adama_tx(k), k),
                          adama_tx(k), False)
  out["scanned adama+fold-in-backward"] = (
      scanned.init,
      lm.microbatch_step(scanned.loss, adama_tx(k), k, fold_in_backward=lm.optim.FoldInBackward()),
      adama_tx(k), False)
  return out


def shapes(init, tx, config, k, micro_batch, length, per_micro_batch):
  params = jax.eval_shape(lambda rng: init(rng, length), jax.random.key(0))
  rows = micro_batch if per_micro_batch else k * micro_batch
  tokens = jax.ShapeDtypeStruct((rows, length), jnp.int32)
  return params, jax.eval_shape(tx.init, params), (tokens, tokens)


def memory_table(model, k, micro_batch, length, head="plain", embedding="late"):
  config = CONFIGS[model]
  rows = []
  for name, (init, step, tx, per_micro_batch) in methods(config, k, head, embedding).items():
    params, state, batch = shapes(init, tx, config, k, micro_batch, length, per_micro_batch)
    jitted = jax.jit(step, donate_argnums=(0, 1))
    start = time.perf_counter()
    stats = lm.memory.analyze(jitted, params, state, batch)
    rows.append((name, stats, lm.memory.tree_bytes(params)))
    print(f"  {model} k={k} {name}: compiled in {time.perf_counter() - start:.0f} s", flush=True)
  return rows


def step_times(k, micro_batch, length, repeats, model="small", only=None):
  """Median seconds per optimizer step, ``model`` (default the small one), real arrays; of
  accumulate (the ratios' reference) and the methods named in ``only`` (default all)."""
  config = CONFIGS[model]
  times = {}
  for name, (init, step, tx, per_micro_batch) in methods(config, k).items():
    if only and name not in (*only, "accumulate"):
      continue
    params = init(jax.random.key(0), length)
    state = tx.init(params)
    tokens = jax.random.randint(jax.random.key(1), (k * micro_batch, length), 0, config.vocab_size)
    batch = (tokens, jnp.roll(tokens, -1, axis=1))
    jitted = jax.jit(step, donate_argnums=(0, 1))
    calls = ([jax.tree.map(lambda x, i=i: x[i * micro_batch:(i + 1) * micro_batch], batch)
              for i in range(k)] if per_micro_batch else [batch])
    samples = []
    for rep in range(repeats + 1):
      start = time.perf_counter()
      for call in calls:
        params, state = jitted(params, state, call)[:2]
      jax.block_until_ready(params)
      if rep:
        samples.append(time.perf_counter() - start)
    times[name] = statistics.median(samples)
  return times


def dense_stack_loss(params, batch):
  """Layers ``tanh(x @ w)`` for each ``w`` of the list ``params``, then the squared error."""
  x, y = batch
  for w in params:
    x = jnp.tanh(x @ w)
  return jnp.mean((x - y) ** 2)


def stack_table(k: int = 4) -> Table:
  """Issue 21's example: 8 float32 layers of 1024 x 1024, batch 4 x 256, AdamW."""
  params = [jax.ShapeDtypeStruct((1024, 1024), jnp.float32)] * 8
  batch = (jax.ShapeDtypeStruct((4 * 256, 1024), jnp.float32),) * 2
  table = Table(title=f"8 float32 layers of 1024 x 1024, k={k}, batch 4 x 256, AdamW "
                      f"(gradient {lm.memory.tree_bytes(params) / 2**20:.0f} MiB)")
  for col in ("step", "temp MiB", "peak MiB"):
    table.add_column(col, justify="left" if col == "step" else "right")
  for name, tx, options in (("accumulate, then AdamW", optax.adamw(LR), None),
                            ("AdamA (microbatch_step)", lm.adamaw(LR, k), None),
                            ("AdamA, fold_in_backward=True", lm.adamaw(LR, k), True)):
    step = jax.jit(lm.microbatch_step(dense_stack_loss, tx, k, fold_in_backward=options),
                   donate_argnums=(0, 1))
    stats = lm.memory.analyze(step, params, jax.eval_shape(tx.init, params), batch)
    table.add_row(name, f"{stats.temp_bytes / 2**20:.1f}", f"{stats.peak_bytes / 2**20:.1f}")
  return table


def plain_step_table(models) -> Table:
  """The peak of one AdamW step (8 x 512 tokens, no micro-batches) with each token embedding."""
  table = Table(title="one AdamW step, 8 x 512 tokens, no micro-batches: peak MiB")
  for col in ("model", "nn.Embed", "late"):
    table.add_column(col, justify="left" if col == "model" else "right")
  for model in models:
    peaks = []
    for embedding in ("plain", "late"):
      init, loss = unscanned(CONFIGS[model], embedding=embedding)
      tx = optax.adam(LR)
      step = jax.jit(lm.optim.train_step(loss, tx), donate_argnums=(0, 1))
      peaks.append(lm.memory.analyze(step, *shapes(init, tx, CONFIGS[model], 1, 8, 512, False))
                   .peak_bytes)
    table.add_row(model, *(f"{p / 2**20:,.0f}" for p in peaks))
  return table


def main(argv=None):
  """Prints the tables; returns ``{"peaks": {(model, k): {method: peak bytes}}, "times":
  {method: seconds}}`` (``times`` empty with --no-timing)."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", nargs="+", default=["gpt2-small", "bert-large"])
  parser.add_argument("--ks", nargs="+", type=int, default=[4, 8])
  parser.add_argument("--micro-batch", type=int, default=2)
  parser.add_argument("--length", type=int, default=512)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--loss", choices=("plain", "fused"), default="plain",
                      help="the unscanned model's loss head")
  parser.add_argument("--embedding", choices=("late", "plain"), default="late",
                      help="the token embedding (Llama's embedding switch)")
  parser.add_argument("--no-timing", action="store_true")
  parser.add_argument("--stack", action="store_true", help="issue 21's 8-layer example only")
  parser.add_argument("--plain-step", action="store_true",
                      help="one AdamW step without micro-batches, each embedding, only")
  parser.add_argument("--time-model", default="small", help="the model of the step-time table")
  parser.add_argument("--time-length", type=int, default=128, help="its tokens per example")
  parser.add_argument("--time-methods", nargs="+",
                      help="the methods timed beside accumulate (default all)")
  parser.add_argument("--quick", action="store_true",
                      help="llama-tiny, k = 2, 1 x 32 tokens, one timed step of accumulate and "
                           "adama: checks that the script runs; its figures are not results")
  args = _quick.parse_args(parser, argv, QUICK)
  console = Console()
  if args.stack:
    console.print(lm.targets.default().note, highlight=False)
    console.print(stack_table())
    return
  if args.plain_step:
    console.print(lm.targets.default().note, highlight=False)
    console.print(plain_step_table(args.models))
    return
  mib = lambda b: f"{b / 2**20:,.0f}"
  peaks = {}
  for model in args.models:
    for k in args.ks:
      rows = memory_table(model, k, args.micro_batch, args.length, args.loss, args.embedding)
      by_name = {name: stats for name, stats, _ in rows}
      peaks[model, k] = {name: stats.peak_bytes for name, stats in by_name.items()}
      grad_bytes = rows[0][2]
      table = Table(title=f"{model}, k={k}, micro-batch {args.micro_batch}x{args.length} tokens, "
                          f"float32 params {mib(grad_bytes)} MiB (= gradient bytes)")
      for col in ("method", "peak MiB", "beyond params+state MiB", "peak - baseline peak"):
        table.add_column(col, justify="left" if col == "method" else "right")
      for name, stats, _ in rows:
        base = by_name["scanned adama"] if name.startswith("scanned") else by_name["accumulate"]
        delta = stats.peak_bytes - base.peak_bytes
        table.add_row(name, mib(stats.peak_bytes), mib(stats.peak_bytes - stats.argument_bytes),
                      f"{mib(delta)} MiB ({delta / grad_bytes:+.2f} x gradient, "
                      f"{delta / base.peak_bytes:+.1%})")
      console.print(table)
  if args.no_timing:
    return {"peaks": peaks, "times": {}}
  times = step_times(4, args.micro_batch, args.time_length, args.repeats, args.time_model,
                     args.time_methods)
  table = Table(title=f"step time, {args.time_model} LLaMA-style model, k=4, micro-batch "
                      f"{args.micro_batch}x{args.time_length}, CPU, median of {args.repeats}")
  table.add_column("method")
  table.add_column("seconds per step", justify="right")
  table.add_column("vs accumulate", justify="right")
  for name, seconds in times.items():
    table.add_row(name, f"{seconds:.3f}", f"{seconds / times['accumulate']:.3f}")
  console.print(table)
  return {"peaks": peaks, "times": times}


if __name__ == "__main__":
  main()
