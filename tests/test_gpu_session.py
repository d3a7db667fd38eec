"""benchmarks/gpu_session.sh, the device call's prepared script, runs through on the CPU."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_prepared_gpu_call_runs_its_dry_run_and_writes_each_file(tmp_path):
  env = dict(os.environ, OUT=str(tmp_path / "out"), DRY_RUN="1", PYTHON=sys.executable,
             TMPDIR=str(tmp_path))
  subprocess.run(["bash", "benchmarks/gpu_session.sh"], cwd=ROOT, env=env, check=True,
                 timeout=1200)
  out = tmp_path / "out"
  assert re.search(r"^jax \d+\.\d+", (out / "device.txt").read_text(), re.M)
  rows = [json.loads(line) for line in (out / "gpu_speed.jsonl").read_text().splitlines()]
  assert [r["model"] for r in rows] == ["llama-tiny", "llama-tiny"]
  assert all(r["seconds"] > 0 and r["target_h100"] is None for r in rows)
  assert "gpu_validate --speed: exit 0" in (out / "gpu_speed.txt").read_text()
  assert "gpu_profile: exit 0" in (out / "gpu_profile.txt").read_text()
  assert "## llama-tiny 2 x 64 bfloat16" in (out / "gpu_profile.md").read_text()
