"""`lm.lowmem` on GPT-2 written as Hugging Face writes it, in plain JAX (issue 37).

Nothing of lowmem_jax is in the model. It follows ``FlaxGPT2LMHeadModel``
(transformers 4.46): ``Conv1D``-style projections (kernels ``[out, in]``), a
boolean causal mask made from ``jnp.arange`` comparisons, sliced to the
length, combined with the ``[B, L]`` padding mask by ``logical_and`` and
turned into an additive bias by ``lax.select``; Flax's
``dot_product_attention_weights`` with dropout 0.1 on the probabilities; the
tanh GELU; the head tied to the token embedding; the loss shifted after the
head (``logits[:, :-1]`` against ``tokens[:, 1:]``), optax's integer-label
cross-entropy. Residual and embedding dropout are left out: they drop
``[B, L, D]`` activations, not the patterns this checks.

    python benchmarks/hf_style_gpt2.py           # GPT-2 small, batch 8 x 1,024, bfloat16, h100
    python benchmarks/hf_style_gpt2.py --model transformers   # FlaxGPT2LMHeadModel itself
    python benchmarks/hf_style_gpt2.py --quick   # a two-layer GPT-2 of width 64: that it runs

prints what ``explain`` found and the compiled peak, for the target, deviceless,
of the plain gradient, of ``lm.lowmem``'s (its default, exact) and of
``lm.lowmem(..., activations="approx")``'s.
"""

import argparse

import jax
import jax.numpy as jnp
import optax
from flax.linen import attention as flax_attention
from jax import lax

import lowmem_jax as lm

import _quick  # beside this script in benchmarks/

GPT2_SMALL = {"layers": 12, "dim": 768, "heads": 12, "vocab": 50257, "positions": 1024}
GPT2_TINY = {"layers": 2, "dim": 64, "heads": 2, "vocab": 256, "positions": 64}  # --quick


def init(key, *, layers, dim, heads, vocab, positions, dtype=jnp.float32):
  """GPT-2's parameters as nested dicts (Hugging Face's names), ``dtype``."""
  del heads
  keys = iter(jax.random.split(key, 4 * layers + 2))
  normal = lambda *shape: (0.02 * jax.random.normal(next(keys), shape)).astype(dtype)
  conv = lambda n_in, n_out: {"kernel": normal(n_out, n_in), "bias": jnp.zeros(n_out, dtype)}
  norm = lambda: {"scale": jnp.ones(dim, dtype), "bias": jnp.zeros(dim, dtype)}
  block = lambda: {"ln_1": norm(), "attn": {"c_attn": conv(dim, 3 * dim),
                                             "c_proj": conv(dim, dim)},
                   "ln_2": norm(), "mlp": {"c_fc": conv(dim, 4 * dim),
                                           "c_proj": conv(4 * dim, dim)}}
  return {"wte": normal(vocab, dim), "wpe": normal(positions, dim),
          "h": [block() for _ in range(layers)], "ln_f": norm()}


def _conv1d(p, x):
  """Hugging Face's ``FlaxConv1D``: the kernel is ``[out, in]``."""
  return lax.dot_general(x, p["kernel"], (((x.ndim - 1,), (1,)), ((), ()))) + p["bias"]


def _layer_norm(p, x, eps=1e-5):
  mean = jnp.mean(x, -1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
  return (x - mean) * lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def _causal_mask(positions):
  """``[1, 1, P, P]`` booleans, as ``flax.linen.make_causal_mask`` makes them."""
  idx = jnp.arange(positions)
  return (idx[:, None] >= idx[None, :])[None, None]


def _attention(p, x, attention_mask, positions, rng, heads, dropout):
  """``FlaxGPT2Attention``: the mask and its bias are made in every layer."""
  b, length, dim = x.shape
  causal = lax.dynamic_slice(_causal_mask(positions), (0, 0, 0, 0), (1, 1, length, length))
  mask = jnp.logical_and(jnp.broadcast_to(causal, (b, 1, length, length)),
                         attention_mask[:, None, None, :].astype(bool))
  bias = lax.select(mask, jnp.full(mask.shape, 0.0, x.dtype),
                    jnp.full(mask.shape, jnp.finfo(x.dtype).min, x.dtype))
  q, k, v = jnp.split(_conv1d(p["c_attn"], x), 3, axis=-1)
  q, k, v = (t.reshape(b, length, heads, dim // heads) for t in (q, k, v))
  weights = flax_attention.dot_product_attention_weights(
      q, k, bias=bias, dropout_rng=rng, dropout_rate=dropout, deterministic=dropout == 0.0,
      dtype=x.dtype)
  out = jnp.einsum("...hqk,...khd->...qhd", weights, v).reshape(b, length, dim)
  return _conv1d(p["c_proj"], out)


def logits(params, tokens, attention_mask, rng, *, heads, dropout=0.1):
  """``[B, L, vocab]`` logits of ``tokens`` ``[B, L]`` int32; ``attention_mask`` ``[B, L]``
  (1 a token, 0 padding); ``rng`` the attention dropout's key."""
  x = params["wte"][tokens] + params["wpe"][jnp.arange(tokens.shape[1])][None]
  for i, block in enumerate(params["h"]):
    x = x + _attention(block["attn"], _layer_norm(block["ln_1"], x), attention_mask,
                       params["wpe"].shape[0], jax.random.fold_in(rng, i), heads, dropout)
    h = jax.nn.gelu(_conv1d(block["mlp"]["c_fc"], _layer_norm(block["ln_2"], x)))
    x = x + _conv1d(block["mlp"]["c_proj"], h)
  x = _layer_norm(params["ln_f"], x)
  return x @ params["wte"].T


def loss(params, tokens, attention_mask, rng, *, heads, dropout=0.1):
  """The causal-LM loss as Hugging Face's examples write it: shifted after the head."""
  out = logits(params, tokens, attention_mask, rng, heads=heads, dropout=dropout)
  return optax.softmax_cross_entropy_with_integer_labels(
      out[:, :-1].astype(jnp.float32), tokens[:, 1:]).mean()


def arguments(config, batch, length, dtype):
  """Abstract ``(params, tokens, attention_mask, rng)`` of a step."""
  params = jax.eval_shape(lambda k: init(k, **config, dtype=dtype), jax.random.key(0))
  ints = jax.ShapeDtypeStruct((batch, length), jnp.int32)
  return params, ints, ints, jax.eval_shape(lambda: jax.random.key(0))


def transformers_gpt2(batch, length, dtype, config=GPT2_SMALL):
  """``(loss, args)`` of transformers' ``FlaxGPT2LMHeadModel`` (``config``'s sizes, random
  weights, ``dtype`` compute and parameters, dropout on), its loss shifted after the head."""
  import transformers  # the test extra's; only for this row

  sizes = transformers.GPT2Config(n_layer=config["layers"], n_embd=config["dim"],
                                  n_head=config["heads"], vocab_size=config["vocab"],
                                  n_positions=config["positions"])
  model = transformers.FlaxGPT2LMHeadModel(sizes, dtype=dtype, _do_init=False)

  def hf_loss(params, tokens, attention_mask, rng):
    out = model(tokens, attention_mask=attention_mask, params=params, dropout_rng=rng,
                train=True).logits
    return optax.softmax_cross_entropy_with_integer_labels(
        out[:, :-1].astype(jnp.float32), tokens[:, 1:]).mean()

  ints = jax.ShapeDtypeStruct((batch, length), jnp.int32)
  params = jax.eval_shape(lambda k: model.init_weights(k, (batch, length)), jax.random.key(0))
  params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, dtype), params)
  return hf_loss, (params, ints, ints, jax.eval_shape(lambda: jax.random.key(0)))


def main(argv=None):
  """Prints what ``explain`` found and the peaks; returns ``{variant: peak bytes}``."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=1024)
  parser.add_argument("--target", default="h100")
  parser.add_argument("--model", default="hf-style", choices=("hf-style", "transformers"))
  parser.add_argument("--quick", action="store_true",
                      help="GPT-2 of 2 layers of width 64, batch 2 x 32, targets.default() (h100 "
                           "where the target packages are, else the CPU): checks that the script "
                           "runs; its figures are not results")
  args = _quick.parse_args(parser, argv, dict(batch=2, seq=32, target=None))
  config = GPT2_TINY if args.quick else GPT2_SMALL
  if args.model == "transformers":
    fn, shapes = transformers_gpt2(args.batch, args.seq, jnp.bfloat16, config)
  else:
    fn = lambda *a: loss(*a, heads=config["heads"])
    shapes = arguments(config, args.batch, args.seq, jnp.bfloat16)
  fast = lm.lowmem(fn)
  print(fast.explain(*shapes))
  approx = lm.lowmem(fn, activations="approx")
  peaks = {name: lm.memory.analyze(jax.grad(f), *shapes, target=args.target).peak_bytes
           for name, f in (("plain", fn), ("lm.lowmem", fast), ("lm.lowmem approx", approx))}
  size = "two-layer" if args.quick else "small"
  for name, peak in peaks.items():
    print(f"{name}: gradient's compiled peak {peak / 2**20:,.1f} MiB "
          f"({lm.targets.resolve(args.target).name}, {args.model} GPT-2 {size}, batch "
          f"{args.batch} x {args.seq}, bfloat16)")
  print(f"ratios {peaks['lm.lowmem'] / peaks['plain']:.3f} (exact), "
        f"{peaks['lm.lowmem approx'] / peaks['plain']:.3f} (approx)")
  return peaks


if __name__ == "__main__":
  main()
