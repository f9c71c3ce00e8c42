"""The Plan JSON round trip and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeoptim.errors import PlanError
from pipeoptim.plan.plan import OptimizerSpec, Plan, even_boundaries


def test_round_trip(tmp_path: Path) -> None:
    plan = Plan(
        "pipeoptim",
        3,
        optimizer=OptimizerSpec("adamw", 1e-3, {"weight_decay": 0.01}),
        boundaries=[(0, 2), (2, 5), (5, 6)],
        notes={"why": "test"},
    )
    path = tmp_path / "plan.json"
    plan.save(path)
    assert json.loads(path.read_text())["format"] == "pipeoptim-plan"
    assert Plan.load(path) == plan


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "1f1b", "num_stages": 4, "micro_batches": 2}, "raise --micro-batches"),
        ({"method": "pipedream", "num_stages": 2, "micro_batches": 4}, "as one unit"),
        ({"method": "pipeoptim", "num_stages": 2, "boundaries": [(0, 2), (3, 4)]}, "start at"),
        ({"method": "pipeoptim", "num_stages": 2, "boundaries": [(0, 2)]}, "1 stage ranges"),
    ],
)
def test_bad_plans(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        Plan(**kwargs)  # type: ignore[arg-type]


def test_unknown_optimizer() -> None:
    with pytest.raises(PlanError, match="unknown optimizer 'lion'; choose one of: sgd"):
        OptimizerSpec("lion")


def test_bad_files(tmp_path: Path) -> None:
    p = tmp_path / "x.json"
    p.write_text("{}")
    with pytest.raises(PlanError, match="not a pipeoptim plan"):
        Plan.load(p)
    p.write_text('{"format": "pipeoptim-plan", "method": "gpipe", "num_stages": 2, "x": 1}')
    with pytest.raises(PlanError, match=r"unknown plan fields \['x'\]"):
        Plan.load(p)
    p.write_text("{")
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(p)


def test_even_boundaries() -> None:
    assert even_boundaries(7, 3) == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(PlanError, match="cannot split 2 layers into 3 stages"):
        even_boundaries(2, 3)
