"""benchmarks/gpu_validate.py checks itself on the CPU (--dry-run)."""

import json

import jax
import pytest

import gpu_validate  # benchmarks/, on sys.path in conftest.py
from lowmem_jax import app


@pytest.mark.slow
@pytest.mark.heavy
def test_dry_run_writes_the_report(tmp_path, monkeypatch):
  out = tmp_path / "gpu.md"
  assert gpu_validate.main(["--dry-run", "--out", str(out), "--repeats", "2"]) == 0
  text = out.read_text()
  assert "Dry run on the CPU" in text
  rows = [line for line in text.splitlines() if line.startswith(("| vit-tiny", "| llama-tiny"))]
  dry = gpu_validate.case_list(gpu_validate.DRY_CASES, gpu_validate.DRY_DTYPES,
                               gpu_validate.DRY_LLAMA3_CASES)
  # vit-tiny, bfloat16: baseline and approx+ms-norm+attention; llama-tiny: baseline, streamed
  assert len(rows) == len(dry) == 4
  # On a GPU: both dtypes, and the Llama-3 cases.
  full = gpu_validate.case_list(gpu_validate.CASES, gpu_validate.DTYPES, gpu_validate.LLAMA3_CASES)
  assert len(full) == 2 * (2 + 3) + 5
  cells = {}
  for row in rows:
    cells[row] = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[row][8]) > 0  # the h100 target's compiled peak, GiB
  # The CPU's real compile, in bytes (a tiny model's is under the table's 0.01 GiB on jax 0.12)
  rows_file = [json.loads(line) for line in (tmp_path / "gpu.jsonl").read_text().splitlines()]
  assert len(rows_file) == len(rows) and all(r["real_compile"] > 0 for r in rows_file)
  streamed = [c for c in cells.values() if "stream:host" in c[3]]
  assert len(streamed) == 1 and streamed[0][1] == "2 x 64"
  assert float(streamed[0][14].replace(",", "")) > 0  # tokens a second
  assert [c[13] for c in cells.values() if c[3] == "baseline"] == ["1.000", "1.000"]
  assert (tmp_path / "gpu_target.txtpb").read_text().count("gpu_device_info") == 1
  assert "linear_cross_entropy 128x512" in text and "ratio to plain" in text  # the loss head
  # --resume keeps the finished cases of the same device, jax, size and repeats.
  monkeypatch.setattr(gpu_validate, "loss_head", lambda dry_run: "(timed above)")
  monkeypatch.setattr(gpu_validate, "run_case", lambda *a, **k: pytest.fail(f"ran {a} again"))
  assert gpu_validate.main(["--dry-run", "--out", str(out), "--repeats", "2", "--resume"]) == 0
  assert out.read_text().count("-tiny |") == len(rows)
  assert len((tmp_path / "gpu.jsonl").read_text().splitlines()) == len(rows)
  # --cases-only stops after the cases: no loss head, no report.
  monkeypatch.setattr(gpu_validate, "loss_head", lambda dry_run: pytest.fail("loss head ran"))
  out.unlink()
  assert gpu_validate.main(["--dry-run", "--out", str(out), "--repeats", "2", "--resume",
                            "--cases-only"]) == 0
  assert not out.exists()
  # Other repeats are other cases: all of them run again.
  ran = []
  monkeypatch.setattr(gpu_validate, "run_case", lambda *a, **k: ran.append(a) or pytest.fail("ran"))
  with pytest.raises(pytest.fail.Exception):
    gpu_validate.main(["--dry-run", "--out", str(out), "--repeats", "3", "--resume"])
  assert len(ran) == 1
  # --models runs only the cases of the models it names, and refuses one without cases.
  ran.clear()
  with pytest.raises(pytest.fail.Exception):
    gpu_validate.main(["--dry-run", "--out", str(out), "--repeats", "3", "--models", "llama-tiny"])
  assert ran[0][0] == "llama-tiny"
  with pytest.raises(SystemExit):
    gpu_validate.main(["--dry-run", "--out", str(out), "--models", "llama-3.1-8b"])


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU it would measure")
def test_refuses_without_a_gpu(capsys):
  assert gpu_validate.main(["--out", "/nonexistent/gpu.md"]) == 2
  assert "use --dry-run" in capsys.readouterr().err


def test_a_case_that_fails_is_reported_and_the_run_goes_on(tmp_path, monkeypatch):
  """A failed case is listed in the report, not kept in --rows (a --resume runs it again), and
  the cases after it run; with --deadline, a case with too little time left is not started."""
  cases = gpu_validate.case_list(gpu_validate.DRY_CASES, gpu_validate.DRY_DTYPES,
                                 gpu_validate.DRY_LLAMA3_CASES)
  ran = []

  def run_case(model, size, dtype, techniques, repeats, timeout=None, compiles=True):
    ran.append((techniques, timeout))
    if len(ran) == 1:
      raise gpu_validate.CaseFailed("RESOURCE_EXHAUSTED: Out of memory")
    return {"model": model, "size": size, "dtype": dtype, "techniques": techniques,
            "repeats": repeats, "seconds": 0.5, "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "target_own": None,
            "target_h100": 2 ** 30, "real_compile": 2 ** 30, "host_bytes": 0,
            "real_no_triton_gemm": 2 ** 30, "before_step": None, "measured": None}

  monkeypatch.setattr(gpu_validate, "run_case", run_case)
  monkeypatch.setattr(gpu_validate, "loss_head", lambda dry_run: "(not timed)")
  out = tmp_path / "gpu.md"
  assert gpu_validate.main(["--dry-run", "--out", str(out), "--deadline", "3600"]) == 1
  assert len(ran) == len(cases) and all(0 < t <= 3600 for _, t in ran)
  text = out.read_text()
  model, size, dtype, techniques = cases[0]
  assert (f"- {model} {gpu_validate.size_text(size)} {dtype} `{techniques}`: "
          "RESOURCE_EXHAUSTED: Out of memory") in text
  assert len((tmp_path / "gpu.jsonl").read_text().splitlines()) == len(cases) - 1
  ran.clear()
  assert gpu_validate.main(["--dry-run", "--out", str(out), "--resume", "--deadline", "1"]) == 1
  assert ran == [] and "not started: 1 s of --deadline left" in out.read_text()


def test_a_case_past_its_time_is_stopped():
  with pytest.raises(gpu_validate.CaseFailed, match="stopped at its 0 s limit"):
    gpu_validate.run_case("vit-tiny", {"batch": 2, "image": 32}, "bfloat16", "baseline", 1,
                          timeout=0.01)


@pytest.mark.slow
def test_speed_runs_issue_50s_rows_each_with_and_without_the_fused_kernel(tmp_path,
                                                                           monkeypatch):
  """--speed: the streamed sets of plan's ladder with and without fused-update, the 1B's
  full-remat step first (their time ratio's baseline, its head as theirs); a dry run of its
  tiny cases, the ratio read."""
  sets = [t for _, _, _, t in gpu_validate.SPEED_CASES]
  assert sets[0] == gpu_validate.SPEED_BASELINE
  plain = [t for t in sets[1:] if "fused-update" not in t]
  assert sorted(t + "+fused-update" for t in plain) == sorted(t for t in sets if "fused-up" in t)
  rungs = {app.parse(t).values for t in app.ladder(2, language_model=True) if "stream" in t}
  assert all(app.parse(t).values in rungs for t in plain), plain
  assert all("ce-one-pass" in app.parse(t) for t in sets if "fused-update" not in t)
  monkeypatch.setattr(gpu_validate, "loss_head", lambda dry_run: "(not timed)")
  out = tmp_path / "speed.md"
  assert gpu_validate.main(["--dry-run", "--speed", "--out", str(out), "--repeats", "1"]) == 0
  rows = [[c.strip() for c in line.strip("|").split("|")]
          for line in out.read_text().splitlines() if line.startswith("| llama-tiny")]
  assert [r[3] for r in rows] == [t for *_, t in gpu_validate.DRY_SPEED_CASES]
  assert rows[0][13] == "1.000" and float(rows[1][13]) > 0  # the streamed step's time ratio
  # The step compiled once: not for the targets, not without Triton GEMMs.
  assert all(r[5] != "n/a" and r[6] == r[7] == r[8] == r[9] == "n/a" for r in rows)
