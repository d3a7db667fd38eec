"""FSDP and data parallelism with JAX's own sharding, every lowmem technique on.

A small LLaMA-style byte-level language model (`lowmem_jax.models.Llama`) of
Python standard-library sources, trained on a `jax.sharding.Mesh` with axes
("data", "fsdp"), 2 x 4 by default on 8 devices:

- FSDP: every parameter is sharded over "fsdp" along its largest axis that
  the axis size divides (replicated where none does) and replicated over
  "data"; AdamA's moments mu and nu are sharded like the parameters, its
  step counters replicated. The compiled step all-gathers a layer's weights
  where it uses them and reduces the gradients back to the shards.
- Data parallelism: the batch ``int32[batch, seq + 1]`` is sharded over
  ("data", "fsdp") on its leading axis, so every device holds batch / 8 rows.
- The shardings come from `jax.eval_shape` of init and ``tx.init``; the
  parameters and optimizer state are initialised straight into them
  (``jax.jit(..., out_shardings=...)``), and the step is jitted with in/out
  shardings and donation. The mesh axes are ``AxisType.Auto`` (XLA
  propagates the shardings): the model has no sharding annotations of its
  own, which explicit axes would require.

Techniques covered, all in one jitted step: ReSiLU2 on the gate
(``activation="approx"``), MS-RMSNorm (``norm="ms"``), attention that
recomputes its probabilities (``attention="recompute"``), remat of every
layer with a `lowmem_jax.compile.policies` policy (``--policy``, default
``compressed``: only the 2-bit activation codes and the norms' 1/rms are
kept), AdamA over k micro-batches (`lowmem_jax.microbatch_step` with
``optax.chain(lm.adama(k), optax.scale_by_learning_rate(lr))``), and, with
``--compute bfloat16``, bfloat16 compute with float32 master weights
(`lowmem_jax.optim.precision.flax_dtypes`). Not covered: int8 compressed residuals
(`lowmem_jax.ops.compress.int8_dot_general`; the reference Llama takes no
``dot_general`` switch, and the quantisation is per row along the last axis,
which the batch sharding keeps local), AdamA's fold-in-backward (needs stacked
layer parameters under `lowmem_jax.optim.scan_layers`; the Llama here unrolls its
layers, ``scan=False``: in `flax.linen.scan`'s loop XLA's propagation shards
the MLP's activations over "fsdp" and moves their 2-bit codes between devices
in the backward), dynamic loss scaling (not for AdamA micro-batching, see
`lowmem_jax.optim.precision.loss_scaled_step`), host offload (a no-op on CPU),
dynamic sparsity (stored dense, saves nothing) and the Pallas kernels (CPU
runs their XLA references).

The micro-batches. `microbatch_step` gives micro-batch i the rows i, i + k,
i + 2k, ... of the batch, so each device's rows split locally into its share
of every micro-batch, and the compiled step moves no batch data between
devices (the script counts the collectives on integer arrays: 0). The
single-device run uses the same step, hence the same micro-batches.

It reports, from XLA's compilation (`lowmem_jax.compile.memory.stats_of`, per device
for the sharded step), the compiled memory of the sharded step beside that
of the single-device step, the bytes of parameters and optimizer state each
device holds, the collectives of the step, and the largest absolute
difference of the parameters and losses between the sharded run and a
single-device run of the same steps, init and batches. In float32 they agree
to float tolerance (`PARAM_ATOL` 1e-4, `LOSS_RTOL` 1e-5; measured 6e-8 to 3e-5 in the
parameters in --quick, by the text the interpreter's standard library gives), not
bitwise: the sharded step splits reductions (the weight gradients' sums over the batch,
the loss mean, the gradient all-reduce) into per-device partial sums added in another
order. Over longer runs ReSiLU2 (and in --quick, two processes under jax 0.12.1: 1.46e-4
in the parameters, 3.75e-7 with ``--activation exact``)
breaks this: its backward uses a piecewise-constant derivative, so a gate
pre-activation within rounding of a kink gets a derivative of about -0.04 in
one run and 1.04 in the other; the runs then drift apart (the default run:
3.2e-3 in the parameters after 40 steps, largest in the gate weights w1 and
in rare bytes' embeddings, while the losses stay within 8e-6 relative).
``--activation exact`` (SiLU) shows that the rest
matches: 2.5e-7 after 12 default-size steps, against 5.4e-4 with ReSiLU2.

Run it (8 CPU devices are forced when XLA_FLAGS does not already set a count:
``--xla_force_host_platform_device_count=8``; on GPUs/TPUs the real devices are
used):

    pip install -e ".[examples]"
    python examples/sharded_train.py --quick                          # ~30 s on a 2-core CPU
    python examples/sharded_train.py --out docs/results
    python examples/sharded_train.py --mesh 4,2 --checkpoint-dir /tmp/ckpt   # resumable

Multi-host: the same script on each of N hosts, each process loading only the
rows of the batch its devices hold (`jax.make_array_from_process_local_data`);
``jax.distributed.initialize`` runs before anything else touches JAX:

    # on host i of N (i = 0 .. N-1), host 0 reachable at HOST:PORT
    python examples/sharded_train.py --coordinator HOST:PORT --num-processes N --process-id I \\
        --mesh DATA,FSDP

with DATA * FSDP the devices of all hosts together. On a GPU or TPU cluster
whose scheduler JAX recognises (SLURM, Cloud TPU, Open MPI, ...) ``--distributed``
calls ``jax.distributed.initialize()`` with no arguments, which often suffices.
On CPU, two processes of one machine make a test of it:
``XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/sharded_train.py
--quick --coordinator localhost:12355 --num-processes 2 --process-id 0`` (and 1).
Each process runs the single-device reference on its first local device
(``--no-reference`` skips it) and process 0 writes the results.
"""

import os

if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  # Before JAX starts its CPU backend; ignored by GPU and TPU backends.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402  (XLA_FLAGS must be set before jax is imported)
import math  # noqa: E402
import re  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import lowmem_jax as lm  # noqa: E402
from lowmem_jax.models import Llama, LlamaConfig  # noqa: E402
import compare  # noqa: E402
import loop  # noqa: E402

AXES = ("data", "fsdp")
SOURCES = ("functools.py", "dataclasses.py", "inspect.py", "argparse.py", "typing.py")
SIZES = {  # model and run sizes of --quick and of the default run
    "quick": dict(config=LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                     ffn_dim=192),
                  batch=32, k=2, seq=64, steps=6),
    "default": dict(config=LlamaConfig(vocab_size=256, dim=128, n_layers=4, n_heads=8,
                                       n_kv_heads=4, ffn_dim=384),
                    batch=64, k=4, seq=128, steps=40),
}
# What a checkpoint must have been saved with to resume.
RESUME_SETTINGS = ("quick", "mesh", "batch", "k", "seq", "lr", "eps", "seed", "policy",
                   "activation", "compute")
# float32: reductions split across devices round differently, and Adam's m / sqrt(v) turns
# that into a share of a whole step for an element whose gradient is near zero: 5% of a step
# at the default lr (the quick run on Python 3.13's standard library as text: 3.0e-5; on
# 3.12's: 6e-8).
PARAM_ATOL = 1e-4
LOSS_RTOL = 1e-5
# Looser in bfloat16, whose rounding (2**-8 relative) the reordered sums expose.
BF16_PARAM_ATOL, BF16_LOSS_RTOL = 5e-3, 5e-3


def text_bytes() -> np.ndarray:
  """``uint8[n]``: the bytes of `SOURCES`, read from this interpreter's standard library."""
  stdlib = Path(sysconfig.get_paths()["stdlib"])
  return np.frombuffer(b"".join((stdlib / name).read_bytes() for name in SOURCES), np.uint8)


def batch_rows(text: np.ndarray, i: int, rows: np.ndarray, batch: int, seq: int,
               seed: int = 0) -> np.ndarray:
  """Rows ``rows`` of step i's batch: ``int32[len(rows), seq + 1]`` windows of ``text``.

  The whole batch's window offsets come from ``(seed, i)`` alone, so every
  process computes the same global batch and can build any subset of its rows.
  """
  offsets = np.random.default_rng([seed, i]).integers(0, len(text) - seq - 1, batch)[rows]
  return text[offsets[:, None] + np.arange(seq + 1)].astype(np.int32)


def parse_mesh(spec: str, n_devices: int) -> tuple[int, int]:
  """``"DATA,FSDP"`` (or ``"auto"``: fsdp 4 where 4 divides the devices) as a checked shape."""
  if spec == "auto":
    fsdp = 4 if n_devices % 4 == 0 else n_devices
    return n_devices // fsdp, fsdp
  try:
    shape = tuple(int(s) for s in spec.split(","))
  except ValueError:
    shape = ()
  if len(shape) != 2 or min(shape) < 1:
    raise ValueError(f"--mesh must be 'auto' or two positive ints DATA,FSDP, got {spec!r}.")
  if math.prod(shape) != n_devices:
    raise ValueError(f"--mesh {spec}: DATA * FSDP = {math.prod(shape)} must equal the number of "
                     f"devices, {n_devices} (all processes together).")
  return shape


def make_mesh(shape: tuple[int, int]) -> Mesh:
  """A ("data", "fsdp") mesh of every device, axes left to XLA's propagation (Auto)."""
  return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def fsdp_spec(shape: tuple[int, ...], fsdp: int) -> P:
  """Shards the largest axis of ``shape`` that ``fsdp`` divides (the first of equals) over
  "fsdp"; ``P()`` (replicated) for scalars and shapes with no such axis."""
  axes = [a for a, size in enumerate(shape) if size % fsdp == 0]
  if not axes:
    return P()
  axis = max(axes, key=lambda a: (shape[a], -a))
  return P(*([None] * axis), "fsdp")


def fsdp_shardings(mesh: Mesh, tree: Any) -> Any:
  """A `NamedSharding` per leaf of ``tree`` (arrays or `jax.ShapeDtypeStruct`) by `fsdp_spec`."""
  return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(x.shape, mesh.shape["fsdp"])), tree)


def make_model(config: LlamaConfig, policy: Callable, compute: str,
               activation: str = "approx") -> Llama:
  """The lowmem Llama: ReSiLU2 (``activation="approx"``), MS-RMSNorm, recomputed
  attention, remat with ``policy``, layers unrolled (``scan=False``, see above)."""
  return Llama(config, activation=activation, norm="ms", attention="recompute", remat=True,
               remat_policy=policy, scan=False, **lm.precision.flax_dtypes(compute))


def make_step(model: Llama, tx: optax.GradientTransformation, k: int) -> Callable:
  """``step(params, opt_state, tokens) -> (params, opt_state, {"loss": float32 []})``.

  ``tokens``: ``int32[batch, seq + 1]``; the model reads ``tokens[:, :-1]`` and
  predicts ``tokens[:, 1:]``. AdamA over k micro-batches (`microbatch_step`).
  """
  def loss(params, tokens):
    logits = model.apply({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  return lm.microbatch_step(loss, tx, k)


def device_bytes(tree: Any, shardings: Any | None = None) -> int:
  """Bytes of ``tree`` one device holds: each leaf's shard under its sharding (whole
  leaves without ``shardings``); the shardings here are even, so every device holds as much."""
  if shardings is None:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))
  return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
             for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


_COLLECTIVE = re.compile(
    r"= (.+?) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "u8": 1, "s8": 1, "pred": 1}


def collectives(compiled: jax.stages.Compiled) -> dict:
  """The collectives of a compiled program, from its HLO text.

  Returns ``{op: {"count", "max_bytes"}}`` over all-gather, all-reduce,
  reduce-scatter, all-to-all and collective-permute (``max_bytes``: the
  largest single result array), and ``"integer_arrays"``: how many move an
  integer array, i.e. batch tokens (the only integer arrays of the step bigger
  than a scalar counter).
  """
  out: dict = {"integer_arrays": 0}
  for result, op in _COLLECTIVE.findall(compiled.as_text()):
    entry = out.setdefault(op, {"count": 0, "max_bytes": 0})
    entry["count"] += 1
    for dtype, dims in _ARRAY.findall(result):
      size = math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE.get(dtype, 4)
      entry["max_bytes"] = max(entry["max_bytes"], size)
      if dtype[0] in "su" and dims:
        out["integer_arrays"] += 1
  return out


def to_host(tree: Any) -> Any:
  """``tree``'s arrays as NumPy global arrays, gathered from every process if need be."""
  def one(x):
    return np.asarray(x) if x.is_fully_addressable else multihost_utils.process_allgather(
        x, tiled=True)
  return jax.tree.map(one, tree)


def max_abs_diff(a: Any, b: Any) -> float:
  """The largest ``|a - b|`` over the leaves of two trees of the same structure."""
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _check_sizes(args, n_devices: int) -> None:
  if args.k < 1:
    raise ValueError(f"--k must be >= 1, got {args.k}.")
  if args.batch < 1 or args.batch % (n_devices * args.k):
    raise ValueError(f"--batch {args.batch} must be a positive multiple of devices * k = "
                     f"{n_devices} * {args.k}: each device holds batch / {n_devices} rows, "
                     f"split locally into k micro-batches.")
  if args.seq < 1 or args.steps < 1:
    raise ValueError(f"--seq and --steps must be >= 1, got {args.seq} and {args.steps}.")


def _initialize_distributed(args) -> None:
  if args.distributed:
    jax.distributed.initialize()
  elif args.coordinator is not None or args.num_processes is not None:
    if None in (args.coordinator, args.num_processes, args.process_id):
      raise ValueError("--coordinator, --num-processes and --process-id go together; got "
                       f"{args.coordinator!r}, {args.num_processes!r}, {args.process_id!r}.")
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.num_processes, process_id=args.process_id)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="a smaller model and run (~30 s)")
  parser.add_argument("--mesh", default="auto",
                      help="DATA,FSDP; 'auto': FSDP 4 where 4 divides the devices (2,4 on 8)")
  parser.add_argument("--batch", type=int, help="global batch (rows), a multiple of devices * k")
  parser.add_argument("--k", type=int, help="AdamA micro-batches per optimizer step")
  parser.add_argument("--seq", type=int, help="tokens (bytes) per row")
  parser.add_argument("--steps", type=int, help="optimizer steps")
  parser.add_argument("--lr", type=float, default=2e-3)
  parser.add_argument("--eps", type=float, default=1e-8,
                      help="AdamA's eps as in optax.adam")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--policy", default="compressed", choices=sorted(lm.policies.READY_MADE),
                      help="remat policy of each layer (lowmem_jax.compile.policies)")
  parser.add_argument("--activation", default="approx", choices=("approx", "exact"),
                      help="gate activation: ReSiLU2 or SiLU (for the exact comparison)")
  parser.add_argument("--compute", default="float32", choices=sorted(lm.precision.POLICIES),
                      help="compute dtype; parameters and optimizer state stay float32")
  parser.add_argument("--no-reference", dest="reference", action="store_false",
                      help="skip the single-device run and the comparison")
  parser.add_argument("--checkpoint-dir", help="save to / resume from this orbax directory")
  parser.add_argument("--out", help="write sharded_train.md to this folder")
  parser.add_argument("--coordinator", help="HOST:PORT of process 0 (multi-host)")
  parser.add_argument("--num-processes", type=int, help="processes in all (multi-host)")
  parser.add_argument("--process-id", type=int, help="this process, 0..N-1 (multi-host)")
  parser.add_argument("--distributed", action="store_true",
                      help="jax.distributed.initialize() with no arguments (GPU/TPU clusters)")
  args = parser.parse_args(argv)
  for name, value in SIZES["quick" if args.quick else "default"].items():
    if getattr(args, name, None) is None:
      setattr(args, name, value)
  return args


def main(argv=None) -> dict:
  """Trains on the mesh and on one device; returns the figures and the sharded state.

  Returns:
    A dict: ``mesh`` (shape), ``memory`` (compiled `MemoryStats` as dicts,
    ``"sharded"`` per device and ``"single"``; ``state_bytes`` per device and
    single), ``collectives`` (`collectives` of the sharded step),
    ``losses`` (per step, sharded run), and with the reference run
    ``reference_losses``, ``max_param_diff``, ``max_moment_diff``, ``max_loss_rel_diff``,
    ``init_param_diff``; ``seconds`` (wall time of each run after compiling),
    ``tolerance`` and ``state``: the sharded ``(params, opt_state)``.
  """
  args = parse_args(argv)
  _initialize_distributed(args)  # before anything asks JAX for its devices
  n = jax.device_count()
  shape = parse_mesh(args.mesh, n)
  _check_sizes(args, n)
  mesh = make_mesh(shape)
  model = make_model(args.config, lm.policies.READY_MADE[args.policy], args.compute,
                     args.activation)
  tx = optax.chain(lm.adama(args.k, eps=args.eps), optax.scale_by_learning_rate(args.lr))
  step = make_step(model, tx, args.k)

  def init(key):
    params = model.init(key, jnp.zeros((1, args.seq), jnp.int32))["params"]
    return params, tx.init(params)

  key = jax.random.key(args.seed)
  abstract = jax.eval_shape(init, key)
  state_sharding = fsdp_shardings(mesh, abstract)  # mu, nu get their params' shardings
  batch_sharding = NamedSharding(mesh, P(AXES))
  replicated = NamedSharding(mesh, P())
  tokens = jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32, sharding=batch_sharding)

  sharded = jax.jit(step, in_shardings=(*state_sharding, batch_sharding),
                    out_shardings=(*state_sharding, {"loss": replicated}), donate_argnums=(0, 1))
  compiled = lm.memory.aot_compile(sharded, *abstract, tokens, target="attached")
  state = jax.jit(init, out_shardings=state_sharding)(key)

  text = text_bytes()
  batch_at = sharded_batches(args, batch_sharding, text)

  def train_step(state, batch):
    params, opt_state, metrics = compiled(*state, batch)
    return (params, opt_state), metrics

  result: dict = {"mesh": shape, "devices": n, "processes": jax.process_count(),
                  "collectives": collectives(compiled)}
  memory = {"sharded": lm.memory.stats_of(compiled).__dict__,
            "state_bytes": {"sharded": device_bytes(abstract, state_sharding),
                            "single": device_bytes(abstract)}}
  init_host = to_host(state[0]) if args.reference else None
  start = time.perf_counter()
  state, history = loop.train(train_step, state, batch_at, steps=args.steps,
                              desc=f"sharded {shape[0]}x{shape[1]}",
                              checkpoint_dir=args.checkpoint_dir,
                              save_every=max(1, args.steps // 4),
                              settings={k: getattr(args, k) for k in RESUME_SETTINGS})
  jax.block_until_ready(state)
  result["seconds"] = {"sharded": time.perf_counter() - start}
  result["losses"] = [loss for _, loss in history["loss"]]
  result["state"] = state
  largest_param = max(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(abstract[0]))
  result["largest_param_bytes"] = largest_param

  param_atol, loss_rtol = ((PARAM_ATOL, LOSS_RTOL) if args.compute == "float32"
                           else (BF16_PARAM_ATOL, BF16_LOSS_RTOL))
  result["tolerance"] = {"param_atol": param_atol, "loss_rtol": loss_rtol}
  if args.reference:
    reference, memory["single"] = single_device_run(args, step, init, key, (*abstract, tokens),
                                                    text)
    result["seconds"]["single"] = reference.pop("seconds")
    result.update(compared(result["losses"], to_host(state), init_host, reference))
  result["memory"] = memory
  text_out = markdown(result, args, argv)
  print(text_out)
  if args.out and jax.process_index() == 0:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sharded_train.md").write_text(text_out + "\n")
  return result


def sharded_batches(args, batch_sharding, text: np.ndarray):
  """``batch_at(i)``: training batch i (``int32[batch, seq + 1]``), each process building only
  the rows its devices hold (`batch_rows`), as one array sharded by ``batch_sharding``."""
  global_shape = (args.batch, args.seq + 1)
  index_map = batch_sharding.addressable_devices_indices_map(global_shape)
  row_blocks = sorted({idx[0].indices(args.batch) for idx in index_map.values()})
  local_rows = np.concatenate([np.arange(*block) for block in row_blocks])  # in device order

  def batch_at(i):
    local = batch_rows(text, i, local_rows, args.batch, args.seq, args.seed)
    return jax.make_array_from_process_local_data(batch_sharding, local, global_shape)
  return batch_at


def compared(losses: list, state: tuple, init_host, reference: dict) -> dict:
  """The reference run's entries of `main`'s result and the differences from it of the sharded
  run's ``losses``, final ``state`` and initial params (all on the host)."""
  ref_losses = reference["reference_losses"]
  return {"reference_losses": ref_losses, "reference_state": reference["reference_state"],
          "init_param_diff": max_abs_diff(reference["reference_init"], init_host),
          "max_param_diff": max_abs_diff(state[0], reference["reference_state"][0]),
          "max_moment_diff": max_abs_diff(state[1], reference["reference_state"][1]),
          "max_loss_rel_diff": float(np.max(np.abs(np.subtract(losses, ref_losses))
                                            / np.abs(ref_losses)))}


def single_device_run(args, step, init, key, abstract, text) -> tuple[dict, dict]:
  """The reference: ``step`` unsharded on this process's first device, from ``init(key)``,
  on every row of each batch. ``abstract`` is ``(params, opt_state, tokens)``' shapes.

  Returns ``(run, memory)``: ``run`` holds ``reference_init`` (the initial params on the
  host), ``reference_losses``, ``reference_state`` (the final state on the host) and
  ``seconds`` (after compiling); ``memory`` the compiled `MemoryStats` as a dict.
  """
  device = jax.local_devices()[0]
  single = jax.jit(step, donate_argnums=(0, 1))
  plain = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract)
  single_compiled = lm.memory.aot_compile(single, *plain, target="attached")
  ref = jax.device_put(jax.jit(init)(key), device)
  reference_init = to_host(ref[0])
  all_rows = np.arange(args.batch)
  losses = []
  start = time.perf_counter()
  for i in range(args.steps):
    batch = jax.device_put(batch_rows(text, i, all_rows, args.batch, args.seq, args.seed), device)
    *ref, metrics = single_compiled(*ref, batch)
    losses.append(float(metrics["loss"]))
  jax.block_until_ready(ref)
  run = {"seconds": time.perf_counter() - start, "reference_init": reference_init,
         "reference_losses": losses, "reference_state": to_host(tuple(ref))}
  return run, lm.memory.stats_of(single_compiled).__dict__


def _mib(n: int) -> str:
  return f"{n / 2**20:.2f} MiB"


def markdown(result: dict, args, argv) -> str:
  """The results as a Markdown section: the memory table, the comparison and the command."""
  mem = result["memory"]
  data, fsdp = result["mesh"]
  cfg = args.config
  rows = [("parameters + optimizer state", mem["state_bytes"]["sharded"],
           mem["state_bytes"]["single"])]
  single = mem.get("single", {})
  for label, field in (("compiled arguments", "argument_bytes"),
                       ("compiled temporaries", "temp_bytes"), ("compiled peak", "peak_bytes")):
    rows.append((label, mem["sharded"][field], single.get(field)))
  lines = [
      "## Sharded training: FSDP x data parallelism", "",
      f"A byte-level Llama (dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads, "
      f"{cfg.n_kv_heads} kv heads, ffn {cfg.ffn_dim}) with "
      f"{'ReSiLU2' if args.activation == 'approx' else 'SiLU'}, MS-RMSNorm, recomputed "
      f"attention, remat ({args.policy}) and AdamA over k={args.k} micro-batches, "
      f"{args.compute} compute; batch {args.batch} x {args.seq} tokens, {args.steps} steps, "
      f"mesh data={data} x fsdp={fsdp} on {result['devices']} {jax.default_backend().upper()} "
      f"device(s), {result['processes']} process(es). Memory per device from XLA's compilation "
      "(`lowmem_jax.compile.memory.stats_of`; on CPU a proxy for an accelerator).", "",
      "| per device | sharded | single device | ratio |", "|---|---:|---:|---:|"]
  for label, ours, theirs in rows:
    ratio = f"{ours / theirs:.3f}" if theirs else "-"
    lines.append(f"| {label} | {_mib(ours)} | {_mib(theirs) if theirs else '-'} | {ratio} |")
  coll = result["collectives"]
  lines += ["", "Collectives of the sharded step: " + ", ".join(
      f"{op} x{v['count']} (largest {v['max_bytes']:,} B)" for op, v in coll.items()
      if op != "integer_arrays") + f"; on integer (batch) arrays: {coll['integer_arrays']}; "
      f"largest parameter {result['largest_param_bytes']:,} B."]
  if "max_param_diff" in result:
    tol = result["tolerance"]
    within = (result["max_param_diff"] <= tol["param_atol"]
              and result["max_loss_rel_diff"] <= tol["loss_rtol"])
    lines += ["", f"Sharded against single-device run, same init and batches: parameters at init "
              f"differ by {result['init_param_diff']:.1e}; after {args.steps} steps max |params "
              f"diff| {result['max_param_diff']:.2e} (tolerance {tol['param_atol']:g}), max "
              f"|AdamA moments diff| {result['max_moment_diff']:.2e}, max relative |loss diff| "
              f"{result['max_loss_rel_diff']:.2e} (tolerance {tol['loss_rtol']:g}): "
              f"{'within' if within else 'outside'} tolerance. Not bitwise: reductions are split "
              "across devices and summed in another order"
              + (", and ReSiLU2's piecewise-constant derivative turns a rounding difference at "
                 "a kink into a different gradient, after which the runs drift apart "
                 "(`--activation exact` to compare without it)." if args.activation == "approx"
                 else "."),
              "", f"Loss: {result['losses'][0]:.4f} at step 1, {result['losses'][-1]:.4f} at step "
              f"{len(result['losses'])}. Wall time after compiling: sharded "
              f"{result['seconds']['sharded']:.1f} s, single device "
              f"{result['seconds']['single']:.1f} s (a 2-core CPU emulating 8 devices: no speed "
              "claim)."]
  lines += ["", "```bash", compare.command("sharded_train.py", argv), "```"]
  return "\n".join(lines)


if __name__ == "__main__":
  main()
