"""Where calibration charges the run's idle time (the executor's gaps, a message's fixed
cost) to the simulated actions, `calibrate` says why the bubble ratios differ."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pipeoptim.calibrate import bubble_note, calibrate, compute_seconds
from pipeoptim.cli import main
from pipeoptim.metrics import COMPUTE_KINDS
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.evaluate import evaluate_trace
from pipeoptim.trace import Trace, TraceEvent


def _measured(keep: float) -> Trace:
    """A simulated pipedream run (no bubble: every gap is the executor's) dressed as a
    runtime trace, each compute event cut to ``keep`` of its length: the rest is a gap
    before the next action, as the executor's own time."""
    plan = Plan("pipedream", 3, optimizer=OptimizerSpec("sgd", 0.1))
    costs = CostModel.uniform(
        3, 0.010, 0.020, 0.002, param_bytes=4096, activation_bytes=1024, samples_per_micro_batch=8
    )
    trace = evaluate_trace("pipedream", plan.shape(12), costs)
    trace.events = [
        replace(e, end=e.start + keep * (e.end - e.start)) if e.kind in COMPUTE_KINDS else e
        for e in trace.events
    ]
    trace.meta.update(
        source="runtime", plan=plan.to_dict(), batch_size=8, mini_batches=12, transport="dist"
    )
    return trace


def test_compute_seconds_sums_the_compute_events_only() -> None:
    trace = Trace(
        events=[
            TraceEvent(0, 0, "F", 0, 0.0, 1.0),
            TraceEvent(0, 0, "SEND_F", 0, 1.0, 3.0),
            TraceEvent(0, 0, "B", 0, 3.0, 3.5),
        ]
    )
    assert compute_seconds(trace) == pytest.approx(1.5)


def test_a_run_whose_actions_are_its_compute_gets_no_note() -> None:
    measured = _measured(1.0)
    predicted, _ = calibrate(measured)
    assert bubble_note(measured, predicted) is None


def test_gaps_charged_to_the_actions_are_named_with_their_ratio() -> None:
    measured = _measured(0.5)
    predicted, _ = calibrate(measured)
    ratio = compute_seconds(predicted) / compute_seconds(measured)
    assert ratio > 1.5
    note = bubble_note(measured, predicted)
    assert note is not None and f"{ratio:.1f}x the run's compute time" in note
    assert "time per mini-batch" in note


def test_an_empty_run_gets_no_note() -> None:
    assert bubble_note(Trace(), _measured(1.0)) is None


def test_the_command_prints_the_note_in_its_notes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "trace.json"
    _measured(0.5).save(path)
    assert main(["calibrate", "--trace", str(path), "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("differ by construction" in n for n in notes)
    _measured(1.0).save(path)
    assert main(["calibrate", "--trace", str(path), "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert not any("differ by construction" in n for n in notes)
