"""The language model's tables beyond equal samples (issue 65): the time to gpipe's final
loss as a share of zb-h1's, the closure per s and M, and the report drawing them (with the
equal-time table) on records where the new rows are missing."""

from __future__ import annotations

import json
import math
from pathlib import Path

from support.depth_study import CONFIG, RATES

from pipeoptim.plan.profile import Profile
from pipeoptim.study.grid import main_specs
from pipeoptim.study.report import write_study_report
from pipeoptim.study.runs import CurvePoint, RunRecord, RunSpec
from pipeoptim.study.tables import closure_by_micro_batches_table, time_ratio_table
from pipeoptim.study.targets import TimeToTarget
from pipeoptim.workloads.loader import build_model


def test_time_ratio_is_against_zb_h1_under_the_same_optimizer() -> None:
    rows = [
        TimeToTarget("zb-h1", "adamw", 8, 1, 1, 1000.0, 1.0),
        TimeToTarget("zb-h1 (muon)", "adamw", 8, 1, 1, 1000.0, 2.0),
        TimeToTarget("xpipe", "adamw", 8, 1, 1, 1000.0, 0.8),
        TimeToTarget("xpipe (muon)", "adamw", 8, 1, 1, 500.0, 2.0),
        TimeToTarget("2bw", "adamw", 8, 0, 1, math.nan, 1.0),
    ]
    lines = time_ratio_table(CONFIG, rows)
    row = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ")}
    assert row["xpipe"] == "| xpipe | 0.80x |"
    assert row["xpipe (muon)"] == "| xpipe (muon) | 0.50x |"  # against zb-h1 (muon), not zb-h1
    assert row["2bw"] == "| 2bw | never (0/1) |"
    assert row["xpipe M=2 (muon)"] == "| xpipe M=2 (muon) | not run |"
    assert row["zb-h1"] == "| zb-h1 | 1.00x |"


def test_closure_per_s_and_m_reads_the_dial_rows_at_their_m() -> None:
    def row(method: str, rule: str | None, stages: int, s: int, closed: float) -> dict:
        return {
            "model": "gpt-deep",
            "method": method,
            "rule_of": rule,
            "optimizer": "muon",
            "lr": 2e-3,
            "stages": stages,
            "stage": 0,
            "s": s,
            "closed": closed,
            "samples": 10,
        }

    rows = [
        row("pipeoptim (muon)", "pipeoptim", 8, 7, 0.3),
        row("pipeoptim (muon)", "pipeoptim", 8, 1, 0.6),
        row("pipeoptim M=2 (muon)", "pipeoptim", 8, 3, 0.5),
        row("pipeoptim M=2 (muon)", "pipeoptim", 4, 1, 0.7),
        row("xpipe (muon)", "xpipe", 8, 1, 0.8),
        row("xpipe (muon)", "xpipe", 8, 1, 0.6),
        row("pipeoptim+Ŵbackward (muon)", None, 8, 1, 0.1),  # a variant: no rule of its own
        row("pipeoptim (muon)", "pipeoptim", 8, 2, 0.9),
    ]
    rows[-1]["lr"] = 1e-3  # another rate: left out
    lines = closure_by_micro_batches_table(rows, {"muon": 2e-3})
    assert lines[0] == "| method | optimizer | M | s=1 | s=3 | s=7 |"
    assert lines[2:] == [
        "| pipeoptim | muon | 1 | 60% |  | 30% |",
        "| pipeoptim | muon | 2 | 70% | 50% |  |",
        "| xpipe | muon | 8 | 70% |  |  |",
    ]


def test_the_report_draws_the_new_tables_with_the_new_rows_missing(tmp_path: Path) -> None:
    specs = [s for s in main_specs(CONFIG, RATES) if s.label in ("gpipe", "gpipe (muon)", "xpipe")]
    losses = {"gpipe": 1.5, "gpipe (muon)": 1.4, "xpipe": 1.52}

    def record(spec: RunSpec) -> RunRecord:
        loss = losses[spec.label]
        curve = [
            CurvePoint(50, 1600, loss + 0.2, math.exp(loss + 0.2), loss),
            CurvePoint(100, 3200, loss, math.exp(loss), loss),
        ]
        return RunRecord(spec, curve, None, 2.0)

    folder = tmp_path / "gpt-deep"
    folder.mkdir()
    (folder / "runs.jsonl").write_text(
        "".join(json.dumps(record(s).to_dict()) + "\n" for s in specs)
    )
    units = len(build_model("gpt-deep", 0)[0])
    profile = Profile.uniform(units, forward_s=0.5, backward_s=1.0, batch_size=32)
    text = write_study_report(tmp_path, [CONFIG], {"gpt-deep": profile}).read_text()
    assert "### Time to gpipe's final loss against zb-h1 (chosen rate)" in text
    assert "| gpipe | " in text and "| xpipe | never (0/1) |" in text
    assert "| xpipe M=2 (muon) | not run |" in text
    assert "### Equal time: the loss in zb-h1's time (chosen rate)" in text
    assert "| 8 | zb-h1 | 100 | 1.500 | +0.0 % |" in text
    assert "| 8 | xpipe (muon) |" in text and "not run" in text
