"""`lowmem_jax.compile.memory._xla_dump` on XLA's dump of a small train step, saved in
``tests/data/xla_dump_h100`` (see ``tests/data/README.md``): these fail first
when XLA changes the format of its dumps."""

import pathlib
import re

import pytest

from lowmem_jax.compile.memory import _xla_dump

DATA = pathlib.Path(__file__).resolve().parent / "data" / "xla_dump_h100"
CAPTURE = "tests/data/xla_dump_h100/capture.py"
ARGUMENTS = {
    "params__w1__.1": 0, "params__w2__.1": 1, "opt_state_0__count.1": 2, "opt_state_0__mu__w1__.1": 3,
    "opt_state_0__mu__w2__.1": 4, "opt_state_0__nu__w1__.1": 5, "opt_state_0__nu__w2__.1": 6, "x.1": 7,
}
COMPONENTS = {name: "parameters" if name.startswith("params") else
              "optimizer state" if name.startswith("opt_state") else "inputs" for name in ARGUMENTS}


@pytest.fixture(scope="module")
def texts():
  return _xla_dump.read(str(DATA))


@pytest.fixture(scope="module")
def instructions(texts):
  return _xla_dump.parse_hlo(texts.hlo)


@pytest.fixture(scope="module")
def dump(texts, instructions):
  values, sequence, held = _xla_dump.parse_dump(instructions, COMPONENTS, texts.buffer_assignment,
                                                texts.live_range)
  return {v.name: v for v in values}, sequence, held


def _line_of(text: str) -> str:
  """``capture.py:N``, N the line of capture.py that holds ``text``."""
  lines = (DATA / "capture.py").read_text().splitlines()
  return f"{CAPTURE}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def test_read_finds_the_three_files(texts, tmp_path):
  assert texts.hlo.startswith("HloModule jit_train_step")
  assert texts.buffer_assignment.startswith("BufferAssignment:")
  assert "BufferLiveRange:" in texts.live_range
  with pytest.raises(RuntimeError, match="Expected one XLA dump file"):
    _xla_dump.read(str(tmp_path))


def test_entry_parameters_are_numbered(instructions):
  numbered = {name: i.parameter for name, i in instructions.items() if i.parameter is not None}
  assert numbered == ARGUMENTS
  # A fused computation's parameters are not the program's.
  assert instructions["param_0.58"].parameter is None


def test_op_names_and_sources(instructions):
  assert instructions["params__w1__.1"].op_name == "params['w1']"  # XLA escapes the quotes
  assert instructions["opt_state_0__mu__w2__.1"].op_name == "opt_state[0].mu['w2']"
  tanh = instructions["wrapped_tanh"]
  assert tanh.op_name == "jit(train_step)/jvp()/tanh"
  assert tanh.source == _line_of("jnp.tanh(x @ params")
  backward = instructions["custom-call.8"]
  assert backward.op_name == "jit(train_step)/transpose(jvp(jvp()))/checkpoint/dot_general"
  assert backward.source == _line_of("jnp.sin(h) @ params")
  assert instructions["loop_add_fusion"].source == "site-packages/optax/_src/update.py:42"
  # Inside a fused computation too; a copy to host memory has no op name or source.
  assert instructions["tanh.2.1"].source == tanh.source
  assert instructions["copy-start.2"] == _xla_dump.Instr("", "", None)


def test_program_order(texts, dump):
  _, sequence, _ = dump
  assert len(sequence) == int(re.search(r"HloLiveRange \(max (\d+)\)", texts.live_range).group(1))
  assert sequence[:5] == ["params__w1__.1", "x.1", "custom-call.7", "get-tuple-element.5", "wrapped_tanh"]
  assert sequence[-1] == "tuple.6"


def test_values_sizes_shapes_and_live_ranges(dump):
  values, _, _ = dump
  tanh = values["wrapped_tanh{}"]
  assert (tanh.nbytes, tanh.shape, tanh.start, tanh.end) == (32 * 256 * 4, "f32[32,256]", 4, 6)
  assert (tanh.op_name, tanh.source) == ("jit(train_step)/jvp()/tanh", _line_of("jnp.tanh(x @ params"))
  workspace = values["custom-call.7{1}"]  # cuBLAS's workspace, live for its GEMM only
  assert (workspace.nbytes, workspace.shape, workspace.start, workspace.end) == (4194304, "s8[4194304]", 2, 2)
  # Layouts and comments go from shapes, tuples included.
  assert values["tuple.6{}"].shape == ("(f32[64,256], f32[256,16], s32[], f32[64,256], f32[256,16], "
                                       "f32[64,256], f32[256,16])")
  x = values["x.1{}"]
  assert (x.start, x.end, x.component) == (0, 44, "inputs")


def test_every_device_value_is_read_and_host_memory_is_skipped(texts, dump):
  values, _, _ = dump
  host = re.search(r"^allocation \d+: size \d+, color 5,.*\n((?: value:.*\n)+)", texts.buffer_assignment,
                   re.MULTILINE).group(1)
  assert host.startswith(" value: <114 copy-start.2{0} @5>")  # the offloaded tanh output
  assert "copy-start.2{0}:5-19" in texts.live_range
  assert "copy-start.2{0}" not in values
  device = texts.buffer_assignment.count("\n value: ") - host.count(" value: ")
  assert len(values) == device == 45


def test_arguments_and_donated_outputs(dump):
  values, _, held = dump
  assert {name.split("{")[0]: v.component for name, v in values.items() if v.component} == COMPONENTS
  # Adam's new w1 is written over the donated w1: the buffer changes hands at 36.
  assert (values["params__w1__.1{}"].end, values["loop_add_fusion{0}"].start) == (35, 36)
  assert values["loop_add_fusion{0}"].component is None
  assert held["loop_add_fusion{0}"] == "parameters"
  assert held["loop_add_fusion{1}"] == held["loop_add_fusion{2}"] == "optimizer state"
  assert held["loop_select_fusion{}"] == "optimizer state"  # the new step count
  assert "wrapped_tanh{}" not in held


def test_bytes_live_at_xla_peak(texts, dump):
  """At the position XLA names as its peak, the values read here are the ones XLA
  lists, less the one in host memory."""
  values, _, _ = dump
  peak = re.search(r"Live ranges at (\d+) \(peak\):\n((?:    \S+: \d+ bytes.*\n?)+)", texts.live_range)
  listed = dict(re.findall(r"^    (\S+): (\d+) bytes", peak.group(2), re.MULTILINE))
  position = int(peak.group(1))
  live = {v.name: str(v.nbytes) for v in values.values() if v.start <= position <= v.end}
  assert live == {name: n for name, n in listed.items() if name != "copy-start.2{0}"}


def test_a_live_range_dump_without_its_section_is_refused(texts, instructions):
  with pytest.raises(RuntimeError, match="format may have changed"):
    _xla_dump.parse_dump(instructions, COMPONENTS, texts.buffer_assignment,
                         texts.live_range.replace("BufferLiveRange:", "Ranges:"))
