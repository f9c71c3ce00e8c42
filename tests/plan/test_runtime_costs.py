"""A profile's record of its host: the runtime's fixed costs (``runtime_costs``) and the
machine (``meta["machine"]``) round-trip through the file; a profile without them (an older
file) loads as it always did and writes the same file back; bad values are refused with the
rule, the value and the fix."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from pipeoptim.errors import PlanError
from pipeoptim.plan.machine import Machine
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.runtime_costs import ACTION_KINDS, RuntimeCosts

MEASURED = RuntimeCosts(
    message_send_s=6e-5,
    message_receive_s=5e-5,
    message_latency_s=1e-5,
    burst_slowdown=1.5,
    shared_burst_slowdown=2.5,
    action_s={
        "flush": {"F": 3e-5, "B": 2e-5, "U": 4e-5, "I": 2.5e-5, "W": 3.5e-5},
        "predict": {"F": 9e-5, "B": 5e-5, "U": 6e-5},
    },
    burst_s=2e-5,
    shared_burst_s=7e-5,
)

OLD_FILE: dict[str, Any] = {  # a profile as pipeoptim wrote it before runtime_costs
    "format": "pipeoptim.profile",
    "version": 1,
    "batch_size": 8,
    "optimizer": "sgd",
    "device": "cpu",
    "dtype_bytes": 4,
    "meta": {"threads": 1},
    "layers": [
        {
            "name": "0:Linear",
            "forward_s": 1e-4,
            "backward_s": 2e-4,
            "activation_bytes": 256,
            "param_bytes": 1024,
            "optimizer_state_bytes": 1024,
            "param_count": 256,
        }
    ],
}


def _profile(**changes: Any) -> Profile:
    base = Profile.from_costs([1e-4, 2e-4], [2e-4, 3e-4], [64, 32], [128, 128])
    meta = {"ranks": 4, "machine": Machine(2, 4, 1).to_dict()}
    return Profile(base.layers, base.batch_size, base.optimizer, "cpu", meta=meta, **changes)


def test_the_runtime_costs_and_the_machine_round_trip(tmp_path: Path) -> None:
    profile = _profile(runtime_costs=MEASURED)
    path = tmp_path / "p.json"
    profile.save(path)
    loaded = Profile.load(path)
    assert loaded == profile
    assert loaded.runtime_costs == MEASURED
    assert loaded.machine == Machine(2, 4, 1)
    assert loaded.planned_ranks == 4
    assert json.loads(path.read_text())["runtime_costs"]["burst_slowdown"] == 1.5


def test_an_old_profile_loads_as_before_and_is_written_back_unchanged() -> None:
    profile = Profile.from_dict(OLD_FILE)
    assert profile.runtime_costs is None and profile.machine is None
    assert profile.planned_ranks is None
    assert profile.to_dict() == OLD_FILE | {
        "layers": [
            OLD_FILE["layers"][0]
            | {
                "update_s": 0.0,
                "predict_s": 0.0,
                "forward_fixed_s": 0.0,
                "backward_fixed_s": 0.0,
                "weight_grad_fraction": 0.5,
            }
        ]
    }
    assert "runtime_costs" not in profile.to_dict()


def test_missing_entries_cost_nothing() -> None:
    costs = RuntimeCosts.from_dict({"message_send_s": 1e-4})
    assert costs.message_receive_s == 0.0 and costs.burst_slowdown == 1.0
    assert costs.shared_burst_slowdown == 1.0
    assert costs.burst_s == 0.0 and costs.shared_burst_s == 0.0
    # a ping-pong ratio alone is a record, not a charge (a wait costs seconds, burst_s)
    assert RuntimeCosts(burst_slowdown=2.0, shared_burst_slowdown=2.5).charges is False
    assert costs.action_s == {} and costs.actions("predict") == (0.0,) * 5
    assert RuntimeCosts().charges is False and costs.charges is True


def test_a_policy_without_its_own_costs_takes_the_synchronous_ones() -> None:
    assert MEASURED.actions("predict") == (9e-5, 5e-5, 6e-5, 0.0, 0.0)
    assert MEASURED.actions("stash") == (3e-5, 2e-5, 4e-5, 2.5e-5, 3.5e-5)
    assert ACTION_KINDS == ("F", "B", "U", "I", "W")


@pytest.mark.parametrize(
    ("record", "words"),
    [
        ({"message_send_s": -1e-5}, ["message_send_s", "finite number of seconds >= 0", "-1e-05"]),
        ({"message_receive_s": "fast"}, ["message_receive_s", ">= 0", "'fast'"]),
        ({"message_latency_s": math.inf}, ["message_latency_s", "finite", "inf"]),
        ({"burst_slowdown": 0.5}, ["burst_slowdown", ">= 1", "0.5", "give 1 for none"]),
        ({"shared_burst_slowdown": math.nan}, ["shared_burst_slowdown", "finite", "nan"]),
        ({"burst_s": -1e-6}, ["burst_s", "after a wait", ">= 0", "-1e-06"]),
        ({"shared_burst_s": math.inf}, ["shared_burst_s", "finite", "inf"]),
        ({"action_s": {"flush": {"F": -2e-5}}}, ["action_s['flush']['F']", ">= 0", "-2e-05"]),
        ({"action_s": {"flush": {"X": 1e-5}}}, ["action kind 'X'", "F, B, U, I, W"]),
        ({"action_s": ["F"]}, ["action_s must map a weight policy", "['F']"]),
    ],
)
def test_bad_runtime_costs_are_refused_with_rule_value_and_fix(
    record: dict[str, Any], words: list[str]
) -> None:
    data = OLD_FILE | {"runtime_costs": record}
    with pytest.raises(PlanError) as err:
        Profile.from_dict(data, source="p.json")
    message = str(err.value)
    assert message.startswith("p.json")
    for word in [*words, "pipeoptim profile --ranks P"]:
        assert word in message, message


@pytest.mark.parametrize(
    ("machine", "words"),
    [
        ({"cores": 0, "ranks_per_host": 4}, ["cores must be a whole number >= 1", "got 0"]),
        ({"cores": 2, "ranks_per_host": -1}, ["ranks_per_host", "got -1"]),
        ({"cores": 2}, ["must be a mapping with cores, ranks_per_host"]),
    ],
)
def test_a_bad_machine_record_is_refused_at_load(machine: dict[str, Any], words: list[str]) -> None:
    data = OLD_FILE | {"meta": {"machine": machine}}
    with pytest.raises(PlanError) as err:
        Profile.from_dict(data, source="p.json")
    message = str(err.value)
    for word in [*words, "p.json"]:
        assert word in message, message
    assert "give" in message or "rewrite" in message  # the fix
