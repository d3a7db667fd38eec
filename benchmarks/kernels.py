"""The Pallas kernels against XLA's fusion of their pure-JAX references.

For each kernel, at LLaMA- and ViT-sized activations in bfloat16: the time of
the kernel and of the jitted reference (median of --repeats runs after one
warm-up, in the same run), their ratio, the bytes each kernel must move (its
inputs read once and its outputs written once), the GB/s that makes, and
that as a share of the device's peak memory bandwidth.

Needs a GPU. ``--interpret`` runs the kernels in Pallas interpret mode at
small shapes instead, to check this script anywhere; its timings measure the
interpreter, not a kernel.

    python benchmarks/kernels.py [--repeats 20] [--interpret]
"""

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import lowmem_jax as lm
from pallas_kernels import _blocks, pack
from pallas_kernels import activations as act_kernels
from pallas_kernels import norms as norm_kernels

# Peak HBM bandwidth, bytes/s, from NVIDIA's data sheets, by device_kind.
PEAK_BANDWIDTH = {
    "NVIDIA H100 80GB HBM3": 3.35e12,
    "NVIDIA H100 PCIe": 2.0e12,
    "NVIDIA H100 NVL": 3.9e12,
    "NVIDIA H200": 4.8e12,
    "NVIDIA A100-SXM4-80GB": 2.039e12,
    "NVIDIA A100-SXM4-40GB": 1.555e12,
}
FITS = {fn.__name__: fn.fit for fn in (lm.regelu2, lm.resilu2, lm.relu)}


def cases(interpret: bool):
  """``(name, kernel, reference, args)``: each kernel at each size."""
  llama, vit = ((2, 16, 344), (2, 7, 96)) if interpret else ((8, 2048, 11008), (64, 197, 3072))
  llama_d, vit_d = ((2, 16, 128), (2, 7, 24)) if interpret else ((8, 2048, 4096), (64, 197, 768))
  options = _blocks.Options(interpret=interpret)
  key = jax.random.key(0)
  for fit_name, shape in (("resilu2", llama), ("regelu2", vit), ("relu", vit)):
    fit = FITS[fit_name]
    x = jax.random.normal(key, shape, jnp.bfloat16)
    packed = act_kernels.forward_reference(fit, x)[1]
    yield (f"{fit_name} fwd {shape}", lambda x, fit=fit: act_kernels.forward(fit, x, options),
           lambda x, fit=fit: act_kernels.forward_reference(fit, x), (x,))
    yield (f"{fit_name} bwd {shape}",
           lambda p, dy, fit=fit: act_kernels.backward(fit, p, dy, options),
           lambda p, dy, fit=fit: act_kernels.backward_reference(fit, p, dy), (packed, x))
  for centered, shape in ((False, llama_d), (True, vit_d)):
    name = "layer_norm" if centered else "rms_norm"
    x = jax.random.normal(key, shape, jnp.bfloat16)
    y, rstd = norm_kernels.forward_reference(x, centered=centered, eps=1e-6)
    yield (f"{name} fwd {shape}",
           lambda x, c=centered: norm_kernels.forward(x, centered=c, eps=1e-6, options=options),
           lambda x, c=centered: norm_kernels.forward_reference(x, centered=c, eps=1e-6), (x,))
    yield (f"{name} bwd {shape}",
           lambda y, r, dy, c=centered: norm_kernels.backward(y, r, dy, centered=c,
                                                              options=options),
           lambda y, r, dy, c=centered: norm_kernels.backward_reference(y, r, dy, centered=c),
           (y, rstd, x))
  codes = jax.random.randint(key, vit, 0, 4).astype(jnp.uint8)
  yield (f"pack 2-bit {vit}", lambda c: pack.pack(c, 2, options=options),
         lambda c: pack.pack_reference(c, 2), (codes,))
  packed = pack.pack_reference(codes, 2)
  yield (f"unpack 2-bit {vit}", lambda p: pack.unpack(p, 2, vit[-1], options=options),
         lambda p: pack.unpack_reference(p, 2, vit[-1]), (packed,))


def nbytes(tree) -> int:
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def median_seconds(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(time.perf_counter() - start)
  return statistics.median(samples)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--repeats", type=int, default=20, help="timed runs of each (default 20)")
  parser.add_argument("--interpret", action="store_true",
                      help="small shapes in interpret mode: checks the script, times nothing real")
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error(f"--repeats must be >= 1, got {args.repeats}")
  device = jax.devices()[0]
  if device.platform != "gpu" and not args.interpret:
    sys.exit(f"benchmarks/kernels.py needs a GPU (JAX's device is {device.device_kind}); "
             "--interpret checks the script without one.")
  peak = PEAK_BANDWIDTH.get(device.device_kind)
  print(f"{device.device_kind}, jax {jax.__version__}, median of {args.repeats}"
        + (", INTERPRET MODE: not kernel timings" if args.interpret else "")
        + ("" if peak else ", peak bandwidth unknown for this device"), flush=True)
  print("| kernel (bfloat16) | MB moved | kernel µs | XLA µs | kernel / XLA time | GB/s | % of peak |")
  print("|---|---:|---:|---:|---:|---:|---:|", flush=True)
  for name, kernel, reference, inputs in cases(args.interpret):
    kernel, reference = jax.jit(kernel), jax.jit(reference)
    moved = nbytes(inputs) + nbytes(jax.eval_shape(kernel, *inputs))
    t_kernel = median_seconds(kernel, inputs, args.repeats)
    t_xla = median_seconds(reference, inputs, args.repeats)
    share = f"{100 * moved / t_kernel / peak:.0f}" if peak else "n/a"
    print(f"| {name} | {moved / 1e6:.1f} | {t_kernel * 1e6:.1f} | {t_xla * 1e6:.1f} | "
          f"{t_kernel / t_xla:.2f} | {moved / t_kernel / 1e9:.0f} | {share} |", flush=True)


if __name__ == "__main__":
  main()
