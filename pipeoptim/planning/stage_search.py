"""The search over methods and micro-batch counts for P stages, and the ranking of its
candidates by effective throughput (:mod:`pipeoptim.planning` says how and why)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from pipeoptim.errors import PlanError
from pipeoptim.plan.limits import fit_budget
from pipeoptim.plan.methods import METHODS, Method, get_method
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.risk import method_risk
from pipeoptim.planning.candidate import (
    Candidate,
    micro_batch_options,
    resolve_methods,
    skipped_candidate,
)
from pipeoptim.planning.evaluate import evaluate_candidate
from pipeoptim.sim.collectives import Cluster
from pipeoptim.sim.host import ProfiledHost


def search(
    profile: Profile,
    num_stages: int,
    *,
    memory_cap_bytes: int | None = None,
    bandwidth_bytes_per_s: float = math.inf,
    latency_s: float = 0.0,
    methods: Sequence[str | Method] | None = None,
    mini_batches: int | None = None,
    tie_tolerance: float = 0.01,
    progress: Callable[[str], None] | None = None,
    optimizer: str = "sgd",
    cluster: Cluster | None = None,
    batch_size: int | None = None,
    host: ProfiledHost | None = None,
) -> list[Candidate]:
    """Every feasible candidate ranked best first, then the infeasible ones; ``cluster``
       and ``batch_size`` (the mini-batch, default the profile's) as in
       :func:`evaluate_candidate`.
    ``methods`` (names or method objects) defaults to
    :data:`~pipeoptim.plan.methods.RANKED_BY_DEFAULT`; each is resolved once here, and
    ``host`` (default: the profile's) once for every candidate."""
    if num_stages > profile.num_layers:
        raise PlanError(
            f"cannot split {profile.num_layers} layers into {num_stages} stages; use at "
            f"most {profile.num_layers} stages"
        )
    specs = resolve_methods(methods)
    host = host if host is not None else ProfiledHost.of(profile)
    pairs = [
        (spec, m)
        for spec in specs
        for m in micro_batch_options(spec, num_stages, batch_size or profile.batch_size)
    ]
    sizes = [_actions(spec, num_stages, m, mini_batches) for spec, m in pairs]
    keep = fit_budget(sizes)
    found: list[Candidate] = []
    simulated: dict[tuple[str, int], Candidate] = {}
    for (spec, m), size, kept in zip(pairs, sizes, keep, strict=True):
        if not kept:
            found.append(skipped_candidate(spec.name, m, size, num_stages))
            continue
        twin = simulated.get((spec.schedule_family, m))
        if twin is not None and _keeps_base_memory(spec, num_stages):
            # a corrected method: its base's timeline, its own risk
            found.append(_corrected_candidate(twin, spec, optimizer))
            continue
        if progress is not None:
            progress(f"{spec.name} M={m}")
        found.append(
            evaluate_candidate(
                profile,
                num_stages,
                spec,
                m,
                memory_cap_bytes=memory_cap_bytes,
                bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                latency_s=latency_s,
                mini_batches=mini_batches,
                optimizer=optimizer,
                cluster=cluster,
                batch_size=batch_size,
                host=host,
            )
        )
        simulated[(spec.name, m)] = found[-1]
    return rank(found, tie_tolerance)


def _keeps_base_memory(method: Method, num_stages: int) -> bool:
    """Whether ``method`` holds its base's weight copies on every stage (a correction that
    keeps a weight-sized buffer does not: its own partition and peak are evaluated)."""
    base = get_method(method.schedule_family)
    return all(
        method.weight_copies(k, num_stages) == base.weight_copies(k, num_stages)
        for k in range(num_stages)
    )


def _corrected_candidate(base: Candidate, method: Method, optimizer: str) -> Candidate:
    """``method`` keeps ``base``'s schedule, versions and memory (a delay correction or a
    prediction's distance): the same simulated run, its own convergence risk."""
    if base.risk is None:
        return replace(base, method=method.name)
    risk = method_risk(method, optimizer, base.risk.distances, base.risk.staleness)
    return replace(base, method=method.name, risk=risk)


def _actions(method: Method, num_stages: int, micro_batches: int, mini_batches: int | None) -> int:
    """Simulated actions of one candidate (0 where the method's rules refuse the sizes:
    evaluating it raises the rule's own message)."""
    try:
        shape = method.shape(num_stages, method.micro_batches_for(micro_batches), mini_batches)
    except PlanError:
        return 0
    return method.work(shape).cost


def rank(candidates: Sequence[Candidate], tie_tolerance: float = 0.01) -> list[Candidate]:
    """Highest effective throughput first; near-ties (within ``tie_tolerance``) by
    uncorrected distance, staleness, memory, then throughput; an exact tie last by the
    prediction rule: the optimizer's own update rule (PipeOptim's) before a fixed one, since
    two rules that predict alike for this optimizer (SpecTrain's momentum is SGD's Δ) part
    ways for another (under Adam SpecTrain's removes about none of the stale distance)."""
    feasible = [c for c in candidates if c.infeasible is None]
    best = max((c.effective_throughput for c in feasible), default=0.0)

    def key(c: Candidate) -> tuple[int, float, int, int, float, int]:
        # bucket throughput on a log scale so near-equal values compare equal
        rate = c.effective_throughput
        gap = math.log(best / rate) if rate > 0 and best > 0 else math.inf
        bucket = int(gap / math.log1p(tie_tolerance)) if math.isfinite(gap) else 2**31
        method = METHODS.get(c.method)
        general = 0 if method is not None and method.predictor == "optimizer" else 1
        return (
            bucket,
            c.uncorrected,
            c.max_staleness,
            c.peak_memory_bytes,
            -c.throughput,
            general,
        )

    return sorted(feasible, key=key) + [c for c in candidates if c.infeasible is not None]
