"""The optimizer update's HBM traffic a parameter, read from its program compiled for a GPU.

One update of a ``rows × cols`` bfloat16 weight (bfloat16 gradient) by each optimizer below,
compiled deviceless for ``--target`` (the parameters and state donated, as a training step
has them). Each kernel's bytes are those the step-time estimate charges it
(`lowmem_jax.compile.memory.step_time`: what it reads of its operands, what it writes);
the table gives their sum over the weight's elements, the Threefry-2x32 evaluations an
element (from the update's jaxpr) and the integer operations an element the estimate charges
(`lowmem_jax._lane_ops`: XLA's fusions', the kernel's declared). The last row is the fused
kernel the layer-streamed step runs with ``fused-update`` (where ``--cols`` is whole blocks of
256). No GPU is needed.

    python benchmarks/optimizer_bytes.py             # a 4096 × 4096 weight, the h100
    python benchmarks/optimizer_bytes.py --quick     # 1024 × 1024
"""

import argparse
import math

from _quick import parse_args

QUICK = {"rows": 1024, "cols": 1024}


def optimizers() -> dict:
  """The updates compared: name -> an optax transformation of bfloat16 parameters."""
  import optax
  from lowmem_jax.optim import lowbit

  return {
      "optax.adamw (moments in bfloat16, the parameters' dtype)": optax.adamw(1e-3),
      "lowbit.adamw_8bit (parameters rounded to nearest)": lowbit.adamw_8bit(1e-3),
      "lowbit.adamw_8bit + lowbit.stochastic_rounding (8bit+bf16-params)": optax.chain(
          lowbit.adamw_8bit(1e-3), lowbit.stochastic_rounding()),
  }


def threefry_per_element(step, args, n: int) -> float:
  """Threefry-2x32 evaluations an element in ``step``'s jaxpr: the elements its
  ``threefry2x32`` equations hash (loops counted as they run), over ``n``."""
  import jax
  from lowmem_jax import _jaxpr

  return sum(times * math.prod(eqn.outvars[0].aval.shape)
             for eqn, times in _jaxpr.walk(jax.make_jaxpr(step)(*args).jaxpr)
             if eqn.primitive.name == "threefry2x32") / n


def measure(tx, rows: int, cols: int, target) -> dict:
  """The update of a ``rows × cols`` bfloat16 weight by ``tx`` compiled for ``target`` (a GPU
  whose speeds are on record): its kernels' HBM bytes a parameter and its Threefry
  evaluations an element."""
  import jax
  import jax.numpy as jnp
  import optax
  from lowmem_jax.compile.memory import step_time

  params = {"w": jax.ShapeDtypeStruct((rows, cols), jnp.bfloat16)}
  state = jax.eval_shape(tx.init, params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  text = target.compile(step, params, state, params, donate_argnums=(0, 1)).as_text()
  estimate = step_time.estimate(text, target)
  if estimate is None:
    raise ValueError(f"`target` must be a GPU whose speeds are on record (h100, rtx4090, ...), "
                     f"got {target.name!r}: the bytes are the step-time estimate's.")
  n = rows * cols
  return {"bytes": estimate.device_bytes / n,
          "threefry": threefry_per_element(step, (params, state, params), n),
          "int_ops": estimate.lane_ops.get("int", 0) / n}


def measure_kernel(rows: int, cols: int, target) -> dict:
  """`measure` of the fused kernel (``pallas_kernels.adam8bit``, what the layer-streamed step
  runs with ``update_impl="pallas"``) on the weight, written in place. Its ``threefry`` is
  None: its evaluations run inside the kernel, not as equations of the jaxpr; the integer
  operations it declares count them."""
  import jax
  import jax.numpy as jnp
  from lowmem_jax.compile.memory import step_time
  from lowmem_jax.optim import lowbit
  from pallas_kernels import adam8bit

  fused = lowbit.adamw_8bit(1e-3, bfloat16_params=True).fused
  weight = jax.ShapeDtypeStruct((rows, cols), jnp.bfloat16)
  mu, nu = jax.eval_shape(lambda: lowbit.moments_zeros(jnp.zeros((rows, cols), jnp.bfloat16)))
  text = target.compile(
      lambda *a: adam8bit.update(*a, hyper=fused, shape=(rows, cols)), weight, weight, mu, nu,
      *[jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
          ((1,), jnp.int32), ((1, 2), jnp.uint32), ((1, 14), jnp.uint32), ((1, 2), jnp.float32),
          ((), jnp.int32), ((), jnp.bool_))],
      donate_argnums=(0, 2, 3, 4, 5)).as_text()
  estimate, n = step_time.estimate(text, target), rows * cols
  return {"bytes": estimate.device_bytes / n, "threefry": None,
          "int_ops": estimate.lane_ops.get("int", 0) / n}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=4096)
  parser.add_argument("--cols", type=int, default=4096)
  parser.add_argument("--target", default="h100")
  parser.add_argument("--quick", action="store_true", help="a 1024 × 1024 weight")
  args = parse_args(parser, argv, QUICK)
  if args.rows < 1 or args.cols < 1:
    parser.error(f"--rows and --cols must be at least 1, got {args.rows} and {args.cols}")
  import jax
  from lowmem_jax.compile import targets

  target = targets.get(args.target)
  print(f"jax {jax.__version__}, target {target.name}, a {args.rows} × {args.cols} bfloat16 "
        "weight\n")
  print("| update | HBM bytes a parameter | Threefry evaluations an element | integer "
        "operations an element |")
  print("|---|---:|---:|---:|")
  found = {}
  for name, tx in optimizers().items():
    found[name] = m = measure(tx, args.rows, args.cols, target)
    print(f"| {name} | {m['bytes']:.2f} | {m['threefry']:g} | {m['int_ops']:.1f} |", flush=True)
  if args.cols % 256 == 0:
    name = "pallas_kernels.adam8bit, in place (8bit+bf16-params+fused-update)"
    found[name] = m = measure_kernel(args.rows, args.cols, target)
    print(f"| {name} | {m['bytes']:.2f} | (in the kernel) | {m['int_ops']:.1f} |", flush=True)
  return found


if __name__ == "__main__":
  main()
