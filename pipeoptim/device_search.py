"""Plan search over a device count: how many stages, how many replicas, which method.

N devices train D data-parallel replicas of a P-stage pipeline, N = P x D (PP x DP; the
placement and the all-reduce are :mod:`pipeoptim.sim.collectives`'). Every factorisation
with P at most the profile's layers gets the candidates of :func:`pipeoptim.planner.search`
(method x micro-batch count, each with its memory-feasible partition for P stages and its
replica's share B/D of the global batch B), timed by the fast evaluator with its links and
all-reduces at the tiers the placement gives them; all candidates are ranked together as
:func:`pipeoptim.planner.rank` does (effective throughput, then freshness and memory).

Runs are kept short, because only the steady state matters and every candidate is capped
at the rate its busiest stage allows (``short_run`` of ``planner.evaluate_candidate``): 2
mini-batches for a flushed method (each is alike), 4 for an asynchronous one that fills
the pipeline within a mini-batch (M >= P), P + 2 for one that needs P mini-batches to fill
it (M = 1). The 1,024-device search takes about a second (``benchmarks/bench_plan_devices.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pipeoptim.errors import PlanError, WorkLimitError
from pipeoptim.plan.limits import estimate_work, fit_budget
from pipeoptim.plan.memory_factors import method_memory_factors
from pipeoptim.plan.methods import RANKED_BY_DEFAULT, get_method
from pipeoptim.plan.partition import min_memory_partition
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.units import format_bandwidth, format_bytes
from pipeoptim.planner import (
    Candidate,
    describe_staleness,
    evaluate_candidate,
    format_rate,
    micro_batch_options,
    per_unit_profile,
    rank,
    skipped_candidate,
)
from pipeoptim.sim.collectives import Cluster, edge_within_node, group_within_node

__all__ = [
    "DeviceSearch",
    "Factorisation",
    "Shares",
    "explain_devices",
    "factorisations",
    "search_devices",
    "shares",
    "steady_mini_batches",
]


def factorisations(devices: int) -> list[tuple[int, int]]:
    """Every ``(P, D)`` with ``P x D = devices``, P ascending."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise PlanError(
            f"--devices must be a whole number of devices >= 1 (got {devices!r}); e.g. --devices 64"
        )
    small = [p for p in range(1, math.isqrt(devices) + 1) if devices % p == 0]
    stages = sorted({*small, *(devices // p for p in small)})
    return [(p, devices // p) for p in stages]


def steady_mini_batches(method: str, num_stages: int, micro_batches: int) -> int:
    """Mini-batches a run needs to show its steady state (module docstring)."""
    spec = get_method(method)
    if spec.flushes:
        return 2
    return 4 if micro_batches >= num_stages else num_stages + 2


@dataclass(frozen=True)
class Factorisation:
    """One way to split the devices: P pipeline stages x D replicas, and its candidates."""

    stages: int
    """Pipeline stages P (devices per replica)."""
    replicas: int
    """Data-parallel replicas D."""
    candidates: tuple[Candidate, ...] = ()
    """Its (method, M) candidates, ranked best first, those that cannot run last."""
    excluded: str | None = None
    """Why it has no candidate that runs (layers, batch, memory cap), or None."""
    inter_node_edges: int = 0
    """Pipeline edges that cross nodes in some replica (run at the inter-node tier)."""
    inter_node_groups: int = 0
    """Pipeline ranks whose data-parallel group spans nodes (all-reduce between nodes)."""

    @property
    def label(self) -> str:
        return f"P={self.stages} x D={self.replicas}"

    @property
    def best(self) -> Candidate | None:
        """Its best candidate that runs, or None."""
        return next((c for c in self.candidates if c.infeasible is None), None)


@dataclass(frozen=True)
class DeviceSearch:
    """The outcome of :func:`search_devices`."""

    devices: int
    """Devices N = P x D."""
    batch_size: int
    """Global mini-batch B (each replica trains B / D)."""
    cluster: Cluster
    """Links and placement the candidates were timed on."""
    memory_cap_bytes: int | None
    """Per-device memory cap, or None."""
    factorisations: tuple[Factorisation, ...]
    """Every factorisation: those with a runnable candidate best first, then the rest."""
    ranked: tuple[Candidate, ...] = field(default=())
    """Every candidate of every factorisation, ranked together."""

    @property
    def best(self) -> Candidate:
        """The recommendation; :class:`PlanError` with every reason when nothing runs."""
        for c in self.ranked:
            if c.infeasible is None:
                return c
        whys = [f.excluded or "" for f in self.factorisations]
        reasons = "; ".join(f"{f.label}: {f.excluded}" for f in self.factorisations)
        fixes = []
        if any("memory cap" in why for why in whys):
            fixes.append("raise --memory-cap")
        if any("split" in why for why in whys):
            fixes.append(
                f"pass a --global-batch that the replicas and micro-batches divide (e.g. a "
                f"multiple of {self.devices})"
            )
        fixes.append("use another device count")
        raise PlanError(
            f"no factorisation of {self.devices} devices into P stages x D replicas can run: "
            f"{reasons}. Fix: {', or '.join(fixes)}"
        )

    def factorisation(self, candidate: Candidate) -> Factorisation:
        """The factorisation ``candidate`` belongs to."""
        return next(
            f
            for f in self.factorisations
            if (f.stages, f.replicas) == (candidate.stages, candidate.data_parallel)
        )


def _options(method: str, stages: int, replica_batch: int, fixed: int | None) -> list[int]:
    spec = get_method(method)
    if spec.runs_whole_mini_batches:
        return [1]
    if fixed is not None:
        return [fixed] if replica_batch % fixed == 0 else []
    return micro_batch_options(method, stages, replica_batch)


def search_devices(
    profile: Profile,
    devices: int,
    *,
    cluster: Cluster | None = None,
    batch_size: int | None = None,
    memory_cap_bytes: int | None = None,
    methods: Sequence[str] | None = None,
    micro_batches: int | None = None,
    optimizer: str = "sgd",
    tie_tolerance: float = 0.01,
    progress: Callable[[str], None] | None = None,
) -> DeviceSearch:
    """Search every P x D factorisation of ``devices`` (module docstring).

    ``batch_size`` is the global mini-batch (default: the profile's); ``micro_batches``
    fixes M for the micro-batching methods; ``methods`` defaults to every method with one
    stage per device.
    """
    pairs = factorisations(devices)
    cluster = cluster or Cluster()
    cluster.check_devices(devices)
    batch = profile.batch_size if batch_size is None else batch_size
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise PlanError(f"--global-batch must be a whole number of samples >= 1 (got {batch!r})")
    names = list(methods) if methods is not None else list(RANKED_BY_DEFAULT)
    jobs: list[tuple[int, int, str, int]] = []  # (P, D, method, M)
    excluded: dict[tuple[int, int], str] = {}
    for p, d in pairs:
        if p > profile.num_layers:
            excluded[(p, d)] = f"more stages than the profile's {profile.num_layers} layers"
        elif batch % d:
            excluded[(p, d)] = (
                f"the global batch of {batch:,} samples does not split into {d:,} replicas"
            )
        else:
            mine = [(p, d, n, m) for n in names for m in _options(n, p, batch // d, micro_batches)]
            if not mine:
                excluded[(p, d)] = (
                    f"a replica's {batch // d:,} samples do not split into the "
                    f"{'given' if micro_batches else f'at least {p}'} micro-batches "
                    f"the methods need"
                )
            jobs += mine
    sizes = [_work(n, p, m) for p, _, n, m in jobs]
    keep = fit_budget(sizes)
    found: dict[tuple[int, int], list[Candidate]] = {}
    for (p, d, name, m), size, kept in zip(jobs, sizes, keep, strict=True):
        if (p, d) not in found and progress is not None:
            count = sum(1 for j in jobs if j[:2] == (p, d))
            progress(f"P={p} x D={d} ({count} candidates)")
        if not kept:
            found.setdefault((p, d), []).append(skipped_candidate(name, m, size, p, d))
            continue
        try:
            c = evaluate_candidate(
                profile,
                p,
                name,
                m,
                memory_cap_bytes=memory_cap_bytes,
                mini_batches=steady_mini_batches(name, p, m),
                optimizer=optimizer,
                replicas=d,
                cluster=cluster,
                batch_size=batch,
                short_run=True,
            )
        except PlanError as err:  # a method's own rule refuses the sizes (e.g. a fixed M)
            if isinstance(err, WorkLimitError):
                raise
            c = Candidate(name, m, None, infeasible=str(err), data_parallel=d, stages=p)
        found.setdefault((p, d), []).append(c)
    ranked = tuple(rank([c for cs in found.values() for c in cs], tie_tolerance))
    position = {id(c): i for i, c in enumerate(ranked)}
    out = []
    for p, d in pairs:
        cands = sorted(found.get((p, d), []), key=lambda c: position[id(c)])
        why = excluded.get((p, d))
        if why is None and not any(c.infeasible is None for c in cands):
            why = _why_none(profile, batch, memory_cap_bytes, p, d, cands)
        if p > profile.num_layers:  # nothing to place
            out.append(Factorisation(p, d, tuple(cands), why))
            continue
        edges = sum(not edge_within_node(k, p, d, cluster) for k in range(p - 1))
        groups = sum(not group_within_node(k, p, d, cluster) for k in range(p)) if d > 1 else 0
        out.append(Factorisation(p, d, tuple(cands), why, edges, groups))
    out.sort(key=lambda f: position[id(f.best)] if f.best is not None else len(ranked) + f.stages)
    return DeviceSearch(devices, batch, cluster, memory_cap_bytes, tuple(out), ranked)


def _work(method: str, stages: int, micro_batches: int) -> int:
    spec = get_method(method)
    try:
        shape = spec.shape(
            stages,
            spec.micro_batches_for(micro_batches),
            steady_mini_batches(method, stages, micro_batches),
        )
    except PlanError:
        return 0  # evaluating it raises the rule's own message
    return estimate_work(spec, shape).cost


def _why_none(
    profile: Profile,
    batch: int,
    cap: int | None,
    stages: int,
    replicas: int,
    candidates: Sequence[Candidate],
) -> str:
    """Why no candidate of a factorisation runs: the memory cap (with the least any method
    needs), the work limit, or the methods' own rules."""
    over = [c for c in candidates if c.infeasible and not c.skipped and "memory" in c.infeasible]
    if over and cap is not None:
        least = min(
            (
                min_memory_partition(
                    per_unit_profile(profile, c.micro_batches, batch // replicas),
                    stages,
                    memory_factors=method_memory_factors(c.method, stages, c.micro_batches),
                ).peak_memory_bytes,
                c.method,
            )
            for c in over
        )
        return (
            f"no partition fits the memory cap of {format_bytes(cap)} (the least any method "
            f"needs is {format_bytes(least[0], round_up=True)}, with {least[1]})"
        )
    if candidates and all(c.skipped for c in candidates):
        return "not simulated: over the work limit (pipeoptim.plan.limits)"
    first = next((c.infeasible for c in candidates if c.infeasible), "no candidates")
    return first


# --------------------------------------------------------------------------- explanation
@dataclass(frozen=True)
class Shares:
    """Where a candidate's update period goes, for comparing factorisations."""

    allreduce: float
    """Largest stage all-reduce / the period."""
    idle: float
    """Steady-state idle fraction of the ranks."""
    device_s_per_sample: float
    """Device-seconds of compute (all-reduce excluded) per sample over all devices."""


def shares(c: Candidate, batch: int) -> Shares:
    """The breakdown of ``c``'s period (see :class:`Shares`)."""
    period = c.update_period_s
    if period <= 0:
        return Shares(0.0, 0.0, 0.0)
    ar = list(c.allreduce_s) or [0.0]
    busy = (1.0 - c.steady_bubble) * period
    compute = max(0.0, busy - math.fsum(ar) / len(ar))
    devices = c.stages * c.data_parallel
    return Shares(max(ar) / period, c.steady_bubble, compute * devices / batch)


def _tier(cluster: Cluster, within: bool) -> str:
    bw, _ = cluster.tier(within)
    where = "within a node" if within or cluster.gpus_per_node is None else "between nodes"
    return f"{where}, {format_bandwidth(bw) if math.isfinite(bw) else 'free links'}"


def _slower(c: Candidate, best: Candidate, batch: int) -> str:
    """Why ``c`` is behind ``best``: the parts of the period that are worse."""
    a, b = shares(c, batch), shares(best, batch)
    reasons = []
    if a.allreduce - b.allreduce > 0.02:
        reasons.append(f"all-reduce {a.allreduce:.0%} of each step against {b.allreduce:.0%}")
    if a.idle - b.idle > 0.02:
        reasons.append(f"ranks idle {a.idle:.0%} of each step against {b.idle:.0%}")
    if b.device_s_per_sample > 0 and a.device_s_per_sample / b.device_s_per_sample > 1.02:
        samples = batch / (c.data_parallel * c.micro_batches)
        reasons.append(
            f"{a.device_s_per_sample / b.device_s_per_sample:.3g}x the device time per "
            f"sample (micro-batches of {_samples(samples)}, links on the way)"
        )
    risk_a = c.risk.risk if c.risk else 0.0
    risk_b = best.risk.risk if best.risk else 0.0
    if risk_a - risk_b > 0.005:
        reasons.append(f"convergence risk +{100 * risk_a:.0f}% against +{100 * risk_b:.0f}%")
    return "; ".join(reasons) or "level within the noise"


def explain_devices(result: DeviceSearch, profile: Profile) -> str:
    """What to run on the devices and why, against every other factorisation."""
    best = result.best
    f = result.factorisation(best)
    p, d, batch = f.stages, f.replicas, result.batch_size
    cluster = result.cluster
    nodes = f", {cluster.gpus_per_node} per node" if cluster.gpus_per_node else ""
    cap = (
        f" within the {format_bytes(result.memory_cap_bytes)} cap"
        if result.memory_cap_bytes
        else ""
    )
    text = (
        f"Run {p} pipeline stage(s) x {d} data-parallel replica(s) on {result.devices:,} "
        f"devices{nodes}: {best.method} with {best.micro_batches} micro-batch(es) of "
        f"{_samples(batch / (d * best.micro_batches))} per replica (global batch {batch:,}): "
        f"predicted {format_rate(best.throughput)} samples/s, {describe_staleness(best)}, peak "
        f"stage memory {format_bytes(best.peak_memory_bytes)}{cap}."
    )
    s = shares(best, batch)
    if d > 1 and best.partition is not None:
        grads = max(
            sum(x.param_bytes for x in profile.layers[a:b]) for a, b in best.partition.boundaries
        )
        text += (
            f" Each update all-reduces up to {format_bytes(grads)} of gradients per stage over "
            f"{d} replicas ({_tier(cluster, f.inter_node_groups == 0)}): "
            f"{max(best.allreduce_s):.3g} s, {s.allreduce:.0%} of the "
            f"{best.update_period_s:.3g} s step; the ranks idle {s.idle:.0%} of it."
        )
    if p > 1 and cluster.gpus_per_node is not None:
        text += (
            f" All {p - 1} pipeline edges stay within a node."
            if f.inter_node_edges == 0
            else f" {f.inter_node_edges} of the {p - 1} pipeline edges cross nodes."
        )
    others = []
    blocked: dict[str, list[str]] = {}  # reason -> labels, so one reason is said once
    for g in result.factorisations:
        if g is f:
            continue
        c = g.best
        if c is None:
            blocked.setdefault(g.excluded or "no candidate", []).append(g.label)
            continue
        ratio = (
            best.effective_throughput / c.effective_throughput
            if c.effective_throughput
            else math.inf
        )
        pace = (
            f"{ratio:.3g}x slower"
            if ratio > 1.001
            else "as fast, ranked lower on freshness or memory"
        )
        others.append(
            f"{g.label} ({c.method}, M={c.micro_batches}) is {pace}: {_slower(c, best, batch)}"
        )
    for why, labels in blocked.items():
        who = labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + f" and {labels[-1]}"
        others.append(f"{who} cannot run: {why}")
    if others:
        text += " Against the other factorisations: " + "; ".join(others) + "."
    return text


def _samples(count: float) -> str:
    return f"{count:g} sample" + ("" if count == 1 else "s")
