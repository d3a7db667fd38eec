"""The options a user's ``make_step`` takes, one keyword each technique of its step passes
(``lowmem-jax report --step``): declared here once, read by `lowmem_jax.app.techniques`'
`TechniqueSet.step_options`, `lowmem_jax.app.job.Job.without_missing` and the CLI's help."""

from typing import NamedTuple


STEP_TECHNIQUES = ("baseline", "lowmem", "approx", "bf16", "remat", "adama", "8bit",
                   "bf16-params", "offload-opt")
"""The techniques of a user's step, each given to ``make_step`` as `STEP_OPTIONS`."""
STEP_DEFAULT = "baseline,lowmem,lowmem+approx"
"""The default technique sets of a user's step."""


class StepOption(NamedTuple):
  """A keyword argument of a user's ``make_step``: ``default`` its default's Python, ``what``
  it is and what each technique of ``terms`` passes."""
  default: str
  what: str
  terms: tuple[str, ...]


STEP_OPTIONS = {
    "lowmem": StepOption("lambda f: f", "the step differentiates lowmem(loss_fn); lowmem: "
                         "lm.lowmem, its exact rewrites (norms, attention, loss head, GELU/SiLU "
                         "recomputed), approx: with activations=\"approx\"",
                         ("lowmem", "approx")),
    "dtype": StepOption("jnp.float32", "the compute dtype; bf16: jnp.bfloat16", ("bf16",)),
    "policy": StepOption("None", "a remat policy, for jax.checkpoint(loss_fn, policy=policy); "
                         "remat:<policy>: lm.policies.<policy> (plan's remat:plan: lm.plan's)",
                         ("remat",)),
    "adamw": StepOption("optax.adamw", "the AdamW, called adamw(learning_rate); 8bit: "
                        "lm.lowbit.adamw_8bit; adama:<k>: functools.partial(lm.adamaw, k=<k>), "
                        "with 8bit state_bits=8", ("8bit", "adama")),
    "micro_batches": StepOption("1", "micro-batches a step, as lm.microbatch_step(loss_fn, tx, "
                                "micro_batches); adama:<k>: <k>", ("adama",)),
    "param_dtype": StepOption("jnp.float32", "the parameters' dtype; bf16-params: jnp.bfloat16",
                              ("bf16-params",)),
    "optimizer": StepOption("lambda tx: tx", "wraps the optimizer; bf16-params: optax.chain(tx, "
                            "lm.lowbit.stochastic_rounding()); offload-opt: "
                            "lm.offload.offload_state(tx), whose state the step's arguments hold "
                            "in host memory (lm.offload.abstract_state(tx, params))",
                            ("bf16-params", "offload-opt")),
}
"""``make_step``'s keyword arguments, by keyword, the one place they are declared (``lowmem-jax
report --help`` prints them). A technique whose keywords ``make_step`` does not take is left
out of the default sets and the ladder (`lowmem_jax.app.job.Job.without_missing`), and
refused where a set names it (`lowmem_jax.app.measurement.check`)."""


def step_help() -> str:
  """The ``--help`` lines of `STEP_OPTIONS`."""
  return "\n".join(f"  {k}={o.default}: {o.what}" for k, o in STEP_OPTIONS.items())
