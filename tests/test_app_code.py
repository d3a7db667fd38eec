"""lowmem_jax/app/code.py: what a program runs is what it prints."""

import jax.numpy as jnp
import numpy as np

from lowmem_jax.app import code


def _program():
  return code.Program((
      ("tx", code.Call.of("lm.adamaw", 1e-3, 4, weight_decay=0.1), "AdamA over 4 micro-batches"),
      ("dtype", code.Code(jnp.bfloat16, "jnp.bfloat16"), ""),
      ("scale", code.Lambda("x", code.Call.of("jnp.multiply", code.Name("x"), 2.0)), ""),
      ("pair", (code.Name("dtype"), "name", None), ""),
  ))


def test_the_printed_program_makes_the_values_the_program_runs():
  program = _program()
  ran = program.run()
  printed = {}
  exec(program.source(), printed)  # the source starts with code.IMPORTS
  assert program.source().splitlines()[1] == (
      'tx = lm.adamaw(0.001, 4, weight_decay=0.1)  # AdamA over 4 micro-batches')
  assert ran["dtype"] is printed["dtype"] is jnp.bfloat16
  np.testing.assert_array_equal(ran["scale"](jnp.arange(3.0)), printed["scale"](jnp.arange(3.0)))
  assert ran["pair"] == printed["pair"] == (jnp.bfloat16, "name", None)
  params = {"w": jnp.ones(3)}
  assert type(ran["tx"].init(params)) is type(printed["tx"].init(params))
