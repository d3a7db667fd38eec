"""lowmem_jax/_jax.py: the one place where JAX's versions differ, read the same on each."""

import jax
import jax.numpy as jnp
from jax import lax

import lowmem_jax as lm
from lowmem_jax import _jax


def test_scan_counts_read_consts_and_carry():
  """A scan reading one array it closes over, carrying two, scanning one: jax 0.10's
  num_consts/num_carry and jax 0.12's ft_in groups give the same counts."""
  def f(w, c, xs):
    return lax.scan(lambda carry, x: ((carry[0] * w + x, carry[1] + 1.0), carry[0]), c, xs)

  jaxpr = jax.make_jaxpr(f)(jnp.ones(3), (jnp.ones(3), jnp.float32(0)), jnp.ones((4, 3)))
  [scan] = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
  consts, carry = _jax.scan_counts(scan.params)
  assert (consts, carry) == (1, 2)
  assert len(scan.invars) == consts + carry + 1 and len(scan.outvars) == carry + 1


def test_a_compile_only_gpu_lowered_gives_no_cost_analysis_but_in_the_errors_named():
  """The lowered program for a compile-only GPU: its backend's cost analysis raises one of
  `COST_ANALYSIS_ERRORS` (jax 0.12: a JaxRuntimeError) or answers None (jax 0.10)."""
  lowered = lm.targets.get("h100").lower(lambda x: x @ x, jax.ShapeDtypeStruct((8, 8), jnp.float32))
  try:
    assert lowered.cost_analysis() is None
  except _jax.COST_ANALYSIS_ERRORS:
    pass
  assert lm.memory.flops_of(lowered) == 2 * 8**3  # counted on the host instead


def test_abstract_device_names_the_gpu_only_where_no_mesh_is_set():
  with _jax.abstract_device("NVIDIA H100"):
    assert jax.sharding.get_abstract_mesh().abstract_device.device_kind == "NVIDIA H100"
  assert jax.sharding.get_abstract_mesh().empty
