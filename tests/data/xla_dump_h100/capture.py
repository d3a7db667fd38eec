"""Writes the XLA dump files beside this script: a small train step compiled for h100.

Run from the repository root, so that its lowmem_jax is the one imported:
``python -m tests.data.xla_dump_h100.capture``. Of
XLA's dump, keeps the three files `lowmem_jax.compile.memory._xla_dump` reads, with
absolute paths made relative, the fused computations of more than 10 lines and
the live-range file's stack-trace breakdown left out.
"""

import glob
import os
import pathlib
import re
import shutil
import tempfile

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

import lowmem_jax as lm

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]
TX = optax.adam(1e-3)


def loss(params, x):
  h = checkpoint_name(jnp.tanh(x @ params["w1"]), "mlp_act")
  return jnp.sum(jnp.sin(h) @ params["w2"])


def train_step(params, opt_state, x):
  grads = jax.grad(jax.checkpoint(loss, policy=lm.policies.offload("mlp_act")))(params, x)
  updates, opt_state = TX.update(grads, opt_state)
  return optax.apply_updates(params, updates), opt_state


def _trimmed(name: str, text: str) -> str:
  site = os.path.dirname(os.path.dirname(optax.__file__)) + os.sep
  text = text.replace(site, "site-packages/").replace(str(ROOT) + os.sep, "")
  if name.endswith("-live-range.txt"):
    return text.split("  Stack trace breakdown", 1)[0]
  if name.endswith("after_optimizations.txt"):
    blocks = re.split(r"(?<=\n)(?=(?:ENTRY )?%\S+ \(.*\{\n)", text)
    return "".join(b for b in blocks if not b.startswith("%") or b.count("\n") <= 12)
  return text


def main():
  params = {"w1": jax.ShapeDtypeStruct((64, 256), jnp.float32),
            "w2": jax.ShapeDtypeStruct((256, 16), jnp.float32)}
  x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
  target = lm.targets.resolve("h100")
  with tempfile.TemporaryDirectory() as dump:
    lowered = target.lower(jax.jit(train_step, donate_argnums=(0, 1)), params,
                           jax.eval_shape(TX.init, params), x)
    target.compile_lowered(lowered, {"xla_dump_to": dump})
    for old in HERE.glob("*.txt"):
      old.unlink()
    for suffix in (".txt", "-buffer-assignment.txt", "-live-range.txt"):
      (path,) = glob.glob(os.path.join(dump, f"*after_optimizations{suffix}"))
      name = os.path.basename(path)
      with open(path) as f:
        (HERE / name).write_text(_trimmed(name, f.read()))
  shutil.rmtree(HERE / "__pycache__", ignore_errors=True)


if __name__ == "__main__":
  main()
