"""One candidate of a method that places several stages on every rank (interleaved-1f1b,
zb-v, dualpipev, interleaved-zb): the units partitioned into the method's P x v stages,
placed on the ranks as its schedule places them, each rank's memory (its stages together)
checked against the cap, and the whole timed by the simulator.

The partition balances the P x v stages one by one (the slowest stage as fast as it can
be); it does not balance the ranks' sums of stages, which the schedule's placement
(round-robin for interleaved, the V for zb-v and dualpipev) already evens out when the
stages are even. Memory is checked per rank from the simulated run (what
``pipeoptim simulate`` reports), not fitted: a rank over the cap makes the candidate
infeasible, with the smallest cap that would do.
"""

from __future__ import annotations

from pipeoptim.errors import PlanError
from pipeoptim.plan.memory_factors import method_memory_factors
from pipeoptim.plan.methods import Method
from pipeoptim.plan.partition import optimal_partition
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.risk import method_risk
from pipeoptim.plan.shape import Shape
from pipeoptim.plan.units import format_bytes
from pipeoptim.planning.candidate import Candidate, per_unit_profile
from pipeoptim.sim.collectives import Cluster
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.evaluate import Evaluation, compile_method, evaluate_program
from pipeoptim.sim.host import ProfiledHost, on_profiled_host
from pipeoptim.sim.memory import memory_report

__all__ = ["check_several_stages_request", "evaluate_several_stages", "rank_peaks"]


def check_several_stages_request(method: Method, replicas: int, cluster: Cluster) -> None:
    """Refuse what the search does not model for several stages per rank: replicas and
    links tiered by node (both place stages on devices one per device)."""
    if replicas > 1:
        raise PlanError(
            f"{method.name} places several stages on every rank; the plan search plans it "
            f"for one pipeline replica only (got {replicas} replicas); plan it with "
            f"--stages P (one replica), or search --devices with --method auto"
        )
    if cluster.gpus_per_node is not None:
        raise PlanError(
            f"{method.name} places several stages on every rank; the plan search does not "
            f"place its stages on nodes (got --gpus-per-node {cluster.gpus_per_node}); plan "
            f"it without --gpus-per-node (one link for every pair of ranks)"
        )


def rank_peaks(
    result: Evaluation, costs: CostModel, method: Method, shape: Shape
) -> dict[int, int]:
    """Peak bytes of every rank, its stages together, over the simulated run ``result``
    (evaluated with ``keep_timing``)."""
    assert result.timing is not None
    report = memory_report(compile_method(method, shape), result.timing, costs)
    peaks: dict[int, int] = {}
    for sample in report.samples:
        peaks[sample.rank] = max(peaks.get(sample.rank, 0), int(sample.bytes))
    return peaks


def evaluate_several_stages(
    profile: Profile,
    spec: Method,
    shape: Shape,
    *,
    memory_cap_bytes: int | None,
    cluster: Cluster,
    batch_size: int,
    optimizer: str,
    host: ProfiledHost,
    short_run: bool = False,
) -> Candidate:
    """The candidate of ``spec`` on ``shape`` (P ranks x v stages each, one replica);
    ``short_run`` caps the throughput at the busiest rank's pace as
    :func:`~pipeoptim.planning.evaluate.evaluate_candidate` does."""
    p, v, m = shape.num_ranks, shape.virtual_stages, shape.micro_batches
    stages = shape.num_stages
    if stages > profile.num_layers:
        raise PlanError(
            f"{spec.name} places {v} stages on each of {p} ranks ({stages} stages), but the "
            f"profile has {profile.num_layers} units; use at most "
            f"{profile.num_layers // v} --stages (or fewer --virtual-stages)"
        )
    unit_profile = per_unit_profile(profile, m, batch_size)
    partition = optimal_partition(
        unit_profile,
        stages,
        bandwidth_bytes_per_s=cluster.bandwidth,
        latency_s=cluster.latency_s,
        memory_factors=method_memory_factors(spec.name, stages, m),
    )
    costs = CostModel.from_profile(
        profile,
        partition.boundaries,
        m,
        batch_size=batch_size,
        bandwidth=cluster.bandwidth,
        latency_s=cluster.latency_s,
    )
    costs = on_profiled_host(costs, host, spec, p)
    program = compile_method(spec, shape)
    result = evaluate_program(program, costs, keep_timing=True)
    peaks = rank_peaks(result, costs, spec, shape)
    peak = max(peaks.values(), default=0)
    if memory_cap_bytes is not None and peak > memory_cap_bytes:
        fullest = max(peaks, key=lambda r: peaks[r])
        size = format_bytes(peak, round_up=True)
        why = (
            f"{spec.name}'s rank {fullest} holds {v} stages that together peak at {size} "
            f"({peak} bytes), over the memory cap of {format_bytes(memory_cap_bytes)} "
            f"({memory_cap_bytes} bytes) per device (the plan search does not recompute or "
            f"shard for several stages per rank); raise --memory-cap to at least {size} or "
            f"use more --stages"
        )
        return Candidate(spec.name, m, None, infeasible=why, stages=p, virtual_stages=v)
    placed = dict(zip(program.stage, program.rank_of, strict=True))
    report = program.versions()
    risk = method_risk(
        spec,
        optimizer,
        [report.max_distance(k) for k in range(stages)],
        [report.max_staleness(k) for k in range(stages)],
    )
    rate = result.steady_throughput
    busy = result.rank_busy_s  # a rank runs its stages one at a time
    if short_run and busy:
        rate = min(rate, result.samples / max(busy.values()))
    mean_busy = sum(busy.values()) / len(busy) if busy else 0.0
    idle = min(1.0, max(0.0, 1.0 - mean_busy * rate / result.samples)) if rate > 0 else 0.0
    return Candidate(
        spec.name,
        m,
        partition,
        throughput=rate,
        run_throughput=result.throughput,
        bubble_ratio=result.overall_bubble,
        max_staleness=max(report.max_staleness(k) for k in report.stages),
        risk=risk,
        stages=p,
        virtual_stages=v,
        rank_peak_memory_bytes=peak,
        stage_ranks=tuple(placed[k] for k in range(stages)),
        update_period_s=batch_size / rate if rate > 0 else 0.0,
        steady_bubble=idle,
    )
