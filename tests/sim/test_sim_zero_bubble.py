"""Zero-bubble schedules (split backwards I/W) in the simulator: the paper's bubbles, the
makespan saved against 1F1B, activations held until W, and both engines equal."""

from __future__ import annotations

import dataclasses

import pytest

from pipeoptim.errors import PlanError
from pipeoptim.metrics import compute_metrics
from pipeoptim.plan.actions import Kind, Schedule
from pipeoptim.plan.methods import WeightPolicy, get_method
from pipeoptim.plan.versions import analyze_versions
from pipeoptim.plan.zero_bubble import zb_h1, zb_v
from pipeoptim.sim import CostModel, Program, evaluate_program, list_schedule, run_simpy
from pipeoptim.sim.engine import simulate_order
from pipeoptim.sim.memory import memory_report

SIZES = [(2, 2), (3, 3), (4, 4), (4, 8), (5, 6)]  # (P, M), M >= P


def unit_costs(stages: int, update_s: float = 0.0, activation_bytes: int = 0) -> CostModel:
    """F = I = W = 1 (B = 2, weight_grad_fraction 0.5), free links."""
    costs = CostModel.uniform(stages, 1.0, 2.0, update_s, activation_bytes=activation_bytes)
    assert costs.backward_input_s == costs.backward_weight_s == (1.0,) * stages
    return costs


def one_f_one_b(p: int, m: int, n: int = 1) -> Program:
    method = get_method("1f1b")
    shape = method.shape(p, m, n)
    return Program(method.order(shape), shape.micro_batches, method.weight_policy)


def idle(program: Program, costs: CostModel) -> dict[int, float]:
    """Seconds each rank waits over the run (span minus its busy time)."""
    result = evaluate_program(program, costs)
    return {r: result.span - busy for r, busy in result.rank_busy_s.items()}


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_idle_time_per_rank_is_the_papers_closed_form(p: int, m: int) -> None:
    """ZB-H1 idles (P-1)(T_F + T_I - T_W) = P-1 per rank and mini-batch, 1F1B
    (P-1)(T_F + T_B) = 3(P-1); the makespan shrinks by the difference, 2(P-1)."""
    costs = unit_costs(p)
    zb = Program(zb_h1(p, m, 1), m, WeightPolicy.FLUSH)
    base = one_f_one_b(p, m)
    assert idle(zb, costs) == {r: float(p - 1) for r in range(p)}
    assert idle(base, costs) == {r: 3.0 * (p - 1) for r in range(p)}
    zb_span = evaluate_program(zb, costs).makespan
    base_span = evaluate_program(base, costs).makespan
    assert zb_span == 3 * m + (p - 1)
    assert base_span - zb_span == 2 * (p - 1)


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_simulated_bubble_ratio_against_1f1b(p: int, m: int) -> None:
    """The SimPy run's metrics: bubble (P-1)/(3M+P-1) against 1F1B's 3(P-1)/(3M+3(P-1))."""
    costs = unit_costs(p)
    zb = compute_metrics(simulate_order(zb_h1(p, m, 1), costs, micro_batches=m))
    method = get_method("1f1b")
    shape = method.shape(p, m, 1)
    base = compute_metrics(simulate_order(method.order(shape), costs, micro_batches=m))
    zb_ratio = (p - 1) / (3 * m + p - 1)
    base_ratio = 3 * (p - 1) / (3 * m + 3 * (p - 1))
    assert zb.rank_bubble == pytest.approx(dict.fromkeys(range(p), zb_ratio))
    assert zb.bubble_ratio == pytest.approx(zb_ratio)
    assert base.bubble_ratio == pytest.approx(base_ratio)
    assert zb.bubble_ratio < base.bubble_ratio


@pytest.mark.parametrize(("p", "m"), [(2, 2), (3, 3), (4, 4), (3, 5)])
def test_unit_costs_reproduce_the_generators_grid(p: int, m: int) -> None:
    """With F = I = W = U = 1 every action starts at its column of the retimed grid."""
    schedule = zb_h1(p, m, 2)
    program = Program(schedule, m, WeightPolicy.FLUSH)
    timing = evaluate_program(program, unit_costs(p, update_s=1.0), keep_timing=True).timing
    assert timing is not None
    column = {str(a): c for row in schedule.values() for c, a in enumerate(row) if a}
    got = {program.describe(i): timing.starts[i] for i in range(program.size)}
    assert got == {name: float(c) for name, c in column.items()}


@pytest.mark.parametrize(("p", "m"), [(2, 2), (3, 3), (4, 4), (4, 7)])
def test_activations_are_held_from_f_until_w(p: int, m: int) -> None:
    """Every ZB-H1 stage holds P micro-batches (F to W, the first stage's 1F1B count); from
    F to I it would be 1F1B's P-k, which is what the paper counts."""
    act = 10
    costs = unit_costs(p, activation_bytes=act)
    schedule = zb_h1(p, m, 2)
    program = Program(schedule, m, WeightPolicy.FLUSH)
    timing = list_schedule(program, program.durations(costs), program.transfer_times(costs))
    report = memory_report(program, timing, costs)
    versions = analyze_versions(schedule, WeightPolicy.FLUSH, m)

    def held(until: Kind) -> dict[int, int]:
        peak: dict[int, int] = {}
        for row in schedule.values():
            level = 0
            for a in row:
                if a is None:
                    continue
                level += a.kind is Kind.FORWARD
                level -= a.kind is until
                peak[a.stage] = max(peak.get(a.stage, 0), level)
        return peak

    until_w = held(Kind.BACKWARD_WEIGHT)
    assert until_w == dict.fromkeys(range(p), p)
    assert held(Kind.BACKWARD_INPUT) == {k: p - k for k in range(p)}
    assert {k: peak.activations for k, peak in report.peaks.items()} == until_w
    assert {k: peak.bytes for k, peak in report.peaks.items()} == {k: p * act for k in range(p)}
    assert versions.max_in_flight == until_w
    # 1F1B holds P-k: ZB-H1 trades the later stages' memory for its bubbles
    base = one_f_one_b(p, m)
    timing = list_schedule(base, base.durations(costs), base.transfer_times(costs))
    peaks = memory_report(base, timing, costs).peaks
    assert {k: peak.activations for k, peak in peaks.items()} == {k: p - k for k in range(p)}


def test_split_backwards_read_their_mini_batchs_weights() -> None:
    """Flushed: I and W of mini-batch t run on W^(t), and U applies their gradient."""
    p, m, n = 3, 3, 3
    program = Program(zb_h1(p, m, n), m, WeightPolicy.FLUSH)
    version = program.flat_versions()[0]
    for i in range(program.size):
        assert version[i] == program.mb[i] // (1 if program.kind[i] == 2 else m)
    report = program.versions()
    assert all(u.staleness == 0 for u in report.updates.values())
    assert all(v.distance == 0 for v in report.passes.values())


@pytest.mark.parametrize(("ranks", "m", "n"), [(1, 1, 2), (2, 3, 2), (3, 5, 2), (4, 7, 1)])
def test_zb_v_runs_equal_in_both_engines(ranks: int, m: int, n: int) -> None:
    stages = 2 * ranks
    schedule: Schedule = zb_v(stages, m, n)
    base = CostModel.uniform(stages, 1.0, 2.0, 0.5, activation_bytes=100, bandwidth=1e4)
    costs = dataclasses.replace(
        base,
        forward_s=tuple(0.75 + 0.25 * (k % 3) for k in range(stages)),
        latency_s=(0.05,) * (stages - 1),
        weight_grad_fraction=0.3,
    )
    program = Program(schedule, m, WeightPolicy.FLUSH)
    durations, transfers = program.durations(costs), program.transfer_times(costs)
    simpy = run_simpy(program, durations, transfers, contention=False)
    fast = evaluate_program(program, costs, keep_timing=True)
    assert fast.timing is not None
    assert simpy.starts == fast.timing.starts and simpy.ends == fast.timing.ends
    trace = simulate_order(schedule, costs, micro_batches=m, contention=False)
    assert trace.meta["makespan"] == fast.makespan
    kinds = {e.kind for e in trace.events}
    assert {"F", "I", "W", "U"} <= kinds and "B" not in kinds
    # the gradient an I sends back crosses the link as a SEND_B
    assert sum(e.kind == "SEND_B" for e in trace.events) == sum(
        e.kind == "I" and e.stage > 0 and e.stage != ranks for e in trace.events
    )


def test_weight_grad_fraction_splits_the_backward_and_is_checked() -> None:
    costs = CostModel.uniform(2, 1.0, 4.0, weight_grad_fraction=0.25)
    assert costs.backward_weight_s == (1.0, 1.0)
    assert costs.backward_input_s == (3.0, 3.0)
    assert CostModel.uniform(2, 1.0, 4.0).backward_input_s == (2.0, 2.0)
    for bad in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(PlanError, match="weight_grad_fraction"):
            CostModel.uniform(2, weight_grad_fraction=bad)


def test_timeline_draws_the_split_backward_in_its_own_colours() -> None:
    from pipeoptim.sim.engine import simulate_order
    from pipeoptim.viz.timeline import KIND_COLORS, timeline_figure

    trace = simulate_order(zb_h1(3, 3, 1), unit_costs(3), micro_batches=3)
    bars = {bar.name: bar for bar in timeline_figure(trace).data}
    for kind, name in (("I", "input gradient"), ("W", "weight gradient")):
        assert bars[name].marker.color == KIND_COLORS[kind]
        assert len(bars[name].x) == 9  # 3 stages x 3 micro-batches
