"""plan --memory-cap prices recomputation as the runtime runs it (issue 64 item 6): a run of
consecutive recomputed units is one region that keeps only its input, so a ReLU or a Flatten
after a layer is worth recomputing with it, though alone it frees nothing.

What would break: pricing each unit alone, which leaves those units out and reports a
smallest possible peak above what full recomputation of the same partition holds.
"""

from __future__ import annotations

import pytest

from pipeoptim.plan.memory_factors import method_holds_weights, method_memory_factors
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.partition import min_memory_partition
from pipeoptim.plan.partition_cost import evaluate_partition
from pipeoptim.plan.profile import Profile
from pipeoptim.planning import per_unit_profile
from pipeoptim.planning.memory_fit import smallest_reach
from pipeoptim.workloads.profiling import profile_builtin


@pytest.fixture(scope="module")
def cnn() -> Profile:
    return profile_builtin("cnn", batch_size=32, repeats=1)


@pytest.mark.parametrize(("method", "stages"), [("1f1b", 2), ("gpipe", 3), ("pipeoptim", 2)])
def test_the_smallest_peak_is_at_most_full_recomputation_of_its_partition(
    cnn: Profile, method: str, stages: int
) -> None:
    m = stages if get_method(method).micro_batched else 1
    unit = per_unit_profile(cnn, m)
    reach = smallest_reach(unit, get_method(method), stages, m, 1)
    factors = method_memory_factors(method, stages, m)
    hold = method_holds_weights(method, stages)
    best = min_memory_partition(
        unit, stages, memory_factors=factors, recompute_stages=[True] * stages, hold_weights=hold
    )
    full = [frozenset(range(end - start)) for start, end in best.boundaries]
    everything = evaluate_partition(
        unit, best.boundaries, memory_factors=factors, recompute=full, hold_weights=hold
    )
    assert reach <= everything.peak_memory_bytes
    # and the search's own figure is the model's for the sets it chose
    again = evaluate_partition(
        unit,
        best.boundaries,
        memory_factors=factors,
        recompute=list(best.recompute),
        hold_weights=hold,
    )
    assert again.stage_memory == best.stage_memory


def test_a_relu_after_a_layer_joins_its_region() -> None:
    """Linear 4X -> ReLU 4X -> Linear X: alone the ReLU frees nothing (keeps what it takes
    in), in one region with the layer before it frees its whole output."""
    x = 2**20
    profile = Profile.from_costs(
        forward_s=[0.01] * 3,
        backward_s=[0.02] * 3,
        activation_bytes=[4 * x, 4 * x, x],
        param_bytes=[1024] * 3,
        names=["up:Linear", "act:ReLU", "down:Linear"],
        batch_size=8,
        meta={"input_shape": [8, x // 32], "input_dtype": "torch.float32"},
    )
    best = min_memory_partition(profile, 1, recompute_stages=[True])
    assert best.recompute == (frozenset({0, 1, 2}),)
    plain = evaluate_partition(profile, best.boundaries)
    assert best.peak_memory_bytes == plain.peak_memory_bytes - 9 * x + x
