"""Equal time (issue 65): each row trains as many updates as its simulated throughput buys
in the time zb-h1 under the row's optimizer needs for the study's updates; zb-h1's loss in
that time is gpipe's. Throughputs here are fakes, so the step counts are known exactly."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from support.depth_study import CONFIG, RATES, fake_speed

from pipeoptim.errors import PlanError, RuntimeConfigError
from pipeoptim.study.cells import aggregate
from pipeoptim.study.equal_time import (
    equal_time_results,
    equal_time_specs,
    equal_time_steps,
    reached_share,
)
from pipeoptim.study.grid import main_specs
from pipeoptim.study.runs import CurvePoint, RunRecord, RunSpec
from pipeoptim.study.tables import equal_time_table


def _record(spec: RunSpec, loss: float) -> RunRecord:
    point = CurvePoint(spec.steps, spec.steps * 32, loss, math.exp(loss), loss)
    return RunRecord(spec, [point], None, 1.0)


def test_the_steps_scale_as_the_throughput_ratio() -> None:
    assert equal_time_steps(2000, 1.0, 1.0) == 2000
    assert equal_time_steps(2000, 1.0, 0.5) == 4000  # twice the throughput, twice the updates
    assert equal_time_steps(2000, 3.0, 4.0) == 1500
    assert equal_time_steps(1000, 1.0, 3.0) == 333  # rounded to a whole update
    assert equal_time_steps(1, 1.0, 100.0) == 1  # at least one
    with pytest.raises(RuntimeConfigError, match="positive, finite"):
        equal_time_steps(100, 1.0, math.nan)


def test_equal_time_specs_for_the_named_rows_their_dial_and_the_best_lambda() -> None:
    specs = main_specs(CONFIG, RATES)
    # λ = 1 ended lower than λ = 0.25: it is the extrapolation's equal-time row
    losses = {"pipedream+pipemare λ=0.25": 1.6, "pipedream+pipemare λ=1": 1.55}
    cells = aggregate(_record(s, losses[s.label]) for s in specs if s.label in losses)
    timed = equal_time_specs(CONFIG, RATES, cells, fake_speed)
    by = {s.label: s for s in timed}
    assert list(by) == [
        "xpipe",
        "2bw",
        "xpipe (muon)",
        "xpipe M=2 (muon)",
        "xpipe M=4 (muon)",
        "pipedream+pipemare λ=1",
    ]
    assert by["xpipe"].steps == 125 and by["xpipe"].equal_time  # 1.0 / 0.8 x 100
    assert by["xpipe (muon)"].steps == 50  # Muon's budget: zb-h1 (muon)'s 2.0 / 4.0
    assert by["xpipe M=2 (muon)"].steps == 200
    assert by["xpipe M=4 (muon)"].steps == 125
    assert by["pipedream+pipemare λ=1"].steps == 200
    # the schedule and everything else are the row's; only the steps and the flag differ
    assert replace(by["xpipe"], steps=100, equal_time=False, closure=False) == replace(
        next(s for s in specs if s.label == "xpipe"), closure=False
    )
    # as fast as zb-h1: its equal-sample run is its equal-time run, nothing new to train
    two = next(s for s in specs if s.label == "2bw")
    assert by["2bw"] == two and not two.equal_time
    # no extrapolation row finished: none is the best yet
    assert "pipedream+pipemare λ=1" not in {
        s.label for s in equal_time_specs(CONFIG, RATES, {}, fake_speed)
    }


def test_the_table_shows_each_rows_loss_against_gpipes_and_what_is_missing() -> None:
    specs = main_specs(CONFIG, RATES)
    finals = {"gpipe": 1.50, "gpipe (muon)": 1.40, "xpipe": 1.52}
    cells = aggregate(_record(s, finals[s.label]) for s in specs if s.label in finals)
    done = [
        _record(s, 1.47)
        for s in equal_time_specs(CONFIG, RATES, cells, fake_speed)
        if s.label == "xpipe"
    ]

    # a row whose schedule the simulator refuses has no budget, said so
    def speed(label: str, stages: int) -> float:
        if label == "xpipe M=4 (muon)":
            raise PlanError("xpipe refuses M=4 here; use another M")
        return fake_speed(label, stages)

    results = equal_time_results(CONFIG, RATES, cells, done, speed)
    by = {r.label: r for r in results}
    assert by["zb-h1"].loss == 1.50 and by["zb-h1 (muon)"].loss == 1.40
    assert by["xpipe"].steps == 125 and by["xpipe"].loss == 1.47
    assert by["xpipe"].excess == pytest.approx(1.47 / 1.50 - 1)
    assert not by["xpipe (muon)"].run and math.isnan(by["xpipe (muon)"].loss)
    assert by["xpipe M=4 (muon)"].not_simulated == "xpipe refuses M=4 here"
    assert "pipedream+pipemare best λ" in by  # named, no λ finished
    lines = equal_time_table(CONFIG, results)
    row = {line.split(" | ")[1]: line for line in lines if line.startswith("| 8 |")}
    assert row["xpipe"] == "| 8 | xpipe | 125 | 1.470 | -2.0 % | 1.00x |"
    assert row["zb-h1"] == "| 8 | zb-h1 | 100 | 1.500 | +0.0 % | 1.00x |"
    assert row["xpipe (muon)"] == "| 8 | xpipe (muon) | 50 | not run | — | — |"
    assert "no budget: xpipe refuses M=4 here" in row["xpipe M=4 (muon)"]
    assert "no λ finished yet" in row["pipedream+pipemare best λ"]


def test_a_run_trained_on_an_older_profile_is_still_the_rows() -> None:
    """The budget is simulated again at each report: a profile taken since changes the
    step count, and the run on file (with the updates it was given) still answers."""
    specs = main_specs(CONFIG, RATES)
    cells = aggregate(_record(s, 1.5) for s in specs if s.label == "gpipe")
    old = next(s for s in equal_time_specs(CONFIG, RATES, cells, fake_speed) if s.label == "xpipe")
    done = [_record(replace(old, steps=118), 1.49)]
    by = {r.label: r for r in equal_time_results(CONFIG, RATES, cells, done, fake_speed)}
    assert by["xpipe"].run and by["xpipe"].steps == 118 and by["xpipe"].loss == 1.49


def test_the_time_to_the_references_loss_is_the_budget_share_at_the_first_evaluation_below_it() -> (
    None
):
    """An equal-time run whose curve passes gpipe's final loss at 300 of its 400 updates took
    0.75 of zb-h1's time to it; one that ends above it never got there within the budget."""
    spec = replace(main_specs(CONFIG, RATES)[0], steps=400, equal_time=True)
    losses = {100: 1.9, 200: 1.6, 300: 1.49, 400: 1.45}
    curve = [
        CurvePoint(step, step * 32, loss, math.exp(loss), loss) for step, loss in losses.items()
    ]
    record = RunRecord(spec, curve, None, 1.0)
    assert reached_share(record, 1.50) == pytest.approx(0.75)
    assert reached_share(record, 1.45) == pytest.approx(1.0)
    assert math.isnan(reached_share(record, 1.40))
