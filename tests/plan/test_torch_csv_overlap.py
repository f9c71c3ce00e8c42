"""PyTorch's DualPipeV (overlapped OVERLAP_F_B steps) and interleaved zero bubble, both ways,
at P = 4 and 8: its dumps load, validate and simulate here as our own methods do, and our
dumps of dualpipev and interleaved-zb load into PyTorch's ``_PipelineScheduleRuntime``.

The CSVs are generated here from ``torch.distributed.pipelining``'s classes on mock stages
(as ``test_torch_csv.py`` does for its other schedules); nothing is a stored golden file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.torch_schedules import mock_stages

from pipeoptim.cli import main
from pipeoptim.plan.actions import load_csv, schedule_to_csv
from pipeoptim.plan.methods import WeightPolicy, build_schedule
from pipeoptim.plan.validate import as_grid, validate
from pipeoptim.sim import CostModel, Program, evaluate_program

torch = pytest.importorskip("torch")
schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

OURS = {"ScheduleDualPipeV": "dualpipev", "ScheduleInterleavedZeroBubble": "interleaved-zb"}
SIZES = [(name, p) for name in OURS for p in (4, 8)]


def micro(p: int) -> int:
    return 2 * p  # DualPipeV's least (M >= 2P stages); a multiple of P for interleaved ZB


def torch_schedule(name: str, p: int) -> Any:
    return getattr(schedules, name)(mock_stages(name, 0, p), micro(p))


def texts(order: dict[int, list[Any]]) -> dict[int, list[str]]:
    """Each rank's actions as text, idle steps left out."""
    return {r: [str(a) for a in acts if a is not None] for r, acts in order.items()}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int, str], Path]:
    root = tmp_path_factory.mktemp("torch_overlap_dumps")
    out: dict[tuple[str, int, str], Path] = {}
    for name, p in SIZES:
        sched = torch_schedule(name, p)
        for fmt in ("compute_only", "compute_comms"):
            path = root / f"{name}-{p}-{fmt}.csv"
            sched._dump_csv(str(path), format=fmt)
            out[(name, p, fmt)] = path
    return out


@pytest.mark.parametrize(("name", "p"), SIZES)
def test_torch_dumps_load_validate_and_simulate_as_ours(
    name: str, p: int, dumps: dict[tuple[str, int, str], Path]
) -> None:
    m = micro(p)
    notes: list[str] = []
    loaded = as_grid(load_csv(dumps[(name, p, "compute_only")]), m, notes=notes)
    assert validate(loaded, m) == m
    overlapped = sum(a.overlapped for row in loaded.values() for a in row if a is not None)
    assert (overlapped > 0) == (name == "ScheduleDualPipeV")
    assert len(notes) == (1 if overlapped else 0)  # DualPipeV's dump is an order: placed
    # action for action PyTorch's order, and ours
    as_dumped = load_csv(dumps[(name, p, "compute_only")])
    assert texts(as_dumped) == _flat(torch_schedule(name, p).pipeline_order)
    ours, _ = build_schedule(OURS[name], p, m, 1)
    assert texts(loaded) == {
        r: [str(a) for a in row if a is not None and a.kind.value != "U"] for r, row in ours.items()
    }
    # the simulator runs it as ours: the same makespan at F = I = W = 1
    costs = CostModel.uniform(2 * p, 1.0, 2.0, 0.0)
    span = evaluate_program(Program(loaded, m, WeightPolicy.FLUSH), costs).makespan
    ours_compute = {
        r: [a for a in row if a is None or a.kind.value != "U"] for r, row in ours.items()
    }
    assert span == evaluate_program(Program(ours_compute, m, WeightPolicy.FLUSH), costs).makespan

    # the lowered dump (sends, receives, FSDP/DP cells) validates as a per-rank order
    lowered = load_csv(dumps[(name, p, "compute_comms")], notes=notes)
    assert validate(lowered, m) == m
    assert sum(a.overlapped for row in lowered.values() for a in row if a is not None) == overlapped


def _flat(order: dict[int, list[Any]]) -> dict[int, list[str]]:
    """PyTorch's order as our text: an OVERLAP_F_B action as its two sub-actions."""
    out: dict[int, list[str]] = {}
    for r, acts in order.items():
        row: list[str] = []
        for a in acts:
            if a is None:
                continue
            row += [str(s) for s in a.sub_actions] if a.sub_actions else [str(a)]
        out[r] = row
    return out


@pytest.mark.parametrize(("name", "p"), SIZES)
def test_cli_loads_torch_dumps(
    name: str, p: int, dumps: dict[tuple[str, int, str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["schedule", "--load", str(dumps[(name, p, "compute_only")])]) == 0
    out = capsys.readouterr().out
    assert len([line for line in out.splitlines() if line.startswith("rank ")]) == p
    assert ("OVERLAP_F_B" in out) == (name == "ScheduleDualPipeV")


@pytest.mark.parametrize(("name", "p"), SIZES)
def test_torch_runtime_loads_our_dumps(name: str, p: int, tmp_path: Path) -> None:
    """Our grid, written without updates, loads into PyTorch's runtime (its own
    validation and lowering run), holding PyTorch's own order."""
    m = micro(p)
    grid, _ = build_schedule(OURS[name], p, m, 1)
    path = tmp_path / "ours.csv"
    path.write_text(schedule_to_csv(grid, include_updates=False))
    assert "OVERLAP_F_B" in path.read_text() or name != "ScheduleDualPipeV"
    runtime = schedules._PipelineScheduleRuntime(mock_stages(name, 0, p), m)
    runtime._load_csv(str(path), format="compute_only")
    assert _flat(runtime.pipeline_order) == _flat(torch_schedule(name, p).pipeline_order)
    assert runtime.pipeline_order_with_comms  # PyTorch lowered it (sends and receives)
    assert dict(runtime.stage_index_to_group_rank) == dict(
        torch_schedule(name, p).stage_index_to_group_rank
    )
