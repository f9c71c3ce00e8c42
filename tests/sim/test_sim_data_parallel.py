"""PP x DP in the simulator: the ring all-reduce closed form, tiers from placement, updates
that carry their stage's all-reduce, global throughput, and both engines still equal."""

from __future__ import annotations

import math

import pytest

from pipeoptim.errors import PlanError
from pipeoptim.metrics import compute_metrics
from pipeoptim.plan.methods import METHODS, get_method
from pipeoptim.plan.replicas import check_batch_split
from pipeoptim.sim import CostModel, Program, evaluate_program, run_simpy
from pipeoptim.sim.collectives import (
    Cluster,
    allreduce_times,
    edge_links,
    edge_within_node,
    group_within_node,
    ring_allreduce_s,
)
from pipeoptim.sim.engine import simulate
from pipeoptim.sim.evaluate import evaluate_method, evaluate_trace

GiB = 2**30


# --------------------------------------------------------------------------- closed form
@pytest.mark.parametrize("replicas", [2, 3, 4, 8, 128, 1024])
@pytest.mark.parametrize("num_bytes", [0, 1, 4_000_000, 3 * GiB])
@pytest.mark.parametrize(("bandwidth", "latency"), [(25e9, 1e-5), (300e9, 0.0), (1.5e8, 2e-3)])
def test_ring_allreduce_is_the_closed_form(
    replicas: int, num_bytes: int, bandwidth: float, latency: float
) -> None:
    d = replicas
    expected = 2 * (d - 1) * latency + 2 * (d - 1) / d * num_bytes / bandwidth
    # the formula written again here, not the module's computation: equal to float64 rounding
    assert ring_allreduce_s(num_bytes, d, bandwidth, latency) == pytest.approx(expected, rel=1e-12)


def test_ring_allreduce_by_hand() -> None:
    # 4 replicas, 1 GB at 25 GB/s, 10 us: 6 latencies + 1.5 x 0.04 s
    assert ring_allreduce_s(1e9, 4, 25e9, 1e-5) == pytest.approx(6e-5 + 0.06, rel=1e-15)
    # one replica has nothing to reduce; free links leave the latencies
    assert ring_allreduce_s(1e9, 1, 25e9, 1e-5) == 0.0
    assert ring_allreduce_s(1e9, 8, math.inf, 1e-5) == pytest.approx(14e-5, rel=1e-15)
    # binary-exact numbers: 2 replicas, 2^30 bytes at 2^30 B/s, 1/8 s: 2/8 + 1
    assert ring_allreduce_s(GiB, 2, GiB, 0.125) == 1.25


def test_ring_allreduce_refuses_zero_replicas() -> None:
    with pytest.raises(PlanError, match=r"replica count must be a whole number .*>= 1 \(got 0\)"):
        ring_allreduce_s(1, 0, 1.0, 0.0)


# --------------------------------------------------------------------------- placement
TWO_TIERS = Cluster(300e9, 5e-6, gpus_per_node=8, inter_node_bandwidth=25e9,
                    inter_node_latency_s=1e-5)  # fmt: skip


def test_pipeline_within_a_node_and_groups_across_nodes() -> None:
    # P=4, D=4, G=8: ranks 0-3 and 4-7 on node 0, 8-15 on node 1
    p, d = 4, 4
    assert [edge_within_node(k, p, d, TWO_TIERS) for k in range(p - 1)] == [True] * 3
    assert [group_within_node(k, p, d, TWO_TIERS) for k in range(p)] == [False] * 4
    assert edge_links(p, d, TWO_TIERS) == [(300e9, 5e-6)] * 3
    grads = [GiB, 2 * GiB, 0, 3]
    expected = tuple(ring_allreduce_s(n, d, 25e9, 1e-5) for n in grads)
    assert allreduce_times(grads, d, TWO_TIERS) == expected


def test_an_edge_that_crosses_nodes_runs_at_the_inter_node_tier() -> None:
    # P=8, D=2, G=4: edge 3 joins ranks 3 and 4 (nodes 0 and 1), in both replicas
    cluster = Cluster(1e11, 0.0, gpus_per_node=4, inter_node_bandwidth=1e10)
    p, d = 8, 2
    within = [edge_within_node(k, p, d, cluster) for k in range(p - 1)]
    assert within == [True, True, True, False, True, True, True]
    assert edge_links(p, d, cluster)[3] == (1e10, 0.0)
    assert not any(group_within_node(k, p, d, cluster) for k in range(p))


def test_some_groups_within_a_node_others_not() -> None:
    # P=3, D=3, G=8: groups {0,3,6} and {1,4,7} on node 0; {2,5,8} spans nodes 0 and 1
    assert [group_within_node(k, 3, 3, TWO_TIERS) for k in range(3)] == [True, True, False]
    # P=3, D=4, G=8: edge 1 of replica 2 joins ranks 7 and 8: the slowest replica counts
    assert [edge_within_node(k, 3, 4, TWO_TIERS) for k in range(2)] == [True, False]


def test_interleaved_stages_sit_on_rank_s_mod_p() -> None:
    # 4 stages on P=2 ranks, D=2, G=2: every pipeline within a node, edge 1 = rank 1 -> 0
    cluster = Cluster(1e11, 0.0, gpus_per_node=2, inter_node_bandwidth=1e9)
    assert edge_links(4, 2, cluster, num_ranks=2) == [(1e11, 0.0)] * 3
    times = allreduce_times([8, 8, 16, 16], 2, cluster, num_ranks=2)
    assert times == tuple(ring_allreduce_s(n, 2, 1e9, 0.0) for n in (8, 8, 16, 16))


def test_placement_shortcuts_agree_with_every_rank() -> None:
    # edge and group tiers check one period of replicas, or a group's ends: the same
    # answer as looking at every replica's ranks (interleaved edges wrap, k >= P)
    import itertools

    for p, d, g in itertools.product(range(1, 10), range(1, 10), range(1, 10)):
        c = Cluster(gpus_per_node=g)
        for k in range(2 * p - 1):
            every = all(c.within_node((r * p + k % p, r * p + (k + 1) % p)) for r in range(d))
            assert edge_within_node(k, p, d, c) == every, (p, d, g, k)
        for k in range(p):
            assert group_within_node(k, p, d, c) == c.within_node([r * p + k for r in range(d)])


def test_one_tier_without_gpus_per_node() -> None:
    one = Cluster(25e9, 1e-5)
    assert not one.tiered
    assert edge_links(4, 64, one) == [(25e9, 1e-5)] * 3
    assert allreduce_times([GiB], 64, one) == (ring_allreduce_s(GiB, 64, 25e9, 1e-5),)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpus_per_node": 0}, r"--gpus-per-node must be a whole number of devices >= 1 \(got 0\)"),
        ({"bandwidth": 0.0}, r"within-node bandwidth must be .* > 0 \(got 0.0\); pass --bandwidth"),
        ({"latency_s": -1.0}, r"within-node latency must be a finite number .* \(got -1.0\)"),
        ({"inter_node_bandwidth": 1e9}, r"needs --gpus-per-node G, which says which ranks"),
        (
            {"gpus_per_node": 8, "inter_node_bandwidth": -5.0},
            r"inter-node bandwidth must be .* \(got -5.0\); pass --inter-node-bandwidth",
        ),
        (
            {"gpus_per_node": 8, "inter_node_latency_s": math.nan},
            r"inter-node latency must be a finite number of seconds >= 0 \(got nan\)",
        ),
    ],
)
def test_cluster_refuses_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        Cluster(**kwargs)


def test_a_job_over_several_nodes_takes_whole_nodes() -> None:
    TWO_TIERS.check_devices(8)
    TWO_TIERS.check_devices(4)  # part of one node
    TWO_TIERS.check_devices(1024)
    with pytest.raises(PlanError, match=r"12 devices on nodes of 8 GPUs .* \(8 or 16 devices\)"):
        TWO_TIERS.check_devices(12)


def test_batch_split() -> None:
    check_batch_split(2048, 128, 16)
    with pytest.raises(
        PlanError, match=r"batch size 96 is not divisible by 4 replicas x 16 micro-batches"
    ):
        check_batch_split(96, 4, 16)


# --------------------------------------------------------------------------- timing
# P=2, D=2, G=2: each pipeline within a node (free links), each stage's group across nodes
# at 2^30 B/s and 1/8 s: the all-reduce of 2^30 bytes takes exactly 2/8 + 1 = 1.25 s.
EXACT = Cluster(
    math.inf, 0.0, gpus_per_node=2, inter_node_bandwidth=GiB, inter_node_latency_s=0.125
)
AR = 1.25


def _uniform(stages: int = 2) -> CostModel:
    return CostModel.uniform(stages, 1.0, 2.0, 0.5, param_bytes=GiB, samples_per_micro_batch=4.0)


def test_update_carries_the_all_reduce() -> None:
    base = _uniform()
    dp = base.with_data_parallel(2, EXACT)
    assert dp.allreduce_s == (AR, AR)
    assert dp.update_total_s == (0.5 + AR, 0.5 + AR)
    assert dp.update_s == base.update_s  # the optimizer step itself is unchanged
    assert dp.global_samples_per_micro_batch == 8.0
    assert dp.bottleneck_s() == 3.5 + AR
    assert base.allreduce_s == (0.0, 0.0) and base.data_parallel == 1


def test_flushed_iteration_grows_by_the_all_reduce() -> None:
    # gpipe, P=2, M=2, N=3: a mini-batch takes (M + P - 1)(F + B) + U = 9.5 s, plus AR
    shape = get_method("gpipe").shape(2, 2, 3)
    one = evaluate_method("gpipe", shape, _uniform())
    two = evaluate_method("gpipe", shape, _uniform().with_data_parallel(2, EXACT))
    assert one.makespan == 3 * 9.5
    assert two.makespan == 3 * (9.5 + AR)
    assert two.makespan - one.makespan == 3 * AR
    # throughput counts both replicas: 3 mini-batches x 2 micro-batches x 4 samples x 2
    assert two.samples == 48.0 == 2 * one.samples
    # a rate (rounded) by hand, against the evaluator's window over the updates
    assert two.steady_throughput == pytest.approx(2 * 2 * 4.0 / (9.5 + AR), rel=1e-12)


def test_async_steady_state_is_the_bottleneck_with_the_all_reduce() -> None:
    shape = get_method("pipeoptim").shape(2, None, 16)
    dp = _uniform().with_data_parallel(2, EXACT)
    result = evaluate_method("pipeoptim", shape, dp)
    assert result.steady_throughput == pytest.approx(2 * 4.0 / (3.5 + AR), rel=1e-12)


def _skewed(stages: int) -> CostModel:
    base = CostModel.uniform(
        stages, 1.0, 2.0, 0.25, activation_bytes=3_000, param_bytes=GiB, latency_s=0.01
    )
    from dataclasses import replace

    return replace(
        base,
        forward_s=tuple(0.5 + 0.25 * (k % 3) for k in range(stages)),
        predict_s=tuple(0.1 * (k + 1) for k in range(stages)),
        param_bytes=tuple(GiB * (k + 1) for k in range(stages)),
    )


CASES = [
    (name, get_method(name).shape(p, m if get_method(name).micro_batched else None, 3))
    for name in METHODS
    for p, m in [(4, 4), (2, 4)]
]


@pytest.mark.parametrize(("name", "shape"), CASES, ids=[f"{n}-P{s.num_ranks}" for n, s in CASES])
def test_simpy_equals_the_fast_evaluator_with_replicas(name, shape) -> None:
    cluster = Cluster(2e5, 0.002, gpus_per_node=4, inter_node_bandwidth=5e4,
                      inter_node_latency_s=0.01)  # fmt: skip
    costs = _skewed(shape.num_stages).with_data_parallel(3, cluster, num_ranks=shape.num_ranks)
    assert any(a > 0 for a in costs.allreduce_s)
    method = get_method(name)
    program = Program(method.order_arrays(shape), shape.micro_batches, method.weight_policy)
    durations, transfers = program.durations(costs), program.transfer_times(costs)
    simpy = run_simpy(program, durations, transfers, contention=False)
    fast = evaluate_program(program, costs, keep_timing=True)
    assert fast.timing is not None
    assert simpy.starts == fast.timing.starts and simpy.ends == fast.timing.ends
    # the traces agree too, and their metrics report the fast evaluator's global throughput
    a = simulate(method, shape, costs, contention=False)
    b = evaluate_trace(method, shape, costs)
    assert [(e.start, e.end) for e in a.events] == [(e.start, e.end) for e in b.events]
    m = compute_metrics(a)
    assert m.throughput == pytest.approx(fast.throughput, rel=1e-12)
    assert m.steady_throughput == pytest.approx(fast.steady_throughput, rel=1e-12)


def test_trace_meta_records_the_replicas_and_the_global_batch() -> None:
    shape = get_method("1f1b").shape(2, 2, 2)
    trace = simulate("1f1b", shape, _uniform().with_data_parallel(2, EXACT))
    meta = trace.meta
    assert meta["data_parallel"] == 2
    assert meta["batch_size"] == 16.0  # 2 micro-batches x 4 samples x 2 replicas
    assert meta["replica_batch_size"] == 8.0
    assert meta["allreduce_s"] == {"0": AR, "1": AR}
    updates = [e for e in trace.events if e.kind == "U"]
    assert {round(e.end - e.start, 12) for e in updates} == {0.5 + AR}
    plain = simulate("1f1b", shape, _uniform())
    assert plain.meta["data_parallel"] == 1 and "allreduce_s" not in plain.meta
    two, one = compute_metrics(trace), compute_metrics(plain)
    assert two.samples == 2 * one.samples


def test_scaled_keeps_link_times() -> None:
    dp = _uniform().with_data_parallel(2, EXACT)
    assert dp.scaled(2.0).allreduce_s == dp.allreduce_s
    assert dp.scaled(2.0).update_total_s == (1.0 + AR, 1.0 + AR)


def test_cost_model_refuses_bad_replicas_and_all_reduce_lengths() -> None:
    from dataclasses import replace

    with pytest.raises(PlanError, match=r"data_parallel must be a whole number .*\(got 0\)"):
        replace(_uniform(), data_parallel=0)
    with pytest.raises(PlanError, match="allreduce_s needs one value per stage"):
        replace(_uniform(), allreduce_s=(1.0, 2.0, 3.0))
