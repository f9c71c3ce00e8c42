"""The offline cost model on the host a profile measured (``sim/host.py``).

A profile without a host record (an older file, a synthetic profile, one for one process)
gives today's costs and times to the bit; a machine record makes the planned ranks share
its cores, checked by hand on a tiny schedule in both engines; the measured fixed costs
of messages and of each action kind are charged as recorded (per weight policy), a wait
costs its measured seconds per message taken in (never a ratio of the layers, which hold
one rank's speed already), and a prediction is what those components add up to; the
planner, ``pipeoptim simulate`` and a plan's stage graph all carry it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from pipeoptim.cli import main
from pipeoptim.errors import PlanError
from pipeoptim.metrics import compute_metrics
from pipeoptim.plan.graph import stage_graph, stage_graph_to_dict
from pipeoptim.plan.machine import Machine
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.profile import LayerProfile, Profile
from pipeoptim.plan.runtime_costs import RuntimeCosts
from pipeoptim.planning import evaluate_candidate
from pipeoptim.sim import CostModel, Program, evaluate_trace, simulate
from pipeoptim.sim.evaluate import evaluate_method
from pipeoptim.sim.host import ProfiledHost, host_notes, on_profiled_host

SHARED = {"ranks": 2, "machine": {"cores": 1, "ranks_per_host": 2, "threads_per_rank": 1}}


def _two_layers(meta: dict[str, Any] | None = None, **changes: Any) -> Profile:
    """Two layers: forward 1 s, backward 2 s, update 1 s each."""
    layers = tuple(LayerProfile(f"{i}:x", 1.0, 2.0, 0, 4, 4, 1, update_s=1.0) for i in range(2))
    return Profile(layers, 1, "sgd", "cpu", meta=dict(meta or {}), **changes)


def _events(trace: Any) -> list[tuple[int, str, int, float, float]]:
    return sorted((e.rank, e.kind, e.mb, e.start, e.end) for e in trace.events)


def test_a_profile_without_a_host_record_gives_todays_costs_to_the_bit() -> None:
    for profile in (
        _two_layers(),
        _two_layers({"threads": 1}),
        _two_layers({"ranks": None, "machine": Machine(2, 1, 2).to_dict()}),  # no --ranks
        _two_layers({"ranks": 1, "machine": Machine(2, 1, 2).to_dict()}),  # one process
        _two_layers(runtime_costs=RuntimeCosts()),  # measured as nothing
    ):
        costs = CostModel.from_profile(profile, [(0, 1), (1, 2)], 1)
        assert on_profiled_host(costs, profile, "pipeoptim", 2) is costs
    profile = Profile.uniform(8, 0.3, 0.7, 100, 1000)
    method = get_method("1f1b")
    shape = method.shape(4, 4, 3)
    costs = CostModel.from_profile(profile, [(0, 2), (2, 4), (4, 6), (6, 8)], 4)
    hosted = on_profiled_host(costs, profile, method, 4)
    assert _events(evaluate_trace(method, shape, hosted)) == _events(
        evaluate_trace(method, shape, costs)
    )


def test_ranks_share_the_recorded_cores_by_hand_in_both_engines() -> None:
    # gpipe, 2 stages, one micro-batch: 0F [0,1], 1F [1,2], 1B [2,4], then 0B and 1U start
    # together at 4 on the one core, each at half speed: 1U's 1 s of work ends at 6, 0B has
    # done 1 of its 2 s by then and ends alone at 7; 0U [7,8]. A core each: 7 s.
    profile = _two_layers(SHARED)
    method = get_method("gpipe")
    shape = method.shape(2, 1, 1)
    costs = CostModel.from_profile(profile, [(0, 1), (1, 2)], 1)
    hosted = on_profiled_host(costs, profile, method, 2)
    assert hosted.machine == Machine(1, 2, 1) and costs.machine is None
    assert evaluate_method(method, shape, costs).makespan == 7.0
    assert evaluate_method(method, shape, hosted).makespan == 8.0
    expected = [
        (0, "B", 0, 4.0, 7.0),
        (0, "F", 0, 0.0, 1.0),
        (0, "U", 0, 7.0, 8.0),
        (1, "B", 0, 2.0, 4.0),
        (1, "F", 0, 1.0, 2.0),
        (1, "U", 0, 4.0, 6.0),
    ]
    assert _events(evaluate_trace(method, shape, hosted)) == expected
    assert _events(simulate(method, shape, hosted)) == expected


def test_the_planned_ranks_go_to_the_recorded_host() -> None:
    host = ProfiledHost.of(_two_layers({"ranks": 4, "machine": Machine(2, 4, 1).to_dict()}))
    assert host.machine_for(8) == Machine(2, 8, 1)  # all of a one-host run's ranks
    assert host.machine_for(2) == Machine(2, 2, 1)  # a core each: no sharing
    assert not host.machine_for(2).shares_cores  # type: ignore[union-attr]
    assert host.machine_for(4, data_parallel=2) == Machine(1, 4, 1)  # D replicas split it
    spread = ProfiledHost(Machine(8, 2, 1), 4, None)  # a record of 2 ranks per host
    assert spread.machine_for(6) == Machine(8, 2, 1)


def test_measured_message_and_action_costs_are_charged_per_kind_and_policy() -> None:
    runtime = RuntimeCosts(
        message_send_s=0.1,
        message_receive_s=0.2,
        message_latency_s=0.05,
        action_s={
            "flush": {"F": 0.01, "B": 0.02, "U": 0.03, "I": 0.04, "W": 0.05},
            "predict": {"F": 0.5, "B": 0.25, "U": 0.125},
        },
    )
    profile = _two_layers(runtime_costs=runtime)
    costs = CostModel.from_profile(profile, [(0, 1), (1, 2)], 2, latency_s=0.01)
    sync = on_profiled_host(costs, profile, "zb-h1", 2)
    assert sync.action_s == (0.01, 0.02, 0.03, 0.04, 0.05)
    assert (sync.message_send_s, sync.message_receive_s) == (0.1, 0.2)
    assert sync.latency_s == (0.05,)  # the measured latency where the link had less
    predicting = on_profiled_host(costs, profile, "pipeoptim", 2)
    assert predicting.action_s == (0.5, 0.25, 0.125, 0.0, 0.0)
    # the duration table adds each kind's fixed cost: F, B, U, I, W, predicted F, U with Δ
    program = Program(get_method("zb-h1").order(get_method("zb-h1").shape(2, 2, 1)), 2)
    plain = program.duration_table(
        dataclasses.replace(sync, message_send_s=0.0, message_receive_s=0.0)
    )
    bare = program.duration_table(dataclasses.replace(costs, action_s=()))
    added = [round(a - b, 12) for a, b in zip(plain, bare, strict=True)]
    per_kind = (0.01, 0.02, 0.03, 0.04, 0.05, 0.01, 0.03)  # two stages each
    assert added == [a for a in per_kind for _ in range(2)]
    # both engines agree to the bit with the charges on
    method = get_method("zb-h1")
    shape = method.shape(2, 2, 2)
    assert _events(evaluate_trace(method, shape, sync)) == _events(simulate(method, shape, sync))


def test_a_wait_costs_its_measured_seconds_per_message_taken_in_not_a_ratio_of_the_layers() -> None:
    # the layer and action times are one rank's own speed already: the ping-pong's ratio
    # on its small step is not charged on them (that counted a large model's layers twice)
    runtime = RuntimeCosts(
        message_receive_s=0.2,
        burst_slowdown=1.5,
        shared_burst_slowdown=2.0,
        action_s={"flush": {"F": 0.1}},
        burst_s=0.03,
        shared_burst_s=0.07,
    )
    profile = _two_layers(runtime_costs=runtime)
    costs = CostModel.from_profile(profile, [(0, 1), (1, 2)], 1)
    hosted = on_profiled_host(costs, profile, "gpipe", 2)  # no machine record: own cores
    assert (hosted.forward_s, hosted.backward_s) == (costs.forward_s, costs.backward_s)
    assert hosted.update_s == costs.update_s and hosted.action_s[0] == 0.1
    assert hosted.message_receive_s == pytest.approx(0.2 + 0.03)  # the wait's cold start
    shared = _two_layers(SHARED, runtime_costs=runtime)  # 2 ranks take turns on 1 core
    turns = on_profiled_host(costs, shared, "gpipe", 2)
    assert turns.forward_s == costs.forward_s and turns.action_s[0] == 0.1
    assert turns.message_receive_s == pytest.approx(0.2 * 2.0 / 1.5 + 0.07)
    assert any("per message taken in 70000 µs more" in n for n in host_notes(shared, 2))
    one = CostModel.from_profile(profile, [(0, 2)], 1)
    alone = on_profiled_host(one, profile, "gpipe", 1)  # one rank never waits for another
    assert alone.forward_s == one.forward_s and alone.message_receive_s == 0.2
    # a profile from before the seconds were measured: its ratio alone charges nothing
    ratio_only = _two_layers(runtime_costs=RuntimeCosts(burst_slowdown=2.05))
    assert on_profiled_host(costs, ratio_only, "gpipe", 2) is costs


def test_the_offline_prediction_is_what_the_measured_components_add_up_to() -> None:
    # A 2-rank profile of fixed numbers on a host of a core per rank: per mini-batch each
    # rank runs its layers (F 1, B 2, U 1 s), its policy's fixed work per action, one
    # message sent and one taken in (with the wait's cold start). pipeoptim (M = 1) keeps
    # both ranks busy in its steady state, so a mini-batch takes one rank's sum, whatever
    # the ping-pong's ratio (which a model's layer times already hold).
    def predicted(burst_slowdown: float) -> float:
        runtime = RuntimeCosts(
            message_send_s=0.05,
            message_receive_s=0.07,
            burst_slowdown=burst_slowdown,
            shared_burst_slowdown=burst_slowdown,
            action_s={"predict": {"F": 0.1, "B": 0.2, "U": 0.3}},
            burst_s=0.04,
        )
        meta = {"ranks": 2, "machine": Machine(2, 2, 1).to_dict()}
        profile = _two_layers(meta, runtime_costs=runtime)
        method = get_method("pipeoptim")
        shape = method.shape(2, None, 40)
        costs = CostModel.from_profile(profile, [(0, 1), (1, 2)], 1)
        hosted = on_profiled_host(costs, profile, method, 2)
        busy, _ = Program(method.order(shape), shape.micro_batches).busy_seconds(hosted)
        per_rank = 1.0 + 2.0 + 1.0 + (0.1 + 0.2 + 0.3) + 0.05 + (0.07 + 0.04)
        assert busy == pytest.approx({0: 40 * per_rank, 1: 40 * per_rank})
        trace = evaluate_trace(method, shape, hosted)
        trace.meta["batch_size"] = 1
        steady = 1.0 / compute_metrics(trace).steady_throughput
        assert steady == pytest.approx(per_rank)
        return steady

    assert predicted(1.0) == predicted(2.05)


def test_a_message_slows_by_the_shared_over_the_own_core_slowdown_where_ranks_take_turns() -> None:
    runtime = RuntimeCosts(
        message_send_s=0.1, message_receive_s=0.2, burst_slowdown=1.5, shared_burst_slowdown=3.0
    )
    costs = CostModel.from_profile(_two_layers(), [(0, 1), (1, 2)], 1)
    own = on_profiled_host(costs, _two_layers(runtime_costs=runtime), "gpipe", 2)
    assert (own.message_send_s, own.message_receive_s) == (0.1, 0.2)  # as measured
    shared = _two_layers(SHARED, runtime_costs=runtime)
    turns = on_profiled_host(costs, shared, "gpipe", 2)
    assert turns.message_send_s == pytest.approx(0.2) and turns.message_receive_s == pytest.approx(
        0.4
    )
    assert any(
        "per message 2.00x that where the ranks take turns" in n for n in host_notes(shared, 2)
    )
    # a shared slowdown measured below the own-core one never makes a message cheaper
    faster = dataclasses.replace(runtime, shared_burst_slowdown=1.2)
    assert faster.shared_over_burst == 1.0
    level = on_profiled_host(costs, _two_layers(SHARED, runtime_costs=faster), "gpipe", 2)
    assert (level.message_send_s, level.message_receive_s) == (0.1, 0.2)


def test_bad_fixed_action_costs_are_refused_with_rule_value_and_fix() -> None:
    base = CostModel.uniform(2)
    with pytest.raises(PlanError, match=r"action_s\[B\] is the fixed seconds .* >= 0 \(got -1"):
        dataclasses.replace(base, action_s=(0.0, -1.0, 0.0, 0.0, 0.0))
    with pytest.raises(PlanError, match=r"one fixed time per action kind F, B, U, I, W.*give 5"):
        dataclasses.replace(base, action_s=(0.1, 0.2))


def test_the_planner_times_candidates_on_the_profiled_host() -> None:
    layers = Profile.uniform(4, 1e-4, 2e-4, 64, 256).layers
    plain = Profile(layers, 8, "sgd", "cpu", meta={"threads": 1})
    hosted = dataclasses.replace(
        plain,
        meta={"threads": 1, "ranks": 4, "machine": Machine(2, 4, 1).to_dict()},
        runtime_costs=RuntimeCosts(message_send_s=5e-5, message_receive_s=5e-5),
    )
    fast = evaluate_candidate(plain, 4, "1f1b", 4)
    slow = evaluate_candidate(hosted, 4, "1f1b", 4)
    assert slow.throughput < fast.throughput / 2  # half the cores, and messages cost
    notes = host_notes(hosted, 4)
    assert notes[0] == "4 rank(s) of 1 thread(s) on 2 core(s): the busy ranks share the cores"
    assert "per message 50 µs at the sender, 50 µs at the receiver" in notes[1]


def test_simulate_and_a_planned_stage_graph_use_the_profiled_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = _two_layers(SHARED)
    path = tmp_path / "p.json"
    profile.save(path)
    argv = ["simulate", "--method", "gpipe", "--stages", "2", "--micro-batches", "1"]
    argv += ["--mini-batches", "1", "--json"]

    def makespan(*more: str) -> float:
        assert main([*argv, *more]) == 0
        return float(json.loads(capsys.readouterr().out)["runs"]["gpipe"]["span_s"])

    assert makespan("--profile", str(path)) == 8.0
    _two_layers().save(tmp_path / "old.json")
    assert makespan("--profile", str(tmp_path / "old.json")) == 7.0
    graph = stage_graph_to_dict(stage_graph(profile, [(0, 1), (1, 2)]))
    assert graph["graph"]["machine"] == SHARED["machine"] and graph["graph"]["ranks"] == 2
    plan = {
        "format": "pipeoptim-plan",
        "version": 1,
        "method": "gpipe",
        "num_stages": 2,
        "micro_batches": 1,
        "boundaries": [[0, 1], [1, 2]],
        "stage_graph": graph,
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert makespan("--plan", str(tmp_path / "plan.json")) == 8.0
