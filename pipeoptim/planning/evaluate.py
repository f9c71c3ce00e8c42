"""One candidate evaluated: its memory-feasible partition for P stages (fitted under the cap
where it must be, :mod:`~pipeoptim.planning.memory_fit`), timed by the simulator's fast
evaluator on the host the profile measured, with its convergence risk."""

from __future__ import annotations

import math

from pipeoptim.errors import PlanError, WorkLimitError
from pipeoptim.plan.memory_factors import method_memory_factors
from pipeoptim.plan.methods import Method
from pipeoptim.plan.partition import optimal_partition
from pipeoptim.plan.partition_cost import evaluate_partition
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.replicas import check_batch_split, check_replicas
from pipeoptim.plan.risk import method_risk
from pipeoptim.plan.units import format_bytes
from pipeoptim.planning.candidate import Candidate, per_unit_profile, resolve_method
from pipeoptim.planning.memory_fit import MemoryFit, fit_memory, smallest_reach, sync_costs
from pipeoptim.planning.several_stages import check_several_stages_request, evaluate_several_stages
from pipeoptim.sim.collectives import Cluster, edge_links
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.evaluate import Evaluation, compile_method, evaluate_program
from pipeoptim.sim.host import ProfiledHost, on_profiled_host


def evaluate_candidate(
    profile: Profile,
    num_stages: int,
    method: str | Method,
    micro_batches: int,
    *,
    memory_cap_bytes: int | None = None,
    bandwidth_bytes_per_s: float = math.inf,
    latency_s: float = 0.0,
    mini_batches: int | None = None,
    optimizer: str = "sgd",
    replicas: int = 1,
    cluster: Cluster | None = None,
    batch_size: int | None = None,
    short_run: bool = False,
    host: ProfiledHost | None = None,
    virtual_stages: int | None = None,
) -> Candidate:
    """Partition for ``method`` at ``micro_batches`` and simulate it; ``optimizer`` sets
    the convergence-risk coefficient (``risk.py``). A method that places several stages on
    every rank (``virtual_stages`` of them: the method's default where None) is planned by
    :mod:`~pipeoptim.planning.several_stages`, for one replica.

    ``batch_size`` is the global mini-batch (default: the profile's), shared by
    ``replicas`` replicas placed on ``cluster``; a cluster replaces
    ``bandwidth_bytes_per_s`` and ``latency_s`` (its within-node tier is the one link
    without ``gpus_per_node``). ``short_run``: ``mini_batches`` is short of the settled
    steady state, so the throughput is capped at what the busiest stage allows (what a
    long run converges to), not what `simulate` shows at its default run length. ``method``
    and ``host`` (default: the profile's) come resolved from the search, once for all its
    candidates."""
    spec = resolve_method(method)
    shape = spec.shape(
        num_stages,
        spec.micro_batches_for(micro_batches),
        mini_batches,
        spec.virtual_stages_for(virtual_stages),
    )
    d, m = check_replicas(replicas, "replicas"), shape.micro_batches
    batch = profile.batch_size if batch_size is None else batch_size
    if cluster is None:
        cluster = Cluster(bandwidth_bytes_per_s, latency_s)
    if spec.places_several_stages_per_rank:
        check_several_stages_request(spec, d, cluster)
        return evaluate_several_stages(
            profile,
            spec,
            shape,
            memory_cap_bytes=memory_cap_bytes,
            cluster=cluster,
            batch_size=batch,
            optimizer=optimizer,
            host=host if host is not None else ProfiledHost.of(profile),
            short_run=short_run,
        )
    if d > 1:  # (one replica keeps its old leniency: M need not divide the batch)
        check_batch_split(batch, d, m)
    links = (
        edge_links(num_stages, d, cluster) if d > 1 or cluster.gpus_per_node is not None else None
    )
    unit_profile = per_unit_profile(profile, m, batch // d)
    fit: MemoryFit | None = None
    try:
        partition = optimal_partition(
            unit_profile,
            num_stages,
            bandwidth_bytes_per_s=cluster.bandwidth,
            latency_s=cluster.latency_s,
            memory_cap_bytes=memory_cap_bytes,
            memory_factors=method_memory_factors(spec.name, num_stages, m),
            edges=links,
            sync=sync_costs(d, cluster, num_stages, m),
        )
    except PlanError as err:
        if isinstance(err, WorkLimitError) or "memory" not in str(err):
            raise
        assert memory_cap_bytes is not None
        cap = int(memory_cap_bytes)
        fit = fit_memory(unit_profile, spec, num_stages, m, d, cap, cluster, links)
        if fit is None:
            reach = smallest_reach(unit_profile, spec, num_stages, m, d)
            sharding = f" and sharding the optimizer state over {d} replicas" if d > 1 else ""
            size = format_bytes(reach, round_up=True)
            why = (
                f"no partition of {profile.num_layers} layers into {num_stages} stages fits "
                f"the memory cap of {format_bytes(cap)} ({cap} bytes) per device, even "
                f"recomputing activations{sharding}; the smallest possible peak is "
                f"{size} ({reach} bytes); raise --memory-cap to at least {size} or use "
                f"more stages"
            )
            return Candidate(spec.name, m, None, infeasible=why, data_parallel=d, stages=num_stages)
        partition = fit.partition

    # the machine and runtime costs it was measured with
    measured_on = host if host is not None else ProfiledHost.of(profile)

    def stage_costs(recompute: list[frozenset[int]] | None = None) -> CostModel:
        costs = CostModel.from_profile(
            profile,
            partition.boundaries,
            m,
            batch_size=batch // d,
            bandwidth=cluster.bandwidth,
            latency_s=cluster.latency_s,
            recompute=recompute,
        )
        costs = on_profiled_host(costs, measured_on, spec, num_stages, data_parallel=d)
        return costs.with_data_parallel(d, cluster) if links is not None else costs

    costs = stage_costs()
    # one compiled order (cached per method and shape) serves timing and versions
    program = compile_method(spec, shape)
    unfitted = 0.0
    unfitted_memory = 0
    if fit is not None:  # the same partition without the savings: what they cost
        unfitted = _steady(evaluate_program(program, costs), short_run)
        unfitted_memory = evaluate_partition(
            unit_profile,
            partition.boundaries,
            memory_factors=method_memory_factors(spec.name, num_stages, m),
        ).peak_memory_bytes
        costs = stage_costs(list(partition.recompute) if partition.recomputes else None)
        if fit.shard:
            costs = costs.with_sharded_optimizer(cluster)
    result = evaluate_program(program, costs)
    report = program.versions()
    stages = range(num_stages * shape.virtual_stages)
    risk = method_risk(
        spec,
        optimizer,
        [report.max_distance(k) for k in stages],
        [report.max_staleness(k) for k in stages],
    )
    steady = _steady(result, short_run)
    return Candidate(
        spec.name,
        m,
        partition,
        throughput=steady,
        run_throughput=result.throughput,
        bubble_ratio=result.overall_bubble,
        max_staleness=max(report.max_staleness(k) for k in report.stages),
        risk=risk,
        data_parallel=d,
        allreduce_s=costs.allreduce_s if d > 1 else (),
        stages=num_stages,
        update_period_s=batch / steady if steady > 0 else 0.0,
        steady_bubble=_steady_bubble(result.busy_s, result.samples, steady),
        recompute=partition.recompute,
        shard_optimizer=fit is not None and fit.shard,
        unfitted_throughput=unfitted,
        unfitted_memory_bytes=unfitted_memory,
    )


def _steady(result: Evaluation, short_run: bool) -> float:
    steady = result.steady_throughput
    if short_run and result.busy_s:
        # A short run's last updates can still be faster than the run settles to: an
        # async pipeline drains its in-flight slack before a slightly slower stage sets
        # the pace. No stage trains faster than its own busy time allows: that caps it.
        steady = min(steady, result.samples / max(result.busy_s.values()))
    return steady


def _steady_bubble(busy_s: dict[int, float], samples: float, rate: float) -> float:
    """1 - mean busy seconds / run length at ``rate`` (its steady state)."""
    if not busy_s or samples <= 0 or rate <= 0:
        return 0.0
    mean = math.fsum(busy_s.values()) / len(busy_s)
    return min(1.0, max(0.0, 1.0 - mean * rate / samples))
