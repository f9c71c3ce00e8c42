"""The SimPy engine and the fast evaluator: exact logs, agreement, jitter, contention."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeoptim.errors import ScheduleError
from pipeoptim.plan.actions import Action, B, F, U
from pipeoptim.plan.methods import METHODS, WeightPolicy, get_method
from pipeoptim.plan.schedules import dependencies, stage_ranks
from pipeoptim.sim import (
    CostModel,
    Program,
    compile_method,
    evaluate_method,
    evaluate_trace,
    list_schedule,
    run_simpy,
    simulate,
    simulate_order,
)


def _log(trace):
    """(rank, action, start, end, version, distance) by rank, then time."""
    rows = [
        (e.rank, f"{e.stage}{e.kind}{e.mb}", e.start, e.end, e.weight_version, e.distance)
        for e in trace.events
    ]
    return sorted(rows, key=lambda r: (r[0], r[2], r[3], r[1]))


def test_pipeoptim_p2_n2_exact_log() -> None:
    method = get_method("pipeoptim")
    shape = method.shape(2, None, 2)
    trace = simulate(method, shape, CostModel.uniform(2, 1.0, 2.0, 0.5))
    # (rank, action, start, end, weight version, prediction distance)
    assert _log(trace) == [
        (0, "0F0", 0.0, 1.0, 0, 0),
        (0, "0F1", 1.0, 2.0, 1, 1),  # predicted: targets W^(1), one update away
        (0, "0B0", 4.0, 6.0, 0, 0),
        (0, "0U0", 6.0, 6.5, 0, 0),
        (0, "0B1", 7.5, 9.5, 1, 0),
        (0, "0U1", 9.5, 10.0, 1, 0),
        (1, "1F0", 1.0, 2.0, 0, 0),
        (1, "1B0", 2.0, 4.0, 0, 0),
        (1, "1U0", 4.0, 4.5, 0, 0),
        (1, "1F1", 4.5, 5.5, 1, 0),
        (1, "1B1", 5.5, 7.5, 1, 0),
        (1, "1U1", 7.5, 8.0, 1, 0),
    ]


def test_pipedream_p2_n2_versions_are_stashed() -> None:
    method = get_method("pipedream")
    trace = simulate(method, method.shape(2, None, 2), CostModel.uniform(2, 1.0, 2.0, 0.5))
    log = {a: (v, d) for _, a, _, _, v, d in _log(trace)}
    assert log["0F1"] == (0, 1)  # runs on W^(0) and stashes it
    assert log["0B1"] == (0, 0)  # the stashed W^(0)
    assert log["0U1"] == (1, 0)  # applied to W^(1): staleness 1


def test_gpipe_with_latency_exact_log() -> None:
    method = get_method("gpipe")
    costs = CostModel.uniform(2, 1.0, 2.0, latency_s=0.5)
    trace = simulate(method, method.shape(2, 2, 1), costs)
    assert _log(trace) == [
        (0, "0F0", 0.0, 1.0, 0, 0),
        (0, "0SEND_F0", 1.0, 1.5, 0, 0),  # activation to stage 1 over the link
        (0, "0F1", 1.0, 2.0, 0, 0),
        (0, "0SEND_F1", 2.0, 2.5, 0, 0),
        (0, "0B0", 6.0, 8.0, 0, 0),
        (0, "0B1", 8.0, 10.0, 0, 0),
        (0, "0U0", 10.0, 10.0, 0, 0),
        (1, "1F0", 1.5, 2.5, 0, 0),
        (1, "1F1", 2.5, 3.5, 0, 0),
        (1, "1B0", 3.5, 5.5, 0, 0),
        (1, "1SEND_B0", 5.5, 6.0, 0, 0),  # gradient back to stage 0
        (1, "1B1", 5.5, 7.5, 0, 0),
        (1, "1U0", 7.5, 7.5, 0, 0),
        (1, "1SEND_B1", 7.5, 8.0, 0, 0),
    ]


SHAPES = [(1, 1, 1), (2, 2, 3), (3, 3, 2), (4, 4, 5), (4, 8, 3), (5, 5, 7)]


def _cases():
    for name, method in METHODS.items():
        for p, m, n in SHAPES:
            try:
                shape = method.shape(p, m if method.micro_batched else None, n)
            except ValueError:
                continue
            yield pytest.param(name, shape, id=f"{name}-P{p}M{shape.micro_batches}N{n}")


def _skewed(stages: int) -> CostModel:
    """Unequal stages and a link that costs less than any compute (so it never queues)."""
    base = CostModel.uniform(
        stages, 1.0, 2.0, 0.25, latency_s=0.1, bandwidth=1e3, activation_bytes=300
    )
    return base.__class__(
        **{
            **base.__dict__,
            "forward_s": tuple(0.5 + 0.25 * (k % 3) for k in range(stages)),
            "backward_s": tuple(1.0 + 0.5 * ((k + 1) % 2) for k in range(stages)),
        }
    )


@pytest.mark.parametrize(("name", "shape"), list(_cases()))
def test_simpy_equals_fast_evaluator(name: str, shape) -> None:
    costs = _skewed(shape.num_stages)
    program = compile_method(name, shape)
    durations = program.durations(costs)
    transfers = program.transfer_times(costs)
    fast = list_schedule(program, durations, transfers)
    for contention in (False, True):  # links are faster than compute: no queueing either way
        slow = run_simpy(program, durations, transfers, contention=contention)
        assert slow.starts == fast.starts
        assert slow.ends == fast.ends
    # and the whole traces, transfers and versions included
    a = simulate(name, shape, costs)
    b = evaluate_trace(name, shape, costs)
    assert a.events == b.events
    assert a.memory == b.memory
    assert evaluate_method(name, shape, costs).makespan == a.meta["makespan"]


def test_compiled_dependencies_match_schedules_dependencies() -> None:
    for name in ("1f1b", "interleaved-1f1b", "2bw", "pipeoptim"):
        method = get_method(name)
        shape = method.shape(4, None if not method.micro_batched else 4, 3)
        order = method.order(shape)
        program = Program(order, shape.micro_batches, method.weight_policy)
        where = stage_ranks(order)
        index = {
            Action(program.stage[i], (F, B, U)[program.kind[i]], program.mb[i]): i
            for i in range(program.size)
        }
        for action, i in index.items():
            cross = [
                index[d]
                for d in dependencies(action, shape.num_stages, shape.micro_batches)
                if where[d.stage] != where[action.stage]
            ]
            assert cross == ([program.dep[i]] if program.dep[i] >= 0 else [])


def test_jitter_is_reproducible_and_shared_by_both_engines() -> None:
    method = get_method("1f1b")
    shape = method.shape(4, 8, 2)
    costs = CostModel.uniform(4, 1.0, 2.0, 0.1)
    a = simulate(method, shape, costs, jitter=0.2, seed=7)
    b = simulate(method, shape, costs, jitter=0.2, seed=7)
    c = simulate(method, shape, costs, jitter=0.2, seed=8)
    plain = simulate(method, shape, costs)
    assert a.events == b.events
    assert a.events != c.events
    assert a.events != plain.events
    assert evaluate_trace(method, shape, costs, jitter=0.2, seed=7).events == a.events
    assert simulate(method, shape, costs, jitter=0.0, seed=99).events == plain.events


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "pipedream", "2bw", "interleaved-1f1b"])
def test_link_contention_is_never_faster(name: str) -> None:
    method = get_method(name)
    shape = method.shape(4, None, 4)
    # a transfer (3 s) takes longer than a forward (1 s): sends pile up on the links
    costs = CostModel.uniform(shape.num_stages, 1.0, 2.0, activation_bytes=3000, bandwidth=1e3)
    free = simulate(method, shape, costs, contention=False)
    queued = simulate(method, shape, costs, contention=True)
    half = simulate(method, shape, costs, contention=True, full_duplex=False)
    ends = lambda t: {(e.rank, e.kind, e.stage, e.mb): e.end for e in t.events}  # noqa: E731
    a, b, c = ends(free), ends(queued), ends(half)
    assert all(b[k] >= a[k] for k in a if k[1] in ("F", "B", "U"))
    assert all(c[k] >= b[k] for k in b if k[1] in ("F", "B", "U"))
    assert half.meta["makespan"] >= queued.meta["makespan"] >= free.meta["makespan"]
    if name == "gpipe":  # back-to-back forwards: their sends really do queue
        assert queued.meta["makespan"] > free.meta["makespan"]
    assert free.meta["makespan"] == evaluate_method(method, shape, costs).makespan


def test_deadlocked_order_is_reported_by_both_engines() -> None:
    order = {
        0: [Action(0, B, 0), Action(0, F, 0)],  # B before its own F: can never run
        1: [Action(1, F, 0), Action(1, B, 0)],
    }
    with pytest.raises(ScheduleError, match="before 0F0"):
        Program(order, 1)
    workable = {
        0: [Action(0, F, 0), Action(0, B, 0), Action(0, F, 1), Action(0, B, 1)],
        1: [Action(1, F, 0), Action(1, B, 0), Action(1, F, 1), Action(1, B, 1)],
    }
    # rank 1 starts with F1, which needs 0F1, which rank 0 runs after 0B0, which needs 1B0
    order2 = {
        0: workable[0],
        1: [Action(1, F, 1), Action(1, B, 1), Action(1, F, 0), Action(1, B, 0)],
    }
    program = Program(order2, 1)
    with pytest.raises(ScheduleError, match="deadlocks"):
        program.steps()
    costs = CostModel.uniform(2)
    with pytest.raises(ScheduleError, match="deadlocks"):
        run_simpy(program, program.durations(costs), program.transfer_times(costs))
    simulate_order(workable, costs)  # the same actions in a workable order run fine


def test_simulate_order_accepts_idle_slots_and_policy() -> None:
    method = get_method("pipedream")
    shape = method.shape(3, None, 4)
    grid = method.schedule(shape)  # retimed grid with None idle slots
    costs = CostModel.uniform(3)
    a = simulate_order(grid, costs, policy=WeightPolicy.STASH)
    b = simulate(method, shape, costs)
    assert sorted(a.events, key=str) == sorted(b.events, key=str)


def test_cost_model_too_small_is_an_error() -> None:
    with pytest.raises(ScheduleError, match="build the costs for 4 stages"):
        simulate("1f1b", get_method("1f1b").shape(4, 4, 1), CostModel.uniform(3))


def test_sim_and_metrics_never_import_torch() -> None:
    code = (
        "import pipeoptim.sim, pipeoptim.metrics, sys; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
