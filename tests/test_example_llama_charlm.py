"""examples/llama_charlm.py: the quick mode learns, the lowmem run holds less, a run resumes,
the streamed row learns near the baseline."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import llama_charlm
from example_checks import assert_lowmem_holds_less, assert_resumes
from third_party_promotion import OPTAX_APPLY_UPDATES, OPTAX_BIAS_CORRECTION

pytestmark = [OPTAX_BIAS_CORRECTION,  # the module fixture's quick run steps optax's Adam
              pytest.mark.slow]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  out = tmp_path_factory.mktemp("results")
  return {**llama_charlm.main(["--quick", "--out", str(out)]), "out": out}


def test_corpus_is_ascii_tokens_split_by_file():
  train, validation, files = llama_charlm.corpus(300_000)
  assert files >= 10 and len(train) > len(validation) > 0
  assert train.dtype == np.uint8 and train.max() < 128 and validation.max() < 128
  assert llama_charlm.encode("aé\n").tolist() == [97, llama_charlm.NON_ASCII, 10]


def test_both_runs_learn(quick):
  results = quick["results"]
  assert set(results) == {"baseline", "lowmem"}
  for row, r in results.items():
    losses = np.array([loss for _, loss in r["history"]["loss"]])
    assert len(losses) == 20 and np.all(np.isfinite(losses)), row
    assert losses[0] > 4.0  # about log(128) = 4.85 at init
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, row
    assert np.isfinite(r["val_loss"]) and r["val_loss"] < np.log(128), row
  assert abs(quick["relative_diff"]["lowmem"]) < 0.15  # 20 steps: loose, not the parity target
  assert quick["shared_params"] > 0


@OPTAX_APPLY_UPDATES
def test_the_streamed_row_learns_near_the_baseline_and_compiles_to_a_lower_peak(quick):
  """The layer-streamed step, AdamA over 4 micro-batches with 8-bit moments, bfloat16
  parameters rounded stochastically: from the quick baseline's initial params, on its batches."""
  streamed = llama_charlm.main(["--quick", "--rows", "streamed"])["results"]["streamed"]
  base = quick["results"]["baseline"]
  losses = np.array([loss for _, loss in streamed["history"]["loss"]])
  assert len(losses) == 20 and np.all(np.isfinite(losses))
  assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
  assert abs(streamed["val_loss"] - base["val_loss"]) / base["val_loss"] < 0.15  # 20 steps
  assert {x.dtype for x in jax.tree.leaves(streamed["params"])} == {jnp.dtype(jnp.bfloat16)}
  assert 0 < streamed["memory"]["peak"] < base["memory"]["peak"]
  assert streamed["memory"]["saved"] is None  # shown as n/a


def test_lowmem_saves_fewer_activations_and_compiles_to_a_lower_peak(quick):
  assert_lowmem_holds_less(quick["results"])


def test_writes_the_table_and_the_plot(quick):
  text = (quick["out"] / "llama_charlm.md").read_text()
  assert "| lowmem |" in text and "nats/char" in text
  assert (quick["out"] / "llama_charlm.png").stat().st_size > 0


def test_batches_depend_only_on_the_step():
  stream = np.arange(1000, dtype=np.uint8)
  a = llama_charlm.windows(stream, 4, 9, np.random.default_rng([0, 7]))
  b = llama_charlm.windows(stream, 4, 9, np.random.default_rng([0, 7]))
  assert a.shape == (4, 9) and np.array_equal(a, b)


def test_a_resumed_run_equals_the_uninterrupted_one(quick, tmp_path):
  # The lowmem row only (AdamA's micro-step counter is part of the state): 8 steps, then on to 20.
  assert_resumes(llama_charlm.main, ["--quick", "--rows", "lowmem", "--checkpoint-dir", str(tmp_path)],
                 8, quick["results"]["lowmem"])


def test_bad_arguments_are_refused():
  with pytest.raises(SystemExit):
    llama_charlm.main(["--quick", "--batch", "10"])  # not a multiple of --k 4
  with pytest.raises(SystemExit):
    llama_charlm.main(["--quick", "--corpus-mb", "0"])
