"""PyTorch's own schedule dumps load and validate, and PyTorch loads what we export.

The CSVs are generated here with ``torch.distributed.pipelining``'s schedule classes on mock
stages (the constructors only read a stage's index, the stage count and the group rank and
size), in both ``_dump_csv`` formats: ``compute_only`` (a clock grid) and the lowered
``compute_comms`` (UNSHARD/RESHARD, SEND/RECV, REDUCE_GRAD). Nothing here is a stored
golden file: the expectations are read from the schedule objects themselves.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support.torch_schedules import RANKS, mock_stages

from pipeoptim.cli import main
from pipeoptim.plan import build_schedule
from pipeoptim.plan.actions import Action, Kind, load_csv, save_csv, schedule_to_csv
from pipeoptim.plan.orders import OrderArrays
from pipeoptim.plan.passes import merge_backward, split_backward
from pipeoptim.plan.schedules import retime, stage_ranks
from pipeoptim.plan.validate import validate

torch = pytest.importorskip("torch")
schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

MICRO = 8
CLASSES = [
    "ScheduleInterleaved1F1B",
    "ScheduleLoopedBFS",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
]
SPLIT = {"ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"}
DROPPED = {"UNSHARD", "RESHARD", "REDUCE_GRAD"}
USERS = {
    Kind.RECV_F: {Kind.FORWARD},
    Kind.RECV_B: {Kind.BACKWARD, Kind.BACKWARD_INPUT},  # what a received gradient feeds
}


def torch_schedule(name: str) -> Any:
    return getattr(schedules, name)(mock_stages(name), MICRO)


def cells(order: dict[int, list[Any]]) -> dict[int, list[str]]:
    """PyTorch's order as its CSV text, rank by rank (None as an empty cell)."""
    return {r: ["" if a is None else str(a) for a in acts] for r, acts in order.items()}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("torch_dumps")
    out: dict[tuple[str, str], Path] = {}
    for name in CLASSES:
        sched = torch_schedule(name)
        for fmt in ("compute_only", "compute_comms"):
            path = root / f"{name}-{fmt}.csv"
            sched._dump_csv(str(path), format=fmt)
            out[(name, fmt)] = path
    return out


def kind_counts(schedule: dict[int, list[Action | None]]) -> Counter[Kind]:
    return Counter(a.kind for acts in schedule.values() for a in acts if a is not None)


@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
@pytest.mark.parametrize("name", CLASSES)
def test_torch_dumps_load_and_validate(
    name: str, fmt: str, dumps: dict[tuple[str, str], Path]
) -> None:
    sched = torch_schedule(name)
    order = sched.pipeline_order if fmt == "compute_only" else sched.pipeline_order_with_comms
    notes: list[str] = []
    loaded = load_csv(dumps[(name, fmt)], notes=notes)
    assert validate(loaded, MICRO) == MICRO

    # cell for cell what PyTorch holds, its FSDP/DP bookkeeping left idle
    want = cells(order)
    dropped = sum(c.lstrip("0123456789") in DROPPED for row in want.values() for c in row)
    for r, row in want.items():
        kept = ["" if c.lstrip("0123456789") in DROPPED else c for c in row]
        assert [("" if a is None else str(a)) for a in loaded[r]] == kept
    if fmt == "compute_comms":
        assert dropped > 0
        assert notes == [notes[0]] and f"{dropped} UNSHARD/RESHARD/REDUCE_GRAD" in notes[0]
        assert "FSDP" in notes[0] and "update" in notes[0]
    else:
        assert dropped == 0 and notes == []

    # every stage runs every micro-batch forward and one backward, split or full
    stages = 2 * RANKS
    counts = kind_counts(loaded)
    assert counts[Kind.FORWARD] == stages * MICRO
    if name in SPLIT:
        assert counts[Kind.BACKWARD_INPUT] == counts[Kind.BACKWARD_WEIGHT] == stages * MICRO
        assert counts[Kind.BACKWARD] == 0
    else:
        assert counts[Kind.BACKWARD] == stages * MICRO
        assert counts[Kind.BACKWARD_INPUT] == counts[Kind.BACKWARD_WEIGHT] == 0
    assert stage_ranks(loaded) == dict(sched.stage_index_to_group_rank)

    if fmt == "compute_comms":
        # the transfers map onto ours: a send names the sender, its receive the receiver,
        # on the rank that runs that stage; and a receive comes before the action using it
        comm = {a for acts in loaded.values() for a in acts if a is not None and a.kind.is_comm}
        assert comm
        for a in comm:
            if a.kind is Kind.SEND_F:
                assert Action(a.stage + 1, Kind.RECV_F, a.mb) in comm
            if a.kind is Kind.SEND_B:
                assert Action(a.stage - 1, Kind.RECV_B, a.mb) in comm
        for acts in loaded.values():
            row = [a for a in acts if a is not None]
            for i, a in enumerate(row):
                if a.kind in USERS:
                    assert any(
                        b.kind in USERS[a.kind] and (b.stage, b.mb) == (a.stage, a.mb)
                        for b in row[i + 1 :]
                    ), f"{a} is used by nothing after it on its rank"


@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
@pytest.mark.parametrize("name", CLASSES)
def test_cli_loads_torch_dumps_with_one_note(
    name: str, fmt: str, dumps: dict[tuple[str, str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = dumps[(name, fmt)]
    assert main(["schedule", "--load", str(path)]) == 0
    out, err = capsys.readouterr()
    rows = [line for line in out.splitlines() if line.startswith("rank ")]
    assert [line.split()[:2] for line in rows] == [["rank", str(r)] for r in range(RANKS)]
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    assert len(notes) == (1 if fmt == "compute_comms" else 0)
    assert "dropped" not in err

    assert main(["schedule", "--load", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["notes"]) == len(notes) and doc["ranks"] == RANKS

    # as CSV on stdout the note goes to stderr, so the CSV stays one row per rank
    assert main(["schedule", "--load", str(path), "--format", "csv"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == RANKS
    assert err.count("note:") == len(notes)


def test_split_schedules_simulate_as_loaded_and_merged(
    dumps: dict[tuple[str, str], Path],
) -> None:
    from pipeoptim.plan.methods import WeightPolicy
    from pipeoptim.sim.program import Program

    loaded = load_csv(dumps[("ScheduleZBVZeroBubble", "compute_only")])
    split = Program(loaded, MICRO, WeightPolicy.FLUSH)
    assert split.size == OrderArrays.from_order(loaded).size
    merged = merge_backward(loaded)
    whole = Program(merged, MICRO, WeightPolicy.FLUSH)
    assert whole.size == OrderArrays.from_order(merged).size
    assert split.size == whole.size + sum(1 for k in whole.kind if k == 1)  # B -> I + W


def test_torch_reads_our_split_export(tmp_path: Path) -> None:
    """PyTorch validates and lowers our I/W export, and its lowered dump loads back here."""
    schedule, shape = build_schedule("interleaved-1f1b", RANKS, MICRO, 1, 2)
    grid = retime(split_backward(schedule), shape.micro_batches)
    validate(grid)
    path = tmp_path / "ours.csv"
    path.write_text(schedule_to_csv(grid, include_updates=False))

    runtime = schedules._PipelineScheduleRuntime(mock_stages("ScheduleInterleaved1F1B"), MICRO)
    runtime._load_csv(str(path), format="compute_only")  # runs PyTorch's _validate_schedule
    ours = {
        r: ["" if a is None or a.kind is Kind.UPDATE else str(a) for a in row]
        for r, row in grid.items()
    }
    theirs = cells(runtime.pipeline_order)
    for r in ours:  # PyTorch keeps trailing idle cells our CSV writer has not written
        assert theirs[r][: len(ours[r])] == ours[r]
        assert all(c == "" for c in theirs[r][len(ours[r]) :])
    lowered = Counter(
        a.computation_type.value for row in runtime.pipeline_order_with_comms.values() for a in row
    )
    assert lowered["I"] == lowered["W"] == shape.num_stages * MICRO

    back = tmp_path / "lowered.csv"
    runtime._dump_csv(str(back), format="compute_comms")
    notes: list[str] = []
    again = load_csv(back, notes=notes)
    assert validate(again, MICRO) == MICRO and len(notes) == 1
    assert Counter(str(a) for row in again.values() for a in row if a and a.kind.is_compute) == (
        Counter(str(a) for row in grid.values() for a in row if a and a.kind is not Kind.UPDATE)
    )


def test_our_export_of_torch_dumps_round_trips_through_torch(
    dumps: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    for name in SPLIT:
        loaded = load_csv(dumps[(name, "compute_only")])
        path = tmp_path / f"{name}.csv"
        save_csv(loaded, path)
        runtime = schedules._PipelineScheduleRuntime(mock_stages(name), MICRO)
        runtime._load_csv(str(path), format="compute_only")
        assert cells(runtime.pipeline_order) == cells(torch_schedule(name).pipeline_order)


def test_runtime_plans_a_synchronous_split_backward() -> None:
    """The runtime's planning step takes a flushed schedule with I/W as it is: the lowered
    order receives the gradient before each I and sends its input gradient after it."""
    from pipeoptim.plan.methods import Method, WeightPolicy
    from pipeoptim.plan.schedules import one_f_one_b
    from pipeoptim.plan.shape import Shape
    from pipeoptim.runtime.segments import segment_plan

    def split(shape: Shape) -> dict[int, list[Action]]:
        return split_backward(one_f_one_b(shape))

    method = Method("zb-test", "1f1b with split backwards", split, WeightPolicy.FLUSH)
    plan = segment_plan(method, Shape(2, 2, 1))
    rank0 = [str(a) for a in plan.actions[0]]
    assert rank0.index("0RECV_B0") < rank0.index("0I0") < rank0.index("0W0")
