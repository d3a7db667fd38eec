"""impl=, implementation= and $LOWMEM_JAX_IMPL: which implementation runs, and the errors where
none can."""

import chex
import jax
import jax.numpy as jnp
import pytest

import lowmem_jax as lm
import pallas_kernels
from lowmem_jax.ops import dispatch

OPS = {"regelu2": lm.regelu2, "resilu2": lm.resilu2, "relu": lm.relu,
       "ms_layer_norm": lm.ms_layer_norm, "ms_rms_norm": lm.ms_rms_norm}
X = jnp.ones((2, 8), jnp.float32)


def _runs_kernel(fn, *args) -> bool:
  return "pallas_call" in str(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(fn(x))))(*args))


@pytest.mark.parametrize("op", OPS)
def test_impls_on_cpu(op, monkeypatch):
  monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
  fn = OPS[op]
  assert not _runs_kernel(lambda x: fn(x, impl="xla"), X)
  assert not _runs_kernel(lambda x: fn(x, impl="auto"), X)  # no GPU: XLA
  assert not _runs_kernel(fn, X)  # the default is "auto"
  assert _runs_kernel(lambda x: fn(x, impl="pallas_interpret"), X)
  with pytest.raises(ValueError, match="impl='pallas' needs a GPU.*'cpu'.*pallas_interpret"):
    fn(X, impl="pallas")
  with pytest.raises(ValueError, match="impl must be one of"):
    fn(X, impl="triton")


@pytest.mark.parametrize("op", OPS)
def test_environment_variable_sets_the_default(op, monkeypatch):
  fn = OPS[op]
  monkeypatch.setenv(dispatch.ENV_VAR, "pallas_interpret")
  assert _runs_kernel(fn, X)
  assert not _runs_kernel(lambda x: fn(x, impl="xla"), X)  # an explicit impl wins
  monkeypatch.setenv(dispatch.ENV_VAR, "fast")
  with pytest.raises(ValueError, match=r"\$LOWMEM_JAX_IMPL must be one of .* got 'fast'"):
    fn(X)


def test_auto_takes_a_kernel_only_where_measured_on_gpu(monkeypatch):
  """"auto" and "pallas" decide by the compile target, here a compile-only H100."""
  with lm.targets.compiling(lm.targets.get("h100")):
    assert dispatch.kernel_options("pallas", "ms_norm") == pallas_kernels.Options()
    assert dispatch.kernel_options("auto", "ms_norm") is None  # not measured: XLA
    monkeypatch.setattr(dispatch, "MEASURED_NO_SLOWER", frozenset({"ms_norm"}))
    assert dispatch.kernel_options("auto", "ms_norm") == pallas_kernels.Options()
    assert dispatch.kernel_options("auto", "ms_norm", unsupported=lambda: "rows too long") is None
    with pytest.raises(ValueError, match="cannot run the ms_norm kernel: rows too long"):
      dispatch.kernel_options("pallas", "ms_norm", unsupported=lambda: "rows too long")
  assert dispatch.kernel_options("auto", "ms_norm") is None  # outside: the CPU


def test_a_changed_choice_reaches_a_traced_function_after_clear_caches(monkeypatch):
  """The module docstring's recipe: the choice is read at trace time, invisible to jit's
  caches, so a function traced before keeps its choice until `jax.clear_caches()`."""
  monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
  step = jax.jit(jax.grad(lambda x: jnp.sum(lm.regelu2(x * 1.5))))
  kernel_in = lambda: "pallas_call" in str(step.trace(X).jaxpr)
  assert not kernel_in()
  monkeypatch.setenv(dispatch.ENV_VAR, "pallas_interpret")
  assert not kernel_in()  # cached: the old choice
  assert "pallas_call" not in str(jax.make_jaxpr(step)(X))  # a new trace from outside: cached too
  jax.clear_caches()
  assert kernel_in()
  chex.assert_trees_all_close(step(X), jax.grad(lambda x: jnp.sum(lm.regelu2(x * 1.5,
                                                                            impl="xla")))(X))
  monkeypatch.delenv(dispatch.ENV_VAR)
  jax.clear_caches()
  assert not kernel_in()


def test_compiling_for_follows_the_platform_set():
  backend = jax.default_backend()
  assert dispatch.compiling_for() == lm.targets.compiling_for() == backend
  with dispatch.compiling_for_platform("gpu"):
    assert dispatch.compiling_for() == "gpu"
    with lm.targets.compiling(lm.targets.get("cpu")):
      assert dispatch.compiling_for() == "cpu"
    assert dispatch.compiling_for() == "gpu"
  assert dispatch.compiling_for() == backend
  with pytest.raises(TypeError, match="name must be a platform name"):
    with dispatch.compiling_for_platform(None):
      pass


@pytest.mark.parametrize("op", OPS)
def test_a_name_the_op_lacks_is_refused_unless_the_environment_gave_it(op, monkeypatch):
  fn = OPS[op]
  with pytest.raises(ValueError, match=r"op has no 'cudnn' implementation: impl must be one of "
                                       r"\('auto', 'xla', 'pallas', 'pallas_interpret'\)"):
    fn(X, impl="cudnn")
  monkeypatch.setenv(dispatch.ENV_VAR, "cudnn")  # a whole program's choice: "auto" where lacking
  assert not _runs_kernel(fn, X)


def _attention_runs(**kwargs) -> str:
  """Which implementation `lm.attention` takes for a bfloat16 call traced for a GPU where cuDNN
  compiles (no refusal given: `tests/test_targets.py` tests the compile-only GPUs')."""
  q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
  with dispatch.compiling_for_platform("gpu"):
    jaxpr = str(jax.make_jaxpr(jax.grad(
        lambda q: jnp.sum(lm.attention(q, q, q, **kwargs).astype(jnp.float32))))(q))
  return "cudnn" if "dot_product_attention_bwd" in jaxpr else "xla"


def test_attention_takes_the_same_names_and_the_environment_variable(monkeypatch):
  monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
  assert _attention_runs() == _attention_runs(implementation="auto") == "cudnn"
  assert _attention_runs(implementation="xla") == "xla"
  monkeypatch.setenv(dispatch.ENV_VAR, "xla")
  assert _attention_runs() == "xla"
  assert _attention_runs(implementation="cudnn") == "cudnn"  # an explicit implementation wins
  monkeypatch.setenv(dispatch.ENV_VAR, "pallas")  # attention has no Pallas kernel: "auto"
  assert _attention_runs() == "cudnn"
  with pytest.raises(ValueError, match="attention has no 'pallas' implementation: implementation "
                                       "must be one of"):
    _attention_runs(implementation="pallas")
  monkeypatch.setenv(dispatch.ENV_VAR, "fast")
  with pytest.raises(ValueError, match=r"\$LOWMEM_JAX_IMPL must be one of .* got 'fast'"):
    _attention_runs()



def test_a_cudnn_refusal_raises_by_name_and_auto_takes_xla_recorded():
  """Where the compile target refuses cuDNN (jax 0.12.1 without a GPU): asked for by name,
  attention raises with the reason; "auto" takes the chunked kernel; both are recorded."""
  q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
  attend = lambda impl: jax.grad(
      lambda q: jnp.sum(lm.attention(q, q, q, implementation=impl).astype(jnp.float32)))
  with dispatch.compiling_for_platform("gpu", cudnn_refusal=lambda: "no driver here"), (
      dispatch.recording_cudnn_refusals()) as found:
    with pytest.raises(RuntimeError, match="no driver here. implementation='xla' compiles"):
      jax.make_jaxpr(attend("cudnn"))(q)
    assert "dot_product_attention_bwd" not in str(jax.make_jaxpr(attend("auto"))(q))
  assert found == ["no driver here", "no driver here"]
  with dispatch.compiling_for_platform("gpu", cudnn_refusal=lambda: None):
    assert "dot_product_attention_bwd" in str(jax.make_jaxpr(attend("auto"))(q))


def test_using_sets_the_default_over_the_environment_variable(monkeypatch):
  monkeypatch.setenv(dispatch.ENV_VAR, "cudnn")
  with dispatch.using("xla"):
    assert _attention_runs() == "xla"
    assert _attention_runs(implementation="cudnn") == "cudnn"  # an explicit implementation wins
  assert _attention_runs() == "cudnn"
  with pytest.raises(ValueError, match="name must be one of .* got 'fast'"):
    with dispatch.using("fast"):
      pass

@pytest.mark.slow
def test_vit_training_step_with_kernels_matches_xla(monkeypatch):
  """The ViT reference step, switched to the kernels by the environment variable alone."""
  wl = lm.models.workload("vit-tiny", batch=2, image=32, dtype=jnp.float32,
                          activation="approx", norm="ms")
  params, batch = wl.init(jax.random.key(0)), wl.batch(jax.random.key(1))

  def loss_and_grads(impl):
    monkeypatch.setenv(dispatch.ENV_VAR, impl)
    fn = jax.value_and_grad(wl.loss)
    return jax.jit(fn)(params, *batch), str(jax.make_jaxpr(fn)(params, *batch))

  (loss, grads), jaxpr = loss_and_grads("pallas_interpret")
  (loss_ref, grads_ref), jaxpr_ref = loss_and_grads("xla")
  for kernel in ("lowmem_approx_activation_fwd", "lowmem_approx_activation_bwd",
                 "lowmem_ms_norm_fwd", "lowmem_ms_norm_bwd"):
    assert kernel in jaxpr and kernel not in jaxpr_ref
  chex.assert_trees_all_close(loss, loss_ref, rtol=1e-6)
  chex.assert_trees_all_close(grads, grads_ref, rtol=1e-4, atol=1e-4)  # |grads| up to 1e2
