"""Fitting a candidate under the memory cap when no partition fits as it is: sharding the
optimizer state over the replicas, then recomputing more and more stages, each cut down to
the units it needs (:mod:`pipeoptim.planning` says in what order and why)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipeoptim.errors import PlanError, WorkLimitError
from pipeoptim.plan.memory_factors import (
    method_holds_weights,
    method_memory_factors,
    resolve_factors,
)
from pipeoptim.plan.methods import Method
from pipeoptim.plan.partition import min_memory_partition, optimal_partition
from pipeoptim.plan.partition_cost import Partition, evaluate_partition
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.recompute_costs import profile_unit_costs, stage_recompute
from pipeoptim.sim.collectives import Cluster, group_within_node


def sync_costs(
    replicas: int, cluster: Cluster, num_stages: int, micro_batches: int, shard: bool = False
) -> list[tuple[float, float]] | None:
    """Each stage's all-reduce (and, with ``shard``, its weight all-gather) as the
    partitioner charges it, shared among the update's units: ``(seconds per gradient
    byte, fixed seconds)``, from the ring closed forms."""
    if replicas == 1:
        return None
    d, m = replicas, micro_batches
    rounds = 3 if shard else 2  # an all-reduce moves 2 (D-1)/D of the bytes, a gather 1
    out = []
    for k in range(num_stages):
        bw, lat = cluster.tier(group_within_node(k, num_stages, d, cluster))
        per_byte = 0.0 if math.isinf(bw) else rounds * (d - 1) / d / bw
        out.append((per_byte / m, rounds * (d - 1) * lat / m))
    return out


@dataclass(frozen=True)
class MemoryFit:
    partition: Partition
    shard: bool


def fit_memory(
    unit_profile: Profile,
    method: Method,
    num_stages: int,
    micro_batches: int,
    replicas: int,
    cap: int,
    cluster: Cluster,
    edges: Sequence[tuple[float, float]] | None,
) -> MemoryFit | None:
    """The first of sharding, then recomputing more and more stages (module doc) whose
    partition fits ``cap``, with each recomputed stage cut down to the units it needs."""
    p, d, m = num_stages, replicas, micro_batches
    factors = method_memory_factors(method.name, p, m)
    _, slots = resolve_factors(factors, p)
    hold = method_holds_weights(method.name, p)
    order = sorted(range(p), key=lambda k: (-slots[k], k))  # who holds the most first
    attempts: list[tuple[bool, int]] = [(True, 0)] if d > 1 else []
    attempts += [(d > 1, j) for j in range(1, p + 1)]
    for shard, count in attempts:
        flags = [k in order[:count] for k in range(p)]
        try:
            found = optimal_partition(
                unit_profile,
                p,
                bandwidth_bytes_per_s=cluster.bandwidth,
                latency_s=cluster.latency_s,
                memory_cap_bytes=cap,
                memory_factors=factors,
                edges=edges,
                sync=sync_costs(d, cluster, p, m, shard),
                recompute_stages=flags if count else None,
                hold_weights=hold,
                optimizer_shards=d if shard else 1,
            )
        except PlanError as err:
            if isinstance(err, WorkLimitError) or "memory" not in str(err):
                raise
            continue
        sets = _fewest_units(unit_profile, found, cap, slots, hold) if count else None
        partition = evaluate_partition(
            unit_profile,
            found.boundaries,
            bandwidth_bytes_per_s=cluster.bandwidth,
            latency_s=cluster.latency_s,
            memory_factors=factors,
            edges=edges,
            sync=sync_costs(d, cluster, p, m, shard),
            recompute=sets,
            hold_weights=hold,
            optimizer_shards=d if shard else 1,
        )
        return MemoryFit(partition, shard)
    return None


def _fewest_units(
    unit_profile: Profile, found: Partition, cap: int, slots: list[int], hold: list[bool]
) -> list[frozenset[int]]:
    """Per recomputed stage of ``found`` the units it needs to come under ``cap``: from the
    set that keeps the least, the units whose forward costs the most are left alone first,
    while the stage still fits. Each set is priced as the runtime runs it (runs of
    consecutive units as one region: ``recompute_costs.stage_recompute``), so a ReLU stays
    in its layer's region where that frees memory."""
    units = profile_unit_costs(unit_profile)
    out: list[frozenset[int]] = []
    for k, chosen in enumerate(found.recompute or [frozenset()] * found.num_stages):
        if not chosen:
            out.append(frozenset())
            continue
        start, end = found.boundaries[k]

        def per_slot(local: frozenset[int], k: int = k, start: int = start, end: int = end) -> int:
            r = stage_recompute(units, start, end, local)
            return r.kept_activation_bytes + (r.param_bytes if hold[k] else 0)

        # the stage's memory less what its activations (and held weights) take per slot
        rest = found.stage_memory[k] - slots[k] * per_slot(chosen)
        picked = set(chosen)
        for i in sorted(chosen, key=lambda i: (-units.forward_s[start + i], i)):
            fewer = frozenset(picked - {i})
            if rest + slots[k] * per_slot(fewer) <= cap:
                picked.discard(i)
        out.append(frozenset(picked))
    return out


def smallest_reach(
    unit_profile: Profile, method: Method, num_stages: int, micro_batches: int, replicas: int
) -> int:
    """The smallest peak stage memory any partition reaches with every saving available."""
    factors = method_memory_factors(method.name, num_stages, micro_batches)
    hold = method_holds_weights(method.name, num_stages)
    shards = replicas if replicas > 1 else 1
    return min(
        min_memory_partition(
            unit_profile,
            num_stages,
            memory_factors=factors,
            recompute_stages=[full] * num_stages,
            hold_weights=hold,
            optimizer_shards=shards,
        ).peak_memory_bytes
        for full in (False, True)
    )
