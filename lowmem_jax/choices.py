"""Every choice a switch of the library takes, declared once as a `str` Enum.

The reference models' switches (`lowmem_jax.models.workload`), `lowmem_jax.lowmem`'s
options, the layer-streamed step's places and the ``lowmem-jax`` command's technique
registry read these. A value is checked once where it enters (`checked`: a clear
ValueError naming the argument); code below receives the Enum member, which is a `str`
equal to its value (``Norm.MS == "ms"``), so a user may pass either. "Off" is spelled
one way: ``"plain"``, the layer as written.
"""

import enum
from typing import Any, TypeVar


class Activation(enum.StrEnum):
  """What an activation keeps for its backward."""
  EXACT = "exact"  # the activation as written, its exact gradient (`lowmem`: recomputed exactly)
  APPROX = "approx"  # GELU/SiLU with ReGELU2/ReSiLU2's 2-bit backward (arXiv:2406.16282): another gradient
  ONE_BIT = "1bit"  # ReLU keeping a 1-bit mask of its input's sign: the exact gradient (the WideResNet)
  PLAIN = "plain"  # `lowmem` only: the activations left as they are, not rewritten


class Norm(enum.StrEnum):
  """Which norm a transformer takes."""
  PLAIN = "plain"  # LayerNorm / RMSNorm as written
  MS = "ms"  # memory-sharing norms: output shared with the next matmul, affine kept (arXiv:2406.16282)


class Attention(enum.StrEnum):
  """What a softmax attention keeps for its backward."""
  PLAIN = "plain"  # as written: the L×L probabilities kept
  RECOMPUTE = "recompute"  # `lowmem_jax.attention`: no L×L residual, recomputed by key blocks


class Loss(enum.StrEnum):
  """A language model's head and loss."""
  PLAIN = "plain"  # float32 logits, then the cross-entropy
  FUSED = "fused"  # `lowmem_jax.ops.losses.linear_cross_entropy`: no [tokens, vocab] logits kept
  FUSED_ONE_PASS = "fused-one-pass"  # the same, its backward in one pass (backward_passes=1)


class Embedding(enum.StrEnum):
  """When a language model's embedding gradient buffer is made."""
  PLAIN = "plain"  # with the rest of the gradient
  LATE = "late"  # when needed: outside AdamA's micro-batch loop


class Conv(enum.StrEnum):
  """What the WideResNet's convolutions keep for their backward."""
  PLAIN = "plain"  # their input, as written
  POOLED = "pooled"  # their input pooled 2×2 (another gradient)
  INT8 = "int8"  # their input in 8 bits (another gradient)


class Place(enum.StrEnum):
  """Where an array lives between uses."""
  DEVICE = "device"  # the accelerator's memory
  HOST = "host"  # pinned host memory, brought over when used


E = TypeVar("E", bound=enum.StrEnum)


def checked(kind: type[E], value: Any, name: str, allowed: tuple[E, ...] | None = None,
            none: E | None = None) -> E:
  """``value`` as a member of ``kind`` (a member or its string), or a ValueError naming the
  argument ``name`` and the values ``allowed`` (default: all of ``kind``); None is read as
  ``none`` where one is given."""
  if value is None and none is not None:
    return none
  allowed = tuple(kind) if allowed is None else allowed
  if isinstance(value, str) and value in allowed:
    return kind(value)
  raise ValueError(f"{name} must be one of {tuple(a.value for a in allowed)}, got {value!r}.")
