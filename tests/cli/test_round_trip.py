"""Profile a built-in model, plan it, run the plan, predict it, and calibrate from the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeoptim.cli import main
from pipeoptim.plan.plan import Plan
from pipeoptim.plan.profile import Profile
from pipeoptim.trace import Trace


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    data = json.loads(capsys.readouterr().out)
    assert isinstance(data, dict)
    return data


def test_profile_plan_train_simulate_calibrate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof, plan_path, trace = tmp_path / "p.json", tmp_path / "plan.json", tmp_path / "run.json"
    run_json(
        capsys,
        "profile",
        "--model",
        "mlp",
        "--batch-size",
        "32",
        "--repeats",
        "2",
        "--out",
        str(prof),
    )
    profile = Profile.load(prof)
    assert profile.num_layers == 9 and profile.meta["model"] == "mlp"

    planned = run_json(
        capsys,
        "plan",
        "--profile",
        str(prof),
        "--stages",
        "3",
        "--method",
        "pipeoptim",
        "--out",
        str(plan_path),
    )
    plan = Plan.load(plan_path)
    assert plan.model == "mlp" and plan.boundaries is not None and plan.stage_graph is not None
    assert planned["why"]

    trained = run_json(
        capsys,
        "train",
        "--plan",
        str(plan_path),
        "--max-steps",
        "30",
        "--trace",
        str(trace),
        "--quiet",
    )
    assert trained["method"] == "pipeoptim"
    measured = Trace.load(trace)
    assert measured.meta["plan"]["boundaries"] == [list(b) for b in plan.boundaries]

    # simulating the plan file predicts what the planner promised when it chose the plan
    predicted = run_json(capsys, "simulate", "--plan", str(plan_path))
    run = predicted["runs"]["pipeoptim"]  # type: ignore[index]
    promised = plan.notes
    assert run["steady_throughput"] == pytest.approx(promised["predicted_samples_per_s"])
    assert run["bubble_ratio"] == pytest.approx(promised["predicted_bubble_ratio"])

    # calibration replays the run on its measured costs: the memory model and the
    # runtime's byte counts agree exactly, and the replay covers the run's own shape
    calibrated = run_json(capsys, "calibrate", "--trace", str(trace))
    rows = {r["quantity"]: r for r in calibrated["rows"]}  # type: ignore[attr-defined]
    memory = rows["peak memory, fullest rank"]
    assert memory["measured"] == memory["predicted"] > plan.stage_graph["stages"][0]["param_bytes"]
    assert rows["time per mini-batch (steady state)"]["measured"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["profile", "--model", "resnet9000", "--out", "x.json"], "unknown model 'resnet9000'"),
        (["plan", "--profile", "missing.json", "--stages", "2"], "missing.json"),
    ],
)
def test_planning_bad_input(
    argv: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
