"""examples/vit_digits.py: the quick mode learns, the lowmem run holds less, a run resumes."""

import numpy as np
import pytest

import vit_digits
from example_checks import assert_lowmem_holds_less, assert_resumes
from third_party_promotion import OPTAX_BIAS_CORRECTION

pytestmark = [OPTAX_BIAS_CORRECTION,  # the module fixture's quick run steps optax's Adam
              pytest.mark.slow]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  out = tmp_path_factory.mktemp("results")
  return {**vit_digits.main(["--quick", "--out", str(out)]), "out": out}


def test_both_runs_learn_and_match_within_reason(quick):
  results = quick["results"]
  assert set(results) == {"baseline", "lowmem"}
  for row, r in results.items():
    losses = np.array([loss for _, loss in r["history"]["loss"]])
    assert len(losses) == 30 and np.all(np.isfinite(losses)), row
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), row  # the loss went down
    assert r["accuracy"] > 0.3, row  # chance is 0.1
    assert np.isfinite(r["test_loss"]) and np.isfinite(r["train_loss"]), row
  assert abs(quick["accuracy_diff_points"]) < 25  # 30 steps: a loose bound, not the parity target
  assert quick["shared_params"] > 0  # same key: every tensor the trees share is equal


def test_lowmem_saves_fewer_activations_and_compiles_to_a_lower_peak(quick):
  assert_lowmem_holds_less(quick["results"])


def test_writes_the_table_and_the_plot(quick):
  text = (quick["out"] / "vit_digits.md").read_text()
  assert "| lowmem |" in text and "percentage points" in text
  assert "python examples/vit_digits.py --quick" in text
  assert (quick["out"] / "vit_digits.png").stat().st_size > 0


def test_a_resumed_run_equals_the_uninterrupted_one(quick, tmp_path):
  # The lowmem row only (AdamA's micro-step counter is part of the state): 12 steps, then on to 30.
  assert_resumes(vit_digits.main, ["--quick", "--rows", "lowmem", "--checkpoint-dir", str(tmp_path)],
                 12, quick["results"]["lowmem"])


def test_bad_arguments_are_refused():
  with pytest.raises(SystemExit):
    vit_digits.main(["--quick", "--batch", "30"])  # not a multiple of --k 4
  with pytest.raises(SystemExit):
    vit_digits.main(["--steps", "0"])
