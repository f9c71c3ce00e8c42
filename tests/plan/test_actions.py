"""Action text form, CSV import/export, and compatibility with torch.distributed.pipelining."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeoptim.errors import ScheduleError
from pipeoptim.plan import METHODS, build_schedule
from pipeoptim.plan.actions import (
    Action,
    Kind,
    format_grid,
    load_csv,
    save_csv,
    schedule_from_csv,
    schedule_to_csv,
)


@pytest.mark.parametrize(
    "text", ["0F0", "2F13", "11B7", "3U2", "1SEND_F4", "2RECV_B10", "0I3", "7W12"]
)
def test_text_form_round_trips(text: str) -> None:
    assert str(Action.parse(text)) == text


def test_parse_fields() -> None:
    assert Action.parse(" 2F13 ") == Action(2, Kind.FORWARD, 13)
    assert Action.parse("1SEND_F4") == Action(1, Kind.SEND_F, 4)
    assert Action.parse("0I3") == Action(0, Kind.BACKWARD_INPUT, 3)
    assert Action.parse("3W0") == Action(3, Kind.BACKWARD_WEIGHT, 0)
    assert Kind.BACKWARD_INPUT.is_compute and Kind.BACKWARD_WEIGHT.is_compute


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("F1", "malformed action 'F1'"),
        ("1X2", "malformed action"),
        ("1F", "has no micro-batch number"),
        ("0UNSHARD", "FSDP/data-parallel bookkeeping .* drop such cells"),
        ("(0F1;1B0)OVERLAP_F_B", "overlapped step of two actions .*parse_step"),
        ("0I", "has no micro-batch number"),
        ("1F2x", "malformed"),
    ],
)
def test_malformed_actions(text: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        Action.parse(text)


@pytest.mark.parametrize("method", list(METHODS))
def test_csv_round_trip(method: str, tmp_path: Path) -> None:
    schedule, _ = build_schedule(method, 3, 3 if METHODS[method].micro_batched else None, 3)
    path = tmp_path / "s.csv"
    save_csv(schedule, path)
    loaded = load_csv(path)
    # trailing idle cells may differ in length; compare content position by position
    for rank, row in schedule.items():
        assert loaded[rank][: len(row)] == row
        assert all(a is None for a in loaded[rank][len(row) :])


def test_csv_layout_is_one_row_per_rank_with_empty_idle_cells() -> None:
    schedule, _ = build_schedule("gpipe", 2, 2, 1)
    assert schedule_to_csv(schedule) == "0F0,0F1,,,0B0,0B1,0U0\n,1F0,1F1,1B0,1B1,1U0\n"
    assert schedule_to_csv(schedule, include_updates=False).splitlines()[0] == (
        "0F0,0F1,,,0B0,0B1,"
    )


def test_csv_errors_name_row_and_cell(tmp_path: Path) -> None:
    with pytest.raises(ScheduleError, match=r"row 2 \(rank 1\): malformed action 'oops'"):
        schedule_from_csv("0F0,0B0\n1F0,oops\n")
    with pytest.raises(ScheduleError, match="holds no schedule"):
        schedule_from_csv("\n,,\n")
    with pytest.raises(ScheduleError, match="cannot read schedule file"):
        load_csv(tmp_path / "missing.csv")


def test_grid_marks_a_cell_and_windows_long_schedules() -> None:
    schedule, _ = build_schedule("pipedream", 2, None, 40)
    text = format_grid(schedule, mark=(1, 30), max_steps=10)
    assert "[" in text and "(steps 25..34 of" in text
    assert text.splitlines()[0].split() == [str(s) for s in range(25, 35)]


def test_torch_pipelining_reads_our_csv_and_we_read_its(tmp_path: Path) -> None:
    """Round trip through PyTorch's own parser and CSV writer (compute-only form)."""
    script = f"""
import csv
from torch.distributed.pipelining.schedules import _Action
from pipeoptim.plan import build_schedule
from pipeoptim.plan.actions import schedule_to_csv, schedule_from_csv
schedule, _ = build_schedule("1f1b", 4, 4, 1)
text = schedule_to_csv(schedule, include_updates=False)
rows = list(csv.reader(text.splitlines()))
torch_order = {{r: [_Action.from_str(c) for c in row] for r, row in enumerate(rows)}}
path = {str(tmp_path / "torch.csv")!r}
with open(path, "w", newline="") as f:
    w = csv.writer(f)
    for r in torch_order:
        w.writerow(torch_order[r])
back = schedule_from_csv(open(path).read())
for r, row in schedule.items():
    want = [None if a is None or a.kind.value == "U" else a for a in row]
    assert back[r][: len(want)] == want, (r, back[r], want)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_plan_package_does_not_import_torch() -> None:
    code = (
        "import sys, pipeoptim.plan, pipeoptim.plan.validate, pipeoptim.plan.passes, "
        "pipeoptim.plan.plan, pipeoptim.trace; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
