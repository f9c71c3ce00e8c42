"""Closed forms with uniform costs (F=1, B=2, free links) that the simulator must reproduce.

Bubbles of flushed methods are measured with update time 0 (see ``pipeoptim.metrics``), so
``(P-1)/(M+P-1)`` holds exactly over a whole run of N flushed mini-batches.
"""

from __future__ import annotations

import itertools

import pytest

from pipeoptim.metrics import compute_metrics
from pipeoptim.plan.methods import get_method
from pipeoptim.sim import CostModel, compile_method, evaluate_method, memory_report, simulate
from pipeoptim.sim.evaluate import list_schedule


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m", "n"), [(2, 2, 1), (4, 4, 2), (4, 8, 3), (3, 7, 2), (8, 8, 1)])
def test_flushed_bubble_closed_form(name: str, p: int, m: int, n: int) -> None:
    method = get_method(name)
    shape = method.shape(p, m, n)
    trace = simulate(method, shape, CostModel.uniform(p, 1.0, 2.0))
    metrics = compute_metrics(trace)
    expected = (p - 1) / (m + p - 1)
    assert metrics.bubble_ratio == pytest.approx(expected, abs=1e-12)
    assert all(b == pytest.approx(expected, abs=1e-12) for b in metrics.rank_bubble.values())
    assert metrics.span_s == n * (m + p - 1) * 3.0
    assert evaluate_method(method, shape, CostModel.uniform(p, 1.0, 2.0)).overall_bubble == (
        pytest.approx(expected, abs=1e-12)
    )


@pytest.mark.parametrize(("p", "m"), [(4, 4), (4, 9), (6, 6), (3, 1)])
def test_activations_in_flight(p: int, m: int) -> None:
    costs = CostModel.uniform(p, 1.0, 2.0, param_bytes=100, activation_bytes=10)
    for name, bound in (("gpipe", lambda k: m), ("1f1b", lambda k: min(m, p - k))):
        method = get_method(name)
        if name == "1f1b" and m < p:
            continue
        shape = method.shape(p, m, 2)
        program = compile_method(method, shape)
        durations = program.durations(costs)
        timing = list_schedule(program, durations, program.transfer_times(costs))
        report = memory_report(program, timing, costs)
        for k in range(p):
            a = bound(k)
            assert report.peaks[k].activations == a
            # one weight copy + sgd momentum + activations, and gradients from the first
            # backward to the update: with all a micro-batches in flight only where a
            # forward follows a backward in the same mini-batch (1F1B's steady state)
            steady = name == "1f1b" and m > a
            peak = 10 * a + 100 if steady else max(10 * a, 100 + 10 * (a - 1))
            assert report.peaks[k].bytes == 100 + 100 + peak


@pytest.mark.parametrize("name", ["pipedream", "pipeoptim", "spectrain"])
@pytest.mark.parametrize(("p", "update"), [(2, 0.0), (4, 0.0), (4, 0.5), (6, 0.25)])
def test_async_steady_throughput_is_bottleneck_rate(name: str, p: int, update: float) -> None:
    method = get_method(name)
    costs = CostModel.uniform(p, 1.0, 2.0, update)
    for n in (4 * p, 12):
        metrics = compute_metrics(simulate(method, method.shape(p, None, n), costs))
        assert metrics.steady_throughput == pytest.approx(1.0 / (3.0 + update), rel=1e-12)


def test_async_steady_throughput_with_a_slow_stage() -> None:
    method = get_method("pipeoptim")
    costs = CostModel(
        forward_s=(1.0, 2.0, 1.0, 0.5),
        backward_s=(2.0, 3.0, 1.5, 1.0),
        update_s=(0.0,) * 4,
        predict_s=(0.0,) * 4,
        param_bytes=(0,) * 4,
        optimizer_state_bytes=(0,) * 4,
        activation_bytes=(0,) * 4,
        send_forward_bytes=(0,) * 3,
        send_backward_bytes=(0,) * 3,
        latency_s=(0.0,) * 3,
        bandwidth=(float("inf"),) * 3,
    )
    result = evaluate_method(method, method.shape(4, None, 200), costs)
    assert result.steady_throughput == pytest.approx(1.0 / 5.0, rel=1e-9)


@pytest.mark.parametrize("name", ["pipedream", "pipeoptim"])
def test_async_whole_run_bubble_shrinks_with_n(name: str) -> None:
    method = get_method(name)
    p = 4
    costs = CostModel.uniform(p, 1.0, 2.0)
    bubbles = [
        evaluate_method(method, method.shape(p, None, n), costs).overall_bubble
        for n in (1, 2, 4, 8, 16, 64, 256)
    ]
    assert all(a > b for a, b in itertools.pairwise(bubbles))
    assert bubbles[-1] < 0.02


@pytest.mark.parametrize("p", [2, 4, 5])
def test_weight_copies(p: int) -> None:
    costs = CostModel.uniform(p, 1.0, 2.0, param_bytes=1000)
    expected = {
        "pipedream": [p - k for k in range(p)],
        "pipeoptim": [2] * (p - 1) + [1],
        "spectrain": [2] * (p - 1) + [1],
        "2bw": [2] * p,
        "1f1b": [1] * p,
        "gpipe": [1] * p,
    }
    for name, copies in expected.items():
        method = get_method(name)
        shape = method.shape(p, None, 3 * p)
        trace = simulate(method, shape, costs)
        stages = range(p)
        assert [int(trace.meta["weight_copies"][str(k)]) for k in stages] == copies, name
        metrics = compute_metrics(trace)
        # weights + stash peak at copies * params: weights, stash, grads, momentum
        for k in stages:
            assert metrics.stages[k].weight_copies == copies[k]
            peak = max(s.detail["weights"] + s.detail["stash"] for s in trace.memory if s.rank == k)
            assert peak == copies[k] * 1000, (name, k)


def test_interleaved_bubble_closed_form() -> None:
    method = get_method("interleaved-1f1b")
    p, m, v = 4, 8, 2
    shape = method.shape(p, m, 2, v)
    metrics = compute_metrics(simulate(method, shape, CostModel.uniform(p * v, 0.5, 1.0)))
    assert metrics.bubble_ratio == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
