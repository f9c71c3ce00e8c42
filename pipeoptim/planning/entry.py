"""The one entry of plan search, :func:`plan_for`, and the one place a candidate becomes a
:class:`~pipeoptim.plan.plan.Plan` (:func:`plan_from_candidate`).

``pipeoptim plan`` (``--stages`` or ``--devices``) and the demo call :func:`plan_for`: it
checks the request, resolves the method names once into method objects and the profile's
host once, hands those resolved objects down to every candidate, explains the choice and
writes the plan, so the commands keep only their flags and their printing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeoptim.errors import PlanError
from pipeoptim.plan.graph import stage_graph_to_dict
from pipeoptim.plan.methods import Method
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.recompute_costs import annotate_units, profile_unit_costs
from pipeoptim.planning.candidate import (
    Candidate,
    micro_batch_options,
    resolve_method,
    resolve_methods,
)
from pipeoptim.planning.devices import DeviceSearch, search_devices
from pipeoptim.planning.evaluate import evaluate_candidate
from pipeoptim.planning.explain import explain, memory_choice, memory_notes
from pipeoptim.planning.explain_devices import explain_devices
from pipeoptim.planning.stage_search import search
from pipeoptim.sim.collectives import Cluster
from pipeoptim.sim.host import ProfiledHost

__all__ = [
    "PlanChoice",
    "PlanLimits",
    "cluster_notes",
    "plan_for",
    "plan_from_candidate",
]


@dataclass(frozen=True)
class PlanLimits:
    """What a plan must respect and what it may use, beyond the profile and its size."""

    memory_cap_bytes: int | None = None
    """Per-device memory cap (None: no cap)."""
    cluster: Cluster = field(default_factory=Cluster)
    """The links between devices and their placement on nodes (default: free links)."""
    batch_size: int | None = None
    """The global mini-batch, each of D replicas training 1/D of it (default: the
    profile's)."""
    micro_batches: int | None = None
    """M for a micro-batching method: with ``stages`` and one method, the count to plan
    (default: the first the search would try); with ``devices``, the count every
    candidate uses (default: searched)."""
    optimizer: str = "sgd"
    """The optimizer family: it sets the convergence-risk coefficient and the plan's
    optimizer."""
    lr: float | None = None
    """The learning rate the plan stores (default: :class:`OptimizerSpec`'s)."""
    tie_tolerance: float = 0.01
    """Effective throughputs within this fraction of each other rank as equal."""
    virtual_stages: int | None = None
    """Stages per rank v for one named method that places several on every rank
    (interleaved-1f1b, interleaved-zb; default: the method's, 2); None elsewhere."""


@dataclass(frozen=True)
class PlanChoice:
    """What :func:`plan_for` found: the plan to run and the candidates it was chosen from."""

    plan: Plan
    """The plan of the best candidate, with the explanation in its notes."""
    ranked: tuple[Candidate, ...]
    """Every candidate, best first, those that cannot run last."""
    best: Candidate
    """The candidate the plan runs."""
    why: str
    """What to run and why, in words (the plan's ``notes["why"]``)."""
    methods: tuple[Method, ...]
    """The methods searched, resolved."""
    devices: DeviceSearch | None = None
    """With ``devices``: the search over every P x D factorisation."""

    def __iter__(self) -> Iterator[Plan | tuple[Candidate, ...]]:
        """``plan, ranked = plan_for(...)``."""
        return iter((self.plan, self.ranked))


def cluster_notes(cluster: Cluster) -> dict[str, Any]:
    """A plan's notes for ``cluster`` (None for an infinite bandwidth, as JSON has none)."""

    def finite(value: float) -> float | None:
        return None if math.isinf(value) else value

    notes: dict[str, Any] = {
        "bandwidth_bytes_per_s": finite(cluster.bandwidth),
        "latency_s": cluster.latency_s,
    }
    if cluster.gpus_per_node is not None:
        notes["gpus_per_node"] = cluster.gpus_per_node
        notes["inter_node_bandwidth_bytes_per_s"] = finite(cluster.inter_bandwidth)
        notes["inter_node_latency_s"] = cluster.inter_latency_s
    return notes


def plan_from_candidate(
    candidate: Candidate,
    profile: Profile,
    *,
    optimizer: OptimizerSpec,
    model: str | None,
    batch_size: int,
    notes: Mapping[str, Any],
    stage_graph: bool = True,
) -> Plan:
    """The plan that runs ``candidate``: its method, shape, replicas, boundaries, what it
    recomputes and shards; ``stage_graph`` adds the partition's stage graph with each
    unit's costs (what ``pipeoptim train --plan`` checks the model against)."""
    part = candidate.partition
    if part is None:
        raise PlanError(
            f"{candidate.method} (M={candidate.micro_batches}) cannot become a plan: "
            f"{candidate.infeasible or 'it has no partition'}; pick a candidate that runs "
            f"(infeasible is None)"
        )
    graph = (
        stage_graph_to_dict(annotate_units(part.stage_graph(profile), profile_unit_costs(profile)))
        if stage_graph
        else None
    )
    return Plan(
        method=candidate.method,
        num_stages=candidate.stages,
        micro_batches=candidate.micro_batches,
        virtual_stages=candidate.virtual_stages,
        data_parallel=candidate.data_parallel,
        optimizer=optimizer,
        model=model,
        batch_size=batch_size,
        boundaries=[(a, b) for a, b in part.boundaries],
        stage_graph=graph,
        recompute=candidate.recompute_entries(),
        shard_optimizer=candidate.shard_optimizer,
        notes=dict(notes),
    )


def _check_stages(stages: object) -> int:
    """``stages`` as a count of stages, refused below 1 with the words the method's own
    shape rule uses (what ``pipeoptim plan --stages 0`` has always said)."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise PlanError(f"need at least 1 stage (got {stages!r}); pass --stages 1 or more")
    return stages


def plan_for(
    profile: Profile,
    *,
    stages: int | None = None,
    devices: int | None = None,
    method: str | Method = "auto",
    limits: PlanLimits | None = None,
    model: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> PlanChoice:
    """The plan for ``profile`` on ``stages`` pipeline stages (one device each) or on
    ``devices`` devices (every P stages x D replicas with P x D = N), and the candidates
    ranked. ``method`` is ``"auto"`` (every method of
    :data:`~pipeoptim.plan.methods.RANKED_BY_DEFAULT`, ranked) or one method, by name or
    object (with ``stages``, one that places several stages per device too: its P x v
    stages partitioned, :mod:`~pipeoptim.planning.several_stages`); ``model`` is the plan's
    model (default: the profile's).
    Raises :class:`PlanError` with the rule and the fix for a bad request (neither or both
    sizes, a size below 1, an unknown method) and when nothing fits."""
    limits = limits or PlanLimits()
    if (stages is None) == (devices is None):
        raise PlanError(
            f"plan_for needs exactly one of stages (P, one device each) and devices (N = P x "
            f"D, searched) (got stages={stages!r}, devices={devices!r}); e.g. stages=4"
        )
    host = ProfiledHost.of(profile)  # the machine the profile measured, once for all
    optimizer = OptimizerSpec(
        limits.optimizer, limits.lr if limits.lr is not None else OptimizerSpec().lr
    )
    model = model or profile.meta.get("model")
    if devices is not None:
        chosen = None if method == "auto" else resolve_method(method)
        return _plan_devices(profile, devices, chosen, limits, host, optimizer, model, progress)
    p = _check_stages(stages)
    limits.cluster.check_devices(p)
    chosen = None if method == "auto" else resolve_method(method)
    return _plan_stages(profile, p, chosen, limits, host, optimizer, model, progress)


def _plan_stages(
    profile: Profile,
    stages: int,
    chosen: Method | None,
    limits: PlanLimits,
    host: ProfiledHost,
    optimizer: OptimizerSpec,
    model: str | None,
    progress: Callable[[str], None] | None,
) -> PlanChoice:
    """:func:`plan_for` on ``stages`` stages: every method searched, or ``chosen`` alone."""
    batch = limits.batch_size or profile.batch_size
    cap, cluster = limits.memory_cap_bytes, limits.cluster
    # a dial's M is searched (its delay and speed move with M) unless the user fixed one
    dial = chosen is not None and chosen.dials_micro_batches and limits.micro_batches is None
    if chosen is None or dial:
        methods = tuple(resolve_methods(None)) if chosen is None else (chosen,)
        ranked = search(
            profile,
            stages,
            memory_cap_bytes=cap,
            methods=methods,
            tie_tolerance=limits.tie_tolerance,
            progress=progress,
            optimizer=limits.optimizer,
            cluster=cluster,
            batch_size=batch,
            host=host,
        )
    else:
        assert chosen is not None
        methods = (chosen,)
        m = _one_count(chosen, stages, batch, limits)
        ranked = [
            evaluate_candidate(
                profile,
                stages,
                chosen,
                m,
                memory_cap_bytes=cap,
                optimizer=limits.optimizer,
                cluster=cluster,
                batch_size=batch,
                host=host,
                virtual_stages=limits.virtual_stages,
            )
        ]
    why = explain(ranked, cap)  # raises when nothing fits
    best = ranked[0]
    notes = {
        **memory_notes(best),
        "predicted_samples_per_s": best.throughput,
        "predicted_bubble_ratio": best.bubble_ratio,
        "memory_cap_bytes": cap,
        **cluster_notes(cluster),
        "why": why,
    }
    plan = plan_from_candidate(
        best, profile, optimizer=optimizer, model=model, batch_size=batch, notes=notes
    )
    return PlanChoice(plan, tuple(ranked), best, why, methods)


def _one_count(method: Method, stages: int, batch: int, limits: PlanLimits) -> int:
    """M for one method: the given count, else the first the search would try (P, or one
    dividing the batch); 1 for a method that does not micro-batch."""
    if method.runs_whole_mini_batches:
        return 1
    if limits.micro_batches is not None:
        return limits.micro_batches
    m = next(iter(micro_batch_options(method, stages, batch)), 0)
    if m == 0:
        raise PlanError(
            f"{method.name} splits a batch into at least {stages} micro-batches, but the "
            f"batch has {batch} samples; profile with --batch-size {stages} or more, or "
            f"pass --global-batch {stages} or more"
        )
    return m


def _plan_devices(
    profile: Profile,
    devices: int,
    chosen: Method | None,
    limits: PlanLimits,
    host: ProfiledHost,
    optimizer: OptimizerSpec,
    model: str | None,
    progress: Callable[[str], None] | None,
) -> PlanChoice:
    """:func:`plan_for` over every P x D factorisation of ``devices``."""
    if chosen is not None and chosen.places_several_stages_per_rank:
        raise PlanError(
            f"the search over P x D places one stage per device; {chosen.name} places "
            f"several stages on every device, so it is planned for one replica only: plan it "
            f"with --stages P (e.g. --stages {devices} --method {chosen.name}), or search "
            f"--devices {devices} with --method auto"
        )
    methods: Sequence[Method] = [chosen] if chosen is not None else resolve_methods(None)
    result = search_devices(
        profile,
        devices,
        cluster=limits.cluster,
        batch_size=limits.batch_size,
        memory_cap_bytes=limits.memory_cap_bytes,
        methods=methods,
        micro_batches=limits.micro_batches,
        optimizer=limits.optimizer,
        tie_tolerance=limits.tie_tolerance,
        progress=progress,
        host=host,
    )
    best = result.best  # raises with every factorisation's reason when nothing runs
    why = explain_devices(result, profile)
    choice = memory_choice(best, limits.memory_cap_bytes)
    if choice:
        why += " " + choice
    notes = {
        **memory_notes(best),
        "predicted_samples_per_s": best.throughput,
        # steady state: a whole run's bubble depends on its length, which the plan
        # leaves to its consumer
        "predicted_steady_idle_ratio": best.steady_bubble,
        "memory_cap_bytes": limits.memory_cap_bytes,
        "devices": result.devices,
        **cluster_notes(limits.cluster),
        "why": why,
    }
    plan = plan_from_candidate(
        best, profile, optimizer=optimizer, model=model, batch_size=result.batch_size, notes=notes
    )
    return PlanChoice(plan, result.ranked, best, why, tuple(methods), result)
