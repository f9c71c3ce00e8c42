"""``pipeoptim train`` under bad input and faults: no input exhausts the machine, loses a
finished result or ends in a traceback."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from pipeoptim.cli import main
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.runtime import fit_watch, segments
from pipeoptim.runtime.checkpoint.store import DirectoryLock, latest_step
from pipeoptim.runtime.executor import Recorder
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.trace import Trace

ROOT = Path(__file__).resolve().parents[2]


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["train", "--quiet", *args])
    out, err = capsys.readouterr()
    return code, out, err


def cli_process(args: list[str], **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeoptim", "train", "--quiet", *args],
        cwd=ROOT,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        **kw,  # type: ignore[call-overload]
    )


# -- 1. sizes ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_billion_steps_run_in_bounded_memory() -> None:
    """`--max-steps 1000000000` trains (it is legitimate) and its memory stops growing:
    segments are bounded, per-step records and the trace keep a bounded window."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    proc = cli_process(
        ["--max-steps", "1000000000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=limit,
    )
    samples = []
    try:
        for _ in range(6):  # 24 s: the resident size is flat after about 20 s
            time.sleep(4)
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            rss = int(Path(f"/proc/{proc.pid}/statm").read_text().split()[1]) * os.sysconf(
                "SC_PAGE_SIZE"
            )
            samples.append(rss)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    assert max(samples) < 1.5 * 2**30, samples  # measured: about 0.43 GB, flat after 20 s


def test_per_step_records_and_the_trace_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fit_watch, "HISTORY", 5)
    monkeypatch.setattr(segments, "SEGMENT_PASSES", 12)  # 4 mini-batches x 3 stages
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    layers = [torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)]
    pipe = Pipeline(layers, "pipeoptim", stages=3, device="cpu")
    pipe.recorder.limit = 40
    result = pipe.fit(DataLoader(TensorDataset(x, y), batch_size=8), max_steps=14)
    assert sorted(pipe.result.losses) == [9, 10, 11, 12, 13]  # the newest 5 steps
    assert len(result.losses) == 5 and result.end_step == 14
    assert pipe.segment_limit == 12  # max(4 P, SEGMENT_PASSES // (stages x M))
    assert len(result.trace.events) == 40 and result.trace.meta["trace_truncated"] is True
    forwards = [e for e in result.trace.events if e.kind == "F"]
    assert forwards  # the beginning of the run
    recorder = Recorder(torch.device("cpu"), 0.0, limit=0)
    assert recorder.full


# -- 2. output paths --------------------------------------------------------------------------
def test_bad_output_paths_are_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    start = time.monotonic()
    code, out, err = run_cli(["--epochs", "1", "--trace", "/nonexistent/t.json"], capsys)
    assert code == 2 and "--trace" in err and "/nonexistent" in err and "Traceback" not in err
    assert out == "" and time.monotonic() - start < 10  # refused before training
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, out, err = run_cli(["--max-steps", "2", "--checkpoint-dir", str(a_file)], capsys)
    assert code == 2 and "--checkpoint-dir" in err and "is a file, not a folder" in err


def test_results_are_printed_when_the_trace_cannot_be_written(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def full_disk(self: Trace, path: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Trace, "save", full_disk)
    code, out, err = run_cli(["--max-steps", "4", "--trace", str(tmp_path / "t.json")], capsys)
    assert code == 2
    assert "test accuracy" in out and "trace not written" in out
    assert "No space left on device" in out and "not written" in err and "Traceback" not in err


# -- 3. one checkpoint folder, one run --------------------------------------------------------
def test_a_second_run_on_a_locked_folder_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    holder = DirectoryLock(tmp_path)
    holder.acquire()  # another run holds the folder
    try:
        code, _, err = run_cli(["--max-steps", "2", "--checkpoint-dir", str(tmp_path)], capsys)
    finally:
        holder.release()
    assert code == 2
    assert re.search(rf"in use by another run \(pid {os.getpid()} on host \S+\)", err), err
    code, _, _ = run_cli(["--max-steps", "2", "--checkpoint-dir", str(tmp_path)], capsys)
    assert code == 0  # free again


def test_a_fresh_run_does_not_take_over_another_runs_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert run_cli(["--max-steps", "2", "--checkpoint-dir", str(tmp_path)], capsys)[0] == 0
    code, _, err = run_cli(
        ["--max-steps", "4", "--checkpoint-dir", str(tmp_path), "--seed", "1"], capsys
    )
    assert code == 2 and "already holds checkpoints" in err and "--resume" in err
    assert latest_step(tmp_path)["step"] == 2  # type: ignore[index]  # untouched


def test_keeps_k_checkpoints_and_resumes_past_a_damaged_one(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"]
    args += ["--keep-checkpoints", "3"]
    assert run_cli([*args, "--max-steps", "10"], capsys)[0] == 0
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [
        "step-00000006",
        "step-00000008",
        "step-00000010",
    ]
    (tmp_path / "step-00000010" / "stage-2.pt").write_bytes(b"truncated")
    code, out, err = run_cli([*args, "--max-steps", "12", "--resume", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["start_step"] == 8 and data["end_step"] == 12
    assert any("resumed from step 8" in n for n in data["notes"])


# -- 4. NaN -----------------------------------------------------------------------------------
def test_nan_without_checkpoints_says_nothing_was_kept_and_json_keeps_the_result(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_cli(["--lr", "1e4", "--max-steps", "60", "--json"], capsys)
    assert code == 2
    assert "nothing was checkpointed" in err and "last good checkpoint" not in err
    data = json.loads(out)
    assert "non-finite loss" in data["error"] and data["losses"]


def test_resume_with_a_lower_lr_is_allowed_and_recorded(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ckpt, trace = tmp_path / "ckpt", tmp_path / "t.json"
    base = ["--checkpoint-dir", str(ckpt), "--lr-schedule", "cosine", "--checkpoint-every", "4"]
    assert run_cli([*base, "--max-steps", "8"], capsys)[0] == 0
    args = [*base, "--max-steps", "12", "--resume", "--lr", "0.005", "--trace", str(trace)]
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    assert "steps 8..12" in out
    assert "changed hyper-parameters: lr 0.02 -> 0.005" in out  # printed as a note
    meta = Trace.load(trace).meta
    assert meta["resumed_with_changes"] == {"lr": [0.02, 0.005]}
    assert meta["hyperparameters"]["lr"] == 0.005


def test_resume_refuses_what_changes_the_state(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert run_cli(["--max-steps", "2", "--checkpoint-dir", str(tmp_path)], capsys)[0] == 0
    code, _, err = run_cli(
        ["--max-steps", "4", "--checkpoint-dir", str(tmp_path), "--resume", "--optimizer", "adam"],
        capsys,
    )
    assert code == 2 and "from a different run" in err and "optimizer" in err


# -- 5. tracebacks ----------------------------------------------------------------------------
def write_model(tmp_path: Path, body: str) -> str:
    path = tmp_path / f"user_model_{abs(hash(body))}.py"  # modules are cached by name
    path.write_text("import torch\nfrom torch import nn\n\n" + body)
    return f"{path}:make"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "def make():\n"
            "    return [nn.Linear(64, 32), nn.ReLU(), nn.Linear(31, 10), nn.ReLU()]\n",
            r"stage 1, unit 2 \(Linear, expects a last dimension of 31\) rejected its input of "
            r"shape \(2, 32\)",
        ),
        (
            "def make():\n    return [nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3), nn.ReLU()]\n"
            "def dataset():\n    x = torch.randn(40, 5)\n"
            "    return x, torch.zeros(40).long(), x, torch.zeros(40).long()\n",
            r"stage 0, unit 0 \(Linear, expects a last dimension of 6\).*\(2, 5\)",
        ),
        (
            "def make():\n    return [nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3), nn.ReLU()]\n"
            "def dataset():\n    x = torch.randn(40, 5)\n"
            "    return x, torch.full((40,), 7), x, torch.full((40,), 7)\n",
            r"the loss failed on the first batch.*values 7\.\.7",
        ),
    ],
)
def test_user_model_and_data_errors_name_the_stage(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, body: str, message: str
) -> None:
    model = write_model(tmp_path, body)
    code, _, err = run_cli(["--model", model, "--stages", "2", "--max-steps", "2"], capsys)
    assert code == 2 and "Traceback" not in err
    assert re.search(message, err), err


def test_zero_stages_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["--stages", "0"], capsys)
    assert code == 2 and "--stages must be at least 1 (got 0)" in err


# -- 6. accepted silently ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch-size", "0"], "--batch-size must be at least 1 (got 0)"),
        (["--prediction-offset", "-5"], "--prediction-offset must be 0 or more (got -5)"),
        (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
        (["--keep-checkpoints", "0"], "--keep-checkpoints must be at least 1"),
    ],
)
def test_flags_once_accepted_silently_are_refused(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, _, err = run_cli([*args, "--max-steps", "2"], capsys)
    assert code == 2 and message in err and "Traceback" not in err


def test_a_plan_for_other_stages_says_its_partition_is_dropped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    plan = Plan("pipeoptim", 4, optimizer=OptimizerSpec("sgd", 0.02), model="mlp", batch_size=32)
    plan.boundaries = [(0, 2), (2, 4), (4, 6), (6, 9)]
    plan.save(tmp_path / "p.json")
    code, _, err = run_cli(
        ["--plan", str(tmp_path / "p.json"), "--stages", "3", "--max-steps", "2"], capsys
    )
    assert code == 0
    assert "the plan's partition was made for 4 stages" in err and "even split" in err


# -- 7. launcher death ------------------------------------------------------------------------
@pytest.mark.slow
def test_ranks_stop_quietly_when_the_launcher_is_killed(tmp_path: Path) -> None:
    log = (tmp_path / "err.log").open("w")
    launcher = cli_process(
        ["--transport", "dist", "--stages", "2", "--max-steps", "100000", "--device", "cpu"],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    children: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(children) < 2:
        time.sleep(0.5)
        children = [
            int(p)
            for p in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
        ]
    assert len(children) == 2, "the ranks did not start"
    time.sleep(1)  # starting or training: both must notice
    launcher.kill()
    launcher.wait()
    killed = time.monotonic()
    while time.monotonic() - killed < 15 and any(Path(f"/proc/{c}").exists() for c in children):
        time.sleep(0.2)
        for c in children:  # reap nothing: they are not our children; zombies count as gone
            status = Path(f"/proc/{c}/status")
            if status.exists() and "State:\tZ" in status.read_text():
                children = [x for x in children if x != c]
    gone_after = time.monotonic() - killed
    log.close()
    text = (tmp_path / "err.log").read_text()
    assert gone_after < 5, f"ranks still ran {gone_after:.0f} s after the launcher died"
    assert "Traceback" not in text, text[-3000:]
    assert len([line for line in text.splitlines() if "launching process is gone" in line]) == 2


def test_disk_full_while_checkpointing_keeps_the_previous_checkpoint(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    args = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"]
    assert run_cli([*args, "--max-steps", "2"], capsys)[0] == 0
    saves = 0
    real_save = torch.save

    def full_after_one(obj: object, f: object) -> None:
        nonlocal saves
        saves += 1
        if saves > 1:
            raise OSError(28, "No space left on device")
        real_save(obj, f)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "save", full_after_one)
    code, _, err = run_cli([*args, "--max-steps", "6", "--resume"], capsys)
    assert code == 2 and "Traceback" not in err
    assert "No space left on device" in err and "stays the previous one (step 2)" in err
    assert latest_step(tmp_path)["step"] == 2  # type: ignore[index]
    assert not list(tmp_path.glob("step-*/.*.tmp"))  # no half file left
