"""The examples' training loop: a progress bar, periodic evaluation, and resuming
from an orbax checkpoint; and a plot of the loss curves it records.

A run with ``checkpoint_dir`` saves its state, history and ``settings``
there every ``save_every`` steps and at the end; started again with the same
directory and settings, it restores the latest checkpoint and goes on from
that step. ``batch_at(i)`` must give the same batch for the same ``i`` on
every call, so a resumed run sees the batches the uninterrupted one would
have, and ends with the same state and history.
"""

import os
from typing import Any, Callable

import numpy as np
import orbax.checkpoint as ocp
from tqdm import tqdm


def train(step: Callable, state: Any, batch_at: Callable[[int], Any], *, steps: int, desc: str,
          evaluate: Callable[[Any], dict] | None = None, eval_every: int | None = None,
          checkpoint_dir: str | None = None, save_every: int = 100,
          settings: dict | None = None) -> tuple[Any, dict]:
  """Runs ``state, metrics = step(state, batch_at(i))`` for i in [0, steps).

  Args:
    step: ``step(state, batch) -> (state, metrics)``, jitted, with a float32 []
      ``metrics["loss"]``.
    state: the initial pytree of arrays (parameters, optimizer state, ...).
    batch_at: ``batch_at(i)``, the batch of step i; the same for the same i.
    steps: optimizer steps in all (a resumed run counts the restored ones).
    desc: label of the progress bar.
    evaluate: ``evaluate(state) -> {name: float}``, every ``eval_every`` steps
      and after the last.
    eval_every: steps between evaluations; None evaluates after the last only.
    checkpoint_dir: where orbax keeps the latest two checkpoints; None keeps none.
    save_every: steps between checkpoints.
    settings: what must not change for a checkpoint to resume (JSON values:
      learning rate, batch, seed, ...); saved with it and compared.

  Returns:
    ``(state, history)``: history["loss"] is ``[[step, loss], ...]`` for every
    step (1-based), history["eval"] ``[[step, {name: value}], ...]``.
  """
  if steps < 1:
    raise ValueError(f"steps must be >= 1, got {steps}.")
  if eval_every is not None and eval_every < 1:
    raise ValueError(f"eval_every must be >= 1 or None, got {eval_every}.")
  if save_every < 1:
    raise ValueError(f"save_every must be >= 1, got {save_every}.")
  history = {"loss": [], "eval": []}
  manager = None
  if checkpoint_dir is not None:
    manager = ocp.CheckpointManager(os.path.abspath(checkpoint_dir),
                                    options=ocp.CheckpointManagerOptions(max_to_keep=2))
    latest = manager.latest_step()
    if latest is not None:
      if latest > steps:
        raise ValueError(f"checkpoint_dir {checkpoint_dir!r} holds step {latest}, past steps={steps}.")
      # The settings first: a state of other settings may not even have this one's structure.
      saved = manager.restore(latest, args=ocp.args.Composite(
          settings=ocp.args.JsonRestore())).settings
      if saved != (settings or {}):
        changed = sorted(k for k in {*saved, *(settings or {})}
                         if saved.get(k) != (settings or {}).get(k))
        raise ValueError(f"checkpoint_dir {checkpoint_dir!r} was saved with other settings "
                         f"({', '.join(changed)}); use another directory or the same settings.")
      restored = manager.restore(latest, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(state), history=ocp.args.JsonRestore()))
      state, history = restored.state, restored.history
      # Keep the evaluations this run makes: a shorter run's last is not one of them.
      history["eval"] = [e for e in history["eval"]
                         if e[0] == steps or (eval_every and e[0] % eval_every == 0)]
  start = len(history["loss"])
  try:
    with tqdm(total=steps, initial=start, desc=desc, unit="step") as bar:
      for i in range(start, steps):
        state, metrics = step(state, batch_at(i))
        loss = float(metrics["loss"])
        history["loss"].append([i + 1, loss])
        done = i + 1
        if evaluate is not None and (done == steps or (eval_every and done % eval_every == 0)):
          history["eval"].append([done, {k: float(v) for k, v in evaluate(state).items()}])
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        bar.update()
        if manager is not None and (done % save_every == 0 or done == steps):
          manager.save(done, args=ocp.args.Composite(
              state=ocp.args.StandardSave(state), history=ocp.args.JsonSave(history),
              settings=ocp.args.JsonSave(settings or {})))
  finally:
    if manager is not None:
      manager.wait_until_finished()
      manager.close()
  return state, history


def smoothed(history: dict, window: int = 20) -> tuple[np.ndarray, np.ndarray]:
  """The training loss as (steps, running mean over ``window`` steps)."""
  steps, losses = np.asarray(history["loss"]).T
  kernel = np.ones(min(window, len(losses))) / min(window, len(losses))
  return steps[len(kernel) - 1:], np.convolve(losses, kernel, mode="valid")


def plot_curves(path: str, histories: dict[str, dict], title: str, window: int = 20) -> None:
  """A PNG of each run's smoothed training loss (matplotlib)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4))
  for label, history in histories.items():
    ax.plot(*smoothed(history, window), label=label, linewidth=1.2)
  ax.set_xlabel("step")
  ax.set_ylabel(f"training loss (mean of {window} steps)")
  ax.set_title(title)
  ax.legend()
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)

