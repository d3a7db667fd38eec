"""`lowmem_jax.optim.move_schedule`: when both sparse formats move their positions."""

import jax.numpy as jnp
import pytest

from lowmem_jax.optim.move_schedule import MoveSchedule


def test_moves_are_due_every_update_every_steps_until_stop_after():
  schedule = MoveSchedule.checked(3, 0.25, 7)
  due = [bool(schedule.due(jnp.int32(t))) for t in range(1, 10)]
  assert due == [False, False, True, False, False, True, False, False, False]
  endless = MoveSchedule.checked(3, 0.25, None)
  assert bool(endless.due(jnp.int32(300)))
  assert schedule.moves(10) == 2 and schedule.ever(10) and not schedule.ever(1)  # 0.25 rounds to 0
  assert not MoveSchedule.checked(3, 0.25, 0).ever(10)


@pytest.mark.parametrize("args,match", [
    ((0, 0.2, None), "`update_every` must be a positive int, got 0"),
    ((1.5, 0.2, None), "`update_every` must be a positive int"),
    ((1, 1.0, None), r"`prune_fraction` must be a number in \[0, 1\), got 1.0"),
    ((1, 0.2, -1), "`stop_after` must be None or an int >= 0, got -1"),
])
def test_bad_arguments_are_named(args, match):
  with pytest.raises(ValueError, match=match):
    MoveSchedule.checked(*args)
