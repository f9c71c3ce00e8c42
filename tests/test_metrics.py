"""Metrics from any Trace: hand-built (as a measured run would write it) and simulated."""

from __future__ import annotations

import json

import pytest

from pipeoptim.metrics import compute_metrics, steady_state_throughput
from pipeoptim.plan.methods import get_method
from pipeoptim.sim import CostModel, evaluate_method, simulate
from pipeoptim.trace import MemorySample, Trace, TraceEvent


def _measured() -> Trace:
    """Two ranks, one mini-batch of two micro-batches, stale update on stage 0."""
    ev = TraceEvent
    events = [
        ev(0, 0, "F", 0, 0.0, 1.0, 0),
        ev(0, 0, "F", 1, 1.0, 2.0, 0),
        ev(0, 0, "SEND_F", 0, 1.0, 1.2, 0, 64),  # communication is not compute
        ev(1, 1, "F", 0, 1.0, 2.0, 0),
        ev(1, 1, "F", 1, 2.0, 3.0, 0),
        ev(1, 1, "B", 0, 3.0, 5.0, 0),
        ev(1, 1, "B", 1, 5.0, 7.0, 1),
        ev(1, 1, "U", 0, 7.0, 7.5, 2),
        ev(0, 0, "B", 0, 5.0, 7.0, 0),
        ev(0, 0, "B", 1, 7.0, 9.0, 0),
        ev(0, 0, "U", 0, 9.0, 10.0, 3),
    ]
    memory = [MemorySample(0, 0.0, 100), MemorySample(0, 2.0, 300), MemorySample(1, 3.0, 250)]
    return Trace(
        events,
        memory,
        {"method": "handmade", "micro_batches": 2, "batch_size": 16, "source": "runtime"},
    )


def test_metrics_of_a_handmade_trace() -> None:
    m = compute_metrics(_measured())
    assert m.span_s == 10.0
    assert m.micro_batches == 2
    assert m.samples == 16.0
    # rates and shares by hand (rounded decimals), against compute_metrics' own sums
    assert m.throughput == pytest.approx(1.6, rel=1e-12)
    assert m.steady_throughput == pytest.approx(1.6, rel=1e-12)  # one update: whole-run
    assert m.rank_bubble == pytest.approx({0: 1.0 - 7.0 / 10.0, 1: 1.0 - 6.5 / 10.0}, rel=1e-12)
    assert m.bubble_ratio == pytest.approx(1.0 - 13.5 / 20.0)
    # stage 0: U applied to version 3, backwards used version 0 -> staleness 3
    # stage 1: U applied to version 2, oldest backward used version 0 -> staleness 2
    assert m.stages[0].max_staleness == 3
    assert m.stages[1].max_staleness == 2
    assert m.stages[1].max_inconsistency == 1  # 1B1 on version 1, 1F1 on version 0
    assert m.stages[0].max_inconsistency == 0
    assert m.stages[0].peak_memory_bytes == 300  # one stage per rank: the rank's samples
    assert m.stages[1].peak_memory_bytes == 250
    assert m.peak_memory_bytes == 300
    assert m.max_weight_copies is None
    assert m.source == "runtime"


def test_metrics_survive_a_json_round_trip(tmp_path) -> None:
    method = get_method("pipedream")
    trace = simulate(method, method.shape(3, None, 6), CostModel.uniform(3, param_bytes=10))
    path = tmp_path / "t.json"
    trace.save(path)
    again = Trace.load(path)
    a, b = compute_metrics(trace), compute_metrics(again)
    assert a == b
    assert a.max_weight_copies == 3
    assert a.stages[0].max_staleness == 2
    json.dumps(a.as_dict())  # JSON-able


def test_metrics_agree_with_the_evaluator() -> None:
    for name in ("gpipe", "1f1b", "2bw", "pipeoptim", "interleaved-1f1b"):
        method = get_method(name)
        shape = method.shape(4, None, 5)
        costs = CostModel.uniform(shape.num_stages, 1.0, 2.0, 0.5, samples_per_micro_batch=4.0)
        result = evaluate_method(method, shape, costs)
        metrics = compute_metrics(simulate(method, shape, costs))
        assert metrics.span_s == result.span
        assert metrics.throughput == pytest.approx(result.throughput, rel=1e-12)
        assert metrics.steady_throughput == pytest.approx(result.steady_throughput, rel=1e-12)
        assert metrics.bubble_ratio == pytest.approx(result.overall_bubble, rel=1e-9)
        assert metrics.samples == result.samples == 4.0 * shape.total_micro_batches


def test_steady_state_window() -> None:
    assert steady_state_throughput([], 1.0) is None
    assert steady_state_throughput([5.0], 1.0) is None
    assert steady_state_throughput([1.0, 3.0], 2.0) == 1.0
    # 8 updates: drop 2 at each end, rate over updates 2..5
    ends = [1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 9.0, 20.0]
    assert steady_state_throughput(ends, 1.0) == 3 / 3.0


def test_empty_trace() -> None:
    m = compute_metrics(Trace())
    assert m.num_ranks == 0 and m.throughput == 0.0 and m.peak_memory_bytes is None
