"""Baseline against lowmem, one run (row) at a time: the examples' shared steps.

`run` builds a row's train step (Adam, or AdamA over k micro-batches through
`lowmem_jax.microbatch_step`), compiles it once, measures it (the compiled
peak and the activations autodiff saves for one micro-batch), trains it with
`loop.train` and returns its figures; `run_streamed` does the same for the
layer-streamed step (`lowmem_jax.optim.layer_streamed`, called once per
micro-batch); `memory_lines` and `write` turn the rows into Markdown and a plot.
"""

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lowmem_jax as lm
import loop

TAIL = 20  # the final training loss is the mean over these last steps
# Arguments a resumed run may change: they do not change the steps it takes.
RUN_ONLY = ("steps", "checkpoint_dir", "out", "rows", "eval_every", "memory_batch")
SCHEDULES = ("constant", "cosine")
WARMUP = 0.05  # the cosine schedule's linear warm-up, a fraction of the steps
FINAL_LR = 0.1  # the cosine schedule's last lr, a fraction of ``--lr``


def add_schedule_argument(parser: argparse.ArgumentParser) -> None:
  """Adds ``--schedule``, which `learning_rate` reads."""
  parser.add_argument(
      "--schedule", choices=SCHEDULES, default="constant",
      help=f"constant: --lr every step; cosine: a linear warm-up over {WARMUP:.0%} of --steps "
           f"from 0 to --lr, then a cosine decay that reaches {FINAL_LR:g} x --lr after --steps")


def learning_rate(args: argparse.Namespace) -> optax.ScalarOrSchedule:
  """``args.lr``, or with ``args.schedule == "cosine"`` an `optax.Schedule` over ``args.steps``
  optimizer steps (`optax.warmup_cosine_decay_schedule`, warm-up `WARMUP`, end `FINAL_LR`)."""
  if args.schedule == "constant":
    return args.lr
  warmup = min(max(1, round(WARMUP * args.steps)), args.steps - 1)  # one step: no warm-up
  return optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps,
                                            FINAL_LR * args.lr)


def batch_indices(n: int, steps: int, batch: int, seed: int) -> np.ndarray:
  """``int[steps, batch]``: consecutive batches of epochs of a seeded permutation of ``n``."""
  order = np.random.default_rng(seed)
  epochs = -(-steps * batch // n)
  return np.concatenate([order.permutation(n) for _ in range(epochs)])[:steps * batch].reshape(
      steps, batch)


def schedule_text(args: argparse.Namespace) -> str:
  """How `learning_rate` uses ``args.lr``, for the examples' summaries: "" when constant."""
  if args.schedule == "constant":
    return ""
  return (f" at the peak of a cosine schedule (warm-up {WARMUP:.0%} of the steps, "
          f"{FINAL_LR:g} x lr at the last)")


def optimizer(lr: optax.ScalarOrSchedule, k: int,
              nu_scale: str = "mean_sq") -> optax.GradientTransformation:
  """``optax.adam(lr)`` for k = 1, else AdamA over k micro-batches at the same lr
  (`lowmem_jax.adamaw` at weight decay 0: a schedule counts optimizer steps; with a fixed lr
  it equals ``optax.chain(adama(k), optax.scale_by_learning_rate(lr))``, which the figures
  before this option used, to float rounding).

  ``nu_scale`` is `lowmem_jax.adama`'s: with the default "mean_sq", when the k
  micro-batch gradients agree, v is Adam's v / k and the step up to sqrt(k)
  times Adam's; "mean" gives Adam's v there.
  """
  if k == 1:
    return optax.adam(lr)
  return lm.adamaw(lr, k, nu_scale=nu_scale, weight_decay=0.0)


def streamed_optimizer(lr: optax.ScalarOrSchedule, k: int, nu_scale: str,
                       seed: int) -> optax.GradientTransformation:
  """AdamA over k micro-batches (`lowmem_jax.adamaw`, weight decay 0: `optimizer`'s Adam and
  AdamA) with 8-bit moments, then `lowmem_jax.optim.lowbit.stochastic_rounding` for bfloat16
  parameters; both draw their rounding bits from ``seed``."""
  return optax.chain(lm.adamaw(lr, k, nu_scale=nu_scale, weight_decay=0.0, state_bits=8,
                               seed=seed),
                     lm.lowbit.stochastic_rounding(seed))


def train_step(loss_fn: Callable, tx: optax.GradientTransformation, k: int) -> Callable:
  """The jitted ``step(state, batch) -> (state, metrics)`` of `loop.train`, state donated.

  ``state`` is ``(params, opt_state)``; ``loss_fn(params, batch)`` the mean
  loss, float32 []; the step is `lowmem_jax.optim.train_step`'s (k > 1: AdamA
  folds each micro-batch gradient into its moments).
  """
  inner = lm.optim.train_step(loss_fn, tx, k)

  def step(state, batch):
    params, opt_state, metrics = inner(*state, batch)
    return (params, opt_state), metrics
  return jax.jit(step, donate_argnums=0)


def with_leading(batch: Any, n: int) -> Any:
  """``jax.ShapeDtypeStruct`` pytree of ``batch`` with leading axis ``n``; allocates nothing."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct((n, *a.shape[1:]), a.dtype), batch)


def saved_bytes(loss_fn: Callable, params: Any, batch: Any, k: int) -> int:
  """Activation bytes autodiff saves for ``loss_fn`` on one micro-batch (a k-th of ``batch``)."""
  n = jax.tree.leaves(batch)[0].shape[0]
  return lm.memory.saved_residuals(loss_fn, params, with_leading(batch, n // k)).activation_bytes


def memory(step: Callable, state: Any, loss_fn: Callable, batch: Any, k: int) -> dict[str, int]:
  """Bytes of a train step at ``batch``'s shapes (arrays or ``ShapeDtypeStruct``).

  Returns ``{"peak": compiled peak of step(state, batch), "saved": `saved_bytes`}``.
  """
  return {"peak": lm.memory.analyze(step, state, batch).peak_bytes,
          "saved": saved_bytes(loss_fn, state[0], batch, k)}


def run(row: str, loss_fn: Callable, params: Any, k: int, batch_at: Callable[[int], Any], *,
        args: argparse.Namespace, evaluate: Callable, memory_batch: int) -> dict:
  """Trains one row with `loop.train`: ``--steps`` of `train_step` from a copy of ``params``.

  The step that trains is the program measured at the training batch
  (`lowmem_jax.compile.memory.aot_compile`). Resumes from ``args.checkpoint_dir/row``
  when given. Returns the history, the final params and state, the last
  evaluation's figures, the final training loss (mean of the last `TAIL`
  steps) and `memory` at the training batch (``memory``) and at
  ``memory_batch`` examples (``memory_large``).
  """
  tx = optimizer(learning_rate(args), k, args.nu_scale)
  params = jax.tree.map(jnp.copy, params)  # the step donates its state
  state = (params, tx.init(params))
  batch = batch_at(0)
  # Compiled once for the devices it runs on (remat kept on CPU): measured and run.
  step = lm.memory.aot_compile(train_step(loss_fn, tx, k), state, batch, target="attached")
  figures = {"memory": {"peak": lm.memory.stats_of(step).peak_bytes,
                        "saved": saved_bytes(loss_fn, params, batch, k)}}
  n = jax.tree.leaves(batch)[0].shape[0]
  figures["memory_large"] = figures["memory"] if memory_batch == n else memory(
      train_step(loss_fn, tx, k), state, loss_fn, with_leading(batch, memory_batch), k)
  return {**fit(row, step, state, batch_at, args=args, evaluate=evaluate), **figures}


def run_streamed(row: str, stack: lm.optim.LayerStack, params: Any, k: int,
                 batch_at: Callable[[int], Any], *, args: argparse.Namespace,
                 evaluate: Callable, memory_batch: int) -> dict:
  """`run` for the layer-streamed step of ``stack`` with `streamed_optimizer`.

  A training step is k calls of `lowmem_jax.optim.layer_streamed`'s step, one
  per strided micro-batch (rows i, i + k, ...: `lowmem_jax.microbatch_step`'s),
  its loss their mean. The memory figures are one call's compiled peak (the
  program that runs, k times a step) and no saved activations (None): the
  step differentiates one layer at a time, keeping each layer's input, so
  there is no whole-loss autodiff to measure.
  """
  tx = streamed_optimizer(learning_rate(args), k, args.nu_scale, args.seed)
  streamed = lm.optim.layer_streamed(stack, tx)
  params = jax.tree.map(jnp.copy, params)  # the step donates its state
  state = (params, streamed.init(params))
  micro = lambda batch, i: jax.tree.map(lambda x: x[i::k], batch)
  first = micro(batch_at(0), 0)
  jitted = jax.jit(streamed.step, donate_argnums=(0, 1))
  call = lm.memory.aot_compile(jitted, *state, first, target="attached")

  def step(state, batch):
    params, opt_state = state
    losses = []
    for i in range(k):
      params, opt_state, metrics = call(params, opt_state, micro(batch, i))
      losses.append(metrics["loss"])
    return (params, opt_state), {"loss": sum(losses) / k}

  figures = {"memory": {"peak": lm.memory.stats_of(call).peak_bytes, "saved": None}}
  n = jax.tree.leaves(first)[0].shape[0] * k
  figures["memory_large"] = figures["memory"] if memory_batch == n else {
      "peak": lm.memory.analyze(jitted, *state, with_leading(first, memory_batch // k)).peak_bytes,
      "saved": None}
  return {**fit(row, step, state, batch_at, args=args, evaluate=evaluate), **figures}


def fit(row: str, step: Callable, state: Any, batch_at: Callable[[int], Any], *,
        args: argparse.Namespace, evaluate: Callable) -> dict:
  """``args.steps`` of ``step`` from ``state`` with `loop.train`, resumed from
  ``args.checkpoint_dir/row`` when given: the history, the final params and
  state, the final training loss (mean of the last `TAIL` steps) and the last
  evaluation's figures."""
  checkpoint = None if args.checkpoint_dir is None else str(Path(args.checkpoint_dir) / row)
  # A cosine schedule spans --steps, so a resumed run must keep them.
  run_only = RUN_ONLY if args.schedule == "constant" else set(RUN_ONLY) - {"steps"}
  settings = {k: v for k, v in vars(args).items() if k not in run_only}
  state, history = loop.train(step, state, batch_at, steps=args.steps, desc=row,
                              evaluate=evaluate, eval_every=args.eval_every,
                              checkpoint_dir=checkpoint, settings=settings)
  train_loss = float(np.mean([loss for _, loss in history["loss"][-TAIL:]]))
  return {"history": history, "params": state[0], "state": state, "train_loss": train_loss,
          **history["eval"][-1][1]}


def memory_lines(results: dict, batch: int, memory_batch: int, k: dict[str, int]) -> list[str]:
  """Markdown table of each row's memory figures (`run`'s, `run_streamed`'s: None is n/a),
  with what they are."""
  mib = lambda b: f"{b / 2**20:.2f}"
  base = results[next(iter(results))]
  sizes = [("memory", batch)] + ([("memory_large", memory_batch)] if memory_batch != batch else [])
  lines = ["| run | " + " | ".join(f"compiled peak, batch {n} (MiB) | saved activations, batch "
                                    f"{n} (MiB)" for _, n in sizes) + " |",
           "|---|" + "---:|---:|" * len(sizes)]
  for row, r in results.items():
    cells = []
    for key, _ in sizes:
      for kind in ("peak", "saved"):
        value, reference = r[key][kind], base[key][kind]
        if value is None:
          cells.append("n/a")
        elif r is base or reference is None:
          cells.append(mib(value))
        else:
          cells.append(f"{mib(value)} ({reference / value:.2f}x less)")
    lines.append(f"| {row} | " + " | ".join(cells) + " |")
  micro = "; ".join(f"{row}: " + " and ".join(str(n // k[row]) for _, n in sizes)
                    for row in results)
  lines += ["", "Compiled peak: XLA's buffer assignment of the whole jitted train step "
            "(`lowmem_jax.compile.memory.analyze`) on CPU in float32, a proxy for an accelerator's. "
            "Saved activations: what autodiff keeps for the backward pass of one micro-batch's "
            f"loss (`lowmem_jax.compile.memory.saved_residuals`); examples in that micro-batch, {micro}."]
  if memory_batch != batch:
    lines.append(f"The batch-{memory_batch} figures are compiled on abstract shapes; nothing "
                 "was trained at that batch.")
  return lines


def write(out: str | None, name: str, text: str, results: dict, title: str) -> None:
  """``out/name.md`` (``text``) and ``out/name.png`` (the loss curves), if ``out`` is given."""
  if not out:
    return
  folder = Path(out)
  folder.mkdir(parents=True, exist_ok=True)
  (folder / f"{name}.md").write_text(text + "\n")
  loop.plot_curves(str(folder / f"{name}.png"), {row: r["history"] for row, r in results.items()},
                   title)


def command(script: str, argv: list[str] | None) -> str:
  """The command line that produced a run."""
  return " ".join(["python", f"examples/{script}", *(sys.argv[1:] if argv is None else argv)])


def check_multiple_of_k(parser: argparse.ArgumentParser, args: argparse.Namespace,
                        *names: str) -> None:
  """``parser.error`` naming the first of ``names`` whose value ``args.k`` does not divide."""
  for name in names:
    if getattr(args, name) % args.k:
      parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be a multiple of "
                   f"--k {args.k}")


def check_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
  """``parser.error`` naming the first of ``names`` whose value is not >= 1."""
  for name in names:
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def check_shared(a: Any, b: Any) -> int:
  """The number of parameters the two trees share by path; raises if any differ."""
  flat_b = dict(jax.tree_util.tree_flatten_with_path(b)[0])
  shared = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(a)[0]:
    if path in flat_b:
      if not np.array_equal(leaf, flat_b[path]):
        raise RuntimeError(f"The initial params differ at {jax.tree_util.keystr(path)}.")
      shared += 1
  return shared
