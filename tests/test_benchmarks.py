"""Every benchmark runs: each script's --quick mode (kernels.py's --interpret), in this process.

A quick run's figures are not results; each test asserts what its tiny run must still show:
the table's rows, figures finite and positive, a technique below its baseline where the script
measures that. benchmarks/gpu_validate.py's --dry-run is tests/test_gpu_validate.py's. The
scripts import beside each other (tests/conftest.py puts benchmarks/ and examples/ on the path).
"""

import math
import pathlib

import jax
import pytest

import lowmem_jax as lm
from third_party_promotion import (FLAX_NORM, OPTAX_APPLY_UPDATES, OPTAX_BIAS_CORRECTION,
                                   OPTAX_UPDATE_MOMENT, TRANSFORMERS_FLAX)

NNX_NORM = pytest.mark.standard_promotion(
    "flax.nnx.nn.normalization._compute_stats (flax/nnx/nn/normalization.py:97): nnx.LayerNorm's "
    "float32 statistics of bfloat16 inputs, jnp.promote_types(bfloat16, float32)")

# Where deviceless GPU targets compile here, the quick runs compile for one (targets.default()):
# host memory is then apart from the device's.
GPU_TARGET = lm.targets.default().platform == "cuda"


def positive(x) -> bool:
  return math.isfinite(x) and x > 0


def table_rows(out: str) -> list[list[str]]:
  """The cells of a printed Markdown table's rows, header and rule left out."""
  lines = [line for line in out.splitlines() if line.startswith("| ")]
  return [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]
          if not line.startswith("|---")]


@pytest.mark.slow
@OPTAX_BIAS_CORRECTION
@pytest.mark.heavy
def test_adama():
  import adama

  found = adama.main(["--quick"])
  peaks = found["peaks"]["llama-tiny", 2]
  assert {"multisteps", "accumulate", "adama", "adama+fold-in-backward", "scanned adama",
          "scanned adama+fold-in-backward"} <= set(peaks)
  assert all(positive(p) for p in peaks.values())
  # Folding each layer's gradient in its backward rule holds no stacked gradient.
  assert peaks["scanned adama+fold-in-backward"] < peaks["scanned adama"]
  assert set(found["times"]) == {"accumulate", "adama"}
  assert all(positive(t) for t in found["times"].values())


def test_block_memory_variant_names():
  import block_memory

  assert block_memory.variant_names("baseline,all three,lm.lowmem(baseline, approx)") == [
      "baseline", "all three", "lm.lowmem(baseline, approx)"]
  assert block_memory.variant_names(",".join(block_memory.VARIANTS)) == list(
      block_memory.VARIANTS)


@pytest.mark.slow
@FLAX_NORM
@pytest.mark.heavy
def test_block_memory():
  import block_memory

  found = block_memory.main(["--quick"])
  rows = {variant: (stats, per_block, saved)
          for variant, stats, per_block, saved in found["llama-tiny", "bfloat16"]}
  assert list(rows) == block_memory.variant_names(block_memory.QUICK["variants"])
  assert all(positive(stats.peak_bytes) for stats, _, _ in rows.values())
  saved = {variant: s.activation_bytes for variant, (_, _, s) in rows.items()}
  assert saved["all three + fused loss"] < saved["baseline"]
  assert saved["lm.lowmem(baseline, approx)"] < saved["baseline"]
  assert rows["all three + fused loss"][0].peak_bytes < rows["baseline"][0].peak_bytes
  assert set(found["llama-tiny", "seconds"]) == set(rows)
  assert all(positive(t) for t in found["llama-tiny", "seconds"].values())


@pytest.mark.slow
@OPTAX_BIAS_CORRECTION
@FLAX_NORM
def test_combination(tmp_path):
  pytest.importorskip("tqdm", reason="benchmarks/combination.py's progress bar needs tqdm")
  import combination

  out = tmp_path / "combination.md"
  found = combination.main(["--quick", "--out", str(out)])
  rows = {r["label"]: r for r in found["vit-tiny"]}
  assert list(rows) == list(combination.QUICK_ROWS)
  assert all(positive(r["peak"]) and positive(r["saved"]) for r in rows.values())
  base = rows["float32 baseline"]
  assert rows["remat every block"]["peak"] < base["peak"]
  assert rows["remat every block"]["saved"] < base["saved"]
  assert rows["compressed residuals + float16"]["saved"] < base["saved"]
  assert [r[0] for r in table_rows(out.read_text())] == list(combination.QUICK_ROWS)


@pytest.mark.slow
@OPTAX_BIAS_CORRECTION
def test_convergence(tmp_path, monkeypatch):
  pytest.importorskip("sklearn", reason="benchmarks/convergence.py's data: scikit-learn")
  pytest.importorskip("tqdm", reason="benchmarks/convergence.py's progress bar needs tqdm")
  import convergence

  monkeypatch.chdir(tmp_path)
  found = convergence.main(["--quick"])
  assert list(found) == convergence.QUICK["variants"]
  for loss, accuracy, _ in found.values():
    assert positive(loss) and 0 <= accuracy <= 100
  notes = found["1bit-relu"][2]  # exact: the baseline's params
  assert notes[0].startswith("final params max abs diff vs baseline ")
  assert float(notes[0].rsplit(" ", 1)[1]) < 1e-5
  assert "steps skipped" in found["fp16+loss-scale"][2][0]
  assert not any(tmp_path.iterdir())  # --quick writes nothing


@pytest.mark.slow
@OPTAX_BIAS_CORRECTION
@pytest.mark.heavy
def test_fine_tune_ablation():
  import fine_tune_ablation
  found = fine_tune_ablation.main(["--quick"])
  assert list(found) == list(fine_tune_ablation.QUICK_ROWS)
  assert all(len(v) == 1 and positive(v[0]) for v in found.values())


@pytest.mark.slow
@OPTAX_BIAS_CORRECTION
@pytest.mark.heavy
def test_finetune_memory():
  import finetune_memory

  rows = finetune_memory.main(["--quick"])["llama-tiny"]
  assert list(rows) == ["AdamW float32", "+ lowmem activations",
                        "+ AdamA (k=2, fold in backward)", "AdamW offloaded instead of AdamA"]
  assert all(positive(peak) and positive(params) for peak, params, _, _ in rows.values())
  assert rows["+ lowmem activations"][0] < rows["AdamW float32"][0]
  if GPU_TARGET:  # the CPU has no host memory apart from the device's
    offloaded = rows["AdamW offloaded instead of AdamA"]
    assert offloaded[3] == offloaded[2] > 0  # the optimizer state, all in host memory


@pytest.mark.slow
@pytest.mark.parametrize("model", [
    "hf-style", pytest.param("transformers", marks=[TRANSFORMERS_FLAX, pytest.mark.heavy])])
def test_hf_style_gpt2(model, capsys):
  if model == "transformers":
    transformers = pytest.importorskip(
        "transformers", reason="--model transformers: transformers' FlaxGPT2LMHeadModel")
    if not hasattr(transformers, "FlaxGPT2LMHeadModel"):
      pytest.skip(f"transformers {transformers.__version__} has no Flax GPT-2 (removed in 5)")
  import hf_style_gpt2

  # Hugging Face's GPT-2, and the model written as they write it, add [D] biases to [B, L, D]
  # arrays by NumPy's rank promotion (as tests/test_hf_models.py allows).
  with jax.numpy_rank_promotion("allow"):
    peaks = hf_style_gpt2.main(["--quick", "--model", model])
  assert set(peaks) == {"plain", "lm.lowmem", "lm.lowmem approx"}
  assert all(positive(p) for p in peaks.values())
  out = capsys.readouterr().out
  assert "lm.lowmem: 12 rewrites" in out  # per layer: attention, layout, two norms, GELU; loss
  assert "linear_cross_entropy (tied embedding)" in out


@pytest.mark.slow
def test_kernels(capsys):
  import kernels

  kernels.main(["--interpret", "--repeats", "1"])
  rows = table_rows(capsys.readouterr().out)
  assert [r[0].split(" (")[0] for r in rows] == [
      "resilu2 fwd", "resilu2 bwd", "regelu2 fwd", "regelu2 bwd", "relu fwd", "relu bwd",
      "rms_norm fwd", "rms_norm bwd", "layer_norm fwd", "layer_norm bwd", "pack 2-bit",
      "unpack 2-bit"]
  assert all(positive(float(r[2])) and positive(float(r[3])) for r in rows)  # kernel, XLA µs


@OPTAX_BIAS_CORRECTION
@pytest.mark.parametrize("growth", [False, True], ids=["rows", "growth"])
def test_layer_streamed(growth):
  import layer_streamed

  (row,) = layer_streamed.main(["--quick"] + ["--growth"] * growth)
  assert row["model"] == "llama-tiny" and "stream:host+offload-opt" in row["techniques"]
  if growth:
    assert positive(row["peak_2_layers"]) and positive(row["one_layer_holds"])
    # On this toy the first row's fetch (in halves, slicing._halves) can hold the 2-layer
    # peak, a row above the 4-layer one's (jax 0.12.0.1: 7,041,613 against 6,793,037 bytes).
    assert row["peak_4_layers"] >= 0.9 * row["peak_2_layers"]
  else:
    assert positive(row["peak_bytes"]) and positive(row["parameters"])
    assert positive(row["host_link_bytes"])  # the state and the saved inputs, both ways
    if GPU_TARGET:
      assert positive(row["host_bytes"])
      assert positive(row["transfer_floor_s"]) and positive(row["compute_floor_s"])


def test_loss_head():
  import loss_head

  # The CPU target: at these sizes the h100 target's compile on jax 0.12 gives the chunked head
  # a fixed 32 MiB scratch buffer (s8[33554432], XLA's own, no JAX op), above the plain head's
  # whole peak; at real sizes it is small beside the logits.
  found = loss_head.main(["--quick", "--target", "cpu"])
  assert list(found) == [loss_head.PLAIN, "linear_cross_entropy 128x512"]
  assert all(positive(peak) and positive(seconds) for peak, seconds in found.values())
  # The chunked head never holds the [tokens, vocab] logits and their gradient.
  assert found["linear_cross_entropy 128x512"][0] < found[loss_head.PLAIN][0]


@pytest.mark.slow
@OPTAX_BIAS_CORRECTION
@pytest.mark.heavy
def test_lowbit_charlm():
  import lowbit_charlm

  found = lowbit_charlm.main(["--quick"])
  assert list(found) == list(lowbit_charlm.QUICK_ROWS)
  (reference,), (rounded,) = found.values()
  assert 0 < rounded < math.log(128) and 0 < reference < math.log(128)  # below a uniform guess
  assert abs(rounded - reference) < 0.01 * reference


@pytest.mark.slow
@OPTAX_BIAS_CORRECTION
def test_lowbit_digits():
  pytest.importorskip("sklearn", reason="benchmarks/lowbit_digits.py's data: scikit-learn")
  import lowbit_digits

  found = lowbit_digits.main(["--quick"])
  assert list(found) == list(lowbit_digits.QUICK_ROWS)
  losses = [loss for (loss,) in found.values()]
  assert all(0 < loss < math.log(10) for loss in losses)  # below a uniform guess
  adam, adam8, adama, adama8 = losses
  assert abs(adam8 - adam) < 0.01 * adam and abs(adama8 - adama) < 0.01 * adama


@OPTAX_BIAS_CORRECTION
def test_offload_memory():
  import offload_memory

  found = offload_memory.main(["--quick"])
  assert list(found) == list(offload_memory.rows())
  assert all(positive(s.peak_bytes) for s in found.values())
  if GPU_TARGET:  # the CPU has no host memory apart from the device's
    on_device, offloaded = found["Adam, state on the device"], found["offload (leaf by leaf)"]
    assert offloaded.argument_bytes < on_device.argument_bytes
    assert offloaded.host_argument_bytes > 0 == on_device.host_argument_bytes


@OPTAX_BIAS_CORRECTION
@OPTAX_UPDATE_MOMENT
@OPTAX_APPLY_UPDATES
def test_optimizer_bytes(capsys):
  import optimizer_bytes

  found = optimizer_bytes.main(["--quick"])
  kernel = "pallas_kernels.adam8bit, in place (8bit+bf16-params+fused-update)"
  assert list(found) == [*optimizer_bytes.optimizers(), kernel]
  assert all(positive(m["bytes"]) for m in found.values())
  assert found[kernel]["bytes"] < min(m["bytes"] for name, m in found.items() if name != kernel)
  # each Threefry evaluation an element is some 74-77 integer operations, the kernel's (which
  # it declares: two, the moments' codes sharing one) as XLA's, besides the moments' and
  # codes' own (up to some 100 an element)
  for m in (*[m for m in found.values() if m["threefry"]], found[kernel]):
    evaluations = m["threefry"] or 2
    assert 70 * evaluations < m["int_ops"] < 77 * evaluations + 100, found
  assert len(table_rows(capsys.readouterr().out)) == len(found)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["plain", pytest.param("nnx", marks=NNX_NORM)])
@pytest.mark.heavy
def test_plain_vit(model):
  import plain_vit

  found = plain_vit.main(["--quick", "--model", model])
  variants = ["plain", "lm.lowmem(plain)", "lm.lowmem(plain, approx)"]
  assert list(found) == [*variants, "seconds"]
  assert all(positive(found[v][0]) for v in variants)  # compiled peak
  assert found["lm.lowmem(plain)"][2] < found["plain"][2]  # autodiff's residuals
  assert all(positive(found["seconds"][v]) for v in variants)


@pytest.mark.slow
@pytest.mark.heavy
def test_remat(capsys):
  import remat  # the planner and memory APIs as they are

  remat.main(["--quick"])
  out = capsys.readouterr().out
  rows = [line for line in out.splitlines() if line.startswith("| ")]
  assert [r.split(" | ")[0] for r in rows[1:6]] == [
      "| everything", "| full", "| minimal", "| dots", "| compressed"]
  assert any(r.startswith("| plan at ") for r in rows)
  assert "compiled for the CPU (a proxy)" in out


def test_every_benchmark_has_a_test():
  """A new script in benchmarks/ gets a quick mode and its test here, ``test_<script>``."""
  scripts = {p.stem for p in (pathlib.Path(__file__).parents[1] / "benchmarks").glob("[!_]*.py")}
  tested = {name[len("test_"):] for name in globals() if name.startswith("test_")}
  # tests/test_gpu_validate.py and test_gpu_profile.py run their --dry-run
  missing = scripts - tested - {"gpu_validate", "gpu_profile"}
  assert not missing, f"benchmarks without a test here: {sorted(missing)}"


@pytest.mark.skipif(not GPU_TARGET, reason="estimates need a compile-only GPU target")
@OPTAX_BIAS_CORRECTION
def test_step_time(capsys):
  import step_time

  found = step_time.main(["--quick"])
  out = capsys.readouterr().out
  # The rewrites' row ran cuDNN's attention, which jax 0.12.1's XLA cannot compile without a
  # GPU: there it is not estimated on another kernel, and the table says why.
  refused = lm.targets.cudnn_refusal(lm.targets.get("h100")) is not None
  rows = ["baseline"] + ([] if refused else ["approx+ms-norm+attention"])
  assert [e["row"]["techniques"] for e in found] == rows
  assert refused == ("not estimated: measured with cuDNN's attention" in out)
  for e in found:  # the estimate within the issue's band of the H100's measured step
    assert 0.75 <= e["ratio"] <= 1.33, e
  assert table_rows(out)[0][-1] in lm.memory.step_time.BOUNDS
