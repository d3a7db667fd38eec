"""When a sparse model's active positions move: every ``update_every`` steps, until
``stop_after``, ``prune_fraction`` of them a move. One schedule read by both sparse
formats, `lowmem_jax.optim.masked_sparsity` (masks) and `lowmem_jax.optim.sparse`
(stored values and positions)."""

from typing import NamedTuple

import jax

from lowmem_jax._checks import is_int, is_real


class MoveSchedule(NamedTuple):
  """The schedule of the moves (`checked` builds one from a user's arguments)."""
  update_every: int  # optimizer steps between moves, >= 1
  prune_fraction: float  # the share of the active positions moved per move, in [0, 1)
  stop_after: int | None  # no move after this many steps; None: no end

  @classmethod
  def checked(cls, update_every, prune_fraction, stop_after) -> "MoveSchedule":
    """The schedule, or a ValueError naming the argument out of range."""
    if not (is_int(update_every) and update_every >= 1):
      raise ValueError(f"`update_every` must be a positive int, got {update_every!r}.")
    if not (is_real(prune_fraction) and 0 <= prune_fraction < 1):
      raise ValueError(f"`prune_fraction` must be a number in [0, 1), got {prune_fraction!r}.")
    if not (stop_after is None or is_int(stop_after) and stop_after >= 0):
      raise ValueError(f"`stop_after` must be None or an int >= 0, got {stop_after!r}.")
    return cls(int(update_every), float(prune_fraction), stop_after)

  def moves(self, active: int) -> int:
    """How many of ``active`` positions a move moves."""
    return round(self.prune_fraction * active)

  def ever(self, active: int) -> bool:
    """Whether any move of ``active`` positions is made at all (else none is compiled)."""
    return self.moves(active) > 0 and self.stop_after != 0

  def due(self, count: jax.Array) -> jax.Array:
    """Whether step ``count`` (counted from 1, an int32 scalar) ends with a move."""
    due = count % self.update_every == 0
    return due if self.stop_after is None else due & (count <= self.stop_after)
