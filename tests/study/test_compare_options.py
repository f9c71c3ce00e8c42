"""``pipeoptim compare``'s resume key and its flags (issue 33, items 5 and 15): every option
that changes a run's result is in the key, so a rerun with another one trains anew instead of
reusing the old runs; rates for an optimizer it does not train, and descending rates, are
refused; the report names the command that produced it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pipeoptim.cli import main
from pipeoptim.study import grid
from pipeoptim.study.grid import run_specs
from pipeoptim.study.runs import CurvePoint, RunRecord, RunSpec

BASE = RunSpec("mlp", "gpipe", "adam", 1e-3, 2, 0, 4, 2)

CHANGED: dict[str, object] = {
    "model": "cnn",
    "method": "pipeoptim",
    "optimizer": "sgd",
    "lr": 2e-3,
    "stages": 4,
    "seed": 1,
    "steps": 8,
    "eval_every": 4,
    "batch_size": 16,
    "eval_samples": 100,
    "weight_decay": 0.1,
    "predicted_backward": True,
    "warmup": 0.1,
    "final_lr": 0.5,
    "grad_clip": 1.0,
    "trained_optimizer": "nadam",
    "micro_batch_count": 1,
    "extrapolation": 0.5,
    "equal_time": True,
}
"""A changed value of every RunSpec field that changes a run's result."""


def test_every_field_that_changes_a_result_changes_the_key() -> None:
    fields = {f.name for f in dataclasses.fields(RunSpec)}
    # closure only measures (it reads the weights), it changes nothing trained
    assert fields - {"closure"} == set(CHANGED), "a new RunSpec field: key it, or list it here"
    for name, value in CHANGED.items():
        other = dataclasses.replace(BASE, **{name: value})
        assert other.key != BASE.key, name
    assert dataclasses.replace(BASE, closure=True).key == BASE.key
    # the plain run's key is the one the committed studies hold
    assert BASE.key == "mlp/gpipe/adam/lr=0.001/P=2/seed=0/steps=4/B=32/eval=2"


def test_a_run_of_another_weight_decay_is_not_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[RunSpec] = []

    def fake(spec: RunSpec) -> RunRecord:
        ran.append(spec)
        return RunRecord(spec, [CurvePoint(2, 64, 0.5, 0.5, 0.5)], None, 1.0)

    monkeypatch.setattr(grid, "run_one", fake)
    path = tmp_path / "runs.jsonl"
    run_specs([BASE], path)
    decayed = dataclasses.replace(BASE, weight_decay=0.1)
    (record,) = run_specs([decayed], path)
    assert ran == [BASE, decayed] and record.spec.weight_decay == 0.1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--optimizers", "adam", "--lr-candidates", "sgd=0.1,0.2"],
            "--lr-candidates sgd=0.1,0.2 gives rates for sgd, which this study does not "
            "train (--optimizers adam)",
        ),
        (
            ["--optimizers", "adam", "--lr-candidates", "adam=2e-3,1e-3"],
            "--lr-candidates adam=2e-3,1e-3: the rates must be ascending, each once (got "
            "0.002, 0.001); give adam=0.001,0.002",
        ),
        (["--lr-candidates", "adam=1e-3,1e-3"], "ascending, each once"),
        (["--lr-candidates", "adam=inf"], "OPT=LR,LR"),
    ],
)
def test_compare_refuses_rates_it_would_not_use_as_given(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    message: str,
) -> None:
    def trained(spec: RunSpec) -> RunRecord:
        raise AssertionError(f"compare trained {spec.key} instead of refusing")

    monkeypatch.setattr(grid, "run_one", trained)
    assert main(["compare", *flags, "--workers", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "mlp").exists()  # refused before any work


def test_the_compare_report_names_the_command_that_produced_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fake(spec: RunSpec) -> RunRecord:
        return RunRecord(spec, [CurvePoint(44, 64, 0.5, 0.9, 0.5)], None, 1.0)

    monkeypatch.setattr(grid, "run_one", fake)
    code = main(
        [
            "compare",
            "--methods",
            "gpipe",
            "--optimizers",
            "adam",
            "--stages",
            "2",
            "--seeds",
            "1",
            "--epochs",
            "1",
            "--lr-candidates",
            "adam=2e-3",
            "--weight-decay",
            "0.1",
            "--workers",
            "1",
            "--out",
            str(tmp_path),
            "--quiet",
        ]
    )
    assert code == 0
    text = (tmp_path / "README.md").read_text()
    assert "examples/convergence/run.py" not in text
    assert "Produced by `pipeoptim compare --model mlp --methods gpipe --optimizers adam" in text
    assert "--weight-decay 0.1" in text and "--lr-candidates adam=0.002" in text
