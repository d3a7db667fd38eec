"""The layer-streamed step of the reference LLaMA cut at its MLP's hidden layer
(`lowmem_jax.models.llama.layer_stack`'s ``split_at_mlp_hidden``, the ``mlp-hidden`` term):
the same step as AdamW on the model, its backward without the MLP's forward matmuls. The
streamed step's other twins: tests/test_streamed.py."""

import re

import jax
import optax
import pytest
from test_streamed import assert_close, run_both
from third_party_promotion import OPTAX_BIAS_CORRECTION

import lowmem_jax as lm
from lowmem_jax.optim import streamed

CONFIG = lm.models.LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2,
                               ffn_dim=48)


def _matmuls(layered, params, batch) -> int:
  """The matmuls in the step's optimized program (each loop's body once): XLA drops a
  forward matmul whose output the backward does not read."""
  text = jax.jit(layered.step).lower(params, layered.init(params), batch).compile().as_text()
  return len(re.findall(r"= \S+ dot\(", text))


@pytest.mark.slow
@OPTAX_BIAS_CORRECTION
@pytest.mark.parametrize("place", ["device", "host"])
def test_a_layer_cut_at_the_mlp_hidden_equals_adamw_without_the_mlps_forward_matmuls(place):
  """The forward keeps each layer's input and, with the stream after the attention, the MLP's
  two pre-activations (``keep_part_inputs``); the backward then makes the MLP's gradients
  from them: the step equals AdamW on the model's gradient (Adam's eps at 1e-4, as
  tests/test_streamed.py's LLaMA twin), and its program holds two matmuls fewer than the
  whole layer's (the MLP's first two, run again there). Without ``keep_part_inputs`` the cut
  layer's backward runs its first part's forward twice (once for the second part's input):
  more than the whole layer's."""
  model = lm.models.Llama(CONFIG, loss="fused")
  tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 64)
  batch = (tokens[:, :-1], tokens[:, 1:])
  params = model.init(jax.random.key(1), batch[0])["params"]
  cut = lm.models.llama.layer_stack(model, split_layer=False, split_at_mlp_hidden=True)
  places = dict(state=place, saved_inputs=place)
  got, want, _ = run_both(cut, optax.adamw(1e-2, eps=1e-4), params, [batch, batch],
                          keep_part_inputs=True, **places)
  assert_close(got, want, rtol=1e-4, atol=1e-5)
  tx = optax.adamw(1e-2)
  whole = lm.models.llama.layer_stack(model, split_layer=False)
  plain = _matmuls(streamed.layer_streamed(whole, tx, **places), params, batch)
  kept = _matmuls(streamed.layer_streamed(cut, tx, keep_part_inputs=True, **places), params,
                  batch)
  again = _matmuls(streamed.layer_streamed(cut, tx, **places), params, batch)
  assert plain - kept == 2 and again > plain, (plain, kept, again)
