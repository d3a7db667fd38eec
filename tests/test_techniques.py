"""lowmem_jax.app.techniques: technique sets parsed, checked and measured without the CLI."""

import ast
import dataclasses
import types

import jax
import optax
import pytest
from third_party_promotion import FLAX_NORM, OPTAX_BIAS_CORRECTION

import lowmem_jax as lm
from lowmem_jax import app
from lowmem_jax.app import code, measurement, step_options

SMALL = app.Job("vit-tiny", batch=4, image=32, target="cpu")


@pytest.mark.parametrize("text, message", [
    ("turbo", "unknown technique 'turbo'"),
    ("sparse:1.5", "sparse:1.5: the density must be a number between 0 and 1"),
    ("sparse:nan", "sparse:nan"),
    ("sparse", "sparse:"),
    ("adama:-2", "adama:-2: k must be a positive integer"),
    ("remat:most", "remat:most: the policy must be one of"),
    ("lowmem", "applies only to --step"),
    ("prefetch:3", "prefetch:3: the layers ahead must be 1 or 2"),
    ("mlp-chunk:0", "mlp-chunk:0: the MLP's chunk must be a positive number of tokens or off"),
    ("mlp-chunk:whole", "mlp-chunk:whole: the MLP's chunk"),
    ("update-slice:0", "update-slice:0: the elements a leaf is updated in at once must be"),
    ("update-slice:1024", "update-slice:1024: the elements .* at least 1048576"),
    ("update-slice:2^26", "update-slice:2\\^26: the elements"),
])
def test_parse_errors_name_the_term(text, message):
  with pytest.raises(app.TechniqueError, match=message):
    app.parse(text)


@pytest.mark.parametrize("text", ["stream:device+stream:host", "remat:full+remat:dots",
                                  "adama:2+adama:4", "8bit+fused-ce+8bit"])
def test_a_term_given_twice_is_refused_by_name(text):
  name = text.split("+")[-1].partition(":")[0]
  with pytest.raises(app.TechniqueError, match=f"{name} is given twice in"):
    app.parse(text)


@pytest.mark.parametrize("text, missing", [("offload-opt+prefetch:2", "stream"),
                                           ("stream:host+prefetch:2", "offload-opt")])
def test_prefetch_needs_the_streamed_step_and_its_state_on_the_host(text, missing):
  with pytest.raises(app.TechniqueError, match=f"prefetch needs {missing}"):
    app.parse(text).check_together()
  assert "prefetch" not in app.parse("stream:host+offload-opt+prefetch:1")  # the default


@pytest.mark.parametrize("text, missing", [("8bit+bf16-params+fused-update", "stream"),
                                           ("8bit+stream:device+fused-update", "bf16-params")])
def test_fused_update_needs_the_streamed_step_and_bfloat16_parameters(text, missing):
  with pytest.raises(app.TechniqueError, match=f"fused-update needs {missing}"):
    app.parse(text).check_together()


def test_fused_update_runs_adamw_8bit_with_bfloat16_parameters_as_one_kernel():
  """The program's optimizer is `adamw_8bit(..., bfloat16_params=True)` (its ``fused``), the
  streamed step's ``update_impl`` "pallas"; without the term, the chain as before."""
  job = app.Job("llama-tiny", batch=2, seq=16, target="h100")
  fused = app.parse("8bit+bf16-params+stream:device+fused-update").python(job)
  assert "lm.lowbit.adamw_8bit(0.001, weight_decay=0.0001, bfloat16_params=True)" in fused
  assert 'update_impl="pallas"' in fused and "stochastic_rounding" not in fused
  plain = app.parse("8bit+bf16-params+stream:device").python(job)
  assert "update_impl" not in plain and "lm.lowbit.stochastic_rounding()" in plain
  assert app.parse("8bit+bf16-params+stream:device+fused-update").exact


def test_update_slice_sets_the_streamed_steps_slice_elements():
  """``update-slice:<n>`` is `layer_streamed`'s ``slice_elements`` (a leaf in slices trains
  as it does whole: tests/test_streamed.py's ``slice_elements`` cases); without it the
  default; it needs the streamed step."""
  job = app.Job("llama-tiny", batch=2, seq=16, target="h100")
  assert "slice_elements=2097152" in app.parse(
      "8bit+stream:device+update-slice:2097152").python(job)
  assert "slice_elements" not in app.parse("8bit+stream:device").python(job)
  texts = app.ladder(2, language_model=True)  # in each family, with the state on the device
  assert sum(t.endswith(f"+stream:device+mlp-chunk:off+update-slice:{2 ** 30}")
             for t in texts) == 2
  with pytest.raises(app.TechniqueError, match="update-slice needs stream"):
    app.parse("8bit+update-slice:2097152").check_together()


def test_exact_is_what_trains_as_the_plain_step_up_to_rounding():
  """The ablation in docs/techniques.md: the approximate activations change training; the
  exact rewrites, fewer bits and recompute do not, beyond rounding."""
  exact = "bf16+ms-norm+attention+fused-ce+8bit+bf16-params+stream:host+offload-opt"
  assert app.parse(exact).exact and app.parse(exact).approximate == ()
  assert app.parse("all+fused-ce").approximate == ("approx",)
  assert not app.parse("sparse:0.1").exact and not app.parse("conv:int8").exact
  assert app.parse("lowmem+8bit", step=True).exact
  assert not app.parse("lowmem+approx", step=True).exact
  assert app.parse("bf16+remat:full+adama:4").approximate == ("adama",)  # a micro-batch sum


@pytest.mark.parametrize("step,language_model", [(False, True), (False, False), (True, False)])
def test_the_ladder_tries_every_exact_set_before_any_other(step, language_model):
  texts = app.ladder(None if step else 8, language_model, step=step)
  sets = [app.parse(t.replace("+remat:plan", ""), step=step) for t in texts]
  first = next(i for i, s in enumerate(sets) if not s.exact)
  assert all(s.exact for s in sets[:first]) and not any(s.exact for s in sets[first:])
  # then the approximate activations, the exact half's sets with approx, then AdamA
  approximate = [s for s in sets[first:] if "adama" not in s]
  assert [s.approximate for s in approximate] == [("approx",)] * len(approximate)
  assert all("adama" in s for s in sets[first + len(approximate):])
  assert [s.values for s in approximate] == [
      app.parse(t.replace("+remat:plan", "") + "+approx", step=step).values
      for t in texts[first - len(approximate):first]]


@pytest.mark.parametrize("budget,approximate", [(20, False), (7, True)])
def test_cheapest_fit_tries_the_approximate_sets_only_where_no_exact_one_fits(
    monkeypatch, budget, approximate):
  """Every exact set peaks at 10 bytes here, every approximate one at 5."""
  from lowmem_jax.app import fits
  peak = lambda s: types.SimpleNamespace(stats=types.SimpleNamespace(
      peak_bytes=10 if s.exact else 5), step_time=None, label=s.label)
  monkeypatch.setattr(fits, "measure", lambda job, s: peak(s))
  monkeypatch.setattr(fits, "planned", lambda job, text, budget: app.parse(
      text.replace("+remat:plan", "")))
  monkeypatch.setattr(fits, "device_argument_bytes", lambda job, s: 0)
  job = app.Job("llama-tiny", batch=2, seq=8, target="cpu")
  fit = app.cheapest_fit(job, budget)
  assert fit.fits.exact is not approximate
  assert any(not s.exact for _, s in fit.tried) is approximate
  assert fit.fits.label == ("all+fused-ce" if approximate else "baseline")


def test_parse_step_techniques():
  assert "lowmem" in app.parse("lowmem", step=True)
  assert app.parse("lowmem+approx+adama:4+8bit", step=True).values == (
      ("approx", True), ("adama", 4), ("8bit", True), ("lowmem", True))
  with pytest.raises(app.TechniqueError, match="'fused-ce' in 'lowmem\\+fused-ce' applies "
                     "only to the reference models"):
    app.parse("lowmem+fused-ce", step=True)
  with pytest.raises(app.TechniqueError, match="'sparse:0.1' in 'sparse:0.1' applies only "
                     "to the reference models"):
    app.parse("sparse:0.1", step=True)


def _all_options(lowmem=lambda f: f, dtype=None, policy=None, adamw=None, micro_batches=1,
                 param_dtype=None, optimizer=lambda tx: tx):
  raise AssertionError("not called")


def _lowmem_and_params(lowmem=lambda f: f, param_dtype=None, optimizer=lambda tx: tx, **unused):
  raise AssertionError("not called")


def _lowmem_only(lowmem=lambda f: f):
  raise AssertionError("not called")


def test_a_steps_ladder_is_the_reference_ladder_in_its_terms():
  def rungs(best):
    state = f"{best}+8bit+bf16-params"
    return [best, f"{best}+8bit", state, f"{state}+remat:plan", f"{state}+offload-opt"]
  micro = lambda best: [f"{best}+8bit+bf16-params+remat:full+adama:{k}" for k in (2, 4, 8)]
  assert app.ladder(None, step=True) == (
      ["baseline", "bf16"] + rungs("bf16+lowmem") + rungs("bf16+lowmem+approx")
      + micro("bf16+lowmem") + micro("bf16+lowmem+approx"))
  full = app.Job(make_step=_all_options, target="cpu")
  assert app.ladder_of(full) == (app.ladder(None, step=True), ())
  only = app.Job(make_step=_lowmem_only, target="cpu")
  assert app.ladder_of(only) == (["baseline", "lowmem", "lowmem+approx"], (
      "bf16", "8bit", "bf16-params", "remat:plan", "offload-opt", "remat:full", "adama:2",
      "adama:4", "adama:8"))
  assert only.default_sets() == ["baseline", "lowmem", "lowmem+approx"]


def _jaxpr(job, text: str) -> str:
  """The jaxpr of set ``text``'s step for ``job``, as text."""
  built, *args = measurement.arguments(job, app.parse(text))
  return str(built["step"].trace(*args).jaxpr)


@OPTAX_BIAS_CORRECTION
def test_whole_layer_is_the_streamed_step_with_one_attention_forward_less():
  """``whole-layer`` is `layer_stack`'s ``split_layer=False`` (tests/test_llama.py: the same
  model either way): a layer's backward in one piece, so the attention half's forward runs
  once a layer, not twice (fewer matmuls and attentions in the step); it needs stream."""
  job = app.Job("llama-tiny", batch=2, seq=16, target="cpu")
  split, whole = "8bit+stream:device", "8bit+stream:device+whole-layer"
  assert "split_layer=False" in app.parse(whole).python(job)
  assert "split_layer" not in app.parse(split).python(job)
  count = lambda text, op: _jaxpr(job, text).count(op)
  # the matmuls, and the attention's [..., 16, 16] probabilities (`exp`'s count is jax's: under
  # jax 0.11.2 it is the same either way)
  for op in ("dot_general", ",16,16]"):
    assert count(whole, op) < count(split, op), op
  with pytest.raises(app.TechniqueError, match="whole-layer needs stream"):
    app.parse("8bit+whole-layer").check_together()


@OPTAX_BIAS_CORRECTION
def test_part_inputs_keeps_the_mlp_halfs_input_and_runs_the_attention_forward_once():
  """``part-inputs`` is `layer_streamed`'s ``keep_part_inputs``: the attention half's forward
  runs once a layer in the backward, as with ``whole-layer``, the layer still in two parts
  (the same matmuls and attention probabilities as ``whole-layer``); a whole layer has no
  other input to keep."""
  job = app.Job("llama-tiny", batch=2, seq=16, target="cpu")
  split, kept = "8bit+stream:host", "8bit+stream:host+part-inputs"
  whole = "8bit+stream:host+whole-layer"
  assert "keep_part_inputs=True" in app.parse(kept).python(job)
  assert "keep_part_inputs" not in app.parse(split).python(job)
  count = lambda text, op: _jaxpr(job, text).count(op)
  for op in ("dot_general", ",16,16]"):
    assert count(kept, op) == count(whole, op) < count(split, op), op
  with pytest.raises(app.TechniqueError, match="part-inputs needs stream"):
    app.parse("8bit+part-inputs").check_together()
  with pytest.raises(app.TechniqueError, match="whole-layer"):
    app.parse(whole + "+part-inputs").check_together()


def test_mlp_hidden_cuts_the_whole_layer_and_keeps_its_parts_inputs():
  """``mlp-hidden`` is `layer_stack`'s ``split_at_mlp_hidden`` with `layer_streamed`'s
  ``keep_part_inputs`` (tests/test_streamed_llama.py: the same step, two matmuls fewer);
  it needs the whole layer (which part-inputs refuses) and the MLP whole."""
  job = app.Job("llama-tiny", batch=2, seq=16, target="cpu")
  text = "8bit+stream:device+whole-layer+mlp-hidden+mlp-chunk:off"
  code = app.parse(text).python(job)
  assert ("wl.layer_stack(split_layer=False, split_at_mlp_hidden=True)" in code
          and "keep_part_inputs=True" in code), code
  app.parse(text).check(job)
  for bad, why in (("8bit+stream:device+mlp-hidden+mlp-chunk:off", "needs whole-layer"),
                   ("8bit+mlp-hidden", "needs stream"),
                   ("8bit+stream:device+whole-layer+mlp-hidden", "needs mlp-chunk:off"),
                   ("8bit+stream:device+whole-layer+mlp-hidden+mlp-chunk:512",
                    "needs mlp-chunk:off"),
                   (text + "+part-inputs", "part-inputs does not take whole-layer")):
    with pytest.raises(app.TechniqueError, match=why):
      app.parse(bad).check_together()


@OPTAX_BIAS_CORRECTION
def test_the_ladder_has_the_bigger_slice_rungs_only_where_a_leaf_is_sliced():
  # llama-tiny's leaves all hold under 2^24 elements: its bigger slices' rungs' steps are the
  # same sets' without the term, equation for equation, and are left out (whole-layer's kept
  # without the term: no other rung is its set); LLaMA-100M's embedding is sliced.
  tiny = app.Job("llama-tiny", batch=2, seq=16, target="cpu")
  kept, _ = app.ladder_of(tiny)
  full, _ = app.ladder_of(app.Job("llama-100m", batch=2, seq=16, target="cpu"))
  bigger = [t for t in full if "update-slice" in t and "whole-layer" not in t]
  whole = [t for t in full if "whole-layer" in t and "update-slice" in t]
  assert len(bigger) == 2 and len(whole) == 4  # with mlp-hidden or not, exact or not
  assert kept == [t[:t.index("+update-slice")] if t in whole else t for t in full
                  if t not in bigger]

  text = bigger[0]
  assert _jaxpr(tiny, text) == _jaxpr(tiny, text[:text.index("+update-slice")])


def test_a_gpu_targets_ladder_tries_the_fused_update_after_its_xla_twin():
  """On a GPU target the one-ahead host-state rung (the rtx4090's) is tried with each leaf's
  update one Pallas kernel too, right after it, in each family; a CPU target has no kernel."""
  gpu, _ = app.ladder_of(app.Job("llama-100m", batch=2, seq=1024, target="h100"))
  cpu, _ = app.ladder_of(app.Job("llama-100m", batch=2, seq=1024, target="cpu"))
  fused = [t for t in gpu if "fused-update" in t]
  assert len(fused) == 2 and not any("fused-update" in t for t in cpu)
  assert [t for t in gpu if t not in fused] == cpu
  for text in fused:
    assert text == gpu[gpu.index(text) - 1] + "+fused-update"
    assert "part-inputs" in text and "offload-opt" in text
    app.parse(text).check_together()


@OPTAX_BIAS_CORRECTION
def test_the_ladder_leaves_out_mlp_chunk_off_where_the_stream_runs_one_chunk():
  # 2 x 16 tokens are one chunk of the stream's 1,024: a streamed set and the same set with
  # mlp-chunk:off trace to one step, and the later of the two is left out; 2 x 1,024 are two.
  one = app.Job("llama-tiny", batch=2, seq=16, target="cpu")
  kept, _ = app.ladder_of(one)
  full, _ = app.ladder_of(app.Job("llama-tiny", batch=2, seq=1024, target="cpu"))
  state = "bf16+ms-norm+attention+fused-ce+8bit+bf16-params+ce-one-pass+stream:"
  twins = [(state + "device+mlp-chunk:off", state + "device"),
           (state + "host+offload-opt", state + "host+offload-opt+mlp-chunk:off")]
  dropped = [later.replace("bf16+ms-norm+attention", best) for _, later in twins
             for best in ("bf16+ms-norm+attention", "all")]  # each family's
  assert kept == [t for t in full if t not in dropped] and len(full) == len(kept) + 4

  for earlier, later in twins:
    assert earlier in kept and later not in kept and later in full
    assert _jaxpr(one, earlier) == _jaxpr(one, later)


def test_a_technique_goes_with_those_it_needs_where_make_step_takes_not_their_options():
  """**unused takes every option: bf16-params stays; without 8bit's (adamw) it goes too."""
  job = app.Job(make_step=_lowmem_and_params, target="cpu")
  assert job.step_keywords() == frozenset(step_options.STEP_OPTIONS)
  job = app.Job(make_step=_all_options, target="cpu")
  assert job.without_missing("bf16+lowmem+8bit+bf16-params") == (
      "bf16+lowmem+8bit+bf16-params", ())
  job = app.Job(make_step=lambda lowmem=None, param_dtype=None, optimizer=None: None,
                       target="cpu")
  assert job.without_missing("bf16+lowmem+approx+8bit+bf16-params") == (
      "lowmem+approx", ("bf16", "8bit", "bf16-params"))
  assert job.without_missing("bf16") == ("baseline", ("bf16",))


def test_a_steps_options_are_printed_as_they_are_passed():
  """What `python` prints is what make_step is called with (`code.value` of each)."""
  job = app.Job(make_step=_all_options, target="cpu")
  s = app.parse("lowmem+approx+bf16+remat:dots+adama:2+8bit+bf16-params", step=True)
  options = s.step_options()
  assert s.python(job).splitlines()[-1] == (
      "step, args, *loss = _all_options(lowmem=functools.partial(lm.lowmem, activations=\"approx\""
      "), dtype=jnp.bfloat16, policy=lm.policies.dots, adamw=functools.partial(lm.adamaw, k=2, "
      "state_bits=8), micro_batches=2, param_dtype=jnp.bfloat16, optimizer=lambda tx: "
      "optax.chain(tx, lm.lowbit.stochastic_rounding()))")
  values = {k: code.value(v) for k, v in options.items()}
  assert values["lowmem"].keywords["activations"] == "approx"
  assert values["policy"] is lm.policies.dots and values["micro_batches"] == 2
  assert values["adamw"].func is lm.adamaw and values["adamw"].keywords == {"k": 2, "state_bits": 8}
  assert isinstance(values["optimizer"](optax.sgd(0.1)), optax.GradientTransformation)
  exact = app.parse("lowmem+offload-opt", step=True).step_options()
  assert code.value(exact["lowmem"]) is lm.lowmem  # its defaults: the exact rewrites
  assert code.source(exact["optimizer"]) == "lambda tx: lm.offload.offload_state(tx)"


@pytest.mark.parametrize("fields, message", [
    (dict(model="gpt-9"), "model must be one of"),
    (dict(batch=0), "batch must be an int >= 1, got 0"),
    (dict(seq=2.5), "seq must be an int >= 1, got 2.5"),
    (dict(image=True), "image must be an int >= 1, got True"),
    (dict(dtype="int8"), "dtype must be float32, bfloat16 or float16, got 'int8'"),
    (dict(compiler_options=["xla_gpu_enable_latency_hiding_scheduler"]),
     "compiler_options must be a dict of XLA options or None"),
])
def test_bad_job_names_the_field(fields, message):
  with pytest.raises(app.TechniqueError, match=message):
    app.Job(**fields)


def test_a_jobs_compiler_options_replace_the_sets_own():
  """A row measured with other XLA options (an earlier release's) compiles as it ran."""
  streamed = app.parse("fused-ce+8bit+bf16-params+stream:host+offload-opt")
  job = app.Job("llama-tiny", batch=2, seq=16, target="cpu")
  assert all(f'"{k}": ' in streamed.python(job) for k in streamed.compiler_options())
  earlier = dataclasses.replace(job, compiler_options={
      "xla_gpu_enable_latency_hiding_scheduler": True})
  assert ('step = jax.jit(streamed.step, donate_argnums=(0, 1), compiler_options='
          '{"xla_gpu_enable_latency_hiding_scheduler": True})\n') in streamed.python(earlier)
  none = dataclasses.replace(job, compiler_options={})
  assert "step = jax.jit(streamed.step, donate_argnums=(0, 1))\n" in streamed.python(none)
  quoted = {"xla_disable_hlo_passes": 'a"b,c', "xla_gpu_enable_latency_hiding_scheduler": False}
  line = next(t for t in streamed.python(dataclasses.replace(job, compiler_options=quoted))
              .splitlines() if t.startswith("step = "))
  call = ast.parse(line).body[0].value  # the printed program parses, the options as given
  assert ast.literal_eval(next(k.value for k in call.keywords
                               if k.arg == "compiler_options")) == quoted


@pytest.mark.parametrize("model", ["vit-b16", "llama-100m", "minilm-l6", "wrn-28-2"])
def test_each_default_set_applies_to_its_model(model):
  """A report's default sets parse and pass the models' own checks, each declared
  technique once, and a language model's include the loss head."""
  job = app.Job(model, batch=8, target="cpu")
  sets = [app.parse(text) for text in job.default_sets()]
  for s in sets:
    s.check(job)
  used = {term for s in sets for term, _ in s.values}
  assert used <= set(app.TECHNIQUES)
  assert ("fused-ce" in used) == job.language_model
  assert sets[0].values == ()  # the baseline first: the ratios are against it


def test_the_default_image_side_is_the_models():
  assert app.Job("wrn-28-2", target="cpu").image_side == 32
  assert app.Job("vit-b16", target="cpu").image_side == 224
  assert app.Job("vit-b16", image=64, target="cpu").image_side == 64


def test_sparse_is_stored_sparse_on_the_wideresnet_only():
  sparse = app.parse("sparse:0.25")
  assert sparse.get("sparse") == 0.25
  with pytest.raises(app.TechniqueError,
                     match="sparse:0.25 in 'sparse:0.25': density .* applies to the WideResNet"):
    sparse.workload(SMALL)
  wrn = app.Job("wrn-28-2", batch=8)
  code = sparse.python(wrn)
  assert "density=0.25" in code and "tx = wl.optimizer(optax.adamw(" in code
  code = app.parse("sparse:0.25+adama:4+8bit").python(wrn)
  assert "fold = lm.MomentFold(4)" in code and "lm.adamaw(0.001, fold, state_bits=8)" in code
  assert "wl.train_step(tx, fold)" in code
  # measure() runs the program the printed lines are made of (test_cli runs printed code)
  program = app.parse("sparse:0.25+adama:4+8bit").program(wrn)
  assert code.startswith(program.source())
  built = program.run()
  assert built["wl"].model.density == 0.25 and built["fold"] == lm.MomentFold(4)
  state = jax.eval_shape(built["tx"].init, built["wl"].abstract_params())
  assert lm.sparse.find_state(state) is not None and lm.optim.find_adama_state(state) is not None
  wl = sparse.workload(wrn)
  assert wl.sparse and wl.model.density == 0.25
  with pytest.raises(app.TechniqueError, match="sparse does not take offload-opt"):
    app.parse("sparse:0.25+offload-opt").workload(wrn)


@pytest.mark.slow
@FLAX_NORM
@OPTAX_BIAS_CORRECTION
@pytest.mark.heavy
def test_cheapest_fit_stops_at_the_first_set_that_fits():
  # on the CPU proxy bfloat16 costs more
  job = dataclasses.replace(SMALL, image=None, target="h100")
  base = app.measure(job, app.parse("baseline"), top=0)
  tried = []
  fit = app.cheapest_fit(job, base.stats.peak_bytes - 1, tried.append, objective="memory")
  assert fit.fits is not None and fit.fits.label == tried[-1] != "baseline"
  assert [b.label for b, _ in fit.tried] == tried
  assert fit.tried[-1][0].stats.peak_bytes < base.stats.peak_bytes
  nothing = app.cheapest_fit(job, 1024)
  assert nothing.fits is None and not nothing.tried and nothing.fixed_bytes > 1024


def test_a_set_that_does_not_suit_the_job_raises():
  def make_step():
    raise AssertionError("not called: the set is refused first")
  with pytest.raises(app.TechniqueError, match="'all' changes a reference model"):
    app.measure(app.Job(make_step=make_step), app.parse("all"))
  with pytest.raises(app.TechniqueError, match="takes no lowmem argument"):
    app.measure(app.Job(make_step=make_step),
                       app.parse("lowmem", step=True))
  lowmem = app.TechniqueSet("lowmem", (("lowmem", True),))
  with pytest.raises(app.TechniqueError, match="applies only to a step of your own"):
    app.measure(SMALL, lowmem)
  with pytest.raises(app.TechniqueError, match="the ladder is the transformers'"):
    app.cheapest_fit(app.Job("wrn-28-2"), 2**30)


@pytest.mark.slow
@FLAX_NORM
@OPTAX_BIAS_CORRECTION
@pytest.mark.heavy
def test_stream_is_the_layer_streamed_step_its_state_on_the_host_with_offload_opt():
  """The 1B: the host state saves the device more than half its size (0.71 on the h100
  target, jax 0.10.2, compiled peaks, both sets' `app.measure`; 0.44
  at ca1b749, before the streamed step's buffers held through the layers' backward were
  freed); on LLaMA-100M the head's gradient and update (vocab x dim, after the layers'
  backward with the state on the host) take back half of what it saves."""
  job = app.Job("llama-3.2-1b", batch=1, seq=64, target="h100")
  streamed = app.parse("fused-ce+8bit+bf16-params+stream:host+offload-opt")
  code = streamed.python(job)
  assert ('streamed = lm.optim.layer_streamed(wl.layer_stack(), tx, state="host", '
          'saved_inputs="host")') in code
  assert ('step = jax.jit(streamed.step, donate_argnums=(0, 1), compiler_options='
          '{"xla_gpu_enable_latency_hiding_scheduler": True') in code
  on_device = app.parse("fused-ce+8bit+bf16-params+stream:device").python(job)
  assert "step = jax.jit(streamed.step, donate_argnums=(0, 1))\n" in on_device
  assert "opt_state = streamed.init(params)" in code and "offload_state" not in code
  b = app.measure(job, streamed, top=0)
  row = app.row(b, b, streamed)
  built = streamed.program(job).run()
  state = jax.eval_shape(built["streamed"].init, built["wl"].abstract_params())
  assert row["host_bytes"] >= lm.memory.tree_bytes(state) > 0
  assert row["optimizer_state"] == 0 and row["saved_activation_bytes"] is None
  on_device = app.measure(job, app.parse("fused-ce+8bit+bf16-params+stream:device"),
                                 top=0)
  assert on_device.stats.host_argument_bytes == 0
  assert on_device.stats.peak_bytes > b.stats.peak_bytes + lm.memory.tree_bytes(state) // 2


@pytest.mark.parametrize("text,job,message", [
    ("stream:host", SMALL, "stream:host in 'stream:host': the layer-streamed step takes the LLaMA"),
    ("stream:host+adama:2", app.Job("llama-100m", batch=2, seq=64, target="cpu"),
     "stream does not take adama"),
    ("stream:host+remat:full", app.Job("llama-100m", batch=2, seq=64, target="cpu"),
     "stream does not take remat"),
])
def test_stream_refuses_what_it_does_not_take(text, job, message):
  with pytest.raises(app.TechniqueError, match=message):
    app.parse(text).check(job)


def test_late_embed_makes_the_embeddings_gradient_late_on_llama_only():
  job = app.Job("llama-tiny", batch=2, seq=16, target="cpu")
  late = app.parse("fused-ce+stream:host+late-embed")
  assert 'embedding="late"' in late.python(job)
  assert late.switches(job)["embedding"] == "late"
  assert "embedding" not in app.parse("fused-ce+stream:host").switches(job)
  with pytest.raises(app.TechniqueError,
                     match="late-embed in 'late-embed': embedding='late' applies to the LLaMA"):
    app.parse("late-embed").check(SMALL)


def test_mlp_chunk_sets_the_llama_mlps_chunks_over_the_streamed_steps_1024():
  job = app.Job("llama-tiny", batch=2, seq=16, target="cpu")
  chunks = lambda text: app.parse(text).switches(job).get("mlp_chunk_tokens", "unset")
  assert chunks("fused-ce") == "unset" and chunks("fused-ce+stream:host") == 1024
  assert chunks("fused-ce+stream:host+mlp-chunk:off") is None
  assert chunks("fused-ce+stream:host+mlp-chunk:8") == chunks("mlp-chunk:8") == 8
  whole = app.parse("fused-ce+stream:device+mlp-chunk:off")
  whole.check(job)
  assert "mlp_chunk_tokens=None" in whole.python(job)
  with pytest.raises(app.TechniqueError, match="mlp_chunk_tokens applies to the LLaMA models"):
    app.parse("mlp-chunk:8").check(SMALL)
  with pytest.raises(app.TechniqueError, match="mlp-chunk:off in 'mlp-chunk:off'.*vit-tiny is not"):
    app.parse("mlp-chunk:off").check(SMALL)


def test_stream_takes_a_place():
  with pytest.raises(app.TechniqueError, match="device or host"):
    app.parse("stream:disk")


@pytest.mark.slow
@FLAX_NORM
@OPTAX_BIAS_CORRECTION
@pytest.mark.heavy
def test_cheapest_fit_skips_a_set_whose_arguments_alone_exceed_the_budget():
  """A budget under every set's arguments on the device but the one with its state on the
  host: the others are skipped without compiling, that one compiled (and fits). The 1B: on
  LLaMA-100M the head's gradient and update (vocab x dim) are a third of that set's peak."""
  job = app.Job("llama-3.2-1b", batch=1, seq=64, target="h100")
  texts = app.ladder(1, language_model=True)
  k = next(i for i, t in enumerate(texts) if "offload-opt" in t)  # the exact half's last
  last = app.parse(texts[k])
  assert "offload-opt" in last and "stream" in last and last.exact
  floor = app.device_argument_bytes(job, last)
  on_device = min(app.device_argument_bytes(job, app.parse(
      t.replace("+remat:plan", ""))) for t in texts[:k])
  assert floor < on_device
  assert texts[k] == texts[k + 3].replace("+mlp-chunk:off", "+part-inputs+mlp-chunk:off")
  two_ahead = "+prefetch:2+whole-layer+mlp-chunk:off"
  assert texts[k + 1].endswith(two_ahead)
  assert texts[k + 2] == texts[k + 1][:-len(two_ahead)]
  assert texts[k + 3] == texts[k + 2] + "+mlp-chunk:off"
  tried = []
  fit = app.cheapest_fit(job, on_device - 1, tried.append)
  # MLPs whole with the halves' inputs kept, with XLA's update and (a GPU target's) the fused
  # one, the state brought over two layers ahead, one (MLPs whole is the same step at 64
  # tokens, one chunk: left out)
  assert tried == [texts[k], texts[k] + "+fused-update", *texts[k + 1:k + 3]]
  sets, _ = app.ladder_of(job)  # without stream:device, the same step as with mlp-chunk:off
  assert [t for t, _ in fit.skipped] == sets[:sets.index(texts[k])] != texts[:k]
  assert fit.fixed_bytes == floor
  assert fit.fits is not None and fit.fitting and all(
      b.stats.peak_bytes <= on_device - 1 for b, _ in fit.fitting)


def test_ce_one_pass_is_the_fused_heads_backward_in_one_pass_the_same_gradients(monkeypatch):
  job = app.Job("llama-tiny", batch=2, seq=16, target="cpu")
  once = app.parse("fused-ce+ce-one-pass+stream:host")
  assert once.switches(job)["loss"] == "fused-one-pass"
  assert 'loss="fused-one-pass"' in once.python(job)
  once.check(job)
  with pytest.raises(app.TechniqueError, match="ce-one-pass needs fused-ce"):
    app.parse("ce-one-pass").check_together()
  with pytest.raises(app.TechniqueError, match="loss='fused' applies to the LLaMA models only"):
    app.parse("fused-ce+ce-one-pass").check(SMALL)
  x, kernel = (jax.random.normal(k, s, jax.numpy.bfloat16) for k, s in zip(
      jax.random.split(jax.random.key(0)), ((2, 9, 8), (8, 40))))
  labels = jax.random.randint(jax.random.key(1), (2, 9), -1, 40)  # -1: the last class
  passes = []
  head_loss = lm.models.llama.linear_cross_entropy
  monkeypatch.setattr(lm.models.llama, "linear_cross_entropy", lambda *args, **kwargs: (
      passes.append(kwargs["backward_passes"]), head_loss(*args, **kwargs))[1])
  grads = {loss: jax.grad(lambda x, w: lm.models.llama.lm_head(x, w, labels, loss,
                                                                jax.numpy.bfloat16), (0, 1))(
      x, kernel) for loss in ("fused", "fused-one-pass")}
  assert passes == [2, 1]
  for one, two in zip(grads["fused-one-pass"], grads["fused"]):
    assert (one == two).all() and (two != 0).any()
