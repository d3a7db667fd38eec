"""`lm.lowmem` on a ViT-B/16 written outside the project, in plain JAX or Flax's stock NNX modules.

Neither model uses anything of lowmem_jax. ``--model plain``: a params dict,
a fused qkv projection, `jax.nn.gelu` (its tanh default), LayerNorm by hand,
einsum attention with `jax.nn.softmax`, a Python loop over the blocks.
``--model nnx``: `StockViT`, of ``nnx.LayerNorm``, ``nnx.MultiHeadAttention``,
``nnx.Linear`` and ``nnx.gelu`` (computing in ``--dtype``, float32 params),
its loss on the state of ``nnx.split``. The script compares the gradient step
with the same step through `lm.lowmem`:
  - compiled per-block bytes for --target (default the H100 target, compiled
    here without a GPU): temp bytes at --depth minus temp bytes at half
    depth, per block removed;
  - autodiff's residuals (backend-free);
  - the time `lm.lowmem` adds to tracing (median of --repeats);
  - the CPU step-time ratio at a small size (median of --repeats).

    python benchmarks/plain_vit.py                       # ViT-B/16, batch 64, bfloat16, H100 target
    python benchmarks/plain_vit.py --explain 10          # + the largest buffers at the peak
    python benchmarks/plain_vit.py --model nnx           # the stock-NNX ViT-B/16
    python benchmarks/plain_vit.py --quick [--model nnx] # two blocks, 32² images: that it runs
"""

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx
from rich.console import Console
from rich.table import Table

import lowmem_jax as lm

import _quick  # beside this script in benchmarks/


def init(key, *, depth=12, dim=768, mlp=3072, patch=16, image=224, classes=1000):
  """Parameters of a ViT, float32, as nested dicts."""
  keys = iter(jax.random.split(key, 4 * depth + 3))
  dense = lambda n, m: {"w": jax.random.normal(next(keys), (n, m)) / n ** 0.5, "b": jnp.zeros(m)}
  norm = lambda: {"scale": jnp.ones(dim), "bias": jnp.zeros(dim)}
  tokens = (image // patch) ** 2 + 1
  return {
      "embed": dense(patch * patch * 3, dim),
      "cls": jnp.zeros((1, 1, dim)),
      "pos": jax.random.normal(next(keys), (1, tokens, dim)) * 0.02,
      "blocks": [{"norm1": norm(), "qkv": dense(dim, 3 * dim), "proj": dense(dim, dim),
                  "norm2": norm(), "fc1": dense(dim, mlp), "fc2": dense(mlp, dim)}
                 for _ in range(depth)],
      "norm": norm(),
      "head": dense(dim, classes),
  }


def layer_norm(x, p, eps=1e-6):
  """Statistics in x's dtype; the affine in the parameters' (float32), as is the result."""
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  y = ((x - mean) * jax.lax.rsqrt(var + eps)).astype(p["scale"].dtype)
  return y * jax.lax.broadcast_to_rank(p["scale"], y.ndim) + jax.lax.broadcast_to_rank(
      p["bias"], y.ndim)


def linear(x, p, dtype):
  y = x.astype(dtype) @ p["w"].astype(dtype)
  return y + jax.lax.broadcast_to_rank(p["b"].astype(dtype), y.ndim)


def block(x, p, heads, dtype):
  b, n, d = x.shape
  qkv = linear(layer_norm(x, p["norm1"]), p["qkv"], dtype).reshape(b, n, 3, heads, d // heads)
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (d // heads) ** 0.5
  out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, n, d)
  x = x + linear(out, p["proj"], dtype)
  h = jax.nn.gelu(linear(layer_norm(x, p["norm2"]), p["fc1"], dtype))
  return x + linear(h, p["fc2"], dtype)


def patchify(images, patch):
  """float32 [b, H, W, 3] -> [b, (H / patch) * (W / patch), patch * patch * 3]."""
  b, side = images.shape[0], images.shape[1] // patch
  patches = images.reshape(b, side, patch, side, patch, 3).transpose(0, 1, 3, 2, 4, 5)
  return patches.reshape(b, side * side, -1)


def cross_entropy(logits, labels):
  """Mean cross-entropy of float32 logits [b, classes] against int32 labels [b]."""
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))


def loss(params, images, labels, *, heads=12, patch=16, dtype=jnp.bfloat16):
  """Mean cross-entropy; images [b, H, W, 3], labels [b] int32."""
  b = images.shape[0]
  x = linear(patchify(images, patch), params["embed"], dtype)
  x = jnp.concatenate([jnp.broadcast_to(params["cls"].astype(dtype), (b, 1, x.shape[-1])), x], 1)
  x = x + params["pos"].astype(dtype)
  for p in params["blocks"]:
    x = block(x, p, heads, dtype)
  logits = linear(layer_norm(x[:, 0], params["norm"]), params["head"], jnp.float32)
  return cross_entropy(logits, labels)


class StockBlock(nnx.Module):
  """A pre-LN ViT block of Flax's stock NNX modules."""

  def __init__(self, dim, heads, mlp, dtype, rngs):
    self.norm1 = nnx.LayerNorm(dim, dtype=dtype, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(heads, dim, dtype=dtype, decode=False, rngs=rngs)
    self.norm2 = nnx.LayerNorm(dim, dtype=dtype, rngs=rngs)
    self.fc1 = nnx.Linear(dim, mlp, dtype=dtype, rngs=rngs)
    self.fc2 = nnx.Linear(mlp, dim, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.norm1(x))
    return x + self.fc2(nnx.gelu(self.fc1(self.norm2(x))))


class StockViT(nnx.Module):
  """ViT of stock NNX modules: images [b, H, W, 3] float32 -> logits [b, classes] float32."""

  def __init__(self, *, depth=12, dim=768, heads=12, mlp=3072, patch=16, image=224, classes=1000,
               dtype=jnp.bfloat16, rngs):
    self.patch = patch
    self.embed = nnx.Linear(patch * patch * 3, dim, dtype=dtype, rngs=rngs)
    self.cls = nnx.Param(jnp.zeros((1, 1, dim)))
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (1, (image // patch) ** 2 + 1, dim)))
    self.blocks = nnx.List([StockBlock(dim, heads, mlp, dtype, rngs) for _ in range(depth)])
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.head = nnx.Linear(dim, classes, rngs=rngs)

  def __call__(self, images):
    x = self.embed(patchify(images, self.patch))
    cls = jnp.broadcast_to(self.cls[...].astype(x.dtype), (x.shape[0], 1, x.shape[-1]))
    x = jnp.concatenate([cls, x], 1) + self.pos[...].astype(x.dtype)
    for blk in self.blocks:
      x = blk(x)
    return self.head(self.norm(x[:, 0].astype(jnp.float32)))


def problem(model, batch, image, depth, dtype, *, abstract=True):
  """``(loss, (params, images, labels))`` of ``--model`` ``model``; ``ShapeDtypeStruct``s if abstract.

  ``loss(params, images, labels)``: mean cross-entropy, float32 []; images
  float32 [batch, image, image, 3], labels int32 [batch].
  """
  if model == "plain":
    fn = lambda params, images, labels: loss(params, images, labels, dtype=dtype)
    make = lambda: init(jax.random.key(0), depth=depth, image=image)
  else:
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: StockViT(depth=depth, image=image, dtype=dtype,
                                                            rngs=nnx.Rngs(0))))

    def fn(params, images, labels):
      return cross_entropy(nnx.merge(graphdef, params)(images), labels)
    make = lambda: nnx.state(StockViT(depth=depth, image=image, dtype=dtype, rngs=nnx.Rngs(0)))
  if abstract:
    return fn, (jax.eval_shape(make), jax.ShapeDtypeStruct((batch, image, image, 3), jnp.float32),
                jax.ShapeDtypeStruct((batch,), jnp.int32))
  return fn, (make(), jax.random.normal(jax.random.key(1), (batch, image, image, 3)),
              jnp.zeros((batch,), jnp.int32))


def median_seconds(fn, repeats):
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    samples.append(time.perf_counter() - start)
  return statistics.median(samples)


def main(argv=None):
  """Prints the tables; returns ``{variant: (compiled peak, per-block bytes, residual bytes)}``
  and, unless --no-timing, ``{"seconds": {variant: step seconds}}``."""
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--depth", type=int, default=12, help="blocks; per block compares with depth // 2")
  parser.add_argument("--image", type=int, default=224, help="image side in pixels")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  parser.add_argument("--target", default=None, help="compile target; default: targets.default()")
  parser.add_argument("--time", default="2,112", help="CPU timing size: batch,image")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--explain", type=int, default=0, metavar="N",
                      help="list the N largest buffers live at the compiled peak of each step")
  parser.add_argument("--no-timing", action="store_true")
  parser.add_argument("--model", default="plain", choices=("plain", "nnx"))
  parser.add_argument("--quick", action="store_true",
                      help="2 blocks, batch 2 of 32² images, one timed step: checks that the "
                           "script runs; its figures are not results")
  args = _quick.parse_args(parser, argv, dict(batch=2, depth=2, image=32, time="1,32", repeats=1))
  dtype = jnp.dtype(args.dtype)
  target = lm.targets.resolve(args.target)
  console = Console(width=200)
  console.print(target.note, highlight=False)
  fn, full = problem(args.model, args.batch, args.image, args.depth, dtype)
  fn_half, half = problem(args.model, args.batch, args.image, args.depth // 2, dtype)
  variants = {"plain": lambda f: f, "lm.lowmem(plain)": lm.lowmem,
              "lm.lowmem(plain, approx)": functools.partial(lm.lowmem, activations="approx")}
  title = "plain-JAX ViT-B/16" if args.model == "plain" else "ViT-B/16 of stock NNX modules"

  table = Table(title=f"{title}, batch {args.batch}, {args.dtype} compute, float32 params, "
                      f"gradient step (MiB; ratio to plain)")
  for col in ("variant", "compiled peak", "ratio", "per block", "ratio", "autodiff's residuals", "ratio"):
    table.add_column(col, justify="left" if col == "variant" else "right")
  mib = lambda b: f"{b / 2**20:,.0f}"
  base, found = None, {}
  for name, wrap in variants.items():
    stats = lm.memory.analyze(jax.grad(wrap(fn)), *full, target=target)
    half_stats = lm.memory.analyze(jax.grad(wrap(fn_half)), *half, target=target)
    per_block = (stats.temp_bytes - half_stats.temp_bytes) / (args.depth - args.depth // 2)
    saved = lm.memory.saved_residuals(wrap(fn), *full).activation_bytes
    base = base or (stats.peak_bytes, per_block, saved)
    found[name] = (stats.peak_bytes, per_block, saved)
    table.add_row(name, mib(stats.peak_bytes), f"{stats.peak_bytes / base[0]:.3f}", mib(per_block),
                  f"{per_block / base[1]:.3f}", mib(saved), f"{saved / base[2]:.3f}")
    if args.explain:
      peak = lm.memory.report(jax.grad(wrap(fn)), *full, top=args.explain, target=target)
      console.print(f"\n{name}: the {args.explain} largest buffers live at the compiled peak")
      for b in peak.buffers:
        console.print(f"  {b.nbytes / 2**20:8,.1f} MiB {b.shape:28s} {b.op_name[-90:]}", highlight=False)
  console.print(table)

  if args.no_timing:
    return found
  trace = {name: median_seconds(lambda: jax.make_jaxpr(jax.grad(wrap(fn)))(*full), args.repeats)
           for name, wrap in variants.items()}
  batch, image = (int(v) for v in args.time.split(","))
  fn32, real = problem(args.model, batch, image, args.depth, jnp.float32, abstract=False)
  times = {}
  for name, wrap in variants.items():
    step = jax.jit(jax.grad(wrap(fn32)))
    jax.block_until_ready(step(*real))
    times[name] = median_seconds(lambda: jax.block_until_ready(step(*real)), args.repeats)
  table = Table(title=f"time, median of {args.repeats}: tracing the ViT-B/16 gradient (make_jaxpr), "
                      f"and the float32 step at batch {batch}, {image}² on {jax.devices()[0].device_kind}")
  for col in ("variant", "trace s", "step s", "step ratio to plain"):
    table.add_column(col, justify="left" if col == "variant" else "right")
  for name in variants:
    table.add_row(name, f"{trace[name]:.2f}", f"{times[name]:.3f}", f"{times[name] / times['plain']:.3f}")
  console.print(table)
  return {**found, "seconds": times}


if __name__ == "__main__":
  main()
