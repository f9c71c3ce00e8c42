"""Ranks that share a host's cores, and messages with a fixed cost, in both engines.

With a core per rank and free messages the engines give today's times to the bit; with
fewer cores the busy ranks share them by processor sharing, whose arithmetic a tiny
schedule checks by hand; the SimPy engine and the fast evaluator agree to the bit on every
method; bad machine records and message costs are refused with the rule, the value and the
fix."""

from __future__ import annotations

import dataclasses

import pytest
from support.sim_costs import unequal_costs as _costs  # the same unequal stages and predictions

from pipeoptim.errors import PlanError
from pipeoptim.plan.machine import Machine
from pipeoptim.plan.methods import METHODS, get_method
from pipeoptim.sim import CostModel, Program, evaluate_program, evaluate_trace, run_simpy, simulate
from pipeoptim.sim.evaluate import schedule
from pipeoptim.sim.sharing import HostCores


def _cases() -> list[tuple[str, int, int | None, int]]:
    out = []
    for name in METHODS:
        method = get_method(name)
        for p, m, n in [(2, 2, 3), (4, 4, 3), (3, 6, 2)]:
            if method.interleaved and m % p:
                continue
            out.append((name, p, m if method.micro_batched else None, n))
    return out


CASES = _cases()


def _log(trace):
    return sorted((e.rank, e.stage, e.kind, e.mb, e.start, e.end) for e in trace.events)


@pytest.mark.parametrize(("name", "p", "m", "n"), CASES)
def test_a_core_per_rank_and_free_messages_give_todays_times(
    name: str, p: int, m: int | None, n: int
) -> None:
    method = get_method(name)
    shape = method.shape(p, m, n)
    costs = _costs(shape.num_stages)
    enough = dataclasses.replace(
        costs, machine=Machine(cores=p * 2, ranks_per_host=p, threads_per_rank=2)
    )
    assert not enough.shares_cores
    program = Program(method.order_arrays(shape), shape.micro_batches, method.weight_policy)
    today = evaluate_program(program, costs, keep_timing=True)
    same = evaluate_program(program, enough, keep_timing=True)
    assert today == same  # every field, the timing included, to the bit
    assert _log(simulate(method, shape, costs)) == _log(simulate(method, shape, enough))
    assert _log(evaluate_trace(method, shape, costs)) == _log(evaluate_trace(method, shape, enough))


def test_one_core_for_two_ranks_follows_processor_sharing_by_hand() -> None:
    """GPipe, 2 stages, 2 micro-batches, F = 1 s, B = 2 s, on one core:

    0-1 rank 0 runs 0F0 alone; 1-3 0F1 and 1F0 share the core (half speed each, 1 s of
    work takes 2 s); 3-4 1F1 alone; 4-6 1B0 alone; 6-10 0B0 and 1B1 share it (2 s of work
    each take 4 s); 10-12 0B1 alone. A core per rank would end at 9."""
    method = get_method("gpipe")
    shape = method.shape(2, 2, 1)
    costs = CostModel.uniform(2, 1.0, 2.0, 0.0)
    shared = dataclasses.replace(costs, machine=Machine(cores=1, ranks_per_host=2))
    expected = [
        (0, 0, "B", 0, 6.0, 10.0),
        (0, 0, "B", 1, 10.0, 12.0),
        (0, 0, "F", 0, 0.0, 1.0),
        (0, 0, "F", 1, 1.0, 3.0),
        (0, 0, "U", 0, 12.0, 12.0),
        (1, 1, "B", 0, 4.0, 6.0),
        (1, 1, "B", 1, 6.0, 10.0),
        (1, 1, "F", 0, 1.0, 3.0),
        (1, 1, "F", 1, 3.0, 4.0),
        (1, 1, "U", 0, 10.0, 10.0),
    ]
    assert _log(simulate(method, shape, shared)) == expected
    assert _log(evaluate_trace(method, shape, shared)) == expected
    assert evaluate_program(Program(method.order_arrays(shape), 2), shared).makespan == 12.0
    assert evaluate_program(Program(method.order_arrays(shape), 2), costs).makespan == 9.0


def test_threads_ask_for_cores_too() -> None:
    """Two ranks of 2 threads on 3 cores: together each runs at 3/4 speed, so 0F1 and 1F0
    (1 s of work each, side by side) take 4/3 s."""
    method = get_method("gpipe")
    shape = method.shape(2, 2, 1)
    costs = CostModel.uniform(2, 1.0, 2.0, 0.0)
    shared = dataclasses.replace(costs, machine=Machine(3, 2, threads_per_rank=2))
    log = {(r, k, mb): (a, b) for r, _, k, mb, a, b in _log(evaluate_trace(method, shape, shared))}
    assert log[(0, "F", 1)] == (1.0, 1.0 + 1.0 / 0.75)
    assert log[(1, "F", 0)] == (1.0, 1.0 + 1.0 / 0.75)


@pytest.mark.parametrize(("name", "p", "m", "n"), CASES)
@pytest.mark.parametrize("cores", [1, 2])
def test_both_engines_share_cores_alike_to_the_bit(
    name: str, p: int, m: int | None, n: int, cores: int
) -> None:
    method = get_method(name)
    shape = method.shape(p, m, n)
    costs = dataclasses.replace(
        _costs(shape.num_stages),
        machine=Machine(cores, ranks_per_host=2),  # hosts of two ranks
        message_send_s=0.03,
        message_receive_s=0.02,
    )
    program = Program(method.order_arrays(shape), shape.micro_batches, method.weight_policy)
    for jitter in (0.0, 0.3):
        durations = program.durations(costs, jitter, 7)
        transfers = program.transfer_times(costs)
        engine = run_simpy(program, durations, transfers, contention=False, machine=costs.machine)
        fast = schedule(program, durations, transfers, costs)
        assert engine.starts == fast.starts
        assert engine.ends == fast.ends
        evaluated = evaluate_program(program, costs, jitter=jitter, seed=7, keep_timing=True)
        assert evaluated.timing is not None and evaluated.timing.ends == fast.ends


def test_sharing_is_never_faster_than_a_core_per_rank() -> None:
    method = get_method("pipeoptim")
    shape = method.shape(4, None, 6)
    costs = _costs(4)
    program = Program(method.order_arrays(shape), 1, method.weight_policy)
    spans = [
        evaluate_program(program, dataclasses.replace(costs, machine=Machine(c, 4))).makespan
        for c in (4, 3, 2, 1)
    ]
    assert spans == sorted(spans)
    assert spans[-1] > spans[0]


def test_a_message_costs_its_sender_and_its_receiver() -> None:
    """GPipe, 2 stages, 1 micro-batch, F = 1, B = 2: 0F0 sends (+0.1 s), 1F0 receives
    (+0.2 s) and its backward 1B0 sends the gradient back (+0.1 s), which 0B0 receives."""
    method = get_method("gpipe")
    shape = method.shape(2, 1, 1)
    costs = dataclasses.replace(
        CostModel.uniform(2, 1.0, 2.0, 0.0), message_send_s=0.1, message_receive_s=0.2
    )
    log = {(r, k): (a, b) for r, _, k, _, a, b in _log(evaluate_trace(method, shape, costs))}
    assert log[(0, "F")] == (0.0, 1.1)
    assert log[(1, "F")] == (1.1, 1.1 + 1.2)
    assert log[(1, "B")] == (2.3, 2.3 + 2.1)
    assert log[(0, "B")] == (4.4, 4.4 + 2.2)
    assert _log(simulate(method, shape, costs)) == _log(evaluate_trace(method, shape, costs))


def test_the_host_retires_finishes_before_starts_at_one_time() -> None:
    host = HostCores(Machine(1, 2))
    assert host.start(0, 1.0, 0.0) == []
    assert host.next_finish() == 1.0
    # rank 1 starts at the moment rank 0 finishes: rank 0 ends at 1, rank 1 runs alone
    assert host.start(1, 1.0, 1.0) == [(0, 1.0)]
    assert host.next_finish() == 2.0
    assert host.finish(1.5) == []  # a stale wake-up changes nothing
    assert host.finish(2.0) == [(1, 2.0)]


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"cores": 0, "ranks_per_host": 4}, r"cores must be a whole number >= 1.*got 0.*give"),
        ({"cores": 2, "ranks_per_host": -1}, r"ranks_per_host must be .*got -1.*give"),
        ({"cores": 2, "ranks_per_host": 4, "threads_per_rank": 1.5}, r"threads_per_rank.*1\.5"),
        ({"cores": True, "ranks_per_host": 4}, r"cores must be a whole number.*True"),
        ({"ranks_per_host": 4}, r"must be a mapping with cores, ranks_per_host"),
        ([2, 4], r"must be a mapping"),
    ],
)
def test_a_bad_machine_is_refused_with_the_rule_the_value_and_the_fix(
    record: object, match: str
) -> None:
    with pytest.raises(PlanError, match=match):
        Machine.from_dict(record)


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf"), "1"])
def test_a_bad_message_cost_is_refused(value: object) -> None:
    with pytest.raises(
        PlanError, match=r"message_send_s is the fixed seconds of one message.*give"
    ):
        dataclasses.replace(CostModel.uniform(2), message_send_s=value)


def test_machine_must_be_a_machine() -> None:
    with pytest.raises(PlanError, match=r"machine must be a pipeoptim.plan.machine.Machine"):
        dataclasses.replace(CostModel.uniform(2), machine={"cores": 2})
