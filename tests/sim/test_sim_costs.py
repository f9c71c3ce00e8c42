"""The cost model: uniform specs, profiles, stage graphs and plans."""

from __future__ import annotations

import math

import pytest

from pipeoptim.errors import PlanError
from pipeoptim.plan.graph import stage_graph, stage_graph_to_dict
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.plan.profile import Profile
from pipeoptim.sim.costs import CostModel, parse_uniform


def test_parse_uniform() -> None:
    assert parse_uniform("1,2") == (1.0, 2.0, 0.0)
    assert parse_uniform(" 0.5, 1.5 ,0.1") == (0.5, 1.5, 0.1)
    for bad in ("1", "1,2,3,4", "a,b", "-1,2", "1,inf"):
        with pytest.raises(PlanError, match="--uniform"):
            parse_uniform(bad)


@pytest.mark.parametrize(
    ("family", "factor"), [("sgd", 1), ("adam", 2), ("adamw", 2), ("rmsprop", 1)]
)
def test_uniform_optimizer_state(family: str, factor: int) -> None:
    costs = CostModel.uniform(3, 1.0, 2.0, 0.5, param_bytes=1000, optimizer=family)
    assert costs.optimizer_state_bytes == (factor * 1000,) * 3
    assert costs.grad_bytes == (1000,) * 3
    assert costs.update_s == (0.5,) * 3
    assert costs.bottleneck_s() == 3.5


def test_transfer_time_is_latency_plus_bytes_over_bandwidth() -> None:
    costs = CostModel.uniform(3, activation_bytes=2000, latency_s=0.25, bandwidth=1000.0)
    assert costs.transfer_s(0) == 0.25 + 2.0
    assert costs.transfer_s(1, backward=True) == 0.25 + 2.0
    free = CostModel.uniform(3, activation_bytes=2000)
    assert free.transfer_s(0) == 0.0
    assert costs.with_links(latency_s=0.0, bandwidth=math.inf).transfer_s(0) == 0.0


def test_validation_errors() -> None:
    with pytest.raises(PlanError, match="num_stages >= 1"):
        CostModel.uniform(0)
    base = CostModel.uniform(2)
    with pytest.raises(PlanError, match="one value per stage"):
        base.__class__(**{**base.__dict__, "forward_s": (1.0, 2.0, 3.0)})
    with pytest.raises(PlanError, match=">= 0"):
        base.__class__(**{**base.__dict__, "backward_s": (1.0, -2.0)})
    with pytest.raises(PlanError, match="bandwidth must be > 0"):
        base.__class__(**{**base.__dict__, "bandwidth": (0.0,)})


def _profile() -> Profile:
    return Profile.from_costs(
        forward_s=[1.0, 2.0, 3.0, 4.0],
        backward_s=[2.0, 4.0, 6.0, 8.0],
        activation_bytes=[40, 80, 120, 160],
        param_bytes=[100, 200, 300, 400],
        optimizer="adam",
        batch_size=8,
    )


def test_from_profile_sums_layers_and_scales_to_micro_batches() -> None:
    costs = CostModel.from_profile(_profile(), [(0, 1), (1, 4)], micro_batches=4)
    # the profile's batch is one mini-batch of 8 samples: a micro-batch has 2 samples
    assert costs.forward_s == (0.25, 9.0 / 4)
    assert costs.backward_s == (0.5, 18.0 / 4)
    assert costs.param_bytes == (100, 900)
    assert costs.optimizer_state_bytes == (200, 1800)  # adam: 2x params
    assert costs.activation_bytes == (10, 90)
    assert costs.send_forward_bytes == (10,)  # stage 0's last layer output, per micro-batch
    assert costs.samples_per_micro_batch == 2.0
    sgd = CostModel.from_profile(_profile(), [(0, 2), (2, 4)], 1, optimizer="sgd")
    assert sgd.optimizer_state_bytes == (300, 700)
    bigger = CostModel.from_profile(_profile(), [(0, 2), (2, 4)], 2, batch_size=32)
    assert bigger.forward_s == (3.0 * 2, 7.0 * 2)  # 16 samples per micro-batch, profile had 8
    with pytest.raises(PlanError):
        CostModel.from_profile(_profile(), [(0, 1), (2, 4)])


def test_from_stage_graph_and_plan() -> None:
    profile = _profile()
    graph = stage_graph(profile, [(0, 2), (2, 4)])
    costs = CostModel.from_stage_graph(graph, 2)
    assert costs == CostModel.from_profile(profile, [(0, 2), (2, 4)], 2)
    plan = Plan(
        "1f1b",
        2,
        micro_batches=2,
        optimizer=OptimizerSpec("adam"),
        boundaries=[(0, 2), (2, 4)],
        stage_graph=stage_graph_to_dict(graph),
    )
    assert CostModel.from_plan(plan) == costs
    bare = Plan("1f1b", 2, micro_batches=2, boundaries=[(0, 3), (3, 4)])
    with pytest.raises(PlanError, match="no stage graph"):
        CostModel.from_plan(bare)
    cut = CostModel.from_plan(bare, profile)
    assert cut.forward_s == (6.0 / 2, 4.0 / 2)
    assert cut.optimizer == "sgd"  # the plan's optimizer family wins over the profile's
