"""The demo prints the planner's study advice for its own recommendation: the same line as
``pipeoptim plan`` for that method, micro-batches, optimizer and depth, or nothing."""

from __future__ import annotations

from typing import Any

import pytest

from pipeoptim.demo.summary import study_advice
from pipeoptim.plan import risk


def _results(method: str, micro_batches: int, stages: int, optimizer: str) -> dict[str, Any]:
    plan = {"recommended": method, "methods": [{"method": method, "micro_batches": micro_batches}]}
    return {"plan": plan, "options": {"stages": stages, "optimizer": optimizer}}


def test_the_demo_gives_the_plans_advice_for_its_configuration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(risk, "DEPTH_EXCESS", {4: {"pipeoptim": 0.3, "xpipe": 0.01}})
    monkeypatch.setattr(risk, "DEPTH_SPEED", {4: {"pipeoptim": 1.4, "xpipe": 1.08}})
    monkeypatch.setattr(risk, "DEPTH_EQUAL_TIME", {})
    monkeypatch.setattr(risk, "DEPTH_COPIES", {4: {"pipeoptim": 2, "xpipe": 2}})
    monkeypatch.setattr(risk, "DEPTH_EXCESS_FIRST", {})
    text = study_advice(_results("pipeoptim", 1, 4, "adamw"))
    assert text == risk.depth_advice("pipeoptim", 4, "adamw", 1)
    assert text is not None and "(its time to that loss not measured): xpipe (1.08×" in text
    assert study_advice(_results("xpipe", 4, 4, "adamw")) is None  # it is the advice
    assert study_advice(_results("pipeoptim", 1, 4, "sgd")) is None  # no SGD rows
    assert study_advice(_results("pipeoptim", 1, 2, "adamw")) is None  # nothing at 2 stages
