"""Plan search over a device count: how many stages, how many replicas, which method.

N devices train D data-parallel replicas of a P-stage pipeline, N = P x D (PP x DP; the
placement and the all-reduce are :mod:`pipeoptim.sim.collectives`'). Every factorisation
with P at most the profile's layers gets the candidates of
:func:`~pipeoptim.planning.stage_search.search` (method x micro-batch count, each with its
memory-feasible partition for P stages and its replica's share B/D of the global batch B),
timed by the fast evaluator with its links and all-reduces at the tiers the placement gives
them; all candidates are ranked together as :func:`~pipeoptim.planning.stage_search.rank`
does (effective throughput, then freshness and memory).

Runs are kept short, because only the steady state matters and every candidate is capped
at the rate its busiest stage allows (``short_run`` of
:func:`~pipeoptim.planning.evaluate.evaluate_candidate`): 2 mini-batches for a flushed
method (each is alike), 4 for an asynchronous one that fills the pipeline within a
mini-batch (M >= P), P + 2 for one that needs P mini-batches to fill it (M = 1). The
1,024-device search takes about a second (``benchmarks/bench_plan_devices.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pipeoptim.errors import PlanError, WorkLimitError
from pipeoptim.plan.limits import fit_budget
from pipeoptim.plan.memory_factors import method_memory_factors
from pipeoptim.plan.methods import Method
from pipeoptim.plan.partition import min_memory_partition
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.units import format_bytes
from pipeoptim.planning.candidate import (
    Candidate,
    micro_batch_options,
    per_unit_profile,
    resolve_method,
    resolve_methods,
    skipped_candidate,
)
from pipeoptim.planning.evaluate import evaluate_candidate
from pipeoptim.planning.stage_search import rank
from pipeoptim.sim.collectives import Cluster, edge_within_node, group_within_node
from pipeoptim.sim.host import ProfiledHost

__all__ = [
    "DeviceSearch",
    "Factorisation",
    "factorisations",
    "search_devices",
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


def steady_mini_batches(method: str | Method, num_stages: int, micro_batches: int) -> int:
    """Mini-batches a run needs to show its steady state (module docstring)."""
    spec = resolve_method(method)
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


def _options(method: Method, stages: int, replica_batch: int, fixed: int | None) -> list[int]:
    if method.runs_whole_mini_batches:
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
    methods: Sequence[str | Method] | None = None,
    micro_batches: int | None = None,
    optimizer: str = "sgd",
    tie_tolerance: float = 0.01,
    progress: Callable[[str], None] | None = None,
    host: ProfiledHost | None = None,
) -> DeviceSearch:
    """Search every P x D factorisation of ``devices`` (module docstring).

    ``batch_size`` is the global mini-batch (default: the profile's); ``micro_batches``
    fixes M for the micro-batching methods; ``methods`` (names or method objects) defaults
    to every method with one stage per device. Each method is resolved once here, and
    ``host`` (default: the profile's) once for every candidate.
    """
    pairs = factorisations(devices)
    cluster = cluster or Cluster()
    cluster.check_devices(devices)
    batch = profile.batch_size if batch_size is None else batch_size
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise PlanError(f"--global-batch must be a whole number of samples >= 1 (got {batch!r})")
    specs = resolve_methods(methods)
    host = host if host is not None else ProfiledHost.of(profile)
    jobs: list[tuple[int, int, Method, int]] = []  # (P, D, method, M)
    excluded: dict[tuple[int, int], str] = {}
    for p, d in pairs:
        if p > profile.num_layers:
            excluded[(p, d)] = f"more stages than the profile's {profile.num_layers} layers"
        elif batch % d:
            excluded[(p, d)] = (
                f"the global batch of {batch:,} samples does not split into {d:,} replicas"
            )
        else:
            mine = [(p, d, s, m) for s in specs for m in _options(s, p, batch // d, micro_batches)]
            if not mine:
                excluded[(p, d)] = (
                    f"a replica's {batch // d:,} samples do not split into the "
                    f"{'given' if micro_batches else f'at least {p}'} micro-batches "
                    f"the methods need"
                )
            jobs += mine
    sizes = [_work(s, p, m) for p, _, s, m in jobs]
    keep = fit_budget(sizes)
    found: dict[tuple[int, int], list[Candidate]] = {}
    for (p, d, spec, m), size, kept in zip(jobs, sizes, keep, strict=True):
        if (p, d) not in found and progress is not None:
            count = sum(1 for j in jobs if j[:2] == (p, d))
            progress(f"P={p} x D={d} ({count} candidates)")
        if not kept:
            found.setdefault((p, d), []).append(skipped_candidate(spec.name, m, size, p, d))
            continue
        try:
            c = evaluate_candidate(
                profile,
                p,
                spec,
                m,
                memory_cap_bytes=memory_cap_bytes,
                mini_batches=steady_mini_batches(spec, p, m),
                optimizer=optimizer,
                replicas=d,
                cluster=cluster,
                batch_size=batch,
                short_run=True,
                host=host,
            )
        except PlanError as err:  # a method's own rule refuses the sizes (e.g. a fixed M)
            if isinstance(err, WorkLimitError):
                raise
            c = Candidate(spec.name, m, None, infeasible=str(err), data_parallel=d, stages=p)
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


def _work(method: Method, stages: int, micro_batches: int) -> int:
    try:
        shape = method.shape(
            stages,
            method.micro_batches_for(micro_batches),
            steady_mini_batches(method, stages, micro_batches),
        )
    except PlanError:
        return 0  # evaluating it raises the rule's own message
    return method.work(shape).cost


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
