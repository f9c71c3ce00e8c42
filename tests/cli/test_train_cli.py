"""``pipeoptim train``: the default job, flags over plan files, and clean errors."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.compare import assert_same

from pipeoptim.cli import main
from pipeoptim.plan.plan import OptimizerSpec, Plan

ROOT = Path(__file__).resolve().parents[2]


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["train", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_default_run_is_the_main_job() -> None:
    """Plain ``pipeoptim train``: PipeOptim, 4 stages, digits MLP, local, CPU; > 90 % test
    accuracy in well under a minute (the whole process, start-up included)."""
    exe = Path(sys.executable).with_name("pipeoptim")
    command = (
        [str(exe), "train"] if exe.exists() else [sys.executable, "-m", "pipeoptim.cli", "train"]
    )
    start = time.monotonic()
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("pipeoptim train: pipeoptim, 4 stages, model mlp, sgd lr 0.02")
    assert "local transport on cpu" in first
    accuracy = float(re.search(r"test accuracy ([\d.]+)%", done.stdout).group(1))  # type: ignore[union-attr]
    assert accuracy > 90.0, done.stdout
    assert "weight copies per stage (peak): 2 2 2 1" in done.stdout
    assert elapsed < 60, f"default run took {elapsed:.0f} s"


def test_json_output(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    code, out, _ = run_cli(
        ["--method", "2bw", "--stages", "3", "--max-steps", "5", "--trace", str(trace), "--json"],
        capsys,
    )
    assert code == 0
    data = json.loads(out)
    # 3 micro-batches do not divide the default batch of 32: the default count is then 4
    assert data["method"] == "2bw" and data["num_stages"] == 3 and data["micro_batches"] == 4
    assert (data["start_step"], data["end_step"], len(data["losses"])) == (0, 5, 5)
    assert data["weight_copies"] == {"0": 2, "1": 2, "2": 2}
    assert {"final_loss", "test_accuracy", "samples_per_second"} <= set(data)
    assert data["trace_file"] == str(trace) and trace.exists()


def test_plan_file_with_flags_on_top(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plan = Plan(
        "pipedream",
        3,
        optimizer=OptimizerSpec("adam", 0.002),
        model="mlp",
        batch_size=16,
        boundaries=[(0, 5), (5, 7), (7, 9)],
    )
    path = tmp_path / "plan.json"
    plan.save(path)
    code, out, _ = run_cli(["--plan", str(path), "--max-steps", "6", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert (data["method"], data["num_stages"], data["batch_size"]) == ("pipedream", 3, 16)
    assert data["weight_copies"] == {"0": 3, "1": 2, "2": 1}
    code, out, _ = run_cli(
        ["--plan", str(path), "--stages", "2", "--max-steps", "3", "--json"], capsys
    )
    assert code == 0 and json.loads(out)["num_stages"] == 2  # flag wins; boundaries dropped


def test_schedule_precision_and_clipping_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--lr-schedule", "warmup-cosine", "--warmup", "2", "--amp", "bf16"]
    code, out, _ = run_cli([*args, "--grad-clip", "0.5", "--max-steps", "8", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["end_step"] == 8
    # the only note says whose norm is clipped (issue 63 item 4)
    assert [n.split(":")[0] for n in data["notes"]] == ["gradient clipping at 0.5"]
    assert "clip_scope='stage'" in data["notes"][0]  # the default method is asynchronous
    assert data["eval"]["samples"] == 359 and 0.0 < data["eval"]["accuracy"] <= 1.0


def test_forwards_first_trains_the_weights_of_the_schedules_order(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["--method", "xpipe", "--stages", "4", "--max-steps", "6", "--json"]
    runs = {}
    for flag in ([], ["--forwards-first"]):
        folder = tmp_path / ("first" if flag else "own")
        code, out, _ = run_cli([*args, *flag, "--checkpoint-dir", str(folder)], capsys)
        assert code == 0
        runs[bool(flag)] = (json.loads(out)["losses"], folder)
    assert runs[True][0] == runs[False][0]
    own, first = (sorted(runs[k][1].rglob("*.pt")) for k in (False, True))
    assert len(own) == 4  # one checkpoint file per stage
    assert [p.relative_to(runs[False][1]) for p in own] == [
        p.relative_to(runs[True][1]) for p in first
    ]
    for a, b in zip(own, first, strict=True):
        assert_same(torch.load(a, weights_only=True), torch.load(b, weights_only=True))


def test_gpt_model_via_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["--model", "gpt", "--max-steps", "3"], capsys)
    assert code == 0
    assert "model gpt, adamw lr 0.0005" in out
    assert re.search(r"test accuracy [\d.]+%, test loss [\d.]+, perplexity [\d.]+ \(1538", out)


def test_user_model_example(capsys: pytest.CaptureFixture[str]) -> None:
    model = str(ROOT / "examples" / "custom_model.py") + ":make_model"
    code, out, _ = run_cli(
        ["--model", model, "--stages", "5", "--max-steps", "4", "--json"], capsys
    )
    assert code == 0
    data = json.loads(out)
    assert data["model"] == model and data["num_stages"] == 5 and data["end_step"] == 4
    assert len(data["losses"]) == 4 and all(math.isfinite(v) for v in data["losses"])
    assert data["eval"]["samples"] == 359  # digits' test split: the example has no dataset()
    assert sorted(data["weight_copies"]) == ["0", "1", "2", "3", "4"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--method", "2bw", "--micro-batches", "4", "--batch-size", "30"],
            "not divisible by 4 micro-batches",
        ),
        (["--stages", "12"], "has 9 layers, too few for 12 stages"),
        (["--optimizer", "lamb"], "unknown optimizer 'lamb'"),
        (["--model", "resnet"], "unknown model 'resnet'"),
        (["--method", "pipedream", "--micro-batches", "2"], "runs each mini-batch as one unit"),
        (["--method", "magic"], "unknown method 'magic'"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--plan", "no/such/plan.json"], "cannot read plan"),
        (["--epochs", "0"], "--epochs must be at least 1"),
        (["--amp", "fp16", "--device", "cpu"], "amp='fp16' needs a CUDA device"),
        (["--lr-schedule", "warmup-cosine", "--warmup", "5"], "--warmup 5 is not shorter"),
        (["--grad-clip", "0"], "--grad-clip must be positive"),
        (
            ["--method", "pipedream+bounded", "--grad-clip", "1", "--clip-scope", "pipeline"],
            "a bounded delay), so no mini-batch's gradient leaves every stage",
        ),
        (["--transport", "dist", "--forwards-first"], "drop --forwards-first"),
        (
            ["--method", "2bw+extrapolate", "--extrapolation", "-1"],
            "--extrapolation must be a finite number >= 0 (got -1.0)",
        ),
        (
            ["--method", "xpipe", "--extrapolation", "0.5"],
            "--extrapolation 0.5 sets λ of the extrapolate correction, and xpipe does not",
        ),
        (
            ["--method", "pipedream+nesterov", "--optimizer", "rmsprop"],
            "RMSprop has no momentum to set (no betas, momentum 0); use NAdam",
        ),
    ],
)
def test_bad_input_exits_2_with_a_message(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, _, err = run_cli([*args, "--max-steps", "2"], capsys)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_a_bad_shared_memory_size_stops_every_rank_with_the_rule(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPEOPTIM_SHARED_MEMORY", "off")  # the ranks inherit it
    code, _, err = run_cli(["--transport", "dist", "--stages", "2", "--max-steps", "2"], capsys)
    assert code == 2
    assert "PIPEOPTIM_SHARED_MEMORY='off': give each shared-memory ring's size in MiB" in err
    assert "or 0 to send every message over gloo" in err
    assert "Traceback" not in err


def test_world_size_mismatch_under_torchrun(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    code, _, err = run_cli(["--transport", "dist", "--stages", "4"], capsys)
    assert code == 2
    assert "world size 2 does not match the plan's 4 pipeline stages" in err


def test_nan_loss_via_the_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace, ckpt = tmp_path / "t.json", tmp_path / "ckpt"
    code, _, err = run_cli(
        [
            "--lr",
            "1e4",
            "--max-steps",
            "30",
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            "2",
            "--trace",
            str(trace),
        ],
        capsys,
    )
    assert code == 2
    assert re.search(r"non-finite loss \((nan|inf)\) at step \d+", err), err
    assert "Traceback" not in err
    assert trace.exists() and (ckpt / "latest.json").exists()
