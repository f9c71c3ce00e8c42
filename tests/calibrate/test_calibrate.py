"""Calibration closes the loop: a run whose costs are known is predicted back exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeoptim.calibrate import calibrate, costs_from_trace, link_latencies
from pipeoptim.cli import main
from pipeoptim.errors import PipeoptimError
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.evaluate import evaluate_trace
from pipeoptim.trace import Trace


def as_measured(method: str, stages: int, mini_batches: int, costs: CostModel) -> Trace:
    """A simulated run dressed as a runtime trace: its costs are known exactly."""
    plan = Plan(method, stages, optimizer=OptimizerSpec("sgd", 0.1))
    trace = evaluate_trace(method, plan.shape(mini_batches), costs)
    trace.meta.update(
        source="runtime",
        plan=plan.to_dict(),
        batch_size=8,
        mini_batches=mini_batches,
        transport="dist",
    )
    return trace


def known_costs(stages: int) -> CostModel:
    return CostModel.uniform(
        stages,
        0.010,
        0.020,
        0.002,
        param_bytes=4096,
        activation_bytes=1024,
        samples_per_micro_batch=8,
    )


@pytest.mark.parametrize("method", ["pipeoptim", "pipedream"])
def test_recovers_the_costs_and_predicts_the_run(method: str) -> None:
    measured = as_measured(method, 3, 12, known_costs(3))
    costs = costs_from_trace(measured)
    assert costs.forward_s == pytest.approx((0.010,) * 3)
    assert costs.backward_s == pytest.approx((0.020,) * 3)
    assert costs.update_s == pytest.approx((0.002,) * 3)
    _, rows = calibrate(measured)
    by_name = {r.quantity: r for r in rows}
    for quantity in ("time per mini-batch (steady state)", "whole-run throughput", "bubble ratio"):
        assert abs(by_name[quantity].relative_error) < 1e-6, quantity


def test_link_latency_is_estimated_from_send_and_receive() -> None:
    from pipeoptim.trace import TraceEvent

    events = [
        TraceEvent(0, 0, "SEND_F", 0, 1.0, 1.1),
        TraceEvent(1, 1, "RECV_F", 0, 0.5, 1.4),  # waiting before the send: 0.4 s in flight
        TraceEvent(1, 1, "SEND_B", 0, 2.0, 2.1),
        TraceEvent(0, 0, "RECV_B", 0, 2.5, 2.6),  # posted late: the data was there
    ]
    assert link_latencies(Trace(events=events), 2) == [pytest.approx((0.4 + 0.1) / 2)]


def test_refuses_a_simulated_trace() -> None:
    trace = evaluate_trace("gpipe", Plan("gpipe", 2).shape(2), known_costs(2))
    with pytest.raises(PipeoptimError, match="needs a trace written by `pipeoptim train"):
        calibrate(trace)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.json"
    as_measured("pipeoptim", 2, 8, known_costs(2)).save(path)
    html = tmp_path / "cal.html"
    assert main(["calibrate", "--trace", str(path), "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "time per mini-batch (steady state)" in out and "+0.0%" in out
    assert html.exists()
    missing = tmp_path / "none.json"
    assert main(["calibrate", "--trace", str(missing)]) == 2
    assert "cannot read trace" in capsys.readouterr().err
