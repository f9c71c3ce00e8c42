"""Export outputs: ``pipeoptim export`` and ``Pipeline.export`` check where they write before
any work (never over the checkpoint they read, a folder for a file or a file for a folder),
and an export under data parallelism waits for the checkpoint on every rank."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support import tied_worker as tw

from pipeoptim import Pipeline
from pipeoptim.cli import main
from pipeoptim.errors import PipeoptimError

ROOT = Path(__file__).resolve().parents[3]


# ----------------------------------------------------------------------- export outputs
def _trained(folder: Path) -> Pipeline:
    pipe = tw.tied_pipeline("1f1b", checkpoint_dir=str(folder))
    pipe.fit(tw.batches(3), max_steps=3)
    return pipe


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, err


def test_export_outputs_are_checked_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    _trained(ckpt)
    pointer = (ckpt / "latest.json").read_bytes()
    (tmp_path / "folder.pt").mkdir()
    (tmp_path / "file.pt").write_bytes(b"not a folder")
    cases = {
        str(tmp_path / "folder.pt"): "is a folder",
        str(tmp_path / "file.pt" / "model.pt"): "is a file, not a folder",
        str(ckpt / "latest.json"): "checkpoint",
        str(next(ckpt.glob("step-*/stage-0*"))): "checkpoint",
    }
    step_files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    before = {p: p.read_bytes() for p in step_files}
    for (out, why), fmt in itertools.product(cases.items(), ([], ["--format", "pt"])):
        code, err = _cli(capsys, "export", "--checkpoint-dir", str(ckpt), "--out", out, *fmt)
        assert code == 2, (out, err)
        assert err.count("\n") == 1 and why in err and out in err, err
    assert (ckpt / "latest.json").read_bytes() == pointer
    assert {p: p.read_bytes() for p in step_files} == before
    # the checkpoint still exports, and a file beside it is fine
    code, _ = _cli(capsys, "export", "--checkpoint-dir", str(ckpt), "--out", str(ckpt / "m.pt"))
    assert code == 0 and (ckpt / "m.pt").is_file()


def test_the_live_export_protects_the_checkpoint_folder_too(tmp_path: Path) -> None:
    pipe = _trained(tmp_path / "ckpt")
    with pytest.raises(PipeoptimError, match="would overwrite the checkpoint's own"):
        pipe.export(tmp_path / "ckpt" / "latest.json", fmt="pt")
    with pytest.raises(PipeoptimError, match="is the checkpoint folder it reads"):
        pipe.export(tmp_path / "ckpt", fmt="hf")
    (tmp_path / "out.pt").mkdir()
    with pytest.raises(PipeoptimError, match="is a folder, and the pt format writes one file"):
        pipe.export(tmp_path / "out.pt")


def test_an_hf_export_onto_an_existing_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before any work (the output is checked before the model's source)."""
    ckpt = tmp_path / "ckpt"
    pipe = _trained(ckpt)
    target = tmp_path / "model"
    target.write_bytes(b"")
    with pytest.raises(PipeoptimError, match=r"is a file.*hf format writes a folder"):
        pipe.export(target, fmt="hf")
    code, err = _cli(
        capsys, "export", "--checkpoint-dir", str(ckpt), "--out", str(target), "--format", "hf"
    )
    assert code == 2 and "hf format writes a folder" in err and err.count("\n") == 1
    assert target.read_bytes() == b""


# ------------------------------------------------------ export under dist, data parallel
WORKER = ROOT / "tests" / "support" / "export_dp_worker.py"


@pytest.mark.slow
def test_export_under_data_parallel_waits_for_the_checkpoint(tmp_path: Path) -> None:
    """2 stages x 2 replicas; the worker fits and exports three times (the race lost 5 runs in
    6): every export succeeds on every rank and writes the final weights."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "4",
            "--master-port",
            str(port),
            str(WORKER),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("ok-*")) == sorted(
        f"ok-{rank}-{r}" for rank in range(4) for r in range(3)
    )
