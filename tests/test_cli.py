"""`lowmem_jax.compile.memory.report` against a hand count, and the ``lowmem-jax`` command."""

import json
import math
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from cli_checks import errors
from third_party_promotion import FLAX_NORM, OPTAX_BIAS_CORRECTION

import lowmem_jax as lm
import lowmem_jax_cli
from lowmem_jax import _text, app, names
from lowmem_jax.app import cli, step_options
from lowmem_jax.compile import memory

BATCH, D_IN, HIDDEN, D_OUT = 32, 64, 256, 16


def _mlp():
  def loss(params, x):
    h = jax.ad_checkpoint.checkpoint_name(x @ params["w1"], names.MLP_HIDDEN)
    a = jax.ad_checkpoint.checkpoint_name(jnp.sin(h), names.MLP_ACT)
    return jnp.sum(a @ params["w2"])

  tx = optax.adam(1e-3)

  def train_step(params, opt_state, x):
    grads = jax.grad(loss)(params, x)
    updates, opt_state = tx.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state

  params = {"w1": jax.ShapeDtypeStruct((D_IN, HIDDEN), jnp.float32),
            "w2": jax.ShapeDtypeStruct((HIDDEN, D_OUT), jnp.float32)}
  x = jax.ShapeDtypeStruct((BATCH, D_IN), jnp.float32)
  return loss, train_step, params, jax.eval_shape(tx.init, params), x


@OPTAX_BIAS_CORRECTION
def test_report_agrees_with_a_hand_count():
  loss, train_step, params, opt_state, x = _mlp()
  # Arguments not donated stay live through the whole step, so the hand count holds whatever
  # XLA's schedule (a donated weight may be reused before the peak: jax 0.12's XLA does).
  b = memory.report(jax.jit(train_step), params, opt_state, x,
                    loss_fn=loss, loss_args=(params, x), top=None)
  weights = 4 * (D_IN * HIDDEN + HIDDEN * D_OUT)
  assert b.at_peak["parameters"] == weights
  assert b.at_peak["optimizer state"] == 2 * weights + 4  # mu, nu and the int32 count
  assert b.at_peak["inputs"] == 4 * BATCH * D_IN
  assert sum(b.at_peak.values()) == b.live_peak_bytes <= b.stats.peak_bytes
  # Autodiff keeps cos(h) for sin's derivative and sin(h) for the second matmul's; the sum
  # and the first matmul need nothing but the arguments.
  assert b.saved.by_name() == {None: 4 * BATCH * HIDDEN, names.MLP_ACT: 4 * BATCH * HIDDEN}
  assert b.saved_by_kind() == {"unnamed": 4 * BATCH * HIDDEN, "matmul inputs": 4 * BATCH * HIDDEN}
  assert b.flops > 2 * 2 * BATCH * (D_IN * HIDDEN + HIDDEN * D_OUT)
  as_json = json.loads(json.dumps(b.to_dict()))
  assert as_json["at_peak"] == b.at_peak
  assert as_json["saved_by_name"] == {"None": 4 * BATCH * HIDDEN, "mlp_act": 4 * BATCH * HIDDEN}


def test_report_finds_activations_and_gradients():
  """On the CPU target: on the H100 target this small MLP's peak is at the last GEMM,
  where cuBLAS's 4 MiB workspace is live and the forward values are gone."""
  loss, _, params, _, x = _mlp()
  b = memory.report(jax.grad(loss), params, x, top=None, target="cpu")
  # At the peak of jax.grad, w2's gradient exists beside the forward values backward needs.
  grads = [buf for buf in b.buffers if buf.component == "gradients"]
  assert grads and all(buf.shape in ("f32[64,256]", "f32[256,16]") for buf in grads)
  assert all("transpose(" in buf.op_name for buf in grads)
  acts = [buf for buf in b.buffers if buf.component == "activations"]
  assert sum(buf.nbytes for buf in acts) >= 4 * BATCH * HIDDEN
  assert all("jvp(" in buf.op_name and "transpose(" not in buf.op_name for buf in acts)
  assert "(estimated)" in str(b) and "largest buffers" in str(b)


def test_layers_and_names_of_a_flax_model():
  wl = lm.models.workload("vit-tiny", batch=8, dtype=jnp.float32)
  params = wl.abstract_params()
  b = memory.report(jax.grad(wl.loss), params, wl.inputs, wl.labels, loss_fn=wl.loss,
                    loss_args=(params, wl.inputs, wl.labels), top=None)
  assert {"Transformer/encoderblock_0", "Transformer/encoderblock_1"} <= set(b.activations_by_layer)
  assert sum(b.activations_by_layer.values()) == b.at_peak["activations"]
  # The softmax probabilities are made on a line that makes nothing else of their shape.
  probs = [buf for buf in b.buffers if buf.checkpoint_name == names.ATTN_PROBS]
  assert len(probs) == 2 and all(buf.shape == "f32[8,3,197,197]" for buf in probs)


@OPTAX_BIAS_CORRECTION
def test_plots_are_pngs(tmp_path):
  loss, train_step, params, opt_state, x = _mlp()
  b = memory.report(train_step, params, opt_state, x, label="mlp")
  b.plot(tmp_path / "bars.png", b)
  b.plot_live_bytes(tmp_path / "live.png")
  for name in ("bars.png", "live.png"):
    data = (tmp_path / name).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@OPTAX_BIAS_CORRECTION
def test_explain_oom():
  _, train_step, params, opt_state, x = _mlp()
  text = memory.explain_oom(train_step, params, opt_state, x, limit_bytes=2**16, top=3)
  assert text.startswith("compiled peak") and "over the limit" in text
  assert "params['w1']" in text
  assert "fits in the limit" in memory.explain_oom(train_step, params, opt_state, x,
                                                   limit_bytes=2**30)


def test_report_bad_top_and_top_0():
  loss, _, params, _, x = _mlp()
  with pytest.raises(ValueError, match="top"):
    memory.report(jax.grad(loss), params, x, top=-1)
  assert "largest buffers live at the peak" in str(memory.report(jax.grad(loss), params, x))
  assert "largest buffers" not in str(memory.report(jax.grad(loss), params, x, top=0))


def _tanh_matmul(x, w):
  return jnp.tanh(x @ w)


@pytest.mark.parametrize("n", [1, 4, 9])
def test_loop_flops_counts_a_loop_body_once_a_trip(n):
  """XLA's cost analysis counts a fori_loop's body once; loop_flops n times."""
  x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  lowered = jax.jit(lambda x, w: jax.lax.fori_loop(0, n, lambda i, x: _tanh_matmul(x, w),
                                                   x)).lower(x, x)
  body = memory.flops_of(jax.jit(_tanh_matmul).lower(x, x))
  assert body >= 2 * 64**3
  assert memory.flops_of(lowered) == pytest.approx(body, rel=0.01)
  assert memory.loop_flops(lowered) == pytest.approx(n * body, rel=0.01)


def test_loop_flops_of_nested_loops_and_of_an_unknown_trip_count():
  x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  body = memory.flops_of(jax.jit(_tanh_matmul).lower(x, x))

  def nested(x, w):  # 5 scan steps of 3 fori_loop trips
    inner = lambda c, _: (jax.lax.fori_loop(0, 3, lambda i, c: _tanh_matmul(c, w), c), None)
    return jax.lax.scan(inner, x, None, length=5)[0]
  assert memory.loop_flops(jax.jit(nested).lower(x, x)) == pytest.approx(15 * body, rel=0.01)

  def traced(x, w, n):  # the bound is an argument: not known when compiling
    return jax.lax.fori_loop(0, n, lambda i, x: _tanh_matmul(x, w), x)
  n = jax.ShapeDtypeStruct((), jnp.int32)
  assert memory.loop_flops(jax.jit(traced).lower(x, x, n)) is None


def test_cuda_driver_notes_are_dropped_and_every_other_line_kept(capfd):
  """CUDA's stubs write their note to file descriptor 2 from C++ (as jax's CUDA plugin loads
  without a GPU): the CLI drops it and the absl line before it, nothing else."""
  absl, note = lowmem_jax_cli._ABSL_NOTE, lowmem_jax_cli._CUDA_NOTE
  with lowmem_jax_cli.without_cuda_notes():
    os.write(2, f"{absl}\nI0000 cudart_stub.cc:31] {note}\nkept\n{absl}\nkept too\n".encode())
  assert capfd.readouterr().err == f"kept\n{absl}\nkept too\n"


def test_console_script_prints_no_cuda_driver_note():
  """``lowmem-jax`` (`lowmem_jax_cli.main`, the console script) in a process of its own: the
  notes ``import jax`` prints where JAX's CUDA plugin is installed (the target extra) are
  dropped; the report's lines and its error come through."""
  run = subprocess.run(
      [sys.executable, "-c", "import sys, lowmem_jax_cli; sys.exit(lowmem_jax_cli.main())",
       "report", "--model", "nope"], capture_output=True, text=True, timeout=300, check=False)
  assert run.returncode == 2 and "nope" in run.stderr, run.stderr[-2000:]
  assert lowmem_jax_cli._CUDA_NOTE not in run.stderr + run.stdout


def test_ctrl_c_during_a_compile_ends_in_one_line_with_status_130():
  """SIGINT while XLA compiles: one line, status 130 (128 + SIGINT), no traceback, no crash.
  The child gets SIGINT's default action as at a terminal: a run started in the background
  by a shell (as CI may be) ignores SIGINT, and Python, as a shell's job does, keeps that."""
  proc = subprocess.Popen(
      [sys.executable, "-c", "import sys, lowmem_jax_cli; sys.exit(lowmem_jax_cli.main())",
       "report", "--model", "llama-3.2-1b", "--batch", "1", "--seq", "64", "--target", "cpu"],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
      preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  try:
    seen = []
    for line in proc.stderr:  # the first set's compile has begun
      seen.append(line)
      if "compiling" in line:
        break
    proc.send_signal(signal.SIGINT)
    err = "".join(seen) + proc.stderr.read()
    assert proc.wait(timeout=60) == 130, err[-2000:]
  finally:
    proc.kill()
  assert err.splitlines()[-1] == "lowmem-jax: interrupted" and "Traceback" not in err, err


def test_report_help_lists_the_lowmem_rewrites_and_the_options_of_make_step(capsys):
  with pytest.raises(SystemExit):
    cli.main(["report", "--help"])
  out = capsys.readouterr().out
  lowmem = next(line for line in out.splitlines() if line.lstrip().startswith("lowmem "))
  assert all(w in lowmem for w in ("norms", "attention", "loss head"))
  for keyword, option in step_options.STEP_OPTIONS.items():
    assert f"  {keyword}={option.default}: " in out


# The CLI, through its entry point, on the two-block ViT: its compiles are short.
SMALL = ["--model", "vit-tiny", "--batch", "4"]


@pytest.mark.slow
@FLAX_NORM
@OPTAX_BIAS_CORRECTION
def test_cli_report_json(capsys, tmp_path):
  """The components on the CPU target, where the micro-batch loop keeps both moments live."""
  assert cli.main(["report", *SMALL, "--techniques", "baseline,approx+ms-norm,all+adama:2",
                   "--top", "3", "--json", "--plot", str(tmp_path), "--target", "cpu"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["target"] == "cpu" and "CPU proxy" in out["target_note"]
  assert [r["techniques"] for r in out["rows"]] == ["baseline", "approx+ms-norm", "all+adama:2"]
  base, approx, adama = out["rows"]
  params = 4 * sum(math.prod(x.shape) for x in jax.tree.leaves(
      lm.models.workload("vit-tiny", batch=4).abstract_params()))
  for r in out["rows"]:
    assert set(r) >= {"parameters", "optimizer_state", "gradients", "activations", "other",
                      "peak_bytes", "reduction", "extra_flops", "saved_activation_bytes",
                      "peak_saved_bytes", "breakdown"}
    assert r["peak_saved_bytes"] == base["peak_bytes"] - r["peak_bytes"] < base["peak_bytes"]
    assert r["live_peak_bytes"] == sum(r["breakdown"]["at_peak"].values())
    assert len(r["breakdown"]["largest_at_peak"]) == 3
  assert base["reduction"] == 1.0 and base["extra_flops"] == 0.0
  assert approx["breakdown"]["saved_by_name"]["act_code"] > 0
  assert approx["saved_activation_bytes"] < base["saved_activation_bytes"]
  assert "attn_lse" in adama["breakdown"]["saved_by_name"]
  # Inside the micro-batch loop the parameters and moments are loop-carried values: still counted.
  # Folding in the backward (adama), the moments being rewritten at the peak are new values
  # made in the backward: the report counts them as gradients or updates, not as state. The
  # parameters and both moments are found, at most whole: donated, they are live at the peak
  # but for what XLA already updated in place (jax 0.10.2's XLA: the parameters whole, the
  # moments 1.99 and 1.4 of them; jax 0.12's: the baseline's parameters 0.73, moments 1.70).
  for r in (base, adama):
    at = r["breakdown"]["at_peak"]
    assert 0.5 * params <= at["parameters"] <= 1.3 * params, (r["techniques"], at)
    assert params <= at["optimizer state"] <= 2 * params + 8, (r["techniques"], at)
  # No remat in either: FLOPs within 1% and (the micro-batch loop's body counted once a trip)
  # 10% of the baseline's either way (XLA's cost analysis of approx+ms-norm and adama: above
  # with jax 0.10.2, +3.1% for adama; 0.2% below with jax 0.12)
  assert abs(approx["extra_flops"]) < 0.01, approx["extra_flops"]
  assert abs(adama["extra_flops"]) < 0.1, adama["extra_flops"]
  for name in ("components.png", "live_bytes.png"):
    assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@OPTAX_BIAS_CORRECTION
def test_cli_report_table(capsys):
  assert cli.main(["report", *SMALL, "--techniques", "baseline,remat:full"]) == 0
  out = capsys.readouterr().out
  for column in ("techniques", "params", "optimizer", "gradients", "activations", "peak",
                 "× less", "extra FLOPs", "saved"):
    assert column in out
  assert "remat:full" in out and "largest buffers live at the peak" in out
  legend = " ".join(out.split())
  assert ("none found: no argument of the step is parameters or optimizer state (found by name, "
          "params and opt_state, or by type)") in legend
  assert "saved: the reference peak over this row's, and the reference peak less this row's" in (
      legend.replace("× less and saved", "saved"))


def test_the_summary_counts_throughput_in_tokens_for_sequences_and_names_no_missing_column():
  """BERT's rate in tokens/s as LLaMA's (it was labelled images/s); a step of the user's own
  has no rate column, and its caption names none, nor a split that does not follow."""
  row = dict(techniques="baseline", parameters=1, optimizer_state=1, gradients=1, activations=1,
             other=1, peak_bytes=2**20, host_bytes=0, collective_bytes=None, extra_flops=0.0,
             transfer_floor_s=None, reduction=1.0, peak_saved_bytes=0, step_s=0.004, mfu=0.5,
             bound="compute")
  for model, unit, rate in (("minilm-l6", "tokens/s", 2 * 32 / 0.004),
                            ("llama-tiny", "tokens/s", 2 * 32 / 0.004),
                            ("vit-tiny", "images/s", 2 / 0.004)):
    text = _text.render(cli._summary([row], "", app.Job(model, batch=2, seq=32, target="cpu")))
    assert unit in text and f"{rate:,.0f}" in text, model
  own = app.Job(make_step=lambda: None, target="cpu")
  text = _text.render(cli._summary([row], "", own))
  assert "/s" not in text and "MFU" in text and "split below" not in text  # plan's: none
  text = _text.render(cli._summary([row], "", own, "each row"))  # report --details
  assert "split below for each row" in " ".join(text.split())


@pytest.mark.parametrize("argv, message", [
    (["report", "--model", "gpt-9"], "invalid choice: 'gpt-9'"),
    (["report", "--techniques", "baseline,turbo"], "unknown technique 'turbo'"),
    (["report", "--techniques", "remat:some"], "remat:some"),
    (["report", "--techniques", "adama:0"], "adama:0"),
    (["report", "--techniques", "adama:²"], "adama:²"),
    (["report", *SMALL, "--techniques", "adama:3"], "equal micro-batches"),
    (["report", *SMALL, "--plot", "/dev/null/x"], "--plot"),
    (["report", *SMALL, "--techniques", "all+fused-ce"], "fused-ce in 'all+fused-ce': loss='fused' "
                                                          "applies to the LLaMA models"),
    (["report", "--batch", "0"], "--batch must be an int >= 1"),
    (["report", "--techniques", "conv:fft"], "conv:fft"),
    (["report", *SMALL, "--techniques", "conv:int8"], "conv:int8 in 'conv:int8': conv applies to "
                                                       "the WideResNet"),
    (["report", "--model", "wrn-28-2", "--techniques", "all"],
     "approx in 'all': activation must be one of ('exact', '1bit')"),
    (["report", "--model", "wrn-28-2", "--techniques", "ms-norm"], "wrn-28-2 has batch norm"),
    (["report", *SMALL, "--techniques", "adama:2+offload-opt"], "offload-opt does not take adama"),
    (["report", *SMALL, "--techniques", "bf16-params"], "bf16-params needs 8bit"),
    (["report", "--model", "llama-tiny", "--batch", "2", "--seq", "16", "--target", "cpu",
      "--techniques", "stream:device+fused-update+8bit+bf16-params"],
     "fused-update in 'stream:device+fused-update+8bit+bf16-params': its kernel is Triton's, "
     "for a GPU target (h100, rtx4090, ...); target cpu is not one"),
    (["report", "--model", "bert-base", "--seq", "1024", "--techniques", "baseline"],
     "'baseline': seq must be <= 512 for bert-base, got 1024"),
    (["report", *SMALL, "--seq", "64"],
     "--seq is for the sequence models (LLaMA, BERT); vit-tiny takes --image."),
    (["report", "--model", "llama-tiny", "--image", "64"],
     "--image is for the image models (ViT, WideResNet); llama-tiny takes --seq."),
    (["report", *SMALL, "--image", "8", "--target", "cpu"],
     "image must be a multiple of vit-tiny's 16-pixel patch, got 8"),
    (["plan", "--model", "wrn-28-2", "--budget", "1GiB"], "invalid choice: 'wrn-28-2'"),
    (["plan", "--budget", "12 parsecs"], "budget '12 parsecs'"),
    (["plan"], "--budget"),
    ([], "command"),
])
def test_cli_usage_errors(capsys, argv, message):
  assert cli.main(argv) == 2
  err = errors(capsys.readouterr().err)
  assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.slow
@FLAX_NORM
@OPTAX_BIAS_CORRECTION
@pytest.mark.heavy
def test_cli_plan(capsys):
  # Baseline does not fit 1 MiB less than its own peak; the exact techniques do.
  base = app.measure(app.Job("vit-tiny", batch=4), app.parse("baseline"))
  budget = base.stats.peak_bytes - 2**20
  # --objective memory stops at the first that fits (time compiles the whole ladder:
  # test_cli_step.py::test_plan_picks_the_fastest_that_fits).
  assert cli.main(["plan", *SMALL, "--budget", f"{budget}B", "--objective", "memory"]) == 0
  out = capsys.readouterr().out
  fits = next(line for line in out.splitlines() if line.startswith("Fits"))
  assert "baseline" not in fits and "lm.models.workload(\"vit-tiny\"" in out
  assert "The first in the ladder that fits (--objective memory)." in fits
  assert "donate_argnums=(0, 1)" in out


@FLAX_NORM  # the ladder's bf16-params sets: bfloat16 norm parameters
def test_cli_plan_nothing_fits(capsys):
  assert cli.main(["plan", *SMALL, "--batch", "1", "--budget", "1MiB"]) == 1
  err = capsys.readouterr().err
  assert "nothing fits 1.0 MiB: the parameters and optimizer state on the device alone" in err
  assert err.count("\n") == 1


@pytest.mark.slow
@OPTAX_BIAS_CORRECTION
def test_fused_ce_for_language_models(capsys):
  assert app.parse("all+fused-ce").values == (
      ("approx", True), ("ms-norm", True), ("attention", True), ("bf16", True), ("fused-ce", True))
  def rungs(best, places):
    state = f"{best}+8bit+bf16-params"
    return [best, f"{best}+8bit", state, f"{state}+remat:plan"] + [f"{state}+{p}" for p in places]
  micro = lambda best, ks: [f"{best}+8bit+bf16-params+remat:full+adama:{k}" for k in ks]
  exact = "bf16+ms-norm+attention"
  assert app.ladder(4) == (["baseline", "bf16"] + rungs(exact, ["offload-opt"])
                           + rungs("all", ["offload-opt"]) + micro(exact, (2, 4))
                           + micro("all", (2, 4)))
  every = f"+update-slice:{2 ** 30}"
  streamed = [f"ce-one-pass+stream:{place}" for place in (
      f"device+whole-layer+mlp-hidden+mlp-chunk:off{every}",
      f"device+whole-layer+mlp-chunk:off{every}", f"device+mlp-chunk:off{every}",
      "device+mlp-chunk:off", "device", "host", "host+late-embed",
      "host+offload-opt+part-inputs+mlp-chunk:off",
      "host+offload-opt+prefetch:2+whole-layer+mlp-chunk:off",
      "host+offload-opt", "host+offload-opt+mlp-chunk:off")]
  assert app.ladder(2, language_model=True) == (
      ["baseline", "fused-ce", "bf16+fused-ce"] + rungs(f"{exact}+fused-ce", streamed)
      + rungs("all+fused-ce", streamed) + micro(f"{exact}+fused-ce", (2,))
      + micro("all+fused-ce", (2,)))
  llama = ["--model", "llama-100m", "--batch", "1", "--seq", "64", "--target", "cpu"]
  assert cli.main(["report", *llama, "--techniques", "baseline,fused-ce", "--json"]) == 0
  rows = json.loads(capsys.readouterr().out)["rows"]
  # the logits of each chunk made again in the backward: +15.2%, each loop's body (the
  # chunks, the scanned layers) counted a time each trip (XLA's own count: -38%)
  assert 0.1 < rows[1]["extra_flops"] < 0.2, rows[1]["extra_flops"]
  # the [64, 32000] float32 logits are not kept; a float32 log-sum-exp a token is. From jax
  # 0.12.1 (`jax.nn.logsumexp` a custom_jvp) the baseline keeps 320 bytes less: 8,191,812
  # bytes saved with 0.12.0.1, 8,191,492 with 0.12.1
  saved = rows[0]["saved_activation_bytes"] - rows[1]["saved_activation_bytes"]
  assert 64 * 32000 * 4 - 2 * 64 * 4 <= saved <= 64 * 32000 * 4, saved


@pytest.mark.slow
@FLAX_NORM
@OPTAX_BIAS_CORRECTION
@pytest.mark.heavy
def test_optimizer_memory_techniques(capsys):
  """8bit, bf16-params and offload-opt each cut what their name says on the h100 target; the
  printed Python runs and builds the same optimizer state."""
  s = app.parse("adama:2+8bit+bf16-params")
  assert s.values == (("adama", 2), ("8bit", True), ("bf16-params", True))
  assert not s.fold_in_backward and app.parse("adama:2").fold_in_backward
  small = ["--model", "vit-tiny", "--batch", "4", "--image", "32", "--target", "h100"]
  # (each 8-bit row compiles for ~15 s: one row holds both; adama's row is test_cli_report_json's)
  assert cli.main(["report", *small, "--techniques", "baseline,8bit+bf16-params,offload-opt",
                   "--json"]) == 0
  base, bf16, off = json.loads(capsys.readouterr().out)["rows"]
  assert bf16["optimizer_state"] < 0.3 * base["optimizer_state"]  # 1 byte + scales, not 4
  assert bf16["parameters"] == pytest.approx(base["parameters"] / 2, rel=0.05)
  assert off["optimizer_state"] == 0  # not on the device at the peak
  assert off["breakdown"]["compiled"]["host_argument_bytes"] >= base["optimizer_state"]
  setting = app.parse("8bit+bf16-params+offload-opt")
  code = setting.python(app.Job("vit-tiny", batch=4, image=32, target="h100"))
  assert "lm.offload.offload_state(lm.lowbit.adamw_8bit(0.001, weight_decay=0.0001))" in code
  assert "lm.lowbit.stochastic_rounding()" in code and "param_dtype=jnp.bfloat16" in code
  assert "params, opt_state = lm.offload.committed((params, opt_state))" in code
  namespace = {}
  exec(code, namespace)
  assert all(x.committed for x in jax.tree.leaves((namespace["params"], namespace["opt_state"])))
  assert jax.tree.structure(namespace["opt_state"]) == jax.tree.structure(
      setting.adamw().init(namespace["params"]))
  assert {p.dtype for p in jax.tree.leaves(namespace["params"])} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.slow
@OPTAX_BIAS_CORRECTION
@pytest.mark.heavy
def test_wrn_in_the_report(capsys):
  assert cli.main(["report", "--model", "wrn-28-2", "--batch", "8", "--target", "h100",
                   "--techniques", "baseline,relu-1bit+conv:int8", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["image"] == 32 and out["seq"] is None  # a shape the model does not take: None
  base, lowmem = out["rows"]
  assert lowmem["saved_activation_bytes"] < 0.7 * base["saved_activation_bytes"]
  # and the compiled peak: the convs' backward makes its full-size copy of the input when it
  # gets there (49.4 -> 43.1 MiB since the head is no GEMM; 56.1 -> 45.4 before it, and 51.9
  # without the barrier, which let XLA hoist the copies: 4.2 MiB less)
  assert lowmem["peak_bytes"] < base["peak_bytes"] - 6 * 2**20


def test_parse_bytes():
  assert cli.parse_bytes("24GiB") == 24 * 2**30
  assert cli.parse_bytes("1.5 GB") == 1_500_000_000
  assert cli.parse_bytes("4096 B") == 4096
  with pytest.raises(cli.UsageError, match="give a unit, e.g. 24GiB"):
    cli.parse_bytes("24")
  assert cli.parse_bytes("1e3MiB") == 1000 * 2**20 and cli.parse_bytes(".5GiB") == 2**29
  for text in ("0.0000001KiB", "1e400GiB"):
    with pytest.raises(cli.UsageError, match=rf"budget '{text}': give at least 1B and less "
                       r"than 2\^63 bytes"):
      cli.parse_bytes(text)
