"""Remat policies over named residuals: what `jax.checkpoint` keeps for backward.

Gradient checkpointing trades recompute for activation memory (Chen et al.
2016, arXiv:1604.06174; one of the techniques of Sohoni et al., "Low-Memory
Neural Network Training", arXiv:1904.10631). A policy is a plain callable
``policy(prim, *avals, **params)`` that `jax.checkpoint`, `flax.linen.remat`,
`nn.scan` over a remat'd module and `nnx.remat` accept. Autodiff asks it about
each equation of the forward pass and it answers True (keep the output on the
device), False (recompute it in the backward pass) or
`jax.ad_checkpoint.Offloadable` (copy it to host memory and back).

The policies here decide by `checkpoint_name` (the vocabulary is
`lowmem_jax.names`, which refuses an unknown name: register a model's own with
`lowmem_jax.names.register`); every value without a chosen name is recomputed.
``save_all_but`` ranges over the named values too, not over every value (it
is JAX's ``save_any_names_but_these``): a policy sees one equation at a time,
so refusing a name only moves the save to the input of the tag, which is the
very same array. This is why JAX 0.10.2's ``save_anything_except_these_names``
is a stub that saves everything.

Ready-made policies:

* `everything`: keep every value: the residuals of the step without remat.
* `full`: keep nothing; the backward recomputes the block from its inputs.
* `minimal`: keep the outputs of matmuls without batch dimensions (the weight
  matmuls), recompute attention's batched matmuls and elementwise work.
* `dots`: keep the outputs of every matmul and convolution.
* `compressed`: keep only the compressed residuals (`names.ACT_CODE`, the
  packed activation codes, and `names.NORM_RSTD`, one float32 per row).

Example:
  >>> import jax, jax.numpy as jnp, lowmem_jax as lm
  >>> from jax.ad_checkpoint import checkpoint_name
  >>> def mlp(x, w):
  ...   h = checkpoint_name(x @ w, lm.names.MLP_HIDDEN)
  ...   return jnp.sum(jnp.sin(h) @ w.T)
  >>> f = jax.checkpoint(mlp, policy=lm.policies.save_only(lm.names.MLP_HIDDEN))
  >>> x = w = jnp.ones((4, 4))
  >>> lm.memory.saved_residuals(f, x, w).by_name()
  {'mlp_hidden': 64}
"""

import dataclasses
from typing import Callable

import jax
from jax.ad_checkpoint import Offloadable, Recompute, Saveable

from lowmem_jax import names as _names

# JAX's remat places any other memory kind ("unpinned_host") in device memory:
# an offload there would be a silent device-to-device copy.
MEMORY_KINDS = ("device", "pinned_host")


def _listed(names: frozenset[str]) -> str:
  return ", ".join(repr(n) for n in _names.ordered(names))


def _tag(prim, params) -> str | None:
  """The name of a `checkpoint_name` equation, else None."""
  return params["name"] if prim.name == "name" else None


class _JaxPolicy:
  """A policy that decides as the closure a JAX factory makes (`_decide`, built from the
  fields), as a frozen dataclass: hashable, compared by its fields, printed as the call
  that made it. JAX's own policies are closures from jax 0.11 (classes up to 0.10)."""

  def _decide(self) -> Callable:
    raise NotImplementedError

  def __post_init__(self):
    object.__setattr__(self, "_decision", self._decide())

  def __call__(self, prim, *args, **params):
    return self._decision(prim, *args, **params)

  def __reduce__(self):  # the closure does not pickle: the fields make it again
    return type(self), dataclasses.astuple(self)


@dataclasses.dataclass(frozen=True)
class SaveOnly(_JaxPolicy):
  """Keeps the values tagged with ``saveable_names``; recomputes the rest (JAX's
  ``save_only_these_names``)."""
  saveable_names: frozenset[str]

  def _decide(self):
    return jax.checkpoint_policies.save_only_these_names(*self.saveable_names)

  def __str__(self) -> str:
    return f"save_only({_listed(self.saveable_names)})"


@dataclasses.dataclass(frozen=True)
class SaveAllBut(_JaxPolicy):
  """Keeps every tagged value except those tagged with ``names``; recomputes the rest
  (JAX's ``save_any_names_but_these``)."""
  names: frozenset[str]

  def _decide(self):
    return jax.checkpoint_policies.save_any_names_but_these(*self.names)

  def __str__(self) -> str:
    return f"save_all_but({_listed(self.names)})"


@dataclasses.dataclass(frozen=True)
class Offload(_JaxPolicy):
  """Copies the values tagged with ``names`` from ``src`` to ``dst`` memory; recomputes the
  rest (JAX's ``save_and_offload_only_these_names`` with nothing saved)."""
  names: frozenset[str]
  src: str
  dst: str

  def _decide(self):
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=self.names,
        offload_src=self.src, offload_dst=self.dst)

  def __str__(self) -> str:
    return f"offload({_listed(self.names)}, src={self.src!r}, dst={self.dst!r})"


@dataclasses.dataclass(frozen=True)
class Combine:
  """The union of ``policies``: keep if one keeps, offload if one offloads, else recompute;
  a value one policy keeps and another offloads is an error."""
  policies: tuple

  def __call__(self, prim, *args, **params):
    decisions = [policy(prim, *args, **params) for policy in self.policies]
    offloads = [d for d in decisions if isinstance(d, Offloadable)]
    if any(d is True or d is Saveable for d in decisions):
      if offloads:
        raise ValueError(f"{self}: one policy keeps the value {_tag(prim, params) or prim.name!r} "
                         "on the device and another offloads it; choose one (JAX's "
                         "save_and_offload_only_these_names refuses the same).")
      return Saveable
    return offloads[0] if offloads else Recompute

  def __str__(self) -> str:
    return f"combine({', '.join(describe(p) for p in self.policies)})"


def save_only(*names: str) -> SaveOnly:
  """Keeps only the values tagged with ``names``; ``save_only()`` keeps nothing.

  Decides as JAX's ``save_only_these_names``, after checking the names.
  """
  return SaveOnly(_names.check(names, "save_only"))


def save_all_but(*names: str) -> SaveAllBut:
  """Keeps every tagged value except those tagged with ``names``; recomputes the rest.

  Decides as JAX's ``save_any_names_but_these``, after checking the names.
  """
  return SaveAllBut(_names.check(names, "save_all_but"))


def offload(*names: str, src: str = "device", dst: str = "pinned_host") -> Offload:
  """Moves the values tagged with ``names`` to host memory for the backward pass.

  On a GPU or TPU the compiled step copies them to ``dst`` after the forward
  pass and back before their use in the backward pass. On CPU the device
  memory is host memory: the lowering drops the copies and the values stay
  where they are, exactly as `save_only` keeps them.

  Args:
    *names: checkpoint names to offload; every other value is recomputed.
    src, dst: memory kinds, from `MEMORY_KINDS`, and different.
  """
  for arg, kind in (("src", src), ("dst", dst)):
    if kind not in MEMORY_KINDS:
      raise ValueError(f"offload: {arg} must be one of {MEMORY_KINDS}, got {kind!r}.")
  if src == dst:
    raise ValueError(f"offload: src and dst must differ, both are {src!r}.")
  return Offload(_names.check(names, "offload"), src, dst)


def kept_names(policy) -> frozenset[str] | None:
  """The names a `save_only` policy keeps; None for any other policy."""
  return policy.saveable_names if isinstance(policy, SaveOnly) else None


def combine(*policies) -> Combine:
  """The union of ``policies``: a value is kept if any policy keeps it.

  Example: ``combine(minimal, offload(names.BLOCK_IN))`` keeps the weight
  matmuls' outputs on the device and the block inputs on the host.
  """
  if not policies:
    raise ValueError("combine: give at least one policy.")
  for policy in policies:
    if not callable(policy):
      raise TypeError(f"combine: each policy must be callable, got {policy!r}.")
  saved = set().union(*(p.saveable_names for p in policies if isinstance(p, SaveOnly)))
  offloaded = set().union(*(p.names for p in policies if isinstance(p, Offload)))
  if saved & offloaded:
    raise ValueError(f"combine: {_listed(frozenset(saved & offloaded))} both kept on the device "
                     "(save_only) and offloaded; choose one.")
  return Combine(tuple(policies))


everything = jax.checkpoint_policies.everything_saveable
full = save_only()
minimal = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
dots = jax.checkpoint_policies.dots_saveable
compressed = save_only(_names.ACT_CODE, _names.NORM_RSTD)

READY_MADE = {"everything": everything, "full": full, "minimal": minimal, "dots": dots,
              "compressed": compressed}


def code(policy) -> str:
  """Python that makes ``policy`` where ``lowmem_jax`` is imported as ``lm``: its factory's
  call (`describe`), or its class's where it names what the vocabulary does not (a step's
  own names, which `lowmem_jax.plan` keeps unchecked: the factory would refuse them)."""
  names = getattr(policy, "saveable_names", None) or getattr(policy, "names", None) or ()
  if set(names) <= _names.known():
    return f"lm.policies.{describe(policy)}"
  return f"lm.policies.{policy!r}"


def describe(policy) -> str:
  """A readable name: the ready-made name, the factory call, or the repr."""
  for name, ready in READY_MADE.items():
    if policy is ready or (isinstance(policy, SaveOnly) and policy == ready):
      return name
  return str(policy)
