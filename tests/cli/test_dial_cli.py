"""PipeOptim's dial from the command line: ``simulate`` and ``train`` take
``--micro-batches`` for pipeoptim; its default stays whole mini-batches."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipeoptim.cli import main
from pipeoptim.plan.profile import Profile

# stage 0's distance ⌈3/M⌉ and the activations it holds: 4 micro-batches of B/M samples
DELAYS = {1: [3, 2, 1, 0], 2: [2, 1, 1, 0], 4: [1, 1, 1, 0]}


def profile(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    Profile.uniform(
        8,
        forward_s=0.01,
        backward_s=0.02,
        activation_bytes=10_000_000,
        param_bytes=1000,
        batch_size=32,
    ).save(path)
    return path


def simulated(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert main(["simulate", "--method", "pipeoptim", "--stages", "4", *args, "--json"]) == 0
    run: dict[str, object] = json.loads(capsys.readouterr().out)["runs"]["pipeoptim"]
    return run


def test_simulate_runs_the_dial_at_every_m(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(profile(tmp_path))
    default = simulated(["--profile", path], capsys)
    assert default["shape"]["micro_batches"] == 1  # type: ignore[index]
    peaks = {}
    for m, delays in DELAYS.items():
        run = simulated(["--profile", path, "--micro-batches", str(m)], capsys)
        stages = run["stages"]
        assert run["shape"]["micro_batches"] == m  # type: ignore[index]
        assert [stages[str(k)]["max_distance"] for k in range(4)] == delays  # type: ignore[index]
        assert [stages[str(k)]["weight_copies"] for k in range(4)] == [2, 2, 2, 1]  # type: ignore[index]
        peaks[m] = run["peak_memory_bytes"]
    # stage 0 holds 4 micro-batches at every M, each of B/M samples: fewer bytes with M
    assert peaks[1] > peaks[2] > peaks[4]


def test_train_runs_pipeoptim_at_two_micro_batches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.json"
    args = ["train", "--method", "pipeoptim", "--stages", "4", "--micro-batches", "2"]
    assert main([*args, "--max-steps", "6", "--trace", str(trace), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["micro_batches"] == 2 and len(out["losses"]) == 6
    events = json.loads(trace.read_text())["events"]
    forwards = [e for e in events if e["kind"] == "F" and e["stage"] == 0]
    # stage 0 of 4 at M = 2 (steady from mini-batch 3): micro-batch 0 of a mini-batch
    # meets two updates before its backward, micro-batch 1 one
    assert [e["distance"] for e in forwards if e["mb"] >= 6] == [2, 1] * 3


def test_plan_notes_a_profile_timed_for_another_optimizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Planning Muon on a profile whose step times are AdamW's says so and how to fix it;
    a profile of the same optimizer (or one without step times) plans without the note."""
    path = tmp_path / "adamw.json"
    base = Profile.uniform(8, forward_s=0.01, backward_s=0.02, param_bytes=1000, batch_size=32)
    timed = [dataclasses.replace(layer, update_s=0.001) for layer in base.layers]
    dataclasses.replace(base, layers=timed, optimizer="adamw").save(path)
    argv = ["plan", "--profile", str(path), "--stages", "4", "--method", "gpipe", "--json"]
    assert main([*argv, "--optimizer", "muon"]) == 0
    note = capsys.readouterr().err
    assert "--optimizer muon, but the profile's update and prediction times are adamw's" in note
    assert "pipeoptim profile --optimizer muon" in note
    assert main([*argv, "--optimizer", "adamw"]) == 0
    assert "prediction times are" not in capsys.readouterr().err
