"""How many mini-batches the demo's real runs train: a time budget of the slower one."""

from __future__ import annotations

import math

import pytest

from pipeoptim.demo.options import Sizes, sizes_for


def _sizes(low: int | None = 120, high: int = 600, budget: float = 4.0) -> Sizes:
    return Sizes(
        profile_repeats=1,
        train_steps=high,
        converge_steps=1,
        eval_every=1,
        train_min_steps=low,
        train_budget_s=budget,
    )


def test_the_budget_sets_the_steps_between_the_bounds() -> None:
    sizes = _sizes()
    # 4 s at 3,200 samples/s in mini-batches of 32: 400 mini-batches
    assert sizes.train_steps_for(3_200.0, 32) == 400
    assert sizes.train_steps_for(3_201.0, 32) == 401  # rounded up: at least the budget
    assert sizes.train_steps_for(100.0, 32) == 120  # a slow model: the fewest
    assert sizes.train_steps_for(1e9, 32) == 600  # a fast one: the most


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan, math.inf])
def test_a_rate_with_no_prediction_trains_the_fewest(rate: float) -> None:
    assert _sizes().train_steps_for(rate, 32) == 120


def test_without_a_lower_bound_the_count_is_fixed() -> None:
    sizes = _sizes(low=None, high=16)
    assert {sizes.train_steps_for(r, 32) for r in (1.0, 3_200.0, 1e9)} == {16}


def test_the_default_demo_trains_seconds_and_quick_a_fixed_count() -> None:
    default = sizes_for("mlp", quick=False)
    assert default.train_steps_for(4_000.0, 32) == 500  # the MLP's 1F1B on 2 cores
    assert sizes_for("mlp", quick=True).train_steps_for(4_000.0, 32) == 16
    assert sizes_for("gpt", quick=False).train_steps_for(4_000.0, 32) == 30
