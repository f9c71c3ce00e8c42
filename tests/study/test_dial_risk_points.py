"""The dial's rows are points of the κ fit at the delay of their own M (issue 65, item 1:
the planner chooses M from the risk the refit model predicts for that delay)."""

from __future__ import annotations

import math

from support.depth_study import CONFIG, RATES

from pipeoptim.plan.risk import schedule_versions
from pipeoptim.study.cells import aggregate
from pipeoptim.study.grid import main_specs
from pipeoptim.study.runs import CurvePoint, RunRecord, RunSpec
from pipeoptim.study.targets import gpipe_finals, risk_points


def _record(spec: RunSpec, losses: list[float]) -> RunRecord:
    step = spec.steps // len(losses)
    curve = [
        CurvePoint(step * (i + 1), step * (i + 1) * 32, x, math.exp(x), x)
        for i, x in enumerate(losses)
    ]
    return RunRecord(spec, curve, None, 1.0)


def test_the_dials_rows_are_kappa_points_at_the_delay_of_their_m() -> None:
    specs = main_specs(CONFIG, RATES)
    curves = {"gpipe (muon)": [1.6, 1.4], "xpipe M=2 (muon)": [1.7, 1.5]}
    cells = aggregate(_record(s, curves[s.label]) for s in specs if s.label in curves)
    targets = gpipe_finals(CONFIG, cells, RATES, within=0.0, label="gpipe (muon)")
    # stage 0's prediction measured to close half its stale distance
    closed = [
        {"method": "xpipe M=2 (muon)", "optimizer": "muon", "lr": 2e-3, "stages": 8}
        | {"stage": 0, "closed": 0.5}
    ]
    points = risk_points(CONFIG, cells, RATES, {"gpipe (muon)": targets}, closed)
    dial = [p for p in points if p.method == "xpipe" and p.optimizer == "muon"]
    assert len(dial) == 1  # M=2 trained; M=4 did not
    # e = s·(1 − c) at stage 0 with s its distance at M = 2 (4), not M = P's 1
    distances, _ = schedule_versions("xpipe", 8, 2)
    assert distances[0] == 4
    assert dial[0].uncorrected == 4 * (1 - 0.5)
    # it ended at gpipe's loss after 1,600 samples' worth: 1.5 is gpipe's at half its run
    assert dial[0].extra_samples > 0
