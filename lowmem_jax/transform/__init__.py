"""`lowmem`: the project's techniques applied to a function's jaxpr.

A model the user already has (plain JAX, Flax linen or NNX, equinox) traces to
a jaxpr. `lowmem(fn)` traces ``fn``, finds the patterns below in the jaxpr and
evaluates it again with each pattern replaced by the project's own op, whose
forward is the same function (to float tolerance) and whose backward keeps
less (LowMemoryBP, Yang et al., ICML 2024, arXiv:2406.16282; Rabe & Staats
2021 for attention):

- ``activations``: an elementwise function of one array that equals, on a grid
  of test points, ReLU (→ `relu`, a 1-bit mask, exact), and GELU (erf or
  tanh) or SiLU: by default its own ops under `jax.checkpoint` (their input
  kept, the rest recomputed: exact); with ``activations="approx"`` `regelu2`
  (the tanh GELU with its exact forward) or `resilu2`, whose 2-bit backward
  is the one rewrite that changes the gradient. Every other rewrite keeps it,
  to float tolerance.
- ``norms``: LayerNorm / RMSNorm (mean and variance, ``jnp.var`` with
  ``ddof=0``, or E[x²] − E[x]²; times ``rsqrt`` or over ``sqrt``; optional scale
  ``g`` and bias ``b`` on the last axis) → `ms_layer_norm` / `ms_rms_norm`. Each
  linear map it feeds (a ``dot_general`` contracting the feature axis, through
  reshapes and casts) gets the affine folded in inside the step:
  ``y @ (g[:, None] * W) + b @ W`` forward, and a backward that recomputes the
  activation-sized ``y * g + b`` from ``y``, so the norm and the matmul save one
  array, no weight-sized product is kept or made in the backward, and the
  parameter tree does not change. Other consumers get ``y * g + b``.
- ``attention``: ``dot_general(q, k)`` → optional scalar scale, additive bias,
  ``where`` mask → softmax over keys → optional dropout (``p * keep / keep_prob``
  as flax's ``dot_product_attention_weights`` writes it, or ``where(keep, p /
  keep_prob, 0)`` as ``flax.linen.Dropout`` does, ``keep`` drawn from a key by
  ``random_bits``) → optional per-head factor (Hugging Face's head mask, as
  ``einsum("...hqk,h->...hqk", p, m)`` or ``p * m[:, None, None]``: it multiplies
  the output instead) → ``dot_general(p, v)``, in any layout that transposes and
  unit axes reach, grouped-query heads included (a group axis right after the
  kv-head axis, as ``jax.nn.dot_product_attention`` writes them) →
  `lowmem_jax.attention`, whose backward draws the keep-mask again from the key.
  A mask that is an ``and`` of parts (through casts, ``x > 0`` and broadcasts,
  as Hugging Face's Flax models combine theirs) is not saved whole: its constant
  parts (iotas, comparisons), evaluated at trace time, become ``is_causal``
  where they are the causal mask; each other part is passed at its own size (a
  ``[B, L]`` padding mask as ``[B, 1, 1, L]``). A mask the function is given
  whole (a ``[B, 1, L, L]`` argument) cannot be seen to be causal at trace time:
  it is kept once, as given, not per layer.
- ``loss``: ``h @ w`` (optionally ``+ bias``; ``w`` ``[d, V]``, or a tied
  ``[V, d]`` table contracted on its second axis or written ``table.T``), then
  slices and reshapes of the token axes that keep the vocabulary axis whole
  (Hugging Face's shift after the head, ``logits[:, :-1]``, ``.reshape(-1, V)``,
  a ``dynamic_slice`` at constant starts), its log-softmax over the last axis
  (``jax.nn.log_softmax``, or ``jax.nn.logsumexp`` less the label's logit as
  ``optax.softmax_cross_entropy_with_integer_labels`` writes it) taken at
  integer labels (``take_along_axis``), or summed against their one-hot
  (``optax.softmax_cross_entropy(l, jax.nn.one_hot(labels, V))``, as Hugging
  Face's ``run_clm_flax.py`` writes it) → `losses.linear_cross_entropy` on ``h``
  sliced as the logits were, where the vocabulary is wider than ``h``, so the
  logits are the larger array. A slice of the vocabulary axis is left.
- ``"layout"`` (with attention): a matmul whose input is the attention output
  ``[.., h, d]`` only reshaped to ``[.., h * d]`` contracts over ``(h, d)``
  instead, so autodiff saves one array, not two.

Nested jaxprs are rewritten too: ``jit`` calls are inlined (so a pattern may
span them), ``scan``, ``cond`` and ``jax.checkpoint`` are rebuilt around their
rewritten bodies (policies keep working). ``custom_jvp`` and ``custom_vjp``
functions keep their own derivative rules and are left as they are, except
`jax.nn.relu`. What the matchers miss: layout redundancies other than the
attention output's, grouped queries laid out group-major (``[.., G, K, ..]``),
a dropout whose keep-mask is not drawn by ``random_bits`` from a key, and
masks combined by ``or`` or negated, or captured as a constant of the traced
function (kept as given, not seen to be causal). A jaxpr
rewrite sees hand-written code as well as framework modules; Qwix's approach
(intercepting framework calls by module path) sees only the modules it knows.

The package, by job: `api` (`lowmem`, `OPTIONS`, `MATCHERS`), `rewrites` (the
`Rewrites` a trace gives and the `Pass` that collects them), `interpreter`
(the one jaxpr evaluator, a rule for each primitive whose nested jaxprs it
rewrites too), `graph` (producers, consumers and values of a jaxpr, shared by
the matchers; the walks themselves are `lowmem_jax._jaxpr`'s), and a matcher
per pattern: `activations`, `norms`, `loss`, and the package `attention` (a
module per step of its pattern). Names shared across the package's modules
have no leading underscore; a module's own helpers have one.
"""

from lowmem_jax.transform.api import MATCHERS, OPTIONS, lowmem
from lowmem_jax.transform.rewrites import Rewrite, Rewrites

__all__ = ["MATCHERS", "OPTIONS", "Rewrite", "Rewrites", "lowmem"]
