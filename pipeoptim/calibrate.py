"""Calibration: feed what a run measured back into the simulator and see how close it was.

A runtime Trace carries every action's measured duration and every rank's memory. The
per-stage medians become a :class:`~pipeoptim.sim.costs.CostModel`; the simulator replays
the run's own method and shape on it; the two Traces go through the same metrics function,
and the comparison lists predicted against measured with the relative error. This is the
one place that reads runtime output and drives the simulator; it needs no torch (both sides
speak the shared Trace).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from pipeoptim.errors import PipeoptimError
from pipeoptim.metrics import RunMetrics, compute_metrics
from pipeoptim.plan.plan import Plan
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.evaluate import evaluate_trace
from pipeoptim.trace import Trace, TraceEvent


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


def _plan_of(trace: Trace) -> Plan:
    data = trace.meta.get("plan")
    if trace.meta.get("source") != "runtime" or not isinstance(data, dict):
        raise PipeoptimError(
            "calibration needs a trace written by `pipeoptim train --trace FILE` (its meta "
            f"has source 'runtime' and the plan); this one has source "
            f"{trace.meta.get('source')!r}"
        )
    return Plan.from_dict(data, source="the trace's plan")


def costs_from_trace(trace: Trace) -> CostModel:
    """Per-stage medians of the measured actions, as simulator costs.

    A stage's forward and backward include the sender-side time of its transfers (the
    copy into the transport), which occupies the rank; time spent waiting in a receive is
    pipeline bubble, not cost, and is left out. Each link's latency is the median delay
    from a send's start to the end of its receive, counted from when the receiver was
    ready (:func:`link_latencies`).
    """
    plan = _plan_of(trace)
    shape = plan.shape(1)
    stages = shape.num_stages
    durations: dict[tuple[int, str], list[float]] = defaultdict(list)
    sizes: dict[tuple[int, str], list[int]] = defaultdict(list)
    gaps: dict[tuple[int, str], list[float]] = defaultdict(list)
    for e in trace.events:
        durations[(e.stage, e.kind)].append(e.duration)
        sizes[(e.stage, e.kind)].append(e.bytes)

    def med(stage: int, kind: str) -> float:
        values = durations.get((stage, kind))
        return statistics.median(values) if values else 0.0

    def size(stage: int, kind: str) -> int:
        values = sizes.get((stage, kind))
        return int(statistics.median(values)) if values else 0

    # The executor's own time between actions (bookkeeping, launching transfers) occupies
    # the rank too: charge each action the median gap that precedes it on its rank.
    by_rank: dict[int, list[TraceEvent]] = defaultdict(list)
    for e in trace.events:
        by_rank[e.rank].append(e)
    for events in by_rank.values():
        events.sort(key=lambda e: e.start)
        for before, e in itertools.pairwise(events):
            gaps[(e.stage, e.kind)].append(max(0.0, e.start - before.end))

    def cost(stage: int, kind: str) -> float:
        values = gaps.get((stage, kind))
        return med(stage, kind) + (statistics.median(values) if values else 0.0)

    missing = [k for k in range(stages) if (k, "F") not in durations]
    if missing:
        raise PipeoptimError(
            f"the trace has no forward of stages {missing}; calibrate from a run's whole "
            f"trace (every rank's events)"
        )
    # Static memory per stage: the most any sample of the rank holding it shows (optimizer
    # state appears at the first update), split evenly among the rank's stages
    # (interleaved schedules hold several).
    most: dict[tuple[int, str], int] = defaultdict(int)
    for m in trace.memory:
        for key in ("weights", "optimizer"):
            most[(m.rank, key)] = max(most[(m.rank, key)], int(m.detail.get(key, 0)))
    rank_of = {e.stage: e.rank for e in trace.events}
    per_rank: dict[int, int] = defaultdict(int)
    for k in range(stages):
        per_rank[rank_of[k]] += 1

    def static(k: int, key: str) -> int:
        return most[(rank_of[k], key)] // per_rank[rank_of[k]]

    batch = trace.meta.get("batch_size") or 1
    return CostModel(
        forward_s=tuple(cost(k, "F") + cost(k, "SEND_F") for k in range(stages)),
        backward_s=tuple(cost(k, "B") + cost(k, "SEND_B") for k in range(stages)),
        update_s=tuple(cost(k, "U") for k in range(stages)),
        predict_s=(0.0,) * stages,  # measured forwards already include the prediction
        param_bytes=tuple(static(k, "weights") for k in range(stages)),
        optimizer_state_bytes=tuple(static(k, "optimizer") for k in range(stages)),
        activation_bytes=tuple(size(k, "F") for k in range(stages)),
        send_forward_bytes=tuple(size(k, "SEND_F") for k in range(stages - 1)),
        send_backward_bytes=tuple(size(k + 1, "SEND_B") for k in range(stages - 1)),
        latency_s=tuple(link_latencies(trace, stages)),
        bandwidth=(math.inf,) * (stages - 1),
        samples_per_micro_batch=float(batch) / shape.micro_batches,
        optimizer=plan.optimizer.family,
    )


def link_latencies(trace: Trace, num_stages: int) -> list[float]:
    """Median arrival delay per edge, both directions: receive end minus the later of the
    send's start and the receive's start (a receive posted late finds the data there)."""
    starts = {
        (e.kind, e.stage, e.mb): e for e in trace.events if e.kind.startswith(("SEND", "RECV"))
    }
    delays: dict[int, list[float]] = defaultdict(list)
    for (kind, stage, mb), recv in starts.items():
        if kind == "RECV_F":
            send, edge = starts.get(("SEND_F", stage - 1, mb)), stage - 1
        elif kind == "RECV_B":
            send, edge = starts.get(("SEND_B", stage + 1, mb)), stage
        else:
            continue
        if send is not None:
            delays[edge].append(max(0.0, recv.end - max(send.start, recv.start)))
    return [statistics.median(delays[k]) if delays[k] else 0.0 for k in range(num_stages - 1)]


def predict_run(trace: Trace) -> Trace:
    """The simulator's Trace of the measured run's method and shape on calibrated costs."""
    plan = _plan_of(trace)
    mini_batches = int(trace.meta.get("mini_batches") or 0)
    if mini_batches < 1:
        raise PipeoptimError("the trace records no mini-batches; was the run empty?")
    shape = plan.shape(mini_batches)
    predicted = evaluate_trace(plan.method, shape, costs_from_trace(trace))
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


def calibrate(trace: Trace) -> tuple[Trace, list[Comparison]]:
    """Predict the measured run and compare; returns the predicted trace and the rows."""
    predicted = predict_run(trace)
    batch = float(trace.meta.get("batch_size") or 1)
    return predicted, compare(compute_metrics(trace), compute_metrics(predicted), batch)


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
