"""Per-layer weight-gradient shares in the profile and per-stage I/W splits in the cost
model: old files load, exact arithmetic through from_profile/from_stage_graph, bad values
refused, and both engines equal with a per-stage split."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipeoptim.errors import PlanError
from pipeoptim.plan.graph import stage_graph, stage_graph_from_dict, stage_graph_to_dict
from pipeoptim.plan.methods import WeightPolicy
from pipeoptim.plan.profile import LayerProfile, Profile
from pipeoptim.plan.zero_bubble import zb_h1
from pipeoptim.sim import CostModel, Program, evaluate_program, run_simpy


def _profile() -> Profile:
    """Backwards 4, 4, 8 s with W shares 1/4, 0 (a ReLU), 3/4: W = 1, 0, 6 s."""
    base = Profile.from_costs([1.0, 1.0, 2.0], [4.0, 4.0, 8.0], [8, 8, 8], [4, 0, 4])
    shares = (0.25, 0.0, 0.75)
    layers = tuple(
        dataclasses.replace(layer, weight_grad_fraction=share)
        for layer, share in zip(base.layers, shares, strict=True)
    )
    return dataclasses.replace(base, layers=layers)


def test_old_profile_file_without_the_share_loads_with_half(tmp_path: Path) -> None:
    data = _profile().to_dict()
    assert [raw["weight_grad_fraction"] for raw in data["layers"]] == [0.25, 0.0, 0.75]
    for raw in data["layers"]:
        del raw["weight_grad_fraction"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    old = Profile.load(path)
    assert [layer.weight_grad_fraction for layer in old.layers] == [0.5, 0.5, 0.5]
    # a default profile splits every stage in half, as before
    costs = CostModel.from_profile(old, [(0, 2), (2, 3)])
    assert costs.weight_grad_fraction == (0.5, 0.5)
    assert costs.backward_weight_s == costs.backward_input_s == (4.0, 4.0)


def test_saved_share_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "new.json"
    _profile().save(path)
    assert Profile.load(path) == _profile()


def test_cost_model_from_profile_carries_the_per_stage_split() -> None:
    profile = _profile()
    bounds = [(0, 2), (2, 3)]
    # stage 0: backward 4 + 4 = 8, W = 1 + 0 -> 1/8; stage 1: backward 8, W = 6 -> 3/4
    # two micro-batches halve the times: B = 4, 4; W = 0.5, 3; I = 3.5, 1
    costs = CostModel.from_profile(profile, bounds, micro_batches=2)
    assert costs.weight_grad_fraction == (0.125, 0.75)
    assert costs.backward_s == (4.0, 4.0)
    assert costs.backward_weight_s == (0.5, 3.0)
    assert costs.backward_input_s == (3.5, 1.0)
    # the stage graph (and a plan file's copy of it) carries the same split
    graph = stage_graph(profile, bounds)
    assert [graph.nodes[k]["weight_grad_s"] for k in (0, 1)] == [1.0, 6.0]
    again = CostModel.from_stage_graph(stage_graph_from_dict(stage_graph_to_dict(graph)), 2)
    assert again.weight_grad_fraction == (0.125, 0.75)
    assert again.backward_weight_s == (0.5, 3.0)
    # a stage graph written before the split existed halves the backward
    old = stage_graph_to_dict(graph)
    for stage in old["stages"]:
        del stage["weight_grad_s"]
    assert CostModel.from_stage_graph(stage_graph_from_dict(old)).weight_grad_fraction == (
        0.5,
        0.5,
    )
    # an explicit share overrides the profile's
    forced = CostModel.from_profile(profile, bounds, weight_grad_fraction=0.5)
    assert forced.weight_grad_fraction == (0.5, 0.5)


def test_a_single_number_is_expanded_and_uniform_accepts_per_stage() -> None:
    assert (
        CostModel.uniform(3, 1.0, 4.0, weight_grad_fraction=0.25).weight_grad_fraction
        == (0.25,) * 3
    )
    costs = CostModel.uniform(2, 1.0, 4.0, weight_grad_fraction=(0.25, 0.75))
    assert costs.backward_weight_s == (1.0, 3.0)
    assert costs.backward_input_s == (3.0, 1.0)


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (1.5, ["stage 0", "[0, 1]", "1.5", "e.g. 0.5"]),
        ((0.2, -0.1), ["stage 1", "[0, 1]", "-0.1", "e.g. 0.5"]),
        ((0.2, 0.3, 0.4), ["one value per stage", "3 values", "for 2 stages", "list of 2"]),
        ("half", ["[0, 1]", "'half'", "e.g. 0.5"]),
    ],
)
def test_bad_cost_model_shares_are_refused(bad: object, words: list[str]) -> None:
    with pytest.raises(PlanError, match="weight_grad_fraction") as info:
        CostModel.uniform(2, weight_grad_fraction=bad)  # type: ignore[arg-type]
    for word in words:
        assert word in str(info.value)
    with pytest.raises(PlanError, match="weight_grad_fraction"):
        dataclasses.replace(CostModel.uniform(2), weight_grad_fraction=bad)


@pytest.mark.parametrize("bad", [-0.5, 1.01, float("nan"), True])
def test_bad_layer_shares_are_refused(bad: object, tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=r"weight_grad_fraction must be a number in \[0, 1\]"):
        LayerProfile("x", 1.0, 2.0, 0, 0, 0, 0, weight_grad_fraction=bad)  # type: ignore[arg-type]
    if isinstance(bad, float) and bad == bad:  # JSON has no NaN
        data = _profile().to_dict()
        data["layers"][0]["weight_grad_fraction"] = bad
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(data), encoding="utf-8")
        with pytest.raises(PlanError, match="weight_grad_fraction") as info:
            Profile.load(path)
        assert "pipeoptim profile" in str(info.value)


def test_engines_equal_with_a_per_stage_split() -> None:
    stages, m = 3, 4
    base = CostModel.uniform(stages, 1.0, 2.0, 0.5, activation_bytes=100, bandwidth=1e4)
    costs = dataclasses.replace(base, weight_grad_fraction=(0.2, 0.5, 0.9), latency_s=(0.05,) * 2)
    program = Program(zb_h1(stages, m, 1), m, WeightPolicy.FLUSH)
    durations, transfers = program.durations(costs), program.transfer_times(costs)
    simpy = run_simpy(program, durations, transfers, contention=False)
    fast = evaluate_program(program, costs, keep_timing=True)
    assert fast.timing is not None
    assert simpy.starts == fast.timing.starts and simpy.ends == fast.timing.ends
    even = evaluate_program(program, dataclasses.replace(costs, weight_grad_fraction=0.5))
    assert fast.makespan != even.makespan  # the per-stage split reaches the schedule
