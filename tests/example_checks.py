"""Checks shared by the tests of examples/vit_digits.py and examples/llama_charlm.py."""

import jax
import numpy as np


def assert_lowmem_holds_less(results: dict) -> None:
  """The lowmem row saves fewer activations and compiles to a lower peak than the baseline."""
  base, low = results["baseline"], results["lowmem"]
  for r in (base, low):
    assert all(v > 0 for v in r["memory"].values())
  assert low["memory"]["saved"] < base["memory"]["saved"]
  assert low["memory"]["peak"] < base["memory"]["peak"]


def assert_resumes(main, argv: list[str], first_steps: int, whole: dict) -> None:
  """``main(argv)`` run for ``first_steps`` and then resumed equals ``whole``, the
  uninterrupted run's lowmem row: losses, evaluation steps and state (AdamA's included)."""
  first = main(argv + ["--steps", str(first_steps)])
  assert len(first["results"]["lowmem"]["history"]["loss"]) == first_steps
  got = main(argv)["results"]["lowmem"]
  np.testing.assert_allclose(np.array(got["history"]["loss"]), np.array(whole["history"]["loss"]),
                             rtol=1e-6)
  assert [e[0] for e in got["history"]["eval"]] == [e[0] for e in whole["history"]["eval"]]
  for a, b in zip(jax.tree.leaves(got["state"]), jax.tree.leaves(whole["state"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
