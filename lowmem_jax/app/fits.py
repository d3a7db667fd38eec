"""The ladder of technique sets, cheapest recompute first, and the first that fits a
budget (``lowmem-jax plan``)."""

from typing import Callable, NamedTuple

import jax

from lowmem_jax.app.job import Job
from lowmem_jax.app.measurement import device_argument_bytes, measure, user_step
from lowmem_jax.app.techniques import TechniqueError, TechniqueSet, parse
from lowmem_jax.compile import planner
from lowmem_jax.ops.token_chunks import mlp_chunks
from lowmem_jax.optim.streamed import SLICE_ELEMENTS


EVERY_LEAF = f"+update-slice:{2 ** 30}"
"""The device-state rung's: 2^30 elements, every leaf of Llama-3.1-8B updated whole, its head
and embedding (525M) too. Its ``stream:device+mlp-chunk:off`` step at 2 x 2,048 tokens on the
``h100`` target: 606.6 ms and 32.87 GiB estimated, against 610.9 ms at 2^26 and 665.8 ms and
32.44 GiB at the default 2^24 (jax 0.11.2; docs/benchmarks.md, session 47)."""


FUSED = "+fused-update"
"""The rung a GPU target's ladder adds after each `_FUSED_AFTER` rung (`ladder_of`): each
leaf's 8-bit update one Pallas kernel (`lowmem_jax.optim.fused_update`). Measured slower than
XLA's update on an H100 (Llama-3.1-8B, the state on the device: 694.9 ms against 657.3;
docs/benchmarks.md, session 40), estimated faster on the ``rtx4090`` target (Llama-3.1-8B at
2 x 2,048 tokens, the state on the host: 2,466.0 ms against 2,633.7, both at a 16.99 GiB
compiled peak; jax 0.12.0.1; docs/benchmarks.md, session 53): the estimate picks."""
_FUSED_AFTER = "+offload-opt+part-inputs+mlp-chunk:off"


def ladder(batch: int | None, language_model: bool = False, step: bool = False) -> list[str]:
  """Technique sets `cheapest_fit` tries, in order: the exact ones (`TechniqueSet.exact`:
  training as the plain step's up to rounding), then those that are not, tried only where
  no exact set fits: the same with the approximate activations (``approx``: ReGELU2/ReSiLU2),
  then AdamA over micro-batches (``adama``, whose second moment is a micro-batch sum).

  Each, cheapest recompute first: the exact rewrites (bfloat16 compute, memory-sharing
  norms, attention keeping no L×L residual), then the optimizer state in fewer bits
  (8-bit moments, bfloat16 parameters), then recompute (``remat:plan``:
  `lowmem_jax.plan`'s policy); a language model's then the layer-streamed step, its fused
  head's backward in one pass (``ce-one-pass``: before the layers' loop, which holds the
  peak; Llama-3.1-8B at 2 x 2,048 tokens 1.6% faster on the ``rtx4090`` target at the same
  peak, 2% on the ``h100`` for 0.09 GiB; not in the whole-tree rungs, whose peak it raises
  0.95 GiB there). Its saved inputs on the device, each layer's MLP whole
  (``mlp-chunk:off``: Llama-3.1-8B's step at 2 x 2,048 tokens on the ``h100`` target 4%
  faster at the same peak), first with bigger update slices (`EVERY_LEAF`: every leaf of a
  Llama 3 whole), first of all with each layer's backward whole (``whole-layer``: one
  attention forward less a layer, the MLP's gradient held through the attention's
  backward), first of all with the MLP's hidden layer kept too (``mlp-hidden``: no forward
  matmul of the MLP in the backward; Llama-3.1-8B at 2 x 2,048 tokens on the ``h100``
  target 519.4 ms and a 39.53 GiB compiled peak against 552.9 ms and 32.53), then over
  chunks of 1,024 tokens (``stream``'s own: less memory for many tokens); its saved inputs
  on the host, then with ``late-embed`` (it lowers some rows' peaks and raises others': XLA's
  schedule); then its state on the host too: a layer ahead
  with each MLP whole and each layer half's input kept (``part-inputs``: one attention forward
  less a layer, the layer still in two parts; Llama-3.1-8B at 2 x 2,048 tokens on the
  ``rtx4090`` target 2,564.9 ms and 16.99 GiB, against 2,655.9 ms and 16.85 GiB without it
  and 2,599.9 ms and 17.46 GiB in the update slices of 2^26 elements this rung had before, in
  session 51; on a GPU target then with `FUSED`, `ladder_of`;
  on the ``h100`` the two-ahead rung next is faster at 17.65 GiB), then brought over two layers
  ahead, each layer's backward and MLP whole (in two banks the rows' reads and writes hide
  under the whole layer: Llama-3.1-8B at 2 x 2,048 tokens on the ``h100`` target 730.9 ms
  and 17.65 GiB against 790.3 ms and 17.84 GiB split and over chunks), then one, then one
  with each MLP whole (Llama-3.1-8B at 2 x 2,048 tokens on the ``rtx4090`` target: 0.23 GiB
  less than over chunks, 4% slower: XLA hides the rows' transfers under the chunks'
  loops). Any other model's state on the host. Last,
  micro-batches with full remat (k a power of 2 dividing ``batch``; 2, 4 and 8 for a
  ``step`` of the user's own, whose batch is its own). A language model's sets all take
  ``fused-ce`` (the largest single saving), after it alone. A user's ``step`` has the same
  ladder in its terms: ``lowmem`` for the exact rewrites."""
  exact = "bf16+lowmem" if step else "bf16+ms-norm+attention"
  approximate = "bf16+lowmem+approx" if step else "all"  # all: approx and the exact rewrites
  head = "+fused-ce" if language_model else ""
  ks = (2, 4, 8) if step else [2**i for i in range(1, batch.bit_length()) if batch % 2**i == 0]

  def rungs(best: str) -> list[str]:
    state = f"{best}+8bit+bf16-params"
    sets = [best, f"{best}+8bit", state, f"{state}+remat:plan"]
    if language_model:
      streamed = f"{state}+ce-one-pass+stream"
      return sets + [f"{streamed}:device+whole-layer+mlp-hidden+mlp-chunk:off{EVERY_LEAF}",
                     f"{streamed}:device+whole-layer+mlp-chunk:off{EVERY_LEAF}",
                     f"{streamed}:device+mlp-chunk:off{EVERY_LEAF}",
                     f"{streamed}:device+mlp-chunk:off", f"{streamed}:device",
                     f"{streamed}:host", f"{streamed}:host+late-embed",
                     f"{streamed}:host+offload-opt+part-inputs+mlp-chunk:off",
                     f"{streamed}:host+offload-opt+prefetch:2+whole-layer+mlp-chunk:off",
                     f"{streamed}:host+offload-opt",
                     f"{streamed}:host+offload-opt+mlp-chunk:off"]
    return sets + [f"{state}+offload-opt"]

  micro = lambda best: [f"{best}+8bit+bf16-params+remat:full+adama:{k}" for k in ks]
  return (["baseline"] + (["fused-ce"] if language_model else []) + [f"bf16{head}"]
          + rungs(f"{exact}{head}") + rungs(f"{approximate}{head}")
          + micro(f"{exact}{head}") + micro(f"{approximate}{head}"))


def ladder_of(job: Job) -> tuple[list[str], tuple[str, ...]]:
  """``(sets, left out)``: `ladder` for ``job``, over several devices without the sets that
  hold state in host memory (``offload-opt``: such a step compiles for one device); on a GPU
  target with each `_FUSED_AFTER` set's `FUSED` twin after it (the kernel is Triton's); without
  a set that compiles another one's program: the bigger slices' term (`EVERY_LEAF`) where no
  parameter leaf holds more than the default slice (`_over_default_slice`; of two rungs then
  the same, the later kept), and the later of two streamed sets that differ in
  ``mlp-chunk:off`` alone where the stream's MLP runs in one chunk (`_one_chunk`). For a
  user's step, each set without the techniques whose options ``make_step`` does not take
  (`Job.without_missing`), once, and those techniques."""
  texts = ladder(job.batch, job.language_model, step=job.make_step is not None)
  if job.make_step is None:
    texts = [t for t in texts if job.devices == 1 or "offload-opt" not in t]
    bigger = [t for t in texts if EVERY_LEAF in t]
    if bigger and not _over_default_slice(job, parse(bigger[0])):
      texts = [t.replace(EVERY_LEAF, "") for t in texts]
      texts = [t for k, t in enumerate(texts) if t not in texts[k + 1:]]
    if job.target.platform == "cuda":
      texts = [u for t in texts for u in ([t, t + FUSED] if t.endswith(_FUSED_AFTER) else [t])]
    chunked = next((t for t in texts if "+stream:" in t and "mlp-chunk" not in t), None)
    if chunked and _one_chunk(job, parse(chunked)):
      first = {}  # each set by its text without mlp-chunk:off, the first in ladder order
      for t in texts:
        first.setdefault(t.replace("+mlp-chunk:off", ""), t)
      texts = list(first.values())
    return texts, ()
  reduced = [job.without_missing(t) for t in texts]
  return (list(dict.fromkeys(t for t, _ in reduced)),
          tuple(dict.fromkeys(term for _, left in reduced for term in left)))


def _over_default_slice(job: Job, techniques: TechniqueSet) -> bool:
  """Whether a leaf of ``job``'s parameters (a stack of layers' leaves as one) holds more
  than `SLICE_ELEMENTS`, the streamed step's default update slice. Where none does, every
  leaf is updated whole under every slice size of `SLICE_ELEMENTS` or more, so an
  `EVERY_LEAF` rung compiles the program of the same set without it. (A stack over the bound
  whose layers are within it keeps the rungs: a compile more, never one less.)"""
  params = techniques.workload(job).abstract_params()
  return any(x.size > SLICE_ELEMENTS for x in jax.tree.leaves(params))


def _one_chunk(job: Job, techniques: TechniqueSet) -> bool:
  """Whether streamed set ``techniques`` (no ``mlp-chunk`` term) runs each layer's MLP of
  ``job`` in one chunk of tokens (`lowmem_jax.ops.token_chunks.mlp_chunks`: batch x seq
  within the chunk; over a mesh too, where a chunk holds whole positions of every sequence):
  then the set and the same set with ``mlp-chunk:off`` trace to the same step."""
  chunk_tokens = techniques.switches(job).get("mlp_chunk_tokens")
  return mlp_chunks(job.batch * job.seq, chunk_tokens) == 1


def _before_plan(text: str) -> str:
  """Set ``text`` without its ``remat:plan`` term (``baseline`` where it is the only one: a
  user's step that takes ``policy`` alone)."""
  return "+".join(t for t in text.split("+") if t != "remat:plan") or "baseline"


def planned(job: Job, text: str, budget: int) -> TechniqueSet | None:
  """The set ``text``; for ``remat:plan`` with the policy `lowmem_jax.plan` picks
  for ``budget`` bytes, or None where no policy fits. A user's step is compiled
  donating its first two arguments (the parameters and optimizer state) as the
  planner weighs the policies."""
  step = job.make_step is not None
  if "remat:plan" not in text:
    return parse(text, step=step)
  techniques = parse(_before_plan(text), step=step)
  if step:
    _, args, _, _ = user_step(job, techniques)
    donated = (0, 1)[:len(args)]

    def train_step(*args, policy):
      return user_step(job, techniques.with_value("remat", policy))[0](*args)
  else:
    wl = techniques.workload(job)
    params = wl.abstract_params()
    tx = techniques.adamw()
    args = job.shard(params, jax.eval_shape(tx.init, params), (wl.inputs, wl.labels))
    donated = (0, 1)

    def train_step(params, opt_state, batch, *, policy):
      new_params, new_state, metrics = wl.with_policy(policy).train_step(
          tx, techniques.adama)(params, opt_state, batch)
      if job.devices == 1:
        return new_params, new_state, metrics
      like = lambda new, old: jax.tree.map(  # sharded as the old, which they replace
          lambda n, o: jax.lax.with_sharding_constraint(n, o.sharding), new, old)
      return like(new_params, args[0]), like(new_state, args[1]), metrics
  try:
    with job.compiling():
      chosen = planner.plan(train_step, *args, budget=budget, donate_argnums=donated,
                            target=job.target)
  except planner.BudgetError:
    return None
  return techniques.with_value("remat", chosen.policy)


class Fit(NamedTuple):
  """What `cheapest_fit` found.

  Attributes:
    tried: ``(breakdown, techniques)`` of each set measured, in ladder order: the
      approximate sets only where no exact one fits (`ladder`).
    fits: of the sets whose compiled peak fits, the fastest by the estimated step time
      (``objective="time"``; ladder order among equals, a set without an estimate after those
      with one) or the first (``objective="memory"``); None where none fits.
    fixed_bytes: the least any set of the ladder holds on the device in its arguments
      (parameters, optimizer state, batch); nothing is measured where it exceeds the budget.
    skipped: ``(text, bytes)`` of each set not compiled because its arguments alone on the
      device exceed the budget, in ladder order.
    not_taken: the techniques left out of a user's step's ladder (`Job.without_missing`),
      as its sets write them.
    objective: what ``fits`` was chosen by.
    budget: the bytes the sets had to fit.
    unplanned: each ``remat:plan`` set tried for which no remat policy fits the budget
      (compiled, not measured), in ladder order.
  """
  tried: list
  fits: TechniqueSet | None
  fixed_bytes: int
  skipped: list
  not_taken: tuple = ()
  objective: str = "time"
  budget: int = 0
  unplanned: list | tuple = ()

  @property
  def fitting(self) -> list:
    """``(breakdown, techniques)`` of each set tried whose compiled peak fits, ladder order."""
    return [(b, t) for b, t in self.tried if b.stats.peak_bytes <= self.budget]


OBJECTIVES = ("time", "memory")
"""What `cheapest_fit` picks by: the estimated step time, or the ladder's order."""


def cheapest_fit(job: Job, budget: int, on_try: Callable[[str], None] = lambda text: None,
                 objective: str = "time") -> Fit:
  """Measures the sets of `ladder` for ``job`` in order, and picks of those whose compiled
  peak is at most ``budget`` bytes the fastest by the estimated step time
  (``objective="time"``: every exact set is measured) or the first (``objective="memory"``:
  up to the first that fits); the approximate sets are measured only where no exact set
  fits. ``on_try(text)`` is called before each. A set whose arguments alone
  on the device exceed the budget (`device_argument_bytes`, a reference model's) is skipped
  without compiling; a user's step's sets go without the techniques whose options
  ``make_step`` does not take (`Job.without_missing`), each set once. The ladder is the
  transformers' (ms-norm, attention), or a user's step's: not the WideResNet's."""
  if objective not in OBJECTIVES:
    raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}.")
  if job.conv_net:
    raise TechniqueError(f"the ladder is the transformers' (ms-norm, attention); {job.model} "
                         "takes measure() of chosen sets instead.")
  step = job.make_step is not None
  texts, not_taken = ladder_of(job)
  arguments = {} if step else {
      text: device_argument_bytes(job, parse(_before_plan(text))) for text in texts}
  floor = min(arguments.values(), default=0)
  tried, skipped, unplanned = [], [], []
  fit = Fit(tried, None, floor, skipped, not_taken, objective, budget, unplanned)
  if floor > budget:
    return fit
  exact_fits = False
  for text in texts:
    exact = parse(_before_plan(text), step=step).exact
    if exact_fits and not exact:
      break  # an exact set fits: the sets that are not exact are not tried
    if arguments.get(text, 0) > budget:
      skipped.append((text, arguments[text]))
      continue
    on_try(text)
    techniques = planned(job, text, budget)
    if techniques is None:
      unplanned.append(text)
      continue
    tried.append((measure(job, techniques), techniques))
    exact_fits = exact_fits or (exact and tried[-1][0].stats.peak_bytes <= budget)
    if objective == "memory" and fit.fitting:
      break
  fitting = fit.fitting
  if not fitting:
    return fit
  fastest = min(range(len(fitting)), key=lambda k: (
      fitting[k][0].step_time is None,
      fitting[k][0].step_time.seconds if fitting[k][0].step_time else 0.0, k))
  return fit._replace(fits=fitting[0 if objective == "memory" else fastest][1])
