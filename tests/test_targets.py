"""`lowmem_jax.compile.targets`: XLA's GPU pipeline compiled here, without a GPU."""

import jax
import jax.numpy as jnp
import jaxlib.version
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import lowmem_jax as lm
from lowmem_jax import _text, names
from lowmem_jax.compile import memory, policies, targets
from third_party_promotion import FLAX_NORM, OPTAX_BIAS_CORRECTION


def _custom_calls(compiled) -> set[str]:
  text = compiled.as_text()
  return {line.split('custom_call_target="')[1].split('"')[0]
          for line in text.splitlines() if 'custom_call_target="' in line}


def _vit_step(dtype):
  wl = lm.models.workload("vit-tiny", batch=8, dtype=dtype)
  tx = optax.adamw(1e-3)
  params = wl.abstract_params()
  return wl.train_step(tx), (params, jax.eval_shape(tx.init, params), (wl.inputs, wl.labels))


def test_names_and_bad_name():
  assert {"h100", "a100-80gb", "a100-40gb", "cpu"} <= set(targets.names())
  with pytest.raises(ValueError, match=r"unknown target 'h200x'; known: .*a100-40gb.*h100.*cpu"):
    targets.get("h200x")
  with pytest.raises(TypeError, match="target must be"):
    targets.resolve(3)


def test_shipped_configs_parse():
  for name in targets.names():
    t = targets.get(name)
    if name == "cpu":
      assert t.memory_bytes is None and not t.deviceless and "CPU proxy" in t.note
      # As the report prints it: "[target]" is not taken for rich's markup and dropped.
      printed = " ".join(_text.render(t.note).split())
      assert targets.INSTALL in t.note and targets.INSTALL in printed
      continue
    assert t.platform == "cuda" and t.deviceless and t.memory_bytes > 2**33
    assert t.device_kind.startswith(("NVIDIA", "Tesla")) and name in t.note
  assert targets.get("h100").device_kind == "NVIDIA H100 80GB HBM3"
  assert targets.get("h200").device_kind == "NVIDIA H200"  # CUDA's name, as nvidia-smi prints it
  assert targets.get("a100-40gb").memory_bytes < targets.get("a100-80gb").memory_bytes


def test_24gb_cards_and_the_l40s_parse():
  """The cards people fine-tune on: memory as the CUDA driver reports it (ECC on where the card
  has it), compute capability 8.6 (Ampere) or 8.9 (Ada)."""
  mib = {"rtx4090": (24564, "8.9"), "rtx3090": (24238, "8.6"), "l4": (22518, "8.9"),
         "a10g": (22587, "8.6"), "l40s": (45373, "8.9")}
  for name, (size, capability) in mib.items():
    t = targets.get(name)
    assert round(t.memory_bytes / 2**20) == size, name  # MiB, as deviceQuery prints it
    major, minor = capability.split(".")
    assert f"cuda_compute_capability {{ major: {major} minor: {minor} }}" in t.config, name
  assert targets.get("a10g").device_kind == "NVIDIA A10G"


def test_every_shipped_gpu_has_a_peak_and_a_host_link():
  for name in targets.names():
    t = targets.get(name)
    if name == "cpu":
      assert t.peak_bf16_flops is None and t.host_link_bytes_per_s is None
      continue
    assert t.peak_bf16_flops > 1e13 and t.host_link_bytes_per_s > 1e10, name


def test_peak_and_host_link_figures(tmp_path):
  tflops = {n: targets.get(n).peak_bf16_flops / 1e12 for n in targets.names() if n != "cpu"}
  # Dense bfloat16 with float32 accumulation: NVIDIA's datasheets give twice, with sparsity.
  assert tflops["h100"] == pytest.approx(989.4) and tflops["a100-80gb"] == 312
  assert tflops["h200"] == tflops["h100"]  # the same die and clocks, with HBM3e
  # A GeForce card accumulates in float32 at half its FP16-accumulate rate (330.3 TFLOPS).
  assert tflops["rtx4090"] == pytest.approx(165.2) and tflops["rtx3090"] == 71
  assert tflops["v100"] < tflops["a10g"] < tflops["l4"] < tflops["a6000"] < tflops["l40s"]
  gb_per_s = {n: targets.get(n).host_link_bytes_per_s / 1e9 for n in tflops}
  assert gb_per_s["v100"] == pytest.approx(15.75, abs=0.01)  # PCIe Gen3 x16
  assert gb_per_s["h100"] == pytest.approx(2 * gb_per_s["rtx4090"]) == pytest.approx(63.0, abs=0.1)
  # NVLink one way where the part links all its peers by it (H100 SXM: 900 GB/s both ways), else
  # the PCIe link (the H100 PCIe's NVLink bridge joins two cards only).
  link = {n: targets.get(n).interconnect_bytes_per_s / 1e9 for n in tflops}
  assert link["h100"] == link["h200"] == 450 and link["a100-80gb"] == 300 and link["b200"] == 900
  assert link["h100-pcie"] == gb_per_s["h100-pcie"] and link["rtx4090"] == gb_per_s["rtx4090"]
  # Known by device kind: the same card saved and loaded keeps them, another card has none.
  targets.get("l4").save(tmp_path / "mine.txtpb")
  assert targets.load(tmp_path / "mine.txtpb").peak_bf16_flops == 121e12
  other = targets.get("l4").config.replace('"NVIDIA L4"', '"NVIDIA L4 Engineering Sample"')
  (tmp_path / "other.txtpb").write_text(other)
  unknown = targets.load(tmp_path / "other.txtpb")
  assert unknown.peak_bf16_flops is None and unknown.host_link_bytes_per_s is None
  assert unknown.interconnect_bytes_per_s is None and targets.get("cpu").interconnect_bytes_per_s \
      is None


def test_the_h200_is_the_h100_with_hbm3e_and_each_shipped_gpu_is_found_by_its_device_kind():
  h100, h200 = targets.get("h100"), targets.get("h200")
  assert h200.memory_bytes_per_s == 4.8e12 and h100.memory_bytes_per_s == pytest.approx(3.35e12,
                                                                                       rel=1e-3)
  # CUDA's total on an H200, as PyTorch reports it: 139.81 GiB.
  assert round(h200.memory_bytes / 2**30, 2) == 139.81
  assert h200.compute_capability == h100.compute_capability == (9, 0)
  for name in targets.names():
    if name != "cpu":
      assert targets.shipped_for(targets.get(name).device_kind) == name
  assert targets.shipped_for("NVIDIA H200 NVL") is None and targets.shipped_for("cpu") is None
  # An attached H200 (no config of its own) takes the bandwidth of the shipped one.
  assert targets.Target("attached", "cuda", "NVIDIA H200", 2**37).memory_bytes_per_s == 4.8e12


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in targets.names() if n != "cpu"])
@FLAX_NORM
@OPTAX_BIAS_CORRECTION
def test_every_shipped_gpu_compiles_a_training_step(name):
  """Every shipped GPU compiles, but a GPU older than CUDA 13's oldest where only JAX's CUDA 13
  plugin is installed (jax 0.12.1 has no CUDA 12 one): that one says why, before XLA does."""
  step, args = _vit_step(jnp.bfloat16)
  if (targets.get(name).compute_capability < targets.CUDA13_OLDEST_CAPABILITY
      and not targets._installed("jax_plugins.xla_cuda12")):
    with pytest.raises(targets.TargetUnavailable, match=r"sm_70, which CUDA 13 .* no longer"):
      targets.get(name).compile(step, *args, donate_argnums=(0, 1))
    return
  compiled = targets.get(name).compile(step, *args, donate_argnums=(0, 1))
  device = jax.tree.leaves(compiled.input_shardings)[0].device_set.pop()
  assert device.device_kind == targets.get(name).device_kind
  assert memory.stats_of(compiled).temp_bytes > 0


@pytest.mark.slow
@FLAX_NORM
@OPTAX_BIAS_CORRECTION
def test_vit_step_on_h100_uses_cublas_and_bf16_is_smaller():
  """The GPU pipeline's GEMMs are cuBLAS custom calls, and bfloat16 holds less than
  float32; the CPU pipeline, which computes 16-bit dots in float32 and
  keeps float32 copies, gives the reverse."""
  peak = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    step, args = _vit_step(dtype)
    for target in ("h100", "cpu"):
      compiled = memory.aot_compile(step, *args, target=target)
      peak[target, dtype] = memory.stats_of(compiled).temp_bytes
      if target == "h100":
        assert any(c.startswith("__cublas$") for c in _custom_calls(compiled))
  # bfloat16 over float32 on the H100: 0.70 with jax 0.10.2's XLA, 0.67 with 0.12.0.1's, 0.85
  # with 0.12.1's (its float32 peak fell, its bfloat16 one rose).
  assert peak["h100", jnp.bfloat16] < 0.9 * peak["h100", jnp.float32]
  assert peak["cpu", jnp.bfloat16] > peak["h100", jnp.bfloat16]


def test_cudnn_attention_compiles_for_the_target():
  """cuDNN's attention compiles for the H100 target where this XLA builds its graph without a
  GPU, as every XLA before jax 0.12.1's does. Where it cannot, asked for by name it raises with
  XLA's reason, "auto" takes the chunked kernel, and the target's note says so."""
  q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)

  def grad(impl):
    return jax.grad(lambda q, k, v: jnp.sum(
        lm.attention(q, k, v, is_causal=True, implementation=impl).astype(jnp.float32)),
                    argnums=(0, 1, 2))
  h100 = targets.get("h100")
  refusal = targets.cudnn_refusal(h100)
  if jaxlib.version.__version_info__ < (0, 12, 1):
    assert refusal is None
  if refusal is None:
    calls = _custom_calls(h100.compile(grad("cudnn"), q, q, q))
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= calls
    # "auto" decides by the compile target: cuDNN for the H100, the chunked kernel on CPU.
    assert "__cudnn$fmhaSoftmax" in _custom_calls(h100.compile(grad("auto"), q, q, q))
  else:
    assert "cudnn" in refusal.lower()
    assert f"attention does not compile here ({refusal})" in h100.note
    with pytest.raises(RuntimeError, match="cuDNN's attention does not compile for this target"):
      h100.compile(grad("cudnn"), q, q, q)
    assert not any("cudnn" in c for c in _custom_calls(h100.compile(grad("auto"), q, q, q)))
  on_cpu = targets.get("cpu").compile(grad("auto"), q, q, q)
  assert not any("cudnn" in c for c in _custom_calls(on_cpu))


def _block_stack(policy):
  def loss(w, x):
    def block(x, w):
      h = jax.ad_checkpoint.checkpoint_name(jnp.tanh(x @ w), names.BLOCK_IN)
      return jnp.tanh(h @ w)
    for _ in range(4):
      x = jax.checkpoint(block, policy=policy)(x, w)
    return jnp.sum(x)
  return (jax.grad(loss), jax.ShapeDtypeStruct((512, 512), jnp.float32),
          jax.ShapeDtypeStruct((2048, 512), jnp.float32))


def test_offload_puts_bytes_in_host_memory():
  grad, w, x = _block_stack(policies.offload(names.BLOCK_IN))
  stats = memory.analyze(grad, w, x, target="h100")
  assert 0 < stats.host_temp_bytes <= 4 * 2048 * 512 * 4  # at most a [2048, 512] float32 a block
  assert memory.analyze(grad, w, x, target="cpu").host_temp_bytes == 0
  b = memory.report(grad, w, x, target="h100")
  assert "offloaded to host memory" in str(b)


def test_a_step_with_host_arguments_compiles_with_its_jits_own_options():
  """Arguments in host memory compile outside jax for a compile-only GPU: the jit's own
  ``compiler_options`` reach XLA there too (an unknown one is refused, as jax refuses it)."""
  x = targets.in_host_memory(jax.ShapeDtypeStruct((64, 256), jnp.float32))
  move = lambda x: jax.device_put(x, jax.memory.Space.Device) * 2
  rtx4090 = targets.get("rtx4090")
  assert isinstance(rtx4090.compile(jax.jit(move, compiler_options=targets.HOST_TRANSFER_OPTIONS),
                                    x), targets.HostArgumentsCompiled)
  with pytest.raises(Exception, match="xla_no_such_option"):
    rtx4090.compile(jax.jit(move, compiler_options={"xla_no_such_option": True}), x)


def test_gpu_pipeline_keeps_remat_without_the_cpu_switch():
  """`jax.checkpoint`'s recompute survives XLA's GPU pipeline as it is: the
  CPU-only `CPU_KEEPS_REMAT` is not applied there, and remat still saves."""
  h100 = targets.get("h100")
  assert h100.compiler_options() == {**targets.DEVICELESS_OPTIONS, **targets.UNRUN_CODE_OPTIONS}
  temp = {p: memory.analyze(*_block_stack(p), target=h100).temp_bytes
          for p in (policies.everything, policies.full)}
  assert temp[policies.full] < 0.75 * temp[policies.everything]


def test_a_compile_only_gpu_skips_only_the_machine_codes_optimizations():
  """`UNRUN_CODE_OPTIONS` change nothing but the machine code: the optimized HLO and XLA's
  memory analysis equal those of the compile without them (the same lowering, XLA's defaults)."""
  grad, w, x = _block_stack(policies.offload(names.BLOCK_IN))
  h100 = targets.get("h100")
  lowered = h100.lower(grad, w, x)
  fast = h100.compile_lowered(lowered)
  full = lowered.compile(compiler_options=targets.DEVICELESS_OPTIONS)
  assert fast.as_text() == full.as_text()
  assert memory.stats_of(fast) == memory.stats_of(full)
  assert memory.stats_of(fast).host_temp_bytes > 0


def test_sharded_arguments_compile_for_eight_target_devices():
  cpus = Mesh(jax.devices()[:8], ("x",))
  x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(cpus, P("x")))
  w = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(cpus, P()))
  h100 = targets.get("h100")
  placed = h100.place((x, w))
  assert len(placed[0].sharding.mesh.devices.flat) == 8
  assert placed[0].sharding.spec == P("x") and placed[1].sharding.spec == P()
  compiled = h100.compile(lambda x, w: jnp.sum(x @ w), x, w)
  assert "all-reduce" in compiled.as_text()
  assert memory.stats_of(compiled).argument_bytes == (64 // 8) * 256 * 4 + 256 * 256 * 4


def test_save_and_load(tmp_path):
  h100 = targets.get("h100")
  h100.save(tmp_path / "mine.txtpb")
  mine = targets.load(tmp_path / "mine.txtpb")
  assert (mine.name, mine.device_kind, mine.memory_bytes) == ("mine", h100.device_kind,
                                                             h100.memory_bytes)
  (tmp_path / "bad.txtpb").write_text("platform_name: 'CUDA'\n")
  with pytest.raises(ValueError, match="not a text GpuTargetConfigProto"):
    targets.load(tmp_path / "bad.txtpb")
  with pytest.raises(ValueError, match="no config to save"):
    targets.get("cpu").save(tmp_path / "cpu.txtpb")
  with pytest.raises(ValueError, match="autotune_results: no file"):
    targets.get("h100", autotune_results=str(tmp_path / "missing.textproto"))


def test_autotune_results_turn_triton_gemm_back_on(tmp_path):
  results = tmp_path / "autotune.textproto"
  results.write_text("version: 3\n")
  options = targets.get("h100", autotune_results=str(results)).compiler_options()
  assert options == {"xla_gpu_load_autotune_results_from": str(results),
                     **targets.UNRUN_CODE_OPTIONS}


@pytest.mark.parametrize("missing", ["plugin", "jax_plugins"])
def test_missing_packages_name_the_install(monkeypatch, missing):
  real = targets.importlib.util.find_spec

  def find_spec(name, *args):
    """As Python answers with no CUDA plugin: None, or where no plugin at all is installed an
    error for the missing parent package."""
    if not name.startswith("jax_plugins"):
      return real(name, *args)
    if missing == "plugin":
      return None
    raise ModuleNotFoundError("No module named 'jax_plugins'", name="jax_plugins")

  monkeypatch.setattr(targets.importlib.util, "find_spec", find_spec)
  why = targets.available()
  assert "CUDA plugin" in why and targets.INSTALL in why
  assert targets.default().name == "cpu"
  targets._compile_only_devices.cache_clear()
  try:
    with pytest.raises(targets.TargetUnavailable, match=r"pip install 'lowmem-jax\[target\]'"):
      targets.get("h100").compile(lambda x: x, jnp.ones(2))
  finally:
    targets._compile_only_devices.cache_clear()
  monkeypatch.setattr(targets, "_ptxas", lambda: None)
  monkeypatch.setattr(targets.importlib.util, "find_spec", real)
  assert "ptxas" in targets.available()


def test_default_and_compiling_for_follow_the_target():
  backend = jax.default_backend()
  assert targets.default().name == ("attached" if backend == "gpu" else "h100")
  assert targets.compiling_for() == backend
  with targets.compiling(targets.get("a100-80gb")):
    assert targets.compiling_for() == "gpu"
  with targets.compiling(targets.get("cpu")):
    assert targets.compiling_for() == "cpu"
  assert targets.compiling_for() == backend


def test_explain_oom_compares_with_the_target_memory():
  grad, w, x = _block_stack(policies.everything)
  limit = f"{targets.get('a100-40gb').memory_bytes / 2**20:,.1f}"
  assert f"fits in the limit of {limit} MiB" in memory.explain_oom(grad, w, x, target="a100-40gb")
  assert "has no memory size (pass limit_bytes=)" in memory.explain_oom(grad, w, x, target="cpu")


def test_a_compile_only_targets_flops_come_from_the_lowered_program():
  """A compile-only GPU gives no cost analysis (jax 0.10 raises NotImplementedError, jax 0.12
  a JaxRuntimeError): `flops_of` says so in one error, and `step_flops` counts the lowered
  program's on the host."""
  x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  target = targets.get("h100")
  lowered = target.lower(lambda a, b: a @ b, x, x)
  compiled = target.compile_lowered(lowered)
  with pytest.raises(RuntimeError, match="gives no FLOP count"):
    memory.flops_of(compiled)
  assert memory.step_flops(lowered, compiled) == 2 * 64**3


def test_compute_capability_comes_from_the_config():
  assert targets.get("h100").compute_capability == (9, 0)
  assert targets.get("rtx4090").compute_capability == (8, 9)
  assert targets.get("cpu").compute_capability is None


def test_compiling_for_a_gpu_target_names_it_to_pallas_and_sets_no_mesh():
  """The abstract device Pallas reads comes with an empty mesh (no sharding changes, the
  streamed step's mesh test stays False); a mesh the user set is left as it is."""
  with targets.compiling(targets.get("rtx4090")):
    mesh = jax.sharding.get_abstract_mesh()
    assert mesh.empty and mesh.abstract_device.device_kind == "NVIDIA L4"  # its sm_89 twin
  user = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  with jax.set_mesh(user), targets.compiling(targets.get("h100")):
    assert jax.sharding.get_abstract_mesh() == user.abstract_mesh
