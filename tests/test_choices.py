"""`lowmem_jax.choices`: each switch's values declared once, checked where they enter."""

import jax
import jax.numpy as jnp
import pytest

import lowmem_jax as lm
from lowmem_jax import choices, models
from lowmem_jax.choices import Activation, Norm, checked


def test_checked_gives_the_member_and_names_the_argument_and_its_choices():
  assert checked(Norm, "ms", "norm") is Norm.MS
  assert checked(Norm, Norm.MS, "norm") is Norm.MS and Norm.MS == "ms"
  with pytest.raises(ValueError, match=r"norm must be one of \('plain', 'ms'\), got 'rms'"):
    checked(Norm, "rms", "norm")
  with pytest.raises(ValueError, match=r"activation must be one of \('exact', '1bit'\), got 'approx'"):
    checked(Activation, "approx", "activation", (Activation.EXACT, Activation.ONE_BIT))
  with pytest.raises(ValueError, match="got None"):
    checked(Norm, None, "norm")
  assert checked(Norm, None, "norm", none=Norm.PLAIN) is Norm.PLAIN
  with pytest.raises(ValueError, match="got 1"):
    checked(Norm, 1, "norm")


def test_the_workload_hands_its_models_the_members():
  wl = models.workload("vit-tiny", batch=1, activation="approx", norm="ms")
  assert wl.model.activation is Activation.APPROX and wl.model.norm is Norm.MS
  assert wl.model.attention is choices.Attention.PLAIN


def test_lowmem_spells_off_as_plain_and_reads_none_as_it():
  def f(w, x):
    return jnp.sum(jax.nn.gelu(x @ w))

  w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
  plain = lm.lowmem(f, activations="plain").explain(w, x)
  none = lm.lowmem(f, activations=None).explain(w, x)
  assert not plain.counts and not none.counts  # the GELU left as written by both
  assert lm.lowmem(f).explain(w, x).counts  # the default rewrites it
  with pytest.raises(ValueError, match=r"lowmem's norms must be one of \('ms', 'plain'\)"):
    lm.lowmem(f, norms="rms")
