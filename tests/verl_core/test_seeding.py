"""derive_seed: deterministic, in range, and no collisions where the old arithmetic mixers collided."""

from __future__ import annotations

import pytest

from verl_core.seeding import derive_seed


def test_deterministic_and_in_range() -> None:
    assert derive_seed("minibatch", 1, 0) == derive_seed("minibatch", 1, 0)
    assert 0 <= derive_seed("x", 2**40, -3) < 2**63


def test_old_collisions_are_gone() -> None:
    # seed + iteration: seed 1 / iteration 1 and seed 2 / iteration 0 both gave 2
    assert 1 + 1 == 2 + 0
    assert derive_seed("update", 1, 1) != derive_seed("update", 2, 0)
    # seed·7919 + epoch: (seed 0, epoch 7919) and (seed 1, epoch 0) both gave 7919
    assert derive_seed("minibatch", 0, 7919) != derive_seed("minibatch", 1, 0)
    # the same numbers for two uses are two streams; parts do not run together; "1" is not 1
    assert derive_seed("rollout", 1, 0) != derive_seed("validate", 1, 0)
    assert derive_seed(1, 23) != derive_seed(12, 3)
    assert derive_seed("1") != derive_seed(1)


def test_integer_types_do_not_matter() -> None:
    import numpy as np

    assert derive_seed("x", np.int64(3), True) == derive_seed("x", 3, 1)


def test_no_collisions_over_a_grid() -> None:
    seeds = {derive_seed("update", s, i) for s in range(50) for i in range(200)}
    assert len(seeds) == 50 * 200


def test_needs_a_part() -> None:
    with pytest.raises(ValueError, match="at least one part"):
        derive_seed()
