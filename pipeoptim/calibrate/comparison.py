"""The measured run predicted on its own calibrated costs, and the two side by side."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipeoptim.calibrate.runs import trace_plan
from pipeoptim.calibrate.trace_costs import costs_from_trace
from pipeoptim.errors import PipeoptimError
from pipeoptim.metrics import COMPUTE_KINDS, RunMetrics, compute_metrics
from pipeoptim.sim.collectives import Cluster
from pipeoptim.sim.evaluate import evaluate_trace
from pipeoptim.trace import Trace


@dataclass(frozen=True)
class Comparison:
    """One quantity, measured against predicted."""

    quantity: str
    measured: float
    predicted: float
    unit: str

    @property
    def relative_error(self) -> float:
        """(predicted - measured) / measured; NaN when nothing was measured."""
        if self.measured == 0:
            return math.nan
        return (self.predicted - self.measured) / self.measured

    def to_dict(self) -> dict[str, float | str]:
        """The row as ``calibrate --json`` prints it."""
        return {
            "quantity": self.quantity,
            "measured": self.measured,
            "predicted": self.predicted,
            "unit": self.unit,
            "relative_error": self.relative_error,
        }


def predict_run(trace: Trace, cluster: Cluster | None = None) -> Trace:
    """The simulator's Trace of the measured run's method and shape on calibrated costs
    (its D replicas' all-reduce on ``cluster``, default :func:`run_cluster`)."""
    plan = trace_plan(trace)
    mini_batches = int(trace.meta.get("mini_batches") or 0)
    if mini_batches < 1:
        raise PipeoptimError("the trace records no mini-batches; was the run empty?")
    shape = plan.shape(mini_batches)
    predicted = evaluate_trace(plan.method, shape, costs_from_trace(trace, cluster))
    predicted.meta["batch_size"] = trace.meta.get("batch_size")
    return predicted


def compare(measured: RunMetrics, predicted: RunMetrics, batch_size: float) -> list[Comparison]:
    """Iteration time, throughput, bubble ratio and peak memory, side by side."""

    def per_batch(m: RunMetrics) -> float:
        return batch_size / m.steady_throughput if m.steady_throughput > 0 else 0.0

    rows = [
        Comparison(
            "time per mini-batch (steady state)", per_batch(measured), per_batch(predicted), "s"
        ),
        Comparison("whole-run throughput", measured.throughput, predicted.throughput, "samples/s"),
        Comparison("bubble ratio", measured.bubble_ratio, predicted.bubble_ratio, ""),
    ]
    if measured.peak_memory_bytes is not None and predicted.peak_memory_bytes is not None:
        rows.append(
            Comparison(
                "peak memory, fullest rank",
                float(measured.peak_memory_bytes),
                float(predicted.peak_memory_bytes),
                "B",
            )
        )
    return rows


def calibrate(trace: Trace, cluster: Cluster | None = None) -> tuple[Trace, list[Comparison]]:
    """Predict the measured run and compare; returns the predicted trace and the rows
    (``cluster``: the links of a data-parallel run's all-reduce, default
    :func:`run_cluster`)."""
    predicted = predict_run(trace, cluster)
    batch = float(trace.meta.get("batch_size") or 1)
    return predicted, compare(compute_metrics(trace), compute_metrics(predicted), batch)


BUBBLE_NOTE_RATIO = 1.1
"""Where the simulated actions hold this much more time than the run's compute events,
:func:`bubble_note` says why the bubble ratios differ."""


def compute_seconds(trace: Trace) -> float:
    """The summed durations of a trace's compute events (what its bubble ratio counts busy)."""
    return sum(e.duration for e in trace.events if e.kind in COMPUTE_KINDS)


def compute_ratio(measured: Trace, predicted: Trace) -> float:
    """The simulated actions' time over the run's compute time (nan where the run has none):
    how much of the messages' fixed cost and the executor's time calibration charged to
    the actions."""
    run = compute_seconds(measured)
    return compute_seconds(predicted) / run if run > 0 else math.nan


def bubble_note(measured: Trace, predicted: Trace) -> str | None:
    """Why the bubble ratios of a calibration differ by construction, where they do: the
    simulated actions carry the fixed cost of each message and the executor's time between
    actions (calibration charges them to the actions, so the time per mini-batch comes out
    right), which the run's trace leaves outside its compute events, as idle. None where
    the two hold about the same compute time (large actions: the bubbles compare)."""
    ratio = compute_ratio(measured, predicted)
    if not ratio > BUBBLE_NOTE_RATIO:  # nan (no compute events) included
        return None
    return (
        f"note: the bubble ratios differ by construction here: the simulated actions hold "
        f"{ratio:.1f}x the run's compute time, since they carry each message's fixed "
        f"cost and the executor's time between actions, which the run's trace counts as idle "
        f"(outside its compute events); compare the time per mini-batch and the throughput"
    )


def format_comparison(rows: Sequence[Comparison]) -> list[list[str]]:
    """Table rows: quantity, measured, predicted, relative error in percent."""

    def show(value: float, unit: str) -> str:
        if unit == "B":
            from pipeoptim.plan.units import format_bytes

            return format_bytes(int(value))
        return f"{value:.4g}" + (f" {unit}" if unit else "")

    return [
        [
            r.quantity,
            show(r.measured, r.unit),
            show(r.predicted, r.unit),
            "n/a" if math.isnan(r.relative_error) else f"{100 * r.relative_error:+.1f}%",
        ]
        for r in rows
    ]
