"""Where calibration charges the run's idle time (the executor's gaps, a message's fixed
cost) to the simulated actions, `calibrate` says why the bubble ratios differ."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pipeoptim.calibrate import bubble_note, calibrate, compute_ratio, compute_seconds
from pipeoptim.cli import main
from pipeoptim.demo.predict import calibrate_runs
from pipeoptim.demo.report import _calibration_notes
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
        source="runtime",
        plan=plan.to_dict(),
        batch_size=8,
        mini_batches=12,
        transport="dist",
        boundaries=[[k, k + 1] for k in range(3)],
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
    assert compute_ratio(measured, predicted) == ratio
    assert ratio > 1.5
    note = bubble_note(measured, predicted)
    assert note is not None and f"{ratio:.1f}x the run's compute time" in note
    assert "time per mini-batch" in note


def test_an_empty_run_gets_no_note() -> None:
    assert math.isnan(compute_ratio(Trace(), _measured(1.0)))
    assert bubble_note(Trace(), _measured(1.0)) is None


def _demo_results(ratios: dict[str, float | None]) -> dict[str, Any]:
    """The parts of the demo's results its calibration notes read."""
    return {
        "profile": {"cpus": 4},
        "options": {"stages": 3},
        "calibrate": {"runs": {m: {"compute_ratio": r} for m, r in ratios.items()}},
    }


def test_the_demo_stores_each_runs_ratio_and_names_the_charged_ones() -> None:
    gaps, whole = _measured(0.5), _measured(1.0)
    predicted_gaps, _ = calibrate(gaps)
    # calibrate_runs also predicts each run from the other's costs, through the profile
    # only for the cross rows, which this test does not read: give it one run.
    runs, _ = calibrate_runs({"pipedream": gaps}, profile=None)  # type: ignore[arg-type]
    stored = runs["runs"]["pipedream"]["compute_ratio"]
    assert stored == pytest.approx(compute_ratio(gaps, predicted_gaps))
    notes = _calibration_notes(_demo_results({"pipedream": stored, "1f1b": 1.0}))
    charged = [n for n in notes if "calibrated actions hold more time" in n]
    assert len(charged) == 1 and f"{stored:.1f}x for pipedream" in charged[0]
    assert "1f1b" not in charged[0]
    predicted_whole, _ = calibrate(whole)
    quiet = {"pipedream": compute_ratio(whole, predicted_whole), "1f1b": None}
    assert not any("calibrated actions" in n for n in _calibration_notes(_demo_results(quiet)))


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


def test_the_what_if_bubble_is_flagged_where_the_actions_were_charged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "trace.json"
    for keep, flagged in ((0.5, True), (1.0, False)):
        _measured(keep).save(path)
        args = ["calibrate", "--trace", str(path), "--predict", "1f1b", "--json"]
        assert main(args) == 0
        out = json.loads(capsys.readouterr().out)
        assert [r["method"] for r in out["what_if"]] == ["1f1b"]
        assert any("what-if bubble column" in n for n in out["notes"]) is flagged
