"""Data order is a function of (seed, epoch, index) only; a step's samples ignore the world size."""

from __future__ import annotations

import numpy as np
import pytest

from broker.runtime.data import epoch_permutation, sample_indices, step_plan
from broker.runtime.scaling import lr_factor


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("micro", [None, 4])
def test_a_step_holds_the_same_samples_at_any_world_size(world: int, micro: int | None) -> None:
    n, batch, done = 50, 24, 40  # this step crosses from epoch 0 into epoch 1
    plans = [step_plan(7, n, done, batch, world, r, micro) for r in range(world)]
    got = np.concatenate([mb.indices for plan in plans for mb in plan])
    assert np.array_equal(got, sample_indices(7, n, done, done + batch))
    assert sum(mb.weight for plan in plans for mb in plan) == pytest.approx(1.0)
    assert all(plan[-1].last and not any(mb.last for mb in plan[:-1]) for plan in plans)
    if micro:
        assert all(len(mb.indices) <= micro for plan in plans for mb in plan)


@pytest.mark.parametrize(
    ("batch", "world", "micro"), [(10, 3, 3), (10, 3, 1), (24, 5, 4), (2, 3, 2)]
)
def test_even_plans_give_every_rank_the_same_number_of_micro_batches(
    batch: int, world: int, micro: int
) -> None:
    """FSDP's forward and backward are collectives: a rank short of samples pads, weight 0."""
    plans = [step_plan(7, 50, 0, batch, world, r, micro, pad=True, even=True) for r in range(world)]
    assert len({len(plan) for plan in plans}) == 1
    real = [mb for plan in plans for mb in plan if mb.weight]
    assert np.array_equal(
        np.concatenate([mb.indices for mb in real]), sample_indices(7, 50, 0, batch)
    )
    assert sum(mb.weight for mb in real) == pytest.approx(1.0)
    assert all(len(mb.indices) <= micro for mb in real)
    assert all(plan[-1].last and not any(mb.last for mb in plan[:-1]) for plan in plans)


def test_epochs_are_permutations_fixed_by_seed_and_epoch() -> None:
    first = sample_indices(3, 10, 0, 10)
    assert sorted(first) == list(range(10))
    assert np.array_equal(sample_indices(3, 10, 10, 20), epoch_permutation(3, 1, 10))
    assert not np.array_equal(first, sample_indices(3, 10, 10, 20))
    assert not np.array_equal(first, sample_indices(4, 10, 0, 10))


def test_a_batch_smaller_than_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match="smaller than the world size 3"):
        step_plan(0, 10, 0, 2, 3, 0, None)


def test_lr_rules() -> None:
    assert lr_factor("linear", 256, 64) == 4
    assert lr_factor("sqrt", 256, 64) == 2
    assert lr_factor("none", 256, 64) == 1
    with pytest.raises(ValueError, match="use one of linear, sqrt, none"):
        lr_factor("cubic", 2, 1)
