"""The ``lowmem-jax`` command on a user's own step (``--step FILE:FUNCTION`` or
``MODULE:FUNCTION``): its reports, plans and errors."""

import json
import pathlib
import runpy
import subprocess
import sys

import pytest
from cli_checks import errors
from third_party_promotion import OPTAX_BIAS_CORRECTION

from lowmem_jax import app
from lowmem_jax.app import cli, fits, techniques
from lowmem_jax.compile import memory

# --step: a user's own step, from a file or a module.
STEP_FILE = '''
import jax, jax.numpy as jnp, optax


def loss(params, x):
  h = x @ params["w1"]
  mu = h.mean(-1, keepdims=True)
  h = (h - mu) * jax.lax.rsqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-6) * params["g"][None]
  return jnp.mean(jax.nn.gelu(h, approximate=False) @ params["w2"])


def make_step(lowmem=lambda f: f):
  tx = optax.adam(1e-3)
  grad = jax.grad(lowmem(loss))

  def step(params, opt_state, x):
    updates, opt_state = tx.update(grad(params, x), opt_state)
    return optax.apply_updates(params, updates), opt_state

  params = {"w1": jax.ShapeDtypeStruct((64, 256), jnp.float32),
            "g": jax.ShapeDtypeStruct((256,), jnp.float32),
            "w2": jax.ShapeDtypeStruct((256, 64), jnp.float32)}
  x = jax.ShapeDtypeStruct((1024, 64), jnp.float32)
  args = (params, jax.eval_shape(tx.init, params), x)
  return jax.jit(step, donate_argnums=(0, 1)), args, (lowmem(loss), (params, x))


def no_lowmem():
  step, args, _ = make_step()
  return step, args


def returns_a_dict():
  return {"step": None}


def args_not_a_tuple():
  step, (params, opt_state, x), _ = make_step()
  return step, {"params": params}


def needs_an_argument(batch):
  return make_step()


def raises():
  raise RuntimeError("no data here")


def mismatched():
  step, (params, opt_state, x), _ = make_step()
  return step, (params, opt_state, jax.ShapeDtypeStruct((1024, 32), jnp.float32))


def short_args():
  step, args, _ = make_step()
  return step, args[:2]


def chain(params, x):
  a = jnp.sin(x * params["p"][None])
  b = jax.ad_checkpoint.checkpoint_name(jnp.tanh(jnp.cos(a) * jnp.exp(a)), "own_act")
  return jnp.mean(jnp.sin(b * params["q"][None]) * jnp.cos(b))


def make_step_of_policy(policy=None):
  tx = optax.sgd(1e-3)
  grad = jax.grad(jax.checkpoint(chain, policy=policy) if policy else chain)

  def step(params, opt_state, x):
    updates, opt_state = tx.update(grad(params, x), opt_state)
    return optax.apply_updates(params, updates), opt_state

  params = {"p": jax.ShapeDtypeStruct((256,), jnp.float32),
            "q": jax.ShapeDtypeStruct((256,), jnp.float32)}
  x = jax.ShapeDtypeStruct((2048, 256), jnp.float32)
  return jax.jit(step, donate_argnums=(0, 1)), (params, jax.eval_shape(tx.init, params), x)
'''
STEP_PARAMS = 4 * (64 * 256 + 256 + 256 * 64)


@pytest.fixture
def step_file(tmp_path):
  path = tmp_path / "mlp_step.py"
  path.write_text(STEP_FILE)
  return str(path)


@OPTAX_BIAS_CORRECTION
def test_cli_report_step(capsys, step_file):
  """lowmem (the step differentiates lm.lowmem(loss)) keeps no more than the baseline, on
  the H100 target."""
  assert cli.main(["report", "--step", f"{step_file}:make_step", "--target", "h100"]) == 0
  out = capsys.readouterr().out
  header = next(line for line in out.splitlines() if line.startswith("┃ techniques"))
  peak = [c.strip().split(" ")[0] for c in header.split("┃")].index("peak")  # "peak MiB"
  rows = {c[1]: c for c in ([c.strip() for c in line.split("│")] for line in out.splitlines()
                            if line.startswith("│ "))}
  assert list(rows)[:2] == ["baseline", "lowmem"]  # the default with --step: both
  assert float(rows["lowmem"][peak]) <= float(rows["baseline"][peak])
  assert "none found" not in rows["baseline"] + rows["lowmem"]  # params and optimizer state


@OPTAX_BIAS_CORRECTION
def test_cli_report_step_module_json(capsys, step_file, monkeypatch):
  monkeypatch.syspath_prepend(str(pathlib.Path(step_file).parent))
  assert cli.main(["report", "--step", "mlp_step:make_step", "--techniques", "baseline,lowmem",
                   "--target", "cpu", "--json"]) == 0
  captured = capsys.readouterr()
  out = json.loads(captured.out)
  assert out["step"] == "mlp_step:make_step" and "model" not in out
  base, low = out["rows"]
  assert (base["techniques"], low["techniques"]) == ("baseline", "lowmem")
  for r in (base, low):  # donated: Adam's int32 count may be updated in place before the peak
    assert r["parameters"] == STEP_PARAMS
    assert r["optimizer_state"] in (2 * STEP_PARAMS, 2 * STEP_PARAMS + 4)
  assert low["peak_bytes"] <= base["peak_bytes"]
  assert low["saved_activation_bytes"] < base["saved_activation_bytes"]
  # stderr is no terminal here: a line a set, before it compiles
  assert captured.err == "[1/2] compiling baseline\n[2/2] compiling lowmem\n"


@OPTAX_BIAS_CORRECTION
def test_cli_plan_step(capsys, step_file):
  """A make_step that takes lowmem only: its ladder is baseline, lowmem, lowmem+approx, the
  techniques it takes no options of left out in one line; the fit's call is printed."""
  spec = f"{step_file}:make_step"
  assert cli.main(["report", "--step", spec, "--target", "cpu", "--json"]) == 0
  peaks = {r["techniques"]: r["peak_bytes"] for r in json.loads(capsys.readouterr().out)["rows"]}
  assert list(peaks) == ["baseline", "lowmem", "lowmem+approx"]
  first = next(t for t in peaks if peaks[t] < peaks["baseline"])
  budget = (peaks["baseline"] + peaks[first]) // 2
  assert cli.main(["plan", "--step", spec, "--target", "cpu", "--budget", f"{budget}B",
                   "--objective", "memory"]) == 0
  captured = capsys.readouterr()
  lines = captured.out.splitlines()
  left = next(line for line in lines if line.startswith("left out: "))
  assert left == ("left out: bf16, 8bit, bf16-params, remat, offload-opt, adama (make_step takes "
                  "no dtype, policy, adamw, micro_batches, param_dtype, optimizer argument; see "
                  "lowmem-jax report --help)")
  fits = next(line for line in lines if line.startswith("Fits"))
  assert fits.startswith(f"Fits {budget / 2**20:,.1f} MiB: {first} ")
  lowmem = "lm.lowmem" if first == "lowmem" else (
      'functools.partial(lm.lowmem, activations="approx")')
  assert lines[-1] == f"step, args, *loss = make_step(lowmem={lowmem})"
  tried = ["baseline", "lowmem", "lowmem+approx"]
  assert captured.err == "".join(f"[{i}/3] compiling {t}\n"
                                 for i, t in enumerate(tried[:tried.index(first) + 1], 1))
  # A make_step without the lowmem argument: only its baseline is tried.
  assert cli.main(["plan", "--step", f"{step_file}:no_lowmem", "--target", "cpu",
                   "--budget", "1MiB"]) == 1
  captured = capsys.readouterr()
  assert "left out: bf16, lowmem, 8bit, bf16-params, remat, offload-opt, approx, adama " in captured.out
  assert errors(captured.err) == ("lowmem-jax: nothing fits 1.0 MiB: the smallest compiled peak "
                                   f"is {peaks['baseline'] / 2**20:,.1f} MiB, with baseline. "
                                   "Lower the step's batch.\n")
  # its report: the baseline, and what was left out, in the JSON too
  assert cli.main(["report", "--step", f"{step_file}:no_lowmem", "--target", "cpu", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert [r["techniques"] for r in out["rows"]] == ["baseline"]
  assert out["left_out"] == ["lowmem", "approx"]


@pytest.mark.parametrize("argv, message", [
    (["report", "--step", "{dir}/missing.py:make_step"], "--step {dir}/missing.py:make_step: no file"),
    (["report", "--step", "{file}:make_stp"], "has no function 'make_stp'"),
    (["report", "--step", "{file}"], "give FILE.py:FUNCTION or MODULE:FUNCTION"),
    (["report", "--step", "no_such_module_here:make_step"], "no module named 'no_such_module_here'"),
    (["report", "--step", "{file}:needs_an_argument"], "must be callable with no arguments"),
    (["report", "--step", "{file}:returns_a_dict", "--target", "cpu"],
     "returned a dict; expected (step, args)"),
    (["report", "--step", "{file}:args_not_a_tuple", "--target", "cpu"],
     "returned a dict as the step's args"),
    (["report", "--step", "{file}:no_lowmem", "--techniques", "lowmem"], "takes no lowmem argument"),
    (["report", "--step", "{file}:make_step", "--techniques", "baseline,remat:full"],
     ("'remat:full' calls make_step(policy=...), and make_step takes no policy argument: "
      "define make_step(policy=None)")),
    (["report", "--step", "{file}:make_step", "--techniques", "bf16"],
     "make_step takes no dtype argument"),
    (["report", "--step", "{file}:make_step", "--techniques", "adama:2"],
     "'adama:2' calls make_step(adamw=...)"),
    (["report", "--step", "{file}:make_step", "--techniques", "all"],
     "'all' in 'all' applies only to the reference models (--model)"),
    (["report", "--step", "{file}:make_step", "--techniques", "lowmem+bf16-params"],
     "bf16-params needs 8bit"),
    (["report", "--step", "{file}:make_step", "--batch", "8"], "--batch is for the reference models"),
    (["plan", "--model", "vit-tiny", "--step", "{file}:make_step", "--budget", "1GiB"],
     "--model is for the reference models"),
    (["report", "--model", "vit-tiny", "--techniques", "lowmem"], "applies only to --step"),
])
def test_cli_step_errors(capsys, step_file, argv, message):
  directory = str(pathlib.Path(step_file).parent)
  argv = [a.format(file=step_file, dir=directory) for a in argv]
  assert cli.main(argv) == 2
  err = errors(capsys.readouterr().err)
  assert message.format(dir=directory) in err, err
  assert err.count("\n") == 1 and "Traceback" not in err


def _line_of(text: str) -> int:
  """The line of STEP_FILE that holds ``text``."""
  return next(i for i, line in enumerate(STEP_FILE.splitlines(), 1) if text in line)


@pytest.mark.parametrize("argv, message", [
    (["report", "--step", "{file}:raises", "--target", "cpu"],
     ("--step {file}:raises: RuntimeError: no data here ({file}, line "
      f"{_line_of('raise RuntimeError')}; --verbose for the traceback)")),
    (["report", "--step", "{file}:mismatched", "--target", "cpu"],
     f"({{file}}, line {_line_of('h = x @')}; --verbose for the traceback)"),
    (["plan", "--model", "llama-1b", "--batch", "100000000", "--budget", "24GiB", "--target", "cpu"],
     "--batch 100000000 and --seq 512 make 51,200,000,000 tokens a step, beyond the 2^31 - 1"),
    (["report", "--step", "{file}:short_args", "--target", "cpu"],
     ("--step {file}:short_args: TypeError: make_step.<locals>.step() missing 1 required "
      "positional argument: 'x' (--verbose for the traceback)")),
    (["plan", "--budget=-5GiB"], "budget '-5GiB': a budget must be positive"),
    (["plan", "--budget", "-5GiB"], "budget '-5GiB': a budget must be positive"),
])
@OPTAX_BIAS_CORRECTION
def test_cli_errors_of_input_and_of_a_step_are_one_line(capsys, step_file, argv, message):
  """Issue 38: a step that raises, a step on mismatched shapes, a size beyond XLA's extents, a
  negative budget: one line each, naming the argument or the user's file and line."""
  directory = str(pathlib.Path(step_file).parent)
  assert cli.main([a.format(file=step_file, dir=directory) for a in argv]) == 2
  err = errors(capsys.readouterr().err)
  assert message.format(file=step_file) in err, err
  assert err.count("\n") == 1 and "Traceback" not in err


def test_plan_of_a_step_that_takes_policy_alone_prints_python_that_runs(capsys, step_file):
  """A make_step taking ``policy`` only: its remat:plan rung is the planned policy alone (it
  was parsed as a set and refused), and the policy keeps the step's own name, which the
  printed call makes (`lm.policies.save_only` would refuse it)."""
  spec = f"{step_file}:make_step_of_policy"
  assert cli.main(["report", "--step", spec, "--target", "cpu", "--techniques", "baseline",
                   "--json"]) == 0
  base = json.loads(capsys.readouterr().out)["rows"][0]["peak_bytes"]
  assert cli.main(["plan", "--step", spec, "--target", "cpu", "--budget", f"{base - 1}B",
                   "--objective", "memory"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert "own_act" in next(line for line in lines if line.startswith("Fits"))
  namespace = runpy.run_path(step_file)
  exec("\n".join(lines[-2:]), namespace)  # the import line and the call
  assert callable(namespace["step"])
  # A budget no policy fits: said, not left out of the table without a word.
  assert cli.main(["plan", "--step", spec, "--target", "cpu", "--budget", "1KiB"]) == 1
  assert ("no remat policy fits 1.0 KiB: remat:plan (its policies compiled, not in the table)"
          in capsys.readouterr().out)


def test_cli_verbose_gives_the_steps_traceback(step_file):
  with pytest.raises(RuntimeError, match="no data here"):
    cli.main(["report", "--step", f"{step_file}:raises", "--target", "cpu", "--verbose"])


def test_cli_refuses_a_size_beyond_xla_before_compiling():
  """--seq 10^11 aborted the process (SIGABRT in XLA's compile): refused in one line, in a
  process of its own so that an abort fails the test only."""
  run = subprocess.run(
      [sys.executable, "-m", "lowmem_jax.app.cli", "report", "--model", "llama-100m", "--batch",
       "1", "--seq", "100000000000", "--techniques", "baseline", "--target", "cpu"],
      capture_output=True, text=True, timeout=300, check=False)
  ours = [line for line in run.stderr.splitlines() if line.startswith("lowmem-jax")]
  assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
  assert len(ours) == 1 and "--seq 100000000000" in ours[0], ours


def test_plan_picks_the_fastest_that_fits(monkeypatch, capsys):
  # Each set's peak and estimated time made up: the ladder's third and fifth fit, the fifth
  # is faster; by memory the third is picked and nothing after it is measured.
  job = app.Job("vit-tiny", batch=4, target="cpu")
  texts, _ = app.ladder_of(job)
  made_up = {t: (2**30 if k in (2, 4) else 2**31, None if k == 0 else 1.0 / (k + 1))
             for k, t in enumerate(texts)}

  def measure(job, techniques):
    peak, seconds = made_up[techniques.label]
    timed = seconds and memory.step_time.StepTime(seconds, {"compute": seconds}, 1, 0, 0, 0, 0, 0, 0)
    return type("Breakdown", (), {"stats": type("Stats", (), {"peak_bytes": peak}),
                                  "step_time": timed, "label": techniques.label})()
  monkeypatch.setattr(fits, "measure", measure)
  monkeypatch.setattr(fits, "planned", lambda job, text, budget: techniques.TechniqueSet(text, ()))
  monkeypatch.setattr(fits, "device_argument_bytes", lambda job, techniques: 0)
  by_time = app.cheapest_fit(job, 2**30)
  by_memory = app.cheapest_fit(job, 2**30, objective="memory")
  exact = [t for t in texts if app.parse(t.replace("+remat:plan", "")).exact]
  assert texts[:len(exact)] == exact  # an exact set fits: no approximate one is measured
  assert by_time.fits.label == texts[4] and len(by_time.tried) == len(exact)
  assert by_memory.fits.label == texts[2] and len(by_memory.tried) == 3
  assert [s.label for _, s in by_time.fitting] == [texts[2], texts[4]]
  chosen = by_time.tried[4][0]
  assert cli._why(by_time, chosen) == (
      f"The fastest of 2 sets that fit by the estimated step time; the first that fits, "
      f"{texts[2]}, takes 1.00 GiB, 333.3 ms a step estimated. ")
  with pytest.raises(ValueError, match="objective"):
    app.cheapest_fit(job, 2**30, objective="speed")
