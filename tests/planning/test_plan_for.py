"""plan_for, the one entry of plan search: the stages and devices variants give the plan
`pipeoptim plan` writes, the method is resolved once, and a bad request says what is wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import pipeoptim.planning.candidate as candidate_module
from pipeoptim.cli import main
from pipeoptim.errors import PlanError
from pipeoptim.plan.methods import RANKED_BY_DEFAULT, get_method
from pipeoptim.plan.plan import Plan
from pipeoptim.plan.profile import Profile
from pipeoptim.planning import (
    Candidate,
    PlanLimits,
    plan_for,
    plan_from_candidate,
    search,
    search_devices,
)
from pipeoptim.sim.collectives import Cluster


def uneven(num_layers: int = 12) -> Profile:
    fwd = [0.01 * (1 + (i % 4)) for i in range(num_layers)]
    return Profile.from_costs(
        fwd,
        [2 * f for f in fwd],
        [1_000_000] * num_layers,
        [4_000_000] * num_layers,
        batch_size=32,
    )


def written_plan(tmp_path: Path, profile: Profile, flags: list[str]) -> dict[str, Any]:
    """The plan file `pipeoptim plan` writes for ``profile`` with ``flags``."""
    source, out = tmp_path / "profile.json", tmp_path / "plan.json"
    profile.save(source)
    assert main(["plan", "--profile", str(source), *flags, "--out", str(out)]) == 0
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def as_json(plan: Plan) -> dict[str, Any]:
    """``plan`` as its file holds it (boundaries as lists)."""
    data: dict[str, Any] = json.loads(json.dumps(plan.to_dict()))
    return data


def test_the_stages_variant_gives_the_plan_the_command_writes(tmp_path: Path) -> None:
    profile = uneven()
    choice = plan_for(profile, stages=4)
    expected = written_plan(tmp_path, profile, ["--stages", "4"])
    assert as_json(choice.plan) == expected
    assert list(as_json(choice.plan)["notes"]) == list(expected["notes"])  # same order
    assert choice.best is choice.ranked[0] and choice.why == expected["notes"]["why"]
    assert [c.method for c in choice.ranked] == [c.method for c in search(profile, 4)]
    plan, ranked = choice
    assert plan is choice.plan and ranked is choice.ranked


def test_one_method_at_a_given_count_gives_the_plan_the_command_writes(tmp_path: Path) -> None:
    profile = uneven()
    limits = PlanLimits(micro_batches=8, optimizer="adam", lr=0.001, memory_cap_bytes=2**30)
    choice = plan_for(profile, stages=4, method="1f1b", limits=limits)
    flags = ["--stages", "4", "--method", "1f1b", "--micro-batches", "8"]
    flags += ["--optimizer", "adam", "--lr", "0.001", "--memory-cap", "1GiB"]
    assert as_json(choice.plan) == written_plan(tmp_path, profile, flags)
    assert [(c.method, c.micro_batches) for c in choice.ranked] == [("1f1b", 8)]


def test_the_devices_variant_gives_the_plan_the_command_writes(tmp_path: Path) -> None:
    profile = uneven()
    cluster = Cluster(25e9, 1e-5, gpus_per_node=2, inter_node_bandwidth=1e9)
    limits = PlanLimits(cluster=cluster, batch_size=64)
    choice = plan_for(profile, devices=4, limits=limits)
    flags = ["--devices", "4", "--bandwidth", "25GB/s", "--latency", "1e-5"]
    flags += ["--gpus-per-node", "2", "--inter-node-bandwidth", "1GB/s", "--global-batch", "64"]
    expected = written_plan(tmp_path, profile, flags)
    assert as_json(choice.plan) == expected
    assert list(as_json(choice.plan)["notes"]) == list(expected["notes"])
    assert choice.devices is not None
    direct = search_devices(profile, 4, cluster=cluster, batch_size=64)
    assert [(c.stages, c.method, c.micro_batches) for c in choice.ranked] == [
        (c.stages, c.method, c.micro_batches) for c in direct.ranked
    ]
    assert {c.stages * c.data_parallel for c in choice.ranked} == {4}


def test_the_method_is_looked_up_by_name_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every candidate of a method (three micro-batch counts here) shares the one method
    object resolved at the entry; the default search resolves each default method once."""
    looked_up: list[str] = []

    def counting(name: str) -> Any:
        looked_up.append(name)
        return get_method(name)

    monkeypatch.setattr(candidate_module, "get_method", counting)
    choice = plan_for(uneven(), stages=4, method="pipeoptim")
    assert looked_up == ["pipeoptim"] and choice.plan.method == "pipeoptim"
    looked_up.clear()
    auto = plan_for(uneven(), stages=4)
    assert sorted(looked_up) == sorted(RANKED_BY_DEFAULT)
    assert len(auto.ranked) > len(RANKED_BY_DEFAULT)  # several counts per method
    looked_up.clear()
    plan_for(uneven(), devices=4, method="1f1b")
    assert looked_up == ["1f1b"]


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        ({"stages": 4, "method": "nope"}, r"unknown method 'nope'; choose one of: gpipe"),
        ({"stages": 0}, r"need at least 1 stage \(got 0\); pass --stages 1 or more"),
        ({"stages": 4, "devices": 4}, r"exactly one of stages .* and devices"),
        ({}, r"exactly one of stages .* \(got stages=None, devices=None\)"),
        ({"devices": 0}, r"--devices must be a whole number of devices >= 1 \(got 0\)"),
        ({"devices": 4, "method": "interleaved-1f1b"}, r"places one stage per device"),
        ({"stages": 13}, r"cannot split 12 layers into 13 stages; use at most 12"),
    ],
)
def test_a_bad_request_says_the_rule_and_the_fix(request_: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan_for(uneven(), **request_)


def test_a_candidate_that_cannot_run_does_not_become_a_plan() -> None:
    over = Candidate("1f1b", 4, None, infeasible="no partition fits the memory cap", stages=4)
    with pytest.raises(PlanError, match=r"1f1b \(M=4\) cannot become a plan: no partition fits"):
        plan_from_candidate(
            over,
            uneven(),
            optimizer=plan_for(uneven(), stages=4).plan.optimizer,
            model=None,
            batch_size=32,
            notes={},
        )
