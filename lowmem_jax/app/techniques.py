"""The technique registry: what ``lowmem-jax report`` and ``plan`` measure, as a library.

`TECHNIQUES` declares each technique once (its CLI term, the model switches it
sets, its `lowmem_jax.lowmem` option, how it wraps the optimizer, whether it
trains as the plain step does); everything else reads it. A technique set joins techniques
with "+" (``"all+remat:full+adama:4"``); `parse` makes a `TechniqueSet` of it,
whose `TechniqueSet.python` is the code that builds its step. What a set is
measured on is a `lowmem_jax.app.job.Job`; `lowmem_jax.app.measurement` compiles
it, `lowmem_jax.app.fits` finds the cheapest set that fits a budget.

    from lowmem_jax import app
    job = app.Job("llama-1b", batch=8, seq=2048, target="h100")
    b = app.measure(job, app.parse("all+fused-ce"))
"""

import dataclasses
import inspect
import json
import re
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import optax

from lowmem_jax import models, transform
from lowmem_jax.app import code
from lowmem_jax.app.step_options import STEP_TECHNIQUES
from lowmem_jax.choices import Activation, Attention, Conv, Embedding, Loss, Norm, Place
from lowmem_jax.compile import policies, targets


class TechniqueError(ValueError):
  """A technique set or a job that cannot be measured, said in one line; ``field``: the
  `lowmem_jax.app.Job` field at fault, where one is (the CLI names its option)."""

  def __init__(self, message: str, field: str | None = None):
    super().__init__(message)
    self.field = field


@dataclasses.dataclass(frozen=True)
class Technique:
  """One technique, declared once: parsing, the workloads, the printed Python,
  ``--help`` and the checks all read this.

  Attributes:
    term: the CLI term; a term that takes a value is written ``term:<value>``.
    summary: what it does, for ``--help``.
    value: how the value reads in ``--help`` (``"<k>"``), or None for a term without one.
    parse: the value from its text; raises ValueError with the reason.
    off: a value that leaves the technique off (``adama:1``: one micro-batch is Adam).
    switches: the reference models' switches it sets (`lowmem_jax.models.workload`'s
      keywords), or a function of ``(value, job)`` giving them; the models say which
      model takes which.
    lowmem: the `lowmem_jax.lowmem` option that does the same to a step of your own.
    optimizer: wraps the optimizer's `code.Call` (offload-opt, bf16-params), in the
      order of `TECHNIQUES`; the optimizer itself is AdamW, or AdamA with ``adama``,
      with 8-bit moments with ``8bit`` (`TechniqueSet.adamw`).
    exact: whether training with it is the plain step's up to rounding: the same
      function, parameters and gradient, computed or kept in fewer bits at most (bfloat16
      compute, 8-bit moments, bfloat16 parameters rounded stochastically; on the
      transformers, for a technique that differs by model). False for an approximate
      gradient (approx, conv), another second moment (adama: a sum over micro-batches) or
      other parameters (sparse). The ablation that set these:
      docs/techniques.md.
    needs: ``(term, why)`` pairs: terms the set must also hold.
    excludes: ``(term, why)`` pairs: terms the set must not also hold.
  """
  term: str
  summary: str
  value: str | None = None
  parse: Callable[[str], Any] | None = None
  off: Any = None
  switches: Mapping[str, Any] | Callable[[Any, Any], Mapping[str, Any]] = dataclasses.field(
      default_factory=dict)
  lowmem: Mapping[str, str] = dataclasses.field(default_factory=dict)
  optimizer: Callable[[code.Call], code.Call] | None = None
  exact: bool = True
  needs: tuple[tuple[str, str], ...] = ()
  excludes: tuple[tuple[str, str], ...] = ()

  def model_switches(self, value: Any, job) -> dict[str, Any]:
    """The model switches this technique sets on ``job`` with ``value``."""
    return dict(self.switches(value, job) if callable(self.switches) else self.switches)

  def help(self) -> str:
    """The ``--help`` line: term, summary, exactness."""
    term = f"{self.term}:{self.value}" if self.value else self.term
    return f"  {term:<19} {self.summary}{'' if self.exact else ' [approximate]'}"


def _policy(text: str) -> Callable:
  if text not in policies.READY_MADE:
    raise ValueError(f"the policy must be one of {', '.join(policies.READY_MADE)}")
  return policies.READY_MADE[text]


def _micro_batches(text: str) -> int:
  if not re.fullmatch(r"[0-9]+", text) or int(text) < 1:
    raise ValueError("k must be a positive integer, e.g. adama:4")
  return int(text)


def _conv(text: str) -> str:
  if text not in (Conv.POOLED, Conv.INT8):
    raise ValueError("the convolution must be pooled or int8")
  return text


def _place(text: str) -> str:
  if text not in tuple(Place):
    raise ValueError("the saved layer inputs' place must be device or host, e.g. stream:host")
  return text


def _prefetch(text: str) -> int:
  if text not in ("1", "2"):
    raise ValueError("the layers ahead must be 1 or 2, e.g. prefetch:2")
  return int(text)


def _mlp_chunk(text: str) -> int:
  if text == "off":
    return 0
  if not re.fullmatch(r"[0-9]+", text) or int(text) < 1:
    raise ValueError("the MLP's chunk must be a positive number of tokens or off, e.g. "
                     "mlp-chunk:2048")
  return int(text)


def _elements(text: str) -> int:
  if not re.fullmatch(r"[0-9]+", text) or int(text) < 2**20:
    raise ValueError("the elements a leaf is updated in at once must be an integer of at "
                     "least 1048576 (2^20; smaller slices would keep float32 moments where "
                     "8-bit ones fit, and update whole a leaf whose row is larger), e.g. "
                     "update-slice:67108864")
  return int(text)


def _density(text: str) -> float:
  try:
    density = float(text)
  except ValueError:
    density = 0.0
  if not 0 < density < 1:
    raise ValueError("the density must be a number between 0 and 1, e.g. sparse:0.1")
  return density


_ALL = ("approx", "ms-norm", "attention", "bf16")

TECHNIQUES = {t.term: t for t in (
    Technique("baseline", "plain JAX/Flax: exact GELU/SiLU, LayerNorm/RMSNorm, attention keeping "
              "its probabilities, AdamW"),
    Technique("approx", "ReGELU2/ReSiLU2 keeping 2-bit activation residuals (the transformers)",
              switches={"activation": Activation.APPROX.value},
              lowmem={"activations": Activation.APPROX.value}, exact=False),
    Technique("relu-1bit", "wrn-28-2: ReLU keeping a 1-bit mask of its input's sign, the exact "
              "gradient", switches={"activation": Activation.ONE_BIT.value}),
    Technique("ms-norm", "memory-sharing norms: the norm keeps only its output and 1/sigma "
              "(its scale and bias kept and trained, the gradients recovered from the output)",
              switches={"norm": Norm.MS.value}, lowmem={"norms": Norm.MS.value}),
    Technique("attention", "attention that keeps no L×L residual (lowmem_jax.attention)",
              switches={"attention": Attention.RECOMPUTE.value},
              lowmem={"attention": Attention.RECOMPUTE.value}),
    Technique("bf16", "bfloat16 compute; parameters and optimizer state stay float32",
              switches={"dtype": code.Code(jnp.bfloat16, "jnp.bfloat16")}),
    Technique("remat", "nn.remat of every block with lowmem_jax.compile.policies.<policy>, one of "
              + ", ".join(policies.READY_MADE), value="<policy>", parse=_policy,
              switches=lambda policy, _: {"remat": True, "remat_policy": code.Code(
                  policy, policies.code(policy))}),
    Technique("adama", "AdamA over k micro-batches of the batch, each micro-batch gradient "
              "folded into the moments in its backward rule (lowmem_jax.adamaw, microbatch_step("
              "fold_in_backward=True)); with 8bit, folded in the scan body; on the LLaMA models "
              "the token embedding's gradient buffer is made late (embedding=\"late\", exact)",
              value="<k>", parse=_micro_batches, off=1, exact=False,
              switches=lambda _, job: ({"embedding": Embedding.LATE.value} if job.language_model
                                       else {})),
    Technique("8bit", "optimizer moments block-wise in 8 bits (lowmem_jax.optim.lowbit.adamw_8bit; "
              "with adama, adamaw(state_bits=8))"),
    Technique("offload-opt", "optimizer state in host memory, brought to the device leaf by leaf "
              "(lowmem_jax.optim.offload); with stream, a layer at a time",
              optimizer=lambda tx: code.Call.of("lm.offload.offload_state", tx),
              excludes=(("adama", "AdamA's moments would cross to the device every micro-batch; "
                         "use 8bit for its moments"),)),
    Technique("bf16-params", "bfloat16 parameters with no float32 copy, each update rounded "
              "stochastically (lowmem_jax.optim.lowbit.stochastic_rounding); with 8bit",
              switches={"param_dtype": code.Code(jnp.bfloat16, "jnp.bfloat16")},
              optimizer=lambda tx: code.Call.of("optax.chain", tx, code.Call.of(
                  "lm.lowbit.stochastic_rounding")),
              needs=(("8bit", "Adam keeps its moments in the parameters' dtype, and a bfloat16 "
                      "second moment rounded to nearest stalls; 8bit keeps them in 8 bits, "
                      "rounded stochastically"),)),
    Technique("conv", "wrn-28-2: convolutions that keep their input 2x2-pooled or in int8 "
              "(lowmem_jax.ops.compress)", value="<pooled|int8>", parse=_conv,
              switches=lambda conv, _: {"conv": conv}, exact=False),
    Technique("sparse", "wrn-28-2: the blocks' conv kernels stored sparse at that density, values "
              "and positions, moved every 100 steps (lowmem_jax.optim.sparse.sparse_storage)",
              value="<density>", parse=_density,
              switches=lambda density, _: {"density": density}, exact=False,
              excludes=(("offload-opt", "the moves zero moments on the device"),)),
    Technique("fused-ce", "LLaMA: the head's cross-entropy block by block, no [tokens, vocab] "
              "logits (lowmem_jax.ops.losses.linear_cross_entropy)",
              switches={"loss": Loss.FUSED.value}, lowmem={"loss": Loss.FUSED.value}),
    Technique("ce-one-pass", "LLaMA, with fused-ce: the head's backward in one pass, each "
              "block's logits made once, not twice, for a float32 [tokens, dim] (exact: the "
              "same sums in the same order; linear_cross_entropy's backward_passes=1)",
              switches={"loss": Loss.FUSED_ONE_PASS.value},
              needs=(("fused-ce", "it is the fused head's backward"),)),
    Technique("late-embed", "LLaMA: the token embedding's gradient buffer made when its "
              "cotangent arrives, where XLA may otherwise make it at the start of the backward "
              "(embedding=\"late\", exact); adama sets it",
              switches={"embedding": Embedding.LATE.value}),
    Technique("stream", "LLaMA: the layer-streamed step (lowmem_jax.optim.layer_streamed): the "
              "optimizer applied inside the backward, one layer at a time, so no whole-model "
              "gradient; each layer's saved input on the device or the host; each layer in "
              "two parts (whole-layer: one), the MLP's parameters updated before the "
              "attention's backward; each "
              "layer's MLP over chunks of 1,024 tokens, recomputed chunk by chunk "
              "(mlp_chunk_tokens)",
              value="<device|host>", parse=_place,
              switches=lambda _, job: {"mlp_chunk_tokens": 1024} if job.language_model else {},
              excludes=(("adama", "the streamed step takes one micro-batch a call: measure it "
                         "at the micro-batch's size"),
                        ("remat", "the streamed backward recomputes each layer from its input "
                         "already"))),
    Technique("whole-layer", "with stream: each layer's backward whole, not its attention "
              "half then its MLP half: one forward of the attention half less a layer (the "
              "plain step with full remat's FLOPs), the MLP's parameter gradient held through "
              "the attention's backward (layer_stack's split_layer=False; Llama-3.2-1B's "
              "stream:device step at 2 x 2,048 tokens on the h100: 123.2 ms estimated, 127.0 "
              "in two parts, the same peak; docs/benchmarks.md)",
              needs=(("stream", "only the streamed step takes a layer's backward in parts"),)),
    Technique("part-inputs", "with stream: the forward keeps each layer half's input (the "
              "attention's and the MLP's), not only the layer's, where stream keeps them: the "
              "backward runs the attention half's forward once, not twice, and still updates "
              "the MLP's parameters before the attention's backward (layer_streamed's "
              "keep_part_inputs; one more [batch, length, dim] a layer kept, and one more "
              "brought over; docs/benchmarks.md)",
              needs=(("stream", "only the streamed step keeps a layer's inputs"),),
              excludes=(("whole-layer", "a whole layer is one part: it has no other input "
                         "to keep"),)),
    Technique("mlp-hidden", "with stream, whole-layer and mlp-chunk:off: each layer cut at "
              "its MLP's hidden layer, whose two pre-activations the forward keeps with the "
              "layer's input, where stream keeps them: the backward runs no forward matmul of "
              "the MLP, for two [batch, length, ffn_dim] kept a layer (layer_stack's "
              "split_at_mlp_hidden, layer_streamed's keep_part_inputs; Llama-3.1-8B's "
              "stream:device step at 2 x 2,048 tokens on the h100: 519.4 ms estimated, 552.9 "
              "without, 39.53 GiB compiled peak against 32.53; over the host link, slower: "
              "docs/benchmarks.md)",
              needs=(("stream", "only the streamed step keeps a layer's inputs"),
                     ("whole-layer", "it cuts the whole layer, not its attention half and "
                      "MLP half"))),
    Technique("prefetch", "with stream and offload-opt: how many layers ahead the streamed "
              "step brings the host state over (layer_streamed's prefetch): 1, the default, "
              "holds the least, the read and the write each under part of a layer's "
              "compute; 2 runs both under all of it, for another layer's state on the device "
              "(Llama-3.1-8B: 0.41 GiB)",
              value="<1|2>", parse=_prefetch, off=1,
              needs=(("stream", "only the streamed step brings the state over a layer at a "
                      "time"), ("offload-opt", "the state lives on the device without it"))),
    Technique("fused-update", "with stream, 8bit and bf16-params: each leaf's update one "
              "Pallas kernel that reads and writes each value once, 10 bytes a parameter "
              "(layer_streamed's update_impl=\"pallas\", pallas_kernels.adam8bit; exact: the "
              "chain's step bit for bit with XLA's excess precision off). GPU targets only; on "
              "an H100 slower than XLA's update (Llama-3.1-8B, the state on the device: "
              "694.9 against 657.3 ms), estimated faster on the rtx4090: plan tries it on "
              "GPU targets and picks by the estimate",
              needs=(("stream", "it is the streamed step's update"),
                     ("bf16-params", "the kernel updates bfloat16 parameters with 8-bit "
                      "moments"))),
    Technique("update-slice", "with stream: the most elements of a leaf the streamed step "
              "updates at once, 2^20 or more (layer_streamed's slice_elements; 16777216 = 2^24 "
              "without it); a bigger leaf is updated in slices along its first axis, one "
              "after the other (whole where no such split fits). Bigger slices take "
              "fewer kernels for more temporaries (plan's ladder tries a bigger one: "
              "lowmem_jax.app.fits.EVERY_LEAF)",
              value="<elements>", parse=_elements,
              needs=(("stream", "it is the streamed step's update"),)),
    Technique("mlp-chunk", "LLaMA: each layer's MLP over chunks of at most this many "
              "tokens, recomputed chunk by chunk in the backward (mlp_chunk_tokens; exact: "
              "the weights' gradients summed over the chunks); off: the MLP whole. Over "
              "stream's 1,024 (Llama-3.2-1B's stream:device step, 2 x 2,048 tokens: 151.0 ms "
              "estimated with them, 130.0 whole, the same peak; docs/benchmarks.md)",
              value="<tokens|off>", parse=_mlp_chunk,
              switches=lambda tokens, _: {"mlp_chunk_tokens": tokens or None}),
    Technique("all", "+".join(_ALL), exact=False),
    Technique("lowmem", "a step of your own only: the exact rewrites of lm.lowmem(loss_fn): "
              "memory-sharing norms, attention keeping no L×L residual, the loss head "
              "block by block, GELU/SiLU keeping their input alone (add approx for "
              "ReGELU2/ReSiLU2)",
              lowmem={"activations": Activation.EXACT.value, "norms": Norm.MS.value,
                      "attention": Attention.RECOMPUTE.value, "loss": Loss.FUSED.value}),
)}
"""Every technique by its CLI term."""
DEFAULT = "baseline,approx,ms-norm,attention,approx+ms-norm+attention,bf16,all"
"""The default technique sets of the transformers."""
LANGUAGE_MODEL_EXTRA = ",fused-ce,all+fused-ce"
"""Added to `DEFAULT` for the language models (``fused-ce``)."""
CONV_NET_DEFAULT = "baseline,relu-1bit,conv:pooled,conv:int8,bf16,relu-1bit+conv:int8+bf16"
"""The default technique sets of the WideResNet (batch norm, no attention)."""
LEARNING_RATE = 1e-3
WEIGHT_DECAY = 1e-4  # optax.adamw's default


@dataclasses.dataclass(frozen=True)
class TechniqueSet:
  """One technique set: its techniques by term, with their values (True for a term
  that takes none), in `TECHNIQUES`' order.

  `program` is the step it measures on a reference model, `python` the same step
  printed; a step of the user's own holds ``lowmem`` or nothing.
  """
  label: str
  values: tuple[tuple[str, Any], ...] = ()

  def __contains__(self, term: str) -> bool:
    return any(t == term for t, _ in self.values)

  @property
  def exact(self) -> bool:
    """Whether every technique of the set trains as the plain step does (`Technique.exact`)."""
    return all(TECHNIQUES[t].exact for t, _ in self.values)

  @property
  def approximate(self) -> tuple[str, ...]:
    """The terms of the set that are not `Technique.exact`."""
    return tuple(t for t, _ in self.values if not TECHNIQUES[t].exact)

  def get(self, term: str, default: Any = None) -> Any:
    """The value of ``term`` in the set, else ``default``."""
    return next((v for t, v in self.values if t == term), default)

  @property
  def adama(self) -> int:
    """AdamA's micro-batches a step; 1 without AdamA."""
    return self.get("adama", 1)

  @property
  def fold_in_backward(self) -> bool:
    """AdamA folds in the backward, except with 8-bit moments (folded in the scan body)."""
    return self.adama > 1 and "8bit" not in self

  def switches(self, job) -> dict[str, Any]:
    """`lowmem_jax.models.workload`'s keywords for ``job`` (a reference model's), as
    `code.Code` where a value prints otherwise than its repr."""
    out = _shapes(job)
    for term, value in self.values:
      out.update(TECHNIQUES[term].model_switches(value, job))
    return out

  def check(self, job) -> None:
    """Raises `TechniqueError` where a technique does not apply to ``job``'s model (the
    models' own check of its switches), the set lacks a technique one needs or holds
    one another excludes, or the model refuses ``job``'s shapes."""
    try:
      _workload(job.model, _shapes(job))
      refused = None
    except ValueError as e:  # a shape the model refuses, e.g. BERT's seq > 512
      refused = e
    for term, value in self.values if refused is None else ():
      try:
        _workload(job.model, {**_shapes(job), **TECHNIQUES[term].model_switches(value, job)})
      except ValueError as e:
        raise TechniqueError(f"{self.text(term)} in {self.label!r}: {e}") from e
    self.check_together()
    if refused is not None:
      raise TechniqueError(f"{self.label!r}: {refused}") from refused
    if "mlp-chunk" in self and not job.language_model:
      raise TechniqueError(f"{self.text('mlp-chunk')} in {self.label!r}: it sets the LLaMA "
                           f"models' MLP chunks; {job.model} is not one.")
    if "stream" in self and not job.language_model:
      raise TechniqueError(f"{self.text('stream')} in {self.label!r}: the layer-streamed step "
                           f"takes the LLaMA models' stacked layers; {job.model} is not one.")
    if "fused-update" in self and job.target.platform != "cuda":
      raise TechniqueError(f"fused-update in {self.label!r}: its kernel is Triton's, for a GPU "
                           f"target (h100, rtx4090, ...); target {job.target.name} is not one.")

  def check_together(self) -> None:
    """Raises `TechniqueError` where the set lacks a technique one needs or holds one
    another excludes."""
    for term, _ in self.values:
      technique = TECHNIQUES[term]
      for other, why in technique.needs:
        if other not in self:
          raise TechniqueError(f"{self.label!r}: {term} needs {other}: {why}.")
      for other, why in technique.excludes:
        if other in self:
          raise TechniqueError(f"{self.label!r}: {term} does not take {other}: {why}.")
    if "mlp-hidden" in self and self.get("mlp-chunk") != 0:
      raise TechniqueError(f"{self.label!r}: mlp-hidden needs mlp-chunk:off: it keeps each "
                           "layer's MLP hidden layer whole.")

  def with_value(self, term: str, value: Any) -> "TechniqueSet":
    """The set with ``term`` at ``value``, its label saying so (``...+remat:dots``)."""
    values = dict(self.values, **{term: value})
    label = "+".join(t for t in self.label.split("+") if t.partition(":")[0] != term
                     and t != "baseline")
    shown = policies.describe(value) if term == "remat" else value
    return TechniqueSet("+".join(filter(None, (label, f"{term}:{shown}"))),
                        tuple((t, values[t]) for t in TECHNIQUES if t in values))

  def step_options(self) -> dict[str, Any]:
    """The `lowmem_jax.app.step_options.STEP_OPTIONS` this set passes to a user's
    ``make_step``, as `code` expressions (the defaults left out); `code.value` makes each."""
    out = {}
    lowmem = {}
    for t, _ in self.values:  # the first technique to set an option wins: approx over lowmem's
      for k, v in TECHNIQUES[t].lowmem.items():
        lowmem.setdefault(k, v)
    if lowmem:
      defaults = {k: p.default for k, p in inspect.signature(transform.lowmem).parameters.items()
                  if p.kind is p.KEYWORD_ONLY}
      given = {k: lowmem.get(k) for k in defaults if lowmem.get(k) != defaults[k]}
      out["lowmem"] = (code.Call.of("functools.partial", code.Name("lm.lowmem"), **given)
                       if given else code.Name("lm.lowmem"))
    if "bf16" in self:
      out["dtype"] = code.Code(jnp.bfloat16, "jnp.bfloat16")
    if "remat" in self:
      policy = self.get("remat")
      out["policy"] = code.Code(policy, policies.code(policy))
    if self.adama > 1:
      bits = {"state_bits": 8} if "8bit" in self else {}
      out["adamw"] = code.Call.of("functools.partial", code.Name("lm.adamaw"), k=self.adama,
                                  **bits)
      out["micro_batches"] = self.adama
    elif "8bit" in self:
      out["adamw"] = code.Name("lm.lowbit.adamw_8bit")
    if "bf16-params" in self:
      out["param_dtype"] = code.Code(jnp.bfloat16, "jnp.bfloat16")
    tx = code.Name("tx")
    for term, _ in self.values:
      if TECHNIQUES[term].optimizer is not None:
        tx = TECHNIQUES[term].optimizer(tx)
    if tx != code.Name("tx"):
      out["optimizer"] = code.Lambda("tx", tx)
    return out

  def text(self, term: str) -> str:
    """How ``term`` is written in the label (``"remat:full"``), or its name where the
    label gives it through ``all``."""
    return next((t.strip() for t in self.label.split("+") if t.strip().partition(":")[0] == term),
                term)

  def workload(self, job) -> models.Workload:
    """The reference workload of ``job`` with this set's switches."""
    self.check(job)
    return _workload(job.model, self.switches(job))

  def _adamw_code(self) -> code.Call:
    """`adamw`'s call; its AdamA rule is the program's ``fold``."""
    if self.adama > 1:
      bits = {"state_bits": 8} if "8bit" in self else {}
      tx = code.Call.of("lm.adamaw", LEARNING_RATE, code.Name("fold"), **bits)
    elif "8bit" in self:
      bf16 = {"bfloat16_params": True} if "fused-update" in self else {}
      tx = code.Call.of("lm.lowbit.adamw_8bit", LEARNING_RATE, weight_decay=WEIGHT_DECAY, **bf16)
    else:
      tx = code.Call.of("optax.adamw", LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    for term, _ in self.values:
      wrapped = {"offload-opt": "stream" in self, "bf16-params": "fused-update" in self}
      if TECHNIQUES[term].optimizer is not None and not wrapped.get(term):
        tx = TECHNIQUES[term].optimizer(tx)
    return tx

  def adamw(self) -> optax.GradientTransformation:
    """AdamW (`LEARNING_RATE`, `WEIGHT_DECAY`) as the set has it: AdamA, 8-bit,
    offloaded, bfloat16 parameters rounded stochastically (a sparse workload wraps it
    in `lowmem_jax.models.Workload.optimizer`)."""
    return code.Program(self._fold() + (("tx", self._adamw_code(), ""),)).run()["tx"]

  def _fold(self) -> tuple:
    if self.adama == 1:
      return ()
    return (("fold", code.Call.of("lm.MomentFold", self.adama),
             "AdamA's rule, for the optimizer and the step"),)

  def program(self, job) -> code.Program:
    """The assignments ``wl`` (the workload), ``fold`` (with AdamA), ``tx`` and ``step``
    (jitted, parameters and state donated) of this set's training step of ``job``."""
    self.check(job)
    tx = self._adamw_code()
    if "sparse" in self:
      tx = code.Call.of("wl.optimizer", tx)
    fold = (code.Name("fold"),) if self.adama > 1 else ()
    in_backward = {"fold_in_backward": True} if self.fold_in_backward else {}
    streamed = ()
    if "stream" in self:
      fsdp = {"gather_params": True} if job.devices > 1 else {}
      streamed = (("streamed", code.Call.of(
          "lm.optim.layer_streamed", code.Call.of(
              "wl.layer_stack", **({"split_layer": False} if "whole-layer" in self else {}),
              **({"split_at_mlp_hidden": True} if "mlp-hidden" in self else {})),
          code.Name("tx"),
          state="host" if "offload-opt" in self else "device", saved_inputs=self.get("stream"),
          **fsdp, **({"prefetch": self.get("prefetch")} if "prefetch" in self else {}),
          **({"slice_elements": self.get("update-slice")} if "update-slice" in self else {}),
          **({"update_impl": "pallas"} if "fused-update" in self else {}),
          **({"keep_part_inputs": True} if "part-inputs" in self or "mlp-hidden" in self
             else {})),
          "the optimizer inside the backward, a layer at a time"),)
      train_step = code.Name("streamed.step")
    else:
      train_step = code.Call.of("wl.train_step", code.Name("tx"), *fold, **in_backward)
    step = code.Call.of("jax.jit", train_step, donate_argnums=(0, 1), **self._jit_options(job))
    return code.Program((("wl", code.Call.of("lm.models.workload", job.model,
                                             **self.switches(job)), ""),
                         *self._fold(), ("tx", tx, ""), *streamed, ("step", step, "")))

  def compiler_options(self) -> dict:
    """The XLA options the step is jitted with: `targets.HOST_TRANSFER_OPTIONS` for a
    layer-streamed step moving rows to and from the host, else none."""
    if "stream" not in self or not ("offload-opt" in self or self.get("stream") == "host"):
      return {}
    return dict(targets.HOST_TRANSFER_OPTIONS)

  def _jit_options(self, job) -> dict:
    """`compiler_options` (or ``job.compiler_options``) as ``jax.jit``'s keyword, written out
    in the printed code."""
    options = self.compiler_options() if job.compiler_options is None else job.compiler_options
    text = ", ".join(f"{json.dumps(k)}: " + (json.dumps(v) if isinstance(v, str) else repr(v))
                     for k, v in options.items())
    return {"compiler_options": code.Code(options, "{" + text + "}")} if options else {}

  def python(self, job) -> str:
    """`program`'s lines, then the parameters and optimizer state it starts from; for a
    step of the user's own, the call of ``make_step`` with `step_options`."""
    if job.make_step is not None:
      name = getattr(job.make_step, "__name__", "make_step")
      return code.Program((("step, args, *loss", code.Call(name, (), tuple(
          self.step_options().items())), ""),)).source()
    init = "streamed.init" if "stream" in self else "tx.init"
    start = (("params", code.Call.of("wl.init", code.Call.of("jax.random.key", 0)), ""),
             ("opt_state", code.Call.of(init, code.Name("params")), ""))
    if "stream" in self or "offload-opt" in self:  # its outputs are committed: so its inputs
      start += (("params, opt_state", code.Call.of(
          "lm.offload.committed", (code.Name("params"), code.Name("opt_state"))),
          "committed, or the second step compiles again"),)
    return code.Program(self.program(job).lines + start).source()


def _shapes(job) -> dict[str, Any]:
  """`lowmem_jax.models.workload`'s batch, size and compute dtype keywords for ``job``."""
  size = {"seq": job.seq} if job.sequences else {"image": job.image_side}
  return {"batch": job.batch, **size, "dtype": code.Code(jnp.dtype(job.dtype), f"jnp.{job.dtype}")}


def _workload(model: str, switches: dict) -> models.Workload:
  return models.workload(model, **{k: v.value if isinstance(v, code.Code) else v
                                   for k, v in switches.items()})


def parse(text: str, step: bool = False) -> TechniqueSet:
  """The `TechniqueSet` of ``"all+remat:full+adama:4"``, or for a user's step
  (``step``) of `STEP_TECHNIQUES` (``"lowmem+approx+8bit"``); `TechniqueError`
  naming the term on a mistake."""
  values, given = {}, set()
  for term in text.strip().split("+"):
    name, colon, value = term.strip().partition(":")
    if name in given:
      raise TechniqueError(f"{name} is given twice in {text!r}; give each technique once.")
    given.add(name)
    technique = TECHNIQUES.get(name)
    if step and name not in STEP_TECHNIQUES:
      what = "applies only to the reference models (--model)" if technique else "is unknown"
      raise TechniqueError(f"technique {term.strip()!r} in {text!r} {what}; with a step of your "
                           f"own (--step), choose from {', '.join(STEP_TECHNIQUES)}.")
    if technique is not None and technique.value and not colon:
      raise TechniqueError(f"{name} in {text!r} takes a value: {name}:{technique.value}.")
    if technique is None or bool(colon) != bool(technique.value):
      raise TechniqueError(f"unknown technique {term.strip()!r} in {text!r}; choose from "
                           f"{', '.join(TECHNIQUES)}.")
    if name == "lowmem" and not step:
      raise TechniqueError(f"technique 'lowmem' in {text!r} applies only to --step (a step of "
                           "your own); a reference model takes approx, relu-1bit, ms-norm, "
                           "attention or all.")
    if technique.parse is not None:
      try:
        values[name] = technique.parse(value)
      except ValueError as e:
        raise TechniqueError(f"{term.strip()}: {e}.") from e
      if values[name] == technique.off:
        del values[name]
    elif name == "all":
      values.update(dict.fromkeys(_ALL, True))
    elif name != "baseline":
      values[name] = True
  return TechniqueSet(text.strip(), tuple((t, values[t]) for t in TECHNIQUES if t in values))


def describe(x: Any) -> str:
  """What ``x`` is, for an error: its type, and a tuple's or list's length."""
  kind = type(x).__name__
  return f"a {kind} of {len(x)}" if isinstance(x, (tuple, list)) else f"a {kind}"
