"""Every Python block of the README runs as written, and the figures it quotes for the
``--step`` example are the compiled ones."""

import pathlib
import re

import pytest

import lowmem_jax as lm
from third_party_promotion import OPTAX_APPLY_UPDATES, OPTAX_BIAS_CORRECTION, OPTAX_UPDATE_MOMENT

README = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def test_every_python_block_of_the_readme_is_run():
  """Each ```python fence is one of `BLOCKS` (so one `test_readme_block_runs` case), the NNX
  and linen blocks among them."""
  assert BLOCKS and len(BLOCKS) == README.count("```python\n")
  assert any("nnx" in b for b in BLOCKS) and any("linen" in b for b in BLOCKS)


def _promotion_marks(block):
  """A block that steps an Adam (optax's, or lowmem_jax's on optax's bias correction) runs
  optax's implicit promotions; with bfloat16 parameters, its moment update and apply_updates'."""
  if "adam" not in block:
    return []
  bf16 = "jnp.bfloat16" in block and "apply_updates" in block
  return [OPTAX_BIAS_CORRECTION] + [OPTAX_UPDATE_MOMENT, OPTAX_APPLY_UPDATES] * bf16


@pytest.mark.slow
@pytest.mark.parametrize("index", [pytest.param(i, marks=_promotion_marks(block))
                                   for i, block in enumerate(BLOCKS)])
def test_readme_block_runs(index, tmp_path, monkeypatch, capfd):
  monkeypatch.chdir(tmp_path)
  namespace = {"__name__": "readme"}
  exec(compile(BLOCKS[index], f"README.md, Python block {index + 1}", "exec"), namespace)
  err = capfd.readouterr().err  # XLA's C++ log, too: its slow-compile alarms are noise to a reader
  assert "Constant folding an instruction is taking" not in err and "slow_operation_alarm" not in err
  if "make_step" in namespace:  # the --step example: its two rows' peaks as the README says
    quoted = re.search(r"prints both rows \((\d+) and (\d+) MiB on the H100 target\)",
                       README.replace("\n", " "))
    peaks = [lm.memory.analyze(*(lambda s, a: (s, *a))(*namespace["make_step"](lowmem)),
                               target="h100").peak_bytes / 2**20
             for lowmem in (lambda f: f, lm.lowmem)]
    assert [round(p) for p in peaks] == [int(quoted[1]), int(quoted[2])]
