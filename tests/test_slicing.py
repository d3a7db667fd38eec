"""`lowmem_jax.optim.slicing`: slices of a stack read and written in place, and scanned."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax.compile import targets
from lowmem_jax.compile.memory import host_transfers
from lowmem_jax.optim import slicing
from lowmem_jax.optim.packed_rows import PackedRows


def test_at_and_put_read_and_write_a_slice_of_a_deeper_stack():
  stack = jnp.arange(2 * 3 * 4, dtype=jnp.float32).reshape(2, 3, 4)
  np.testing.assert_array_equal(slicing.at(stack, 1, 2), stack[1, 2])
  rows = slicing.at(stack, 1, 1, rows=1)  # rows [1, 2) of stack[1]
  np.testing.assert_array_equal(rows, stack[1, 1:2])
  written = slicing.put(stack, -slicing.at(stack, 0, 1), 0, 1)
  np.testing.assert_array_equal(written[0, 1], -stack[0, 1])
  np.testing.assert_array_equal(written.at[0, 1].set(stack[0, 1]), stack)


def test_scan_slices_updates_each_slice_in_place_and_the_host_state_comes_back():
  params = jnp.arange(12.0).reshape(3, 4)
  states = jnp.zeros((3, 4))
  xs = jnp.ones((3, 4))

  def fn(carry, i, p, state, x):
    return carry + 1, p * 2 + x, state + i.astype(jnp.float32)

  for place in ("device", "host"):
    carry, new_p, new_s = slicing.scan_slices(fn, jnp.int32(0), params,
                                              slicing.stacked(place, states, 3), xs, place)
    assert int(carry) == 3
    np.testing.assert_array_equal(new_p, params * 2 + 1)
    if place == "host":  # a row of bytes a slice
      assert isinstance(new_s, PackedRows) and new_s.joined().shape == (3, 4 * 4)
      new_s = new_s.unstacked()
    np.testing.assert_array_equal(new_s, np.arange(3.0)[:, None] * np.ones(4))
  with pytest.raises(TypeError, match="PackedRows"):
    slicing.scan_slices(fn, jnp.int32(0), params, states, xs, "host")


@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("banks,odd,fence", [(1, False, False), (1, False, True), (1, True, True),
                                             (2, False, False), (2, True, True)])
def test_host_rows_come_over_ahead_and_go_back_each_to_its_own_slice(n, reverse, banks, odd,
                                                                      fence):
  """Two passes over host rows (each trip reads its row a trip ahead of its compute, in two
  banks two, and writes it back a trip late, in one bank from ``fn``'s fence where it calls
  one; the first rows and the last write in halves, a row of odd width whole): every slice
  sees its own state, in the order of the trips, and the second pass sees the first's
  writes."""
  params = jnp.zeros((n, 2))
  xs = jnp.arange(n, dtype=jnp.float32)[:, None] * jnp.ones((n, 2))

  def fn(order, i, p, state, x, *fence_of):  # the state counts its visits, keeps the trip
    s, new_p = state, p + x
    if fence:
      new_p = fence_of[0](new_p)
    return order + 1, new_p, {**s, "visits": s["visits"] + 1, "trip": s["trip"] * 0 + order}

  tag = {"tag": jnp.full((n, 1), 7, jnp.uint8)} if odd else {}  # 17 bytes a row
  states = slicing.stacked("host", {"visits": jnp.zeros((n, 3), jnp.int32),
                                    "trip": jnp.full((n,), -1, jnp.int32), **tag}, n, banks)
  assert states.layout.row_bytes % 2 == odd
  run = jax.jit(lambda p, s: slicing.scan_slices(fn, jnp.int32(0), p, s, xs, "host",
                                                 reverse=reverse, fence=fence))
  _, params, states = run(params, states)
  _, params, states = run(params, states)
  np.testing.assert_array_equal(params, 2 * xs)
  got = states.unstacked()
  np.testing.assert_array_equal(got["visits"], np.full((n, 3), 2))
  trips = np.arange(n)[::-1] if reverse else np.arange(n)
  np.testing.assert_array_equal(got["trip"], trips)
  assert len(states.banks) == min(n, banks)
  if odd:
    np.testing.assert_array_equal(got["tag"], np.full((n, 1), 7))


@pytest.mark.parametrize("place", ["device", "host"])
@pytest.mark.parametrize("reverse", [False, True])
def test_each_trip_reads_its_own_slice_of_xs_in_host_and_device_memory(place, reverse):
  """A leaf of ``xs`` in host memory comes over a trip ahead (`slicing._ahead`), a device
  leaf is read in its own trip: each trip sees its own slice of both, with the states on
  the device or on the host."""
  n = 4
  params = jnp.zeros((n, 2))
  on_host = jnp.arange(n, dtype=jnp.float32)[:, None] * jnp.ones((n, 2))
  xs = {"host": slicing.to("host", on_host), "device": 100 * on_host}
  states = slicing.stacked(place, {"s": jnp.zeros((n, 2))}, n)

  def fn(c, i, p, state, x):
    assert jax.typeof(x["host"]).memory_space != jax.memory.Space.Host  # brought over
    return c, p + x["host"] + x["device"], state

  run = jax.jit(lambda p, s, xs: slicing.scan_slices(fn, 0, p, s, xs, place, reverse=reverse))
  _, params, _ = run(params, states, xs)
  np.testing.assert_array_equal(params, 101 * on_host)


def test_stateless_host_rows_in_two_banks_and_a_row_count_that_is_not_the_slices_refused():
  params, xs = jnp.zeros((3, 2)), jnp.ones((3, 2))
  fn = lambda c, i, p, state, x: (c, p + x, state)
  empty = slicing.stacked("host", {}, 3, 2)  # rows of no bytes: a stateless optimizer's
  _, params, empty = jax.jit(lambda p, s: slicing.scan_slices(fn, 0, p, s, xs, "host"))(
      params, empty)
  np.testing.assert_array_equal(params, xs)
  assert empty.count == 3 and empty.layout.row_bytes == 0 and len(empty.banks) == 2
  with pytest.raises(ValueError, match=r"hold 2 rows in banks of \[1, 1\]; the params have 3"):
    slicing.scan_slices(fn, 0, params, slicing.stacked("host", {"s": jnp.zeros((2, 4))}, 2, 2),
                        xs, "host")


@pytest.mark.parametrize("calls", [0, 2])
@pytest.mark.parametrize("place,banks", [("host", 1), ("host", 2), ("device", 1)])
def test_a_fence_not_called_once_is_refused(calls, place, banks):
  params, xs = jnp.zeros((3, 2)), jnp.ones((3, 2))
  states = slicing.stacked(place, {"s": jnp.zeros((3, 2))}, 3, banks)

  def fn(c, i, p, state, x, fence):
    for _ in range(calls):
      p = fence(p)
    return c, p + x, state

  with pytest.raises(RuntimeError, match=f"call its fence once, called it {calls} times"):
    slicing.scan_slices(fn, 0, params, states, xs, place, fence=True)


def test_late_waits_for_its_value_and_leaves_an_empty_index():
  index = (jnp.int32(1),)
  after = jnp.ones(3)
  jaxpr = jax.make_jaxpr(lambda i, a: slicing.late(i, a))(index, after)
  assert any(e.primitive.name == "optimization_barrier" for e in jaxpr.jaxpr.eqns)
  assert slicing.late((), after) == ()


@pytest.mark.skipif(targets.available() is not None, reason="no GPU target compiles here")
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("fence", [False, True])
def test_no_host_row_is_read_from_the_loop_counters_increment(reverse, fence):
  """One bank of host rows, GEMMs in each trip, compiled for the rtx4090: no host transfer
  starts from a value XLA orders after other instructions (``control-predecessors``), as
  it orders the loop counter's increment after every reader of the counter
  (`slicing._HostTrips.later`; written as ``index(k + 1)``, the next row's read waited for
  the trip's GEMMs)."""
  n, width = 8, 1024

  def step(params, states, xs):
    def fn(c, i, p, state, x, *barrier):
      h = x
      for layer in range(8):
        h = jnp.tanh(h @ p)
        if layer == 3 and fence:
          h = barrier[0](h)
      return c + 1, p + 1e-3 * h[:width], {"v": state["v"] + jnp.sum(h, dtype=jnp.float32)}
    return slicing.scan_slices(fn, jnp.int32(0), params, states, xs, "host", reverse=reverse,
                               fence=fence)

  states = slicing.stacked("host", {"v": jnp.zeros((n, 1 << 20), jnp.float32)}, n, 1)
  compiled = targets.get("rtx4090").compile(
      jax.jit(step, donate_argnums=(0, 1)), jnp.zeros((n, width, width), jnp.bfloat16), states,
      jnp.zeros((n, 4096, width), jnp.bfloat16), compiler_options=targets.HOST_TRANSFER_OPTIONS)
  text = compiled.as_text()
  assert len(host_transfers.loop_host_transfers(text)) >= 3
  assert host_transfers.ordered_host_transfers(text) == []
