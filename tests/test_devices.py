"""``lowmem-jax report --devices N``: FSDP over N compile-only GPUs, and the collective bytes
of a step (`lowmem_jax.compile.memory.collective_bytes`)."""

import json
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from third_party_promotion import OPTAX_BIAS_CORRECTION, OPTAX_UPDATE_MOMENT

from lowmem_jax import app
from lowmem_jax.app import cli
from lowmem_jax.compile import memory, targets

needs_target = pytest.mark.skipif(targets.available() is not None,
                                  reason=f"no compile-only GPU target: {targets.available()}")

# An SPMD module as XLA prints it: a loop of 3 trips gathering f32[4,8] (128 bytes) each, an
# all-reduce of f32[2] (8 bytes), a conditional whose larger branch all-gathers 64 bytes.
_HLO = """HloModule m

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[4,8]{1,0}) %p), index=0
  %x = f32[4,8]{1,0} get-tuple-element((s32[], f32[4,8]{1,0}) %p), index=1
  %s = f32[2,8]{1,0} slice(f32[4,8]{1,0} %x), slice={[0:2], [0:8]}
  %g = f32[4,8]{1,0} all-gather(f32[2,8]{1,0} %s), dimensions={0}
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(s32[] %i, f32[4,8]{1,0} %g)
}

%cond (p: (s32[], f32[4,8])) -> pred[] {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %r = f32[] add(f32[] %a, f32[] %b)
}

%one (q: f32[8]) -> f32[8] {
  %q = f32[8]{0} parameter(0)
  ROOT %r = f32[8]{0} all-reduce(f32[8]{0} %q), to_apply=%add
}

%two (q: f32[8]) -> f32[16] {
  %q = f32[8]{0} parameter(0)
  ROOT %r = f32[16]{0} all-gather-done(f32[8]{0} %q)
}

ENTRY %main (x: f32[4,8], y: f32[2], b: s32[], z: f32[8]) -> f32[2] {
  %x = f32[4,8]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,8]{1,0}) tuple(s32[] %zero, f32[4,8]{1,0} %x)
  WHILE
  %b = s32[] parameter(2)
  %z = f32[8]{0} parameter(3)
  %k = f32[16] conditional(s32[] %b, f32[8]{0} %z, f32[8]{0} %z), branch_computations={%one, %two}
  %y = f32[2]{0} parameter(1)
  ROOT %a = f32[2]{0} all-reduce(f32[2]{0} %y), to_apply=%add
}
""".replace("WHILE", "%w = (s32[], f32[4,8]{1,0}) while((s32[], f32[4,8]{1,0}) %init), "
            "condition=%cond, body=%body, TRIPS")


def test_collective_bytes_counts_each_loop_trip():
  known = _HLO.replace("TRIPS", 'backend_config={"known_trip_count":{"n":"3"}}')
  assert memory.collective_bytes(known) == 3 * 128 + 8 + 64
  assert memory.collective_bytes(_HLO.replace(", TRIPS", "")) is None


@needs_target
@pytest.mark.parametrize("layers", [2, 4])
def test_collective_bytes_of_a_sharded_scan_grow_with_its_trips(layers):
  """A scan over layers whose weights are split over 2 h100 devices moves each layer's
  collectives once a trip: twice the layers, twice the bytes."""
  target = targets.get("h100")
  mesh = target.mesh((2,), ("fsdp",))

  def f(w, x):
    return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0]

  def bytes_of(n):
    w = jax.ShapeDtypeStruct((n, 128, 128), jnp.float32,
                             sharding=jax.sharding.NamedSharding(mesh, P(None, None, "fsdp")))
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32,
                             sharding=jax.sharding.NamedSharding(mesh, P()))
    return memory.collective_bytes(target.compile(jax.jit(f), w, x).as_text())
  one, more = bytes_of(layers), bytes_of(2 * layers)
  assert 0 < one and more == 2 * one


def test_fsdp_spec_splits_the_largest_divisible_axis():
  assert app.fsdp_spec((80, 8192, 28672), 8) == P(None, None, "fsdp")
  assert app.fsdp_spec((4, 4), 2) == P(None, "fsdp")
  assert app.fsdp_spec((3, 5), 2) == P()


@needs_target
@pytest.mark.slow
@OPTAX_UPDATE_MOMENT
@OPTAX_BIAS_CORRECTION
@pytest.mark.heavy
def test_report_on_two_devices(capsys):
  """llama-100m FSDP over 2 h100s: each device holds half the parameters, state and batch, its
  peak is below one device's, and its collectives are counted."""
  llama = ["--model", "llama-100m", "--batch", "2", "--seq", "64", "--target", "h100",
           "--techniques", "all+fused-ce+8bit+bf16-params+stream:device", "--json"]
  assert cli.main(["report", *llama]) == 0
  alone = json.loads(capsys.readouterr().out)["rows"][0]
  assert cli.main(["report", *llama, "--devices", "2"]) == 0
  out = json.loads(capsys.readouterr().out)
  shared = out["rows"][0]
  assert out["devices"] == 2 and alone["collective_bytes"] == 0
  assert shared["peak_bytes"] < alone["peak_bytes"]
  arguments = lambda row: row["breakdown"]["compiled"]["argument_bytes"]
  assert arguments(shared) == pytest.approx(arguments(alone) / 2, rel=0.02)
  # XLA's memory analysis of the partitioned program is one device's: its arguments are the shards
  job = app.Job("llama-100m", batch=2, seq=64, target="h100", devices=2)
  assert arguments(shared) == app.device_argument_bytes(job, app.parse(llama[9]))
  # the scan over 12 layers moves each layer's weights: far more than the loop body once
  assert shared["collective_bytes"] > shared["parameters"]
  assert shared["transfer_floor_s"] == pytest.approx(shared["collective_bytes"] / 450e9)


def _error(capsys) -> str:
  err = "".join(line for line in capsys.readouterr().err.splitlines(keepends=True)
                if not re.match(r"\[\d+/\d+\] compiling ", line))
  assert err.count("\n") == 1 and "Traceback" not in err
  return err


@pytest.mark.parametrize("argv", [
    ["--model", "llama-100m", "--devices", "0"],
    ["--model", "llama-100m", "--devices", "2", "--target", "cpu"],
    ["--devices", "2", "--step", "train.py:make_step"],
])
def test_bad_devices(capsys, argv):
  assert cli.main(["report", *argv]) == 2
  assert "--devices" in _error(capsys)


@needs_target
def test_batch_must_split_over_the_devices(capsys):
  assert cli.main(["plan", "--model", "llama-100m", "--batch", "3", "--devices", "2",
                   "--target", "h100", "--budget", "1GiB"]) == 2
  err = _error(capsys)
  assert "--batch 3" in err and "--devices 2" in err


@needs_target
def test_the_ladder_over_several_devices_keeps_the_state_on_them():
  job = app.Job("llama-100m", batch=2, seq=64, target="h100", devices=2)
  sets, _ = app.ladder_of(job)
  alone, _ = app.ladder_of(app.Job("llama-100m", batch=2, seq=64, target="h100"))
  assert sets == [t for t in alone if "offload-opt" not in t] and len(sets) < len(alone)
