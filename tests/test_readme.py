"""Every Python block of the README and of docs/report.md runs as written, and the figures
docs/report.md quotes for the ``--step`` example are the compiled ones."""

import json
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from third_party_promotion import (
  OPTAX_APPLY_UPDATES,
  OPTAX_BIAS_CORRECTION,
  OPTAX_UPDATE_MOMENT,
)

from lowmem_jax import app
from lowmem_jax.app import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The documents whose ```python blocks are run: the README, and docs/report.md, which holds the
# ``--step`` protocol and its example.
DOCS = {name: (ROOT / name).read_text() for name in ("README.md", "docs/report.md")}
# (document, its Python block), in the documents' order.
BLOCKS = [(name, block) for name, text in DOCS.items()
          for block in re.findall(r"```python\n(.*?)```", text, re.S)]


def test_every_python_block_of_the_readme_is_run():
  """Each ```python fence of each of `DOCS` is one of `BLOCKS` (so one `test_readme_block_runs`
  case), the NNX and linen blocks among them, and one block (the ``--step`` example) defines
  ``make_step``."""
  for name, text in DOCS.items():
    assert text.count("```python\n") == sum(n == name for n, _ in BLOCKS) > 0, name
  assert any("nnx" in b for _, b in BLOCKS) and any("linen" in b for _, b in BLOCKS)
  assert sum("def make_step" in b for _, b in BLOCKS) == 1


def _promotion_marks(block):
  """A block that steps an Adam (optax's, or lowmem_jax's on optax's bias correction) runs
  optax's implicit promotions; with bfloat16 parameters, its moment update and apply_updates'."""
  if "adam" not in block:
    return []
  bf16 = "jnp.bfloat16" in block and "apply_updates" in block
  return [OPTAX_BIAS_CORRECTION] + [OPTAX_UPDATE_MOMENT, OPTAX_APPLY_UPDATES] * bf16


def _block_id(index):
  """``README-1``, ``report-1``: the document's stem and the block's number in it."""
  name, _ = BLOCKS[index]
  number = sum(n == name for n, _ in BLOCKS[:index + 1])
  return f"{pathlib.Path(name).stem}-{number}"


@pytest.mark.slow
@pytest.mark.parametrize("index", [
    pytest.param(i, marks=_promotion_marks(block), id=_block_id(i))
    for i, (_, block) in enumerate(BLOCKS)])
def test_readme_block_runs(index, tmp_path, monkeypatch, capfd):
  monkeypatch.chdir(tmp_path)
  namespace = {"__name__": "readme"}
  name, block = BLOCKS[index]
  exec(compile(block, f"{name}, Python block {_block_id(index)}", "exec"), namespace)
  err = capfd.readouterr().err  # XLA's C++ log, too: its slow-compile alarms are noise to a reader
  assert "Constant folding an instruction is taking" not in err and "slow_operation_alarm" not in err
  if "make_step" in namespace:  # the --step example: its rows' peaks as its document says
    _check_the_step_example(name, tmp_path, capfd)


def _check_the_step_example(name, tmp_path, capfd):
  """`lowmem-jax report --step` gives the peaks that the document `name` (the one holding the
  make_step block) quotes, and `plan --step` with its budget tries at least five rows,
  cheapest recompute first, and with ``objective="memory"`` picks the first that fits; the
  Python it prints makes that step."""
  text = DOCS[name].replace("\n", " ")
  quoted = re.search(r"prints `baseline`, `lowmem` and `lowmem\+approx` \((\d+), (\d+) and "
                     r"(\d+) MiB on the H100 target", text)
  budget = re.search(r"lowmem-jax plan --step train.py:make_step --budget (\d+)MiB`", text)
  assert quoted and budget, f"{name} quotes the --step example's peaks and budget"
  source = next(b for n, b in BLOCKS if n == name and "def make_step" in b)
  (tmp_path / "train.py").write_text(source)
  spec = f"{tmp_path / 'train.py'}:make_step"
  assert cli.main(["report", "--step", spec, "--target", "h100", "--json"]) == 0
  rows = json.loads(capfd.readouterr().out)["rows"]
  assert [r["techniques"] for r in rows] == ["baseline", "lowmem", "lowmem+approx"]
  assert [round(r["peak_bytes"] / 2**20) for r in rows] == [int(q) for q in quoted.groups()]
  job = app.Job(make_step=cli.load_step(spec), target="h100")
  fit = app.cheapest_fit(job, int(budget[1]) * 2**20, objective="memory")
  texts, left_out = app.ladder_of(job)
  assert not left_out and len(fit.tried) >= 5
  # in ladder order, exact sets only; a remat:plan set is not measured where no policy fits
  tried = [s.label for _, s in fit.tried]
  untried = [t for t in texts[:texts.index(tried[-1])] if t not in tried]
  assert tried == [t for t in texts if t in tried] and all("remat:plan" in t for t in untried)
  # an approximate set only where no exact set fits
  assert fit.fits.exact or not any(s.exact for b, s in fit.tried
                                   if b.stats.peak_bytes <= int(budget[1]) * 2**20)
  assert all(b.stats.peak_bytes > int(budget[1]) * 2**20 for b, _ in fit.tried[:-1])
  assert fit.tried[-1][0].stats.peak_bytes <= int(budget[1]) * 2**20
  # the Python printed for the fit makes the step measured
  namespace = {"make_step": job.make_step}
  exec(fit.fits.python(job), namespace)
  shapes = lambda tree: jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), tree)
  assert shapes(namespace["args"]) == shapes(app.user_step(job, fit.fits)[1])
