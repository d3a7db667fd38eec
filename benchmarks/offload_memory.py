"""Optimizer state in host memory against on the device, compiled for the h100 target.

Adam over ``--leaves`` float32 leaves of 16,384² (1 GiB each), parameters and
state donated. Rows: `optax.adam` (state on the device);
`lowmem_jax.optim.offload.offload_state` (state on the host, updated leaf by leaf); and,
for comparison, the whole state brought to the device and updated at once.
Device peak, device arguments, XLA's temporaries (what is in transit) and
host arguments, GiB.

    python benchmarks/offload_memory.py [--leaves 28]
    python benchmarks/offload_memory.py --quick    # 2 leaves of 256²: that it runs
"""

import argparse

import jax
import jax.numpy as jnp
import optax
from rich.console import Console
from rich.table import Table

import lowmem_jax as lm
from lowmem_jax.optim import offload


def whole_tree(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """``inner`` with its whole state on the host, brought over and updated at once (held in
  an `OffloadState`, so that `offload.abstract_state` puts it on the host)."""
  move = lambda space, tree: jax.tree.map(lambda x: jax.device_put(x, space), tree)

  def init(params):
    return offload.OffloadState(move(jax.memory.Space.Host, inner.init(params)))

  def update(updates, state, params=None):
    updates, new = inner.update(updates, move(jax.memory.Space.Device, state.leaves), params)
    return updates, offload.OffloadState(move(jax.memory.Space.Host, new))

  return optax.GradientTransformation(init, update)


def step(tx: optax.GradientTransformation):
  def run(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return run


def stats(tx: optax.GradientTransformation, leaves: int, target="h100",
          side: int = 16384) -> lm.memory.MemoryStats:
  """`MemoryStats` of one Adam step over ``leaves`` float32 leaves of ``side``² (1 GiB)."""
  params = {f"w{i}": jax.ShapeDtypeStruct((side, side), jnp.float32) for i in range(leaves)}
  state = offload.abstract_state(tx, params)
  return lm.memory.stats_of(lm.targets.resolve(target).compile(
      jax.jit(step(tx), donate_argnums=(0, 1)), params, state, params))


def rows() -> dict:
  return {"Adam, state on the device": optax.adam(1e-3),
          "offload (leaf by leaf)": offload.offload_state(optax.adam(1e-3)),
          "whole state brought over at once": whole_tree(optax.adam(1e-3))}


def main(argv=None):
  """Prints the table; returns ``{row: MemoryStats}``."""
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--leaves", type=int, default=28)
  parser.add_argument("--quick", action="store_true",
                      help="2 leaves of 256², for targets.default() (h100 where the target "
                           "packages are, else the CPU): checks that the script runs; its figures "
                           "are not results")
  args = parser.parse_args(argv)
  if args.quick:  # the quick size as the default: --leaves given still wins
    parser.set_defaults(leaves=2)
    args = parser.parse_args(argv)
  side, target = (256, lm.targets.default().name) if args.quick else (16384, "h100")
  table = Table(title=f"Adam over {args.leaves} float32 leaves of {side}², {target} target (GiB)")
  for column in ("optimizer", "device peak", "device arguments", "in transit (temp)",
                 "host arguments"):
    table.add_column(column, justify="left" if column == "optimizer" else "right")
  found = {}
  for name, tx in rows().items():
    s = found[name] = stats(tx, args.leaves, target, side)
    table.add_row(name, *(f"{b / 2**30:.2f}" for b in (
        s.peak_bytes, s.argument_bytes, s.temp_bytes, s.host_argument_bytes)))
  Console(width=140).print(table)
  return found


if __name__ == "__main__":
  main()
