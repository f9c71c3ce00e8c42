"""The `pipeoptim schedule` and `pipeoptim methods` commands, in-process and as a real command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeoptim.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_grid_and_version_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "schedule", "--method", "pipeoptim", "--stages", "3", "--mini-batches", "4"
    )
    assert code == 0
    lines = out.splitlines()
    assert lines[1].split() == [
        "rank",
        "0",
        "0F0",
        "0F1",
        "0F2",
        ".",
        ".",
        "0B0",
        "0U0",
        "0F3",
        "0B1",
        "0U1",
        ".",
        "0B2",
        "0U2",
        ".",
        "0B3",
        "0U3",
    ]
    assert "weight copies" in out


def test_csv_out_and_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.csv"
    code, out, _ = run(
        capsys,
        "schedule",
        "--method",
        "1f1b",
        "--stages",
        "2",
        "--micro-batches",
        "2",
        "--mini-batches",
        "1",
        "--format",
        "csv",
        "--out",
        str(path),
    )
    assert code == 0 and "wrote csv schedule" in out
    assert path.read_text() == "0F0,0F1,,0B0,,0B1,0U0\n,1F0,1B0,1F1,1B1,1U0\n"
    code, out, _ = run(capsys, "schedule", "--load", str(path), "--json")
    data = json.loads(out)
    assert code == 0 and data["micro_batches"] == 2 and data["ranks"] == 2
    assert data["schedule"]["1"] == ["", "1F0", "1B0", "1F1", "1B1", "1U0"]


def test_methods_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "methods", "--json")
    names = [m["name"] for m in json.loads(out)]
    assert code == 0
    assert names == [
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "pipedream",
        "2bw",
        "spectrain",
        "xpipe",
        "pipeoptim",
        "zb-h1",
        "zb-v",
        "dualpipev",
        "interleaved-zb",
        "pipeoptim+shrink",
        "pipedream+pipemare",
        "pipeoptim+pipemare",
        "pipedream+nesterov",
        "pipeoptim+nesterov",
        "pipedream+qk-clip",
        "pipeoptim+qk-clip",
        "xpipe+extrapolate",
        "2bw+extrapolate",
        "pipeoptim+extrapolate",
        "pipedream+bounded",
        "pipeoptim+bounded",
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "foo", "--stages", "2"], "unknown method 'foo'; choose one of: gpipe"),
        (
            ["--method", "1f1b", "--stages", "4", "--micro-batches", "2"],
            "raise --micro-batches to 4",
        ),
        (["--method", "gpipe", "--stages", "0"], "need at least 1 stage"),
        (["--stages", "2"], "needs --method and --stages"),
    ],
)
def test_bad_input_exits_2_without_traceback(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "schedule", *args)
    assert code == 2
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "holds no schedule"),
        ("0F0,0F1,,0B0\n,1F0,1B0,1F1,1B1\n", "0F1 has no backward"),
        ("0F0,0B0\n,1F0,1B0\n", "needs 1B0"),
        ("0F0,0Q0\n", "malformed action '0Q0'"),
        ("0F0,0W0,0I0\n", "0W0 runs before 0I0"),
        ("0F0,(0F1;0B1)OVERLAP_F_B,0B0\n", "of another micro-batch right after it"),
    ],
)
def test_bad_csv_files(
    content: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content)
    code, _, err = run(capsys, "schedule", "--load", str(path))
    assert code == 2 and message in err


def test_load_a_lowered_split_schedule_with_fsdp_cells(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """PyTorch's lowered form (no clock lock-step, FSDP/DP bookkeeping) with I and W."""
    path = tmp_path / "lowered.csv"
    path.write_text(
        "0UNSHARD,0F0,0SEND_F0,0RECV_B0,0I0,0W0,0REDUCE_GRAD,0RESHARD\r\n"
        "1UNSHARD,1RECV_F0,1F0,1I0,1SEND_B0,1W0,1REDUCE_GRAD,1RESHARD\r\n"
    )
    code, out, err = run(capsys, "schedule", "--load", str(path))
    assert code == 0 and err == ""
    assert out.splitlines()[1].split() == [
        "rank", "0", ".", "0F0", "0SEND_F0", "0RECV_B0", "0I0", "0W0", ".", ".",
    ]  # fmt: skip
    assert out.count("note:") == 1 and "6 UNSHARD/RESHARD/REDUCE_GRAD cells" in out


def test_console_script_runs() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeoptim.cli",
            "schedule",
            "--method",
            "gpipe",
            "--stages",
            "2",
            "--micro-batches",
            "2",
            "--mini-batches",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1].split() == [
        "rank",
        "0",
        "0F0",
        "0F1",
        ".",
        ".",
        "0B0",
        "0B1",
        "0U0",
    ]
