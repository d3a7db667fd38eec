"""benchmarks/remat.py runs (its --quick mode): it calls the planner and memory APIs as they are."""

import pytest

import remat  # benchmarks/remat.py (tests/conftest.py puts benchmarks/ on the path)


@pytest.mark.slow
def test_quick_mode_prints_the_pareto_table(capsys):
  remat.main(["--quick"])
  out = capsys.readouterr().out
  rows = [line for line in out.splitlines() if line.startswith("| ")]
  assert [r.split(" | ")[0] for r in rows[1:6]] == [
      "| everything", "| full", "| minimal", "| dots", "| compressed"]
  assert any(r.startswith("| plan at ") for r in rows)
  assert "compiled for the CPU (a proxy)" in out
