"""The partitioner: exactness against brute force, memory caps, errors, method factors."""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeoptim.errors import PlanError
from pipeoptim.plan.memory_factors import MEMORY_METHODS, MemoryFactors, method_memory_factors
from pipeoptim.plan.partition import equal_layer_partition, min_memory_partition, optimal_partition
from pipeoptim.plan.partition_cost import Partition, evaluate_partition, stage_comm_s
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.units import format_bytes, parse_bandwidth, parse_bytes

GiB = 2**30


def all_splits(num_layers: int, num_stages: int) -> list[list[tuple[int, int]]]:
    splits = []
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        edges = [0, *cuts, num_layers]
        splits.append(list(itertools.pairwise(edges)))
    return splits


@dataclass(frozen=True)
class Case:
    profile: Profile
    num_stages: int
    bandwidth: float
    latency: float
    factors: MemoryFactors | None
    cap: int | None

    def evaluate(self, bounds: list[tuple[int, int]]) -> Partition:
        return evaluate_partition(
            self.profile,
            bounds,
            bandwidth_bytes_per_s=self.bandwidth,
            latency_s=self.latency,
            memory_factors=self.factors,
        )

    def optimal(self) -> Partition:
        return optimal_partition(
            self.profile,
            self.num_stages,
            bandwidth_bytes_per_s=self.bandwidth,
            latency_s=self.latency,
            memory_factors=self.factors,
            memory_cap_bytes=self.cap,
        )


@st.composite
def instances(draw: st.DrawFn) -> Case:
    num_layers = draw(st.integers(1, 8))
    num_stages = draw(st.integers(1, num_layers))
    times = st.floats(0.0, 10.0, allow_nan=False, allow_infinity=False)

    def per_layer(values: st.SearchStrategy[Any]) -> Any:
        return draw(st.lists(values, min_size=num_layers, max_size=num_layers))

    profile = Profile.from_costs(
        forward_s=per_layer(times),
        backward_s=per_layer(times),
        activation_bytes=per_layer(st.integers(0, 1000)),
        param_bytes=per_layer(st.integers(0, 1000)),
        optimizer_state_bytes=per_layer(st.integers(0, 2000)),
    )
    method = draw(st.sampled_from([None, *MEMORY_METHODS]))
    factors = None
    if method is not None:
        factors = method_memory_factors(method, num_stages, draw(st.integers(1, 4)))
    return Case(
        profile=profile,
        num_stages=num_stages,
        bandwidth=draw(st.sampled_from([math.inf, 100.0, 1e3])),
        latency=draw(st.sampled_from([0.0, 0.5])),
        factors=factors,
        cap=draw(st.one_of(st.none(), st.integers(0, 40_000))),
    )


@settings(max_examples=400, deadline=None)
@given(instances())
def test_dp_equals_brute_force(case: Case) -> None:
    evaluated = [case.evaluate(b) for b in all_splits(case.profile.num_layers, case.num_stages)]
    cap = case.cap
    feasible = [e for e in evaluated if cap is None or e.peak_memory_bytes <= cap]
    lowest_peak = min(e.peak_memory_bytes for e in evaluated)
    if feasible:
        best = min(e.bottleneck_s for e in feasible)
        got = case.optimal()
        assert abs(got.bottleneck_s - best) <= 1e-9
        assert cap is None or got.peak_memory_bytes <= cap
        assert got.num_stages == case.num_stages
    else:
        with pytest.raises(PlanError, match="no partition") as info:
            case.optimal()
        assert f"({lowest_peak} bytes)" in str(info.value)
    low = min_memory_partition(case.profile, case.num_stages, memory_factors=case.factors)
    assert low.peak_memory_bytes == lowest_peak


def uneven() -> Profile:
    return Profile.from_costs(
        forward_s=[1, 1, 1, 1, 8, 8],
        backward_s=[0] * 6,
        activation_bytes=[10] * 6,
        param_bytes=[100, 100, 100, 100, 800, 800],
        optimizer_state_bytes=[0] * 6,
    )


def test_balances_uneven_model_better_than_equal_layers() -> None:
    p = uneven()
    naive = evaluate_partition(p, equal_layer_partition(6, 3))
    assert naive.boundaries == ((0, 2), (2, 4), (4, 6))
    assert naive.bottleneck_s == 16
    best = optimal_partition(p, 3)
    assert best.bottleneck_s == 8
    assert best.boundaries == ((0, 4), (4, 5), (5, 6))
    two = optimal_partition(p, 2)
    assert two.bottleneck_s == 12  # [1,1,1,1,8] | [8]
    assert evaluate_partition(p, equal_layer_partition(6, 2)).bottleneck_s == 17


def front_heavy() -> Profile:
    return Profile.from_costs(
        forward_s=[1, 1, 1, 1, 8, 8],
        backward_s=[0] * 6,
        activation_bytes=[10] * 6,
        param_bytes=[800, 800, 100, 100, 100, 100],
        optimizer_state_bytes=[0] * 6,
    )


def test_respects_memory_cap() -> None:
    p = front_heavy()
    # 1 copy + grads, 1 activation slot: stage memory = 2·params + activations
    free = optimal_partition(p, 2)
    assert free.boundaries == ((0, 5), (5, 6))
    assert free.stage_memory == (2 * 1900 + 50, 2 * 100 + 10)
    assert free.bottleneck_s == 12
    capped = optimal_partition(p, 2, memory_cap_bytes=3700)
    assert capped.boundaries == ((0, 4), (4, 6))
    assert capped.bottleneck_s == 16
    assert capped.peak_memory_bytes == 3640
    tight = optimal_partition(p, 2, memory_cap_bytes=3000)
    assert tight.boundaries == ((0, 1), (1, 6))
    assert tight.bottleneck_s == 19
    assert optimal_partition(p, 2, memory_cap_bytes=3640).boundaries == ((0, 4), (4, 6))
    assert optimal_partition(p, 2, memory_cap_bytes="1GiB").boundaries == free.boundaries


def test_infeasible_cap_states_minimum() -> None:
    p = front_heavy()
    # every split but (0,1)|(1,6) puts both 800-byte layers on stage 0 (>= 3220 bytes)
    low = min_memory_partition(p, 2)
    assert low.boundaries == ((0, 1), (1, 6))
    assert low.peak_memory_bytes == 2 * 1200 + 50
    with pytest.raises(PlanError) as info:
        optimal_partition(p, 2, memory_cap_bytes=2000)
    message = str(info.value)
    assert "no partition of 6 layers into 2 stages fits the memory cap" in message
    assert "2000 bytes" in message
    assert "smallest possible peak is 2.40 KiB (2450 bytes) on stage 1" in message
    assert "raise --memory-cap to at least 2.40 KiB or use more stages" in message


def test_stage_count_errors() -> None:
    p = Profile.uniform(3)
    with pytest.raises(PlanError, match=r"cannot split 3 layers into 4 stages; use at most 3"):
        optimal_partition(p, 4)
    with pytest.raises(PlanError, match="at least 1"):
        optimal_partition(p, 0)
    with pytest.raises(PlanError, match="cannot split 3 layers into 4 stages"):
        equal_layer_partition(3, 4)
    assert equal_layer_partition(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert optimal_partition(p, 3).boundaries == ((0, 1), (1, 2), (2, 3))
    assert optimal_partition(p, 1).boundaries == ((0, 3),)


def test_communication_formula() -> None:
    p = Profile.from_costs(
        forward_s=[1, 1, 1],
        backward_s=[2, 2, 2],
        activation_bytes=[100, 300, 7],
        param_bytes=[0, 0, 0],
    )
    bw, lat = 100.0, 0.25
    # middle stage: receives layer 0's activation, sends layer 1's (both ways each)
    assert stage_comm_s(p, 1, 2, 1, 3, bandwidth_bytes_per_s=bw, latency_s=lat) == (
        2 * 100 / bw + 2 * lat + 2 * 300 / bw + 2 * lat
    )
    assert stage_comm_s(p, 0, 1, 0, 3, bandwidth_bytes_per_s=bw, latency_s=lat) == 2 + 0.5
    assert stage_comm_s(p, 2, 3, 2, 3, bandwidth_bytes_per_s=bw, latency_s=lat) == 6 + 0.5
    assert stage_comm_s(p, 0, 3, 0, 1, bandwidth_bytes_per_s=bw, latency_s=lat) == 0
    part = evaluate_partition(
        p, [(0, 1), (1, 2), (2, 3)], bandwidth_bytes_per_s="100B/s", latency_s=lat
    )
    assert part.stage_compute_s == (3, 3, 3)
    assert part.stage_comm_s == (2.5, 9.0, 6.5)
    assert part.stage_times == (5.5, 12.0, 9.5)
    assert part.bottleneck_s == 12.0
    assert part.bottleneck_stage == 1
    # with slow links the big activation (layer 1's output) should not cross a boundary:
    # (0,1)|(1,3) costs max(3 + 2.5, 6 + 2.5); (0,2)|(2,3) costs max(6 + 6.5, 3 + 6.5)
    best = optimal_partition(p, 2, bandwidth_bytes_per_s=bw, latency_s=lat)
    assert best.boundaries == ((0, 1), (1, 3))
    assert best.bottleneck_s == 8.5
    free = optimal_partition(p, 2)
    assert free.bottleneck_s == 6.0


def test_memory_factor_tables() -> None:
    pd = method_memory_factors("pipedream", 4, 1)
    assert [pd(k, 4) for k in range(4)] == [(4, 4), (3, 3), (2, 2), (1, 1)]
    po = method_memory_factors("pipeoptim", 4, 1)
    assert [po(k, 4) for k in range(4)] == [(2, 4), (2, 3), (2, 2), (1, 1)]
    gp = method_memory_factors("gpipe", 4, 8)
    assert {gp(k, 4) for k in range(4)} == {(1, 8)}
    fb = method_memory_factors("1f1b", 4, 2)
    assert [fb(k, 4) for k in range(4)] == [(1, 2), (1, 2), (1, 2), (1, 1)]
    bw2 = method_memory_factors("2bw", 4, 8)
    assert [bw2(k, 4) for k in range(4)] == [(2, 4), (2, 3), (2, 2), (2, 1)]
    il = method_memory_factors("interleaved-1f1b", 4, 8)
    assert [il(k, 4) for k in range(4)] == [
        fb2 for fb2 in map(method_memory_factors("1f1b", 4, 8), range(4), [4] * 4)
    ]
    for name in ("spectrain", "xpipe"):
        f = method_memory_factors(name, 3, 6)
        assert [f(k, 3) for k in range(3)] == [(2, 3), (2, 2), (1, 1)]
    with pytest.raises(PlanError, match=r"unknown method 'zb'.*gpipe, 1f1b.*pipeoptim"):
        method_memory_factors("zb", 4, 4)
    with pytest.raises(PlanError, match="micro_batches must be a whole number >= 1"):
        method_memory_factors("gpipe", 4, 0)
    with pytest.raises(PlanError, match=r"outside 0\.\.3"):
        pd(4, 4)


def test_method_factors_change_the_partition_memory() -> None:
    p = Profile.uniform(8, 1.0, 1.0, activation_bytes=10, param_bytes=100, optimizer="sgd")
    f = method_memory_factors("pipedream", 4, 1)
    part = optimal_partition(p, 4, memory_factors=f)
    # 2 layers per stage: (P-k) copies + grads + sgd state + (P-k) activation slots
    assert part.stage_memory == tuple((c + 2) * 200 + c * 20 for c in (4, 3, 2, 1))
    g = part.stage_graph(p)
    assert [g.nodes[k]["memory_bytes"] for k in range(4)] == list(part.stage_memory)
    assert [g.nodes[k]["weight_copies"] for k in range(4)] == [4, 3, 2, 1]
    assert isinstance(part, Partition)
    assert part.to_dict()["boundaries"] == [[0, 2], [2, 4], [4, 6], [6, 8]]
    # a cap that the front stages (more copies) only meet by holding fewer layers
    capped = optimal_partition(p, 4, memory_factors=f, memory_cap_bytes=1100)
    assert capped.boundaries == ((0, 1), (1, 3), (3, 5), (5, 8))
    assert capped.peak_memory_bytes <= 1100
    assert capped.bottleneck_s == 6
    with pytest.raises(PlanError, match="1060 bytes"):
        optimal_partition(p, 4, memory_factors=f, memory_cap_bytes=1000)


def test_larger_instance_beats_or_matches_equal_split() -> None:
    import random

    rng = random.Random(1)
    n = 300
    p = Profile.from_costs(
        [rng.uniform(0.1, 1.0) for _ in range(n)],
        [rng.uniform(0.2, 2.0) for _ in range(n)],
        [rng.randint(1, 10**6) for _ in range(n)],
        [rng.randint(1, 10**7) for _ in range(n)],
    )
    best = optimal_partition(p, 16, bandwidth_bytes_per_s="1GB/s", latency_s=1e-4)
    naive = evaluate_partition(
        p, equal_layer_partition(n, 16), bandwidth_bytes_per_s="1GB/s", latency_s=1e-4
    )
    assert best.bottleneck_s <= naive.bottleneck_s
    assert best.bottleneck_s >= p.total_compute_s / 16


# ------------------------------------------------------------------------ units
@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("8GiB", 8 * GiB),
        ("8 GiB", 8 * GiB),
        ("16GB", 16 * 10**9),
        ("8G", 8 * GiB),
        ("512m", 512 * 2**20),
        ("1.5KiB", 1536),
        ("1024", 1024),
        ("100B", 100),
        (4096, 4096),
        (1e3, 1000),
    ],
)
def test_parse_bytes(text: str | int | float, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("lots", "cannot read 'lots' as a byte size"),
        ("8Gb", "in bits"),
        ("8GB/s", "is a bandwidth"),
        (-1, ">= 0"),
        ("", "cannot read"),
    ],
)
def test_parse_bytes_errors(text: str | int, needle: str) -> None:
    with pytest.raises(PlanError, match=re.escape(needle)):
        parse_bytes(text)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("25GB/s", 25e9),
        ("12.5GiB/s", 12.5 * GiB),
        ("100Gb/s", 12.5e9),
        ("100Gbps", 12.5e9),
        ("100 Gbit/s", 12.5e9),
        ("1e9", 1e9),
        (5.0, 5.0),
        (math.inf, math.inf),
    ],
)
def test_parse_bandwidth(text: str | float, value: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(value)


@pytest.mark.parametrize(
    ("text", "needle"),
    [("25GB", "no per-second unit"), ("fast", "cannot read"), (0, "> 0"), ("-3", "cannot")],
)
def test_parse_bandwidth_errors(text: str | int, needle: str) -> None:
    with pytest.raises(PlanError, match=needle):
        parse_bandwidth(text)


def test_format_bytes() -> None:
    assert format_bytes(3 * 2**29) == "1.50 GiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(GiB + 1, round_up=True) == "1.01 GiB"
    assert format_bytes(GiB, round_up=True) == "1.00 GiB"


# interleaved stages are per chunk; the table treats a rank like 1f1b
@pytest.mark.parametrize("method", [m for m in MEMORY_METHODS if m != "interleaved-1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 4), (4, 8)])
def test_memory_factors_agree_with_the_version_analysis(method: str, p: int, m: int) -> None:
    """The partitioner's table and the schedule-derived copies/in-flight counts are one truth."""
    from pipeoptim.plan import analyze_versions, build_schedule, get_method

    spec = get_method(method)
    schedule, shape = build_schedule(method, p, m if spec.micro_batched else None, 3 * p)
    report = analyze_versions(schedule, spec.weight_policy, shape.micro_batches)
    stages = p * shape.virtual_stages  # zb-v: 2 stages per rank, in a V
    factors = method_memory_factors(method, stages, shape.micro_batches)
    for k in range(stages):
        # a correction's kept buffers (the extrapolation's previous update) are no version
        copies = report.weight_copies[k] + spec.correction_buffers
        assert factors(k, stages) == (copies, report.max_in_flight[k])
