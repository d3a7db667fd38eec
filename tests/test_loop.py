"""examples/loop.py: a resumed run equals the uninterrupted one; what cannot resume raises."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loop
from third_party_promotion import OPTAX_BIAS_CORRECTION

pytestmark = OPTAX_BIAS_CORRECTION  # both tests step optax.adam

TX = optax.adam(0.1)


@jax.jit
def _step(state, batch):
  params, opt_state = state
  loss, grads = jax.value_and_grad(lambda p: jnp.mean((batch * p["w"] - 1.0) ** 2))(params)
  updates, opt_state = TX.update(grads, opt_state, params)
  return (optax.apply_updates(params, updates), opt_state), {"loss": loss}


def _run(steps, directory=None, settings=None):
  params = {"w": jnp.zeros(3)}
  return loop.train(_step, (params, TX.init(params)), lambda i: jnp.full(3, 1.0 + i % 3),
                    steps=steps, desc="test", evaluate=lambda s: {"w0": s[0]["w"][0]},
                    eval_every=4, checkpoint_dir=directory, save_every=3, settings=settings)


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
  whole, whole_history = _run(10)
  _run(6, tmp_path, {"lr": 0.1})  # stops at 6: checkpoints at 3 and 6, an evaluation at 6
  resumed, history = _run(10, tmp_path, {"lr": 0.1})
  assert history == whole_history
  assert [e[0] for e in history["eval"]] == [4, 8, 10]
  jax.tree.map(np.testing.assert_array_equal, resumed, whole)


def test_what_cannot_resume_raises(tmp_path):
  _run(6, tmp_path, {"lr": 0.1})
  with pytest.raises(ValueError, match=r"other settings \(lr\)"):
    _run(10, tmp_path, {"lr": 0.2})
  with pytest.raises(ValueError, match=r"other settings \(schedule\)"):  # another state's tree
    loop.train(_step, ({"w": jnp.zeros(3)}, optax.chain(TX, optax.scale_by_schedule(
        optax.constant_schedule(1.0))).init({"w": jnp.zeros(3)})), lambda i: jnp.ones(3),
        steps=10, desc="test", checkpoint_dir=tmp_path, settings={"lr": 0.1, "schedule": "cosine"})
  with pytest.raises(ValueError, match="holds step 6, past steps=5"):
    _run(5, tmp_path, {"lr": 0.1})
  with pytest.raises(ValueError, match="steps must be >= 1"):
    _run(0)
