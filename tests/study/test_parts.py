"""The study in resumable parts (issue 65, ``examples/convergence/run.py --part``): which
part each run belongs to, the order within a part (Muon and AdamW rows first, the longest
first), the equal-time part from the rows on file, and the run-time estimate."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from support.depth_study import CONFIG, RATES

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.profile import Profile
from pipeoptim.study import grid
from pipeoptim.study.grid import main_specs, relative_cost, run_specs
from pipeoptim.study.parts import estimated_seconds, part_of, part_order, part_specs
from pipeoptim.study.runs import CurvePoint, RunRecord, RunSpec
from pipeoptim.workloads.loader import build_model

ONE_STEP = ("xpipe", "2bw")


def _record(spec: RunSpec, loss: float = 1.5, seconds: float = 1.0) -> RunRecord:
    point = CurvePoint(spec.steps, spec.steps * 32, loss, math.exp(loss), loss)
    return RunRecord(spec, [point], None, seconds)


def test_each_run_belongs_to_one_part() -> None:
    parts = {(s.label, part_of(s, ONE_STEP)) for s in main_specs(CONFIG, RATES)}
    assert parts == {
        ("gpipe", "main"),
        ("gpipe (muon)", "main"),
        ("pipedream", "main"),
        ("xpipe", "one-step"),
        ("2bw", "one-step"),
        ("xpipe (muon)", "one-step"),
        ("xpipe M=2 (muon)", "dial"),
        ("xpipe M=4 (muon)", "dial"),
        ("pipedream+pipemare λ=0.25", "extrapolate"),
        ("pipedream+pipemare λ=1", "extrapolate"),
    }


def test_muon_and_adamw_rows_first_then_the_longest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    short = CONFIG.spec("xpipe", "adamw", 2e-3, 8, 0, micro_batch_count=2)
    long_nadam = CONFIG.spec("xpipe", "adamw", 2e-3, 8, 0, trained_optimizer="nadam")
    muon = CONFIG.spec("xpipe", "adamw", 2e-3, 8, 0, trained_optimizer="muon")
    plain = CONFIG.spec("xpipe", "adamw", 2e-3, 8, 0)
    assert relative_cost(long_nadam) > relative_cost(short)
    started: list[str] = []

    def fake_run(spec: RunSpec) -> RunRecord:
        started.append(spec.label)
        return _record(spec)

    monkeypatch.setattr(grid, "run_one", fake_run)
    path = tmp_path / "runs.jsonl"
    run_specs([short, long_nadam, muon, plain], path, order=part_order(("muon", "adamw")))
    assert started == ["xpipe (muon)", "xpipe", "xpipe M=2", "xpipe (nadam)"]
    started.clear()
    run_specs([short, long_nadam, muon, plain], path, order=part_order(("muon", "adamw")))
    assert started == []  # resumed: every run is on file


def test_part_specs_and_the_equal_time_part_from_the_rows_on_file(tmp_path: Path) -> None:
    folder = tmp_path / "gpt-deep"
    folder.mkdir()
    on_file = [s for s in main_specs(CONFIG, RATES) if s.label in ("gpipe", "xpipe")]
    (folder / "runs.jsonl").write_text(
        "".join(json.dumps(_record(s).to_dict()) + "\n" for s in on_file)
    )
    dial, notes = part_specs(CONFIG, folder, "dial", one_step=ONE_STEP)
    assert [s.label for s in dial] == ["xpipe M=2 (muon)", "xpipe M=4 (muon)"] and not notes
    units = len(build_model("gpt-deep", 0)[0])
    profile = Profile.uniform(units, forward_s=0.5, backward_s=1.0, batch_size=32)
    timed, notes = part_specs(CONFIG, folder, "equal-time", one_step=ONE_STEP, profile=profile)
    assert notes == []
    assert {s.label for s in timed} >= {"xpipe", "2bw", "xpipe (muon)", "xpipe M=2 (muon)"}
    assert all(s.stages == 8 and s.seed == 0 for s in timed)
    with pytest.raises(RuntimeConfigError, match="unknown part"):
        part_specs(CONFIG, folder, "everything", one_step=ONE_STEP)


def test_the_estimate_scales_the_measured_seconds_of_similar_rows() -> None:
    xpipe = _record(CONFIG.spec("xpipe", "adamw", 2e-3, 8, 0), seconds=60.0)
    gpipe = _record(CONFIG.spec("gpipe", "adamw", 2e-3, 8, 0), seconds=10.0)
    rate = {r.spec.method: r.seconds / relative_cost(r.spec) for r in (xpipe, gpipe)}
    dial = CONFIG.spec("xpipe", "adamw", 2e-3, 8, 0, micro_batch_count=2)
    assert estimated_seconds([dial], [xpipe, gpipe]) == pytest.approx(
        rate["xpipe"] * relative_cost(dial)  # the same method and depth
    )
    other = CONFIG.spec("2bw", "adamw", 2e-3, 8, 0)
    both = (rate["xpipe"] + rate["gpipe"]) / 2  # the same depth: their median
    assert estimated_seconds([other], [xpipe, gpipe], workers=2) == pytest.approx(
        both * relative_cost(other) / 2
    )
    assert math.isnan(estimated_seconds([other], []))
    assert estimated_seconds([], [xpipe]) == 0.0
