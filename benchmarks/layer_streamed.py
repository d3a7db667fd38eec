"""The layer-streamed step on the Llama-3 family, compiled for consumer and data-centre GPUs.

Every parameter trained, an AdamW-equivalent update: 8-bit moments
(`lowmem_jax.optim.lowbit.adamw_8bit`), bfloat16 parameters rounded stochastically,
the fused loss head, ReSiLU2, MS-RMSNorm, the recomputing attention
(``all+fused-ce+8bit+bf16-params``) and `lowmem_jax.optim.layer_streamed`
(``stream:host``: each layer's saved input in host memory; ``+offload-opt``:
the optimizer state there too). Each row is a deviceless compile for its
target (XLA's GPU buffer assignment): the device peak and what lives in host
memory. Beside them:

- the bytes that cross the host link a step: the offloaded state twice (to
  the device and back) and the saved layer inputs twice (out in the forward,
  back in the backward), and the time that takes at the target's host link
  (`lowmem_jax.compile.targets.Target.host_link_bytes_per_s`, one direction each way);
- the compute floor: 8 x parameters x tokens FLOPs (the forward, the
  backward's recompute of each layer, the backward's two matmuls a weight;
  attention's length-squared terms left out) over the target's dense
  bfloat16 peak (`Target.peak_bf16_flops`).
  Where the transfer floor is below the compute floor, the streaming can
  hide under the compute (XLA's schedule, on a real GPU, decides).

``--growth`` compiles the same step with 2 and 4 of the model's layers and
gives the growth a layer against what one layer must hold: its parameters,
its state where it lives on the device, its saved input where it lives there.

    python benchmarks/layer_streamed.py            # the rows of docs/benchmarks.md
    python benchmarks/layer_streamed.py --growth   # the growth per layer
    python benchmarks/layer_streamed.py --quick [--growth]   # llama-tiny: that it runs
"""

import argparse
import dataclasses
import json
import time

import jax

from lowmem_jax import app
from lowmem_jax.compile import memory, targets
from lowmem_jax.optim import layer_streamed

STATE = "all+fused-ce+8bit+bf16-params"
ROWS = (  # (model, batch, seq, target, technique set)
    ("llama-3.1-8b", 2, 2048, "rtx4090", f"{STATE}+stream:host+offload-opt"),
    ("llama-3.1-8b", 8, 4096, "rtx4090", f"{STATE}+stream:host+offload-opt"),
    ("llama-3.1-8b", 8, 4096, "h100", f"{STATE}+stream:host"),
    ("llama-3.1-8b", 8, 4096, "h100", f"{STATE}+stream:host+late-embed"),
    ("llama-3.1-8b", 8, 4096, "h100", f"{STATE}+remat:full"),
    ("llama-3.2-1b", 2, 2048, "rtx4090", f"{STATE}+stream:host"),
    ("llama-3.2-1b", 8, 4096, "h100", f"{STATE}+stream:host"),
    ("llama-3.2-3b", 2, 2048, "rtx4090", f"{STATE}+stream:host"),
    ("llama-3.2-3b", 8, 4096, "h100", f"{STATE}+stream:host"),
)
GROWTH = (("llama-3.1-8b", 2, 2048, "rtx4090", f"{STATE}+stream:host+offload-opt"),
          ("llama-3.1-8b", 8, 4096, "h100", f"{STATE}+stream:host"))
GiB = 2 ** 30


def quick_rows(target: str) -> tuple:
  """--quick's one row (and growth): llama-tiny, 2 x 64 tokens, its AdamW state and saved layer
  inputs in host memory, compiled for ``target``; float32 moments and parameters (8-bit ones
  compile for 20 s and more even at this size). Its figures are not results."""
  return (("llama-tiny", 2, 64, target, "all+fused-ce+stream:host+offload-opt"),)


def floors(job: app.Job, text: str) -> dict:
  """The host traffic a step and the transfer and compute floors of ``text`` on ``job``."""
  s = app.parse(text)
  built, params, opt_state, batch = app.arguments(job, s)
  n = sum(x.size for x in jax.tree.leaves(params))
  tokens = job.batch * job.seq
  state = memory.tree_bytes(opt_state) if "offload-opt" in s else 0
  layers = jax.tree.leaves(params["layers"])[0].shape[0]
  dim = built["wl"].model.config.dim
  inputs = (layers * tokens * dim * 2) if s.get("stream") == "host" else 0  # bfloat16
  crossing = 2 * state + 2 * inputs
  link, peak = job.target.host_link_bytes_per_s, job.target.peak_bf16_flops
  return {"parameters": n, "host_link_bytes": crossing,
          "transfer_floor_s": crossing / link if link else None,
          "compute_floor_s": 8 * n * tokens / peak if peak else None}


def row(model: str, batch: int, seq: int, target: str, text: str) -> dict:
  job = app.Job(model, batch=batch, seq=seq, target=target)
  start = time.perf_counter()
  b = app.measure(job, app.parse(text), top=0)
  return {"model": model, "batch": batch, "seq": seq, "target": target, "techniques": text,
          "peak_bytes": b.stats.peak_bytes,
          "host_bytes": b.stats.host_argument_bytes + b.stats.host_temp_bytes,
          "seconds": time.perf_counter() - start, **floors(job, text)}


def growth(model: str, batch: int, seq: int, target: str, text: str) -> dict:
  """The peak with 2 and 4 of ``model``'s layers, its growth a layer, and what a layer holds."""
  job = app.Job(model, batch=batch, seq=seq, target=target)
  s = app.parse(text)
  peaks, holds = {}, None
  built = s.program(job).run()
  for layers in (2, 4):
    wl = built["wl"]
    wl = dataclasses.replace(wl, model=wl.model.clone(
        config=dataclasses.replace(wl.model.config, n_layers=layers)))
    state_place = "host" if "offload-opt" in s else "device"
    ls = layer_streamed(wl.layer_stack(), built["tx"], state=state_place,
                        saved_inputs=s.get("stream"))
    params = wl.abstract_params()
    opt_state = jax.eval_shape(ls.init, params)
    if state_place == "host":
      opt_state = targets.in_host_memory(opt_state)
    step = jax.jit(ls.step, donate_argnums=(0, 1), compiler_options=s.compiler_options() or None)
    compiled = job.target.compile(step, params, opt_state, (wl.inputs, wl.labels))
    peaks[layers] = memory.stats_of(compiled).peak_bytes
    first = lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    one, layer_state = jax.tree.map(first, (params["layers"], opt_state.layers))
    holds = (memory.tree_bytes(one)
             + (memory.tree_bytes(layer_state) if state_place == "device" else 0)
             + (batch * seq * wl.model.config.dim * 2 if s.get("stream") == "device" else 0))
  per_layer = (peaks[4] - peaks[2]) / 2
  return {"model": model, "batch": batch, "seq": seq, "target": target, "techniques": text,
          "peak_2_layers": peaks[2], "peak_4_layers": peaks[4], "growth_per_layer": per_layer,
          "one_layer_holds": holds, "ratio": per_layer / holds}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--growth", action="store_true", help="the growth per layer (2 vs 4)")
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--quick", action="store_true",
                      help="one llama-tiny row (2 x 64 tokens) for targets.default() (h100 where "
                           "the target packages are, else the CPU): checks that the script runs; "
                           "its figures are not results")
  args = parser.parse_args(argv)
  specs = quick_rows(targets.default().name) if args.quick else GROWTH if args.growth else ROWS
  if args.growth:
    out = [growth(*spec) for spec in specs]
    for r in out:
      print(f"| {r['model']} | {r['batch']} x {r['seq']} | {r['target']} | {r['techniques']} | "
            f"{r['peak_2_layers'] / GiB:.2f} | {r['peak_4_layers'] / GiB:.2f} | "
            f"{r['growth_per_layer'] / GiB:.3f} | {r['one_layer_holds'] / GiB:.3f} | "
            f"{r['ratio']:.2f} |", flush=True)
  else:
    out = []
    for spec in specs:
      r = row(*spec)
      out.append(r)
      floor = lambda s: "n/a" if s is None else f"{s:.2f}"
      print(f"| {r['model']} | {r['batch']} x {r['seq']} | {r['target']} | {r['techniques']} | "
            f"{r['peak_bytes'] / GiB:.2f} | {r['host_bytes'] / GiB:.2f} | "
            f"{r['host_link_bytes'] / GiB:.1f} | {floor(r['transfer_floor_s'])} | "
            f"{floor(r['compute_floor_s'])} | {r['seconds']:.0f} |", flush=True)
  if args.json:
    print(json.dumps(out, indent=1))
  return out


if __name__ == "__main__":
  main()
