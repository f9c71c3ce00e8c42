"""The partitioner's cost model: what a stage of a partition costs, and the result type.

Cost model (``a_l`` = output activation bytes of layer ``l``, ``bw`` =
``bandwidth_bytes_per_s``, ``lat`` = ``latency_s``). Stage ``k`` of ``P`` holding layers
``[i, j)``::

    time_k   = Σ_{l=i}^{j-1} (forward_s_l + backward_s_l) + comm_k
    comm_k   = [k > 0]     · (2·a_{i-1} / bw + 2·lat)   # receive activation, send its gradient
             + [k < P - 1] · (2·a_{j-1} / bw + 2·lat)   # send activation, receive its gradient
    memory_k = (weight_copies_k + 1)·Σ param_bytes + Σ optimizer_state_bytes
             + activation_slots_k·Σ_{l=i}^{j-1} a_l      # "+ 1": the gradients

Memory-saving options (``R_k``: the units stage ``k`` recomputes, sums as in
:mod:`pipeoptim.plan.recompute_costs`; ``D``: the optimizer-state shards)::

    time_k   += Σ_{l ∈ R_k} forward_s_l                       # one more forward per backward
    memory_k  = (weight_copies_k + 1)·Σ param_bytes
              + Σ ceil(optimizer_state_bytes_l / D)            # ZeRO-1: 1/D per replica
              + activation_slots_k·kept_k                      # kept: inputs of R_k, not a_l
              + [hold_k]·activation_slots_k·Σ_{l ∈ R_k} param_bytes_l   # PREDICT's Ŵ per slot

``hold_k`` is true where the method predicts on stage ``k``
(:func:`~pipeoptim.plan.memory_factors.method_holds_weights`). The all-gather of sharded
weights is a ``sync`` term like the all-reduce.

Communication is counted in full on both ends of a link and is not overlapped with compute
(a conservative, per-batch model). ``weight_copies_k`` and
``activation_slots_k`` depend on the training method: see
:func:`~pipeoptim.plan.memory_factors.method_memory_factors`.

Two options serve data-parallel plans (PP x DP), where links come in tiers and updates
all-reduce: ``edges`` gives every stage edge its own ``(bw, lat)`` in place of one link, and
``sync`` charges stage ``k`` ``per_byte_k · Σ param_bytes + fixed_k`` seconds more (its
gradient all-reduce, shared among the units of an update: linear in the stage's bytes, so
the programme stays exact).

:func:`evaluate_partition` applies the model to given boundaries and returns a
:class:`Partition`; the search for the best boundaries (:mod:`pipeoptim.plan.partition`)
computes the same terms vectorised and ends with :func:`evaluate_partition`, so both report
one set of figures. The argument checks the two share (links, ``sync``) live here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np

from pipeoptim.errors import PlanError
from pipeoptim.plan.graph import stage_graph, stage_memory_bytes, validate_boundaries
from pipeoptim.plan.kept_bytes import stage_kept_bytes
from pipeoptim.plan.memory_factors import MemoryFactors, resolve_factors
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.recompute_costs import profile_unit_costs, stage_recompute
from pipeoptim.plan.units import parse_bandwidth

__all__ = [
    "Partition",
    "Sync",
    "check_edges",
    "check_link",
    "check_recompute_sets",
    "check_sync",
    "evaluate_partition",
    "stage_comm_s",
]


def check_link(bandwidth_bytes_per_s: float | str, latency_s: float) -> tuple[float, float]:
    bandwidth = parse_bandwidth(bandwidth_bytes_per_s)  # inf passes: free communication
    if isinstance(latency_s, bool) or not isinstance(latency_s, (int, float)):
        raise PlanError(f"latency_s must be a number of seconds >= 0, got {latency_s!r}")
    if not math.isfinite(latency_s) or latency_s < 0:
        raise PlanError(f"latency_s must be a finite number of seconds >= 0, got {latency_s!r}")
    return bandwidth, float(latency_s)


Sync = Sequence[tuple[float, float]]
"""Per stage ``(seconds per parameter byte, fixed seconds)`` added to its time."""


def check_edges(
    edges: Sequence[tuple[float, float]] | None, bandwidth: float, latency: float, num_stages: int
) -> list[tuple[float, float]]:
    """One checked ``(bandwidth, latency)`` per stage edge: ``edges``, or the one link."""
    if edges is None:
        return [(bandwidth, latency)] * (num_stages - 1)
    if len(edges) != num_stages - 1:
        raise PlanError(
            f"edges needs one (bandwidth, latency) per stage edge (got {len(edges)} for "
            f"{num_stages} stages); pass {num_stages - 1}"
        )
    return [check_link(bw, lat) for bw, lat in edges]


def check_sync(sync: Sync | None, num_stages: int) -> list[tuple[float, float]] | None:
    if sync is None:
        return None
    if len(sync) != num_stages:
        raise PlanError(
            f"sync needs one (seconds per byte, seconds) per stage (got {len(sync)} for "
            f"{num_stages} stages); pass {num_stages}"
        )
    out = []
    for k, (per_byte, fixed) in enumerate(sync):
        if not (math.isfinite(per_byte) and per_byte >= 0 and math.isfinite(fixed) and fixed >= 0):
            raise PlanError(
                f"sync of stage {k} must be finite numbers >= 0 (got {(per_byte, fixed)!r})"
            )
        out.append((float(per_byte), float(fixed)))
    return out


def stage_comm_s(
    profile: Profile,
    start: int,
    end: int,
    stage_index: int,
    num_stages: int,
    *,
    bandwidth_bytes_per_s: float = math.inf,
    latency_s: float = 0.0,
) -> float:
    """Communication time of stage ``stage_index`` holding layers ``[start, end)``, seconds.

    Formula in the module docstring: each boundary of the stage costs an activation one way
    and its gradient the other (``2·bytes/bw + 2·latency``); the first stage has no boundary
    before it, the last none after it.
    """
    link = (bandwidth_bytes_per_s, latency_s)
    return _comm(profile, start, end, stage_index, num_stages, link, link)


def _comm(
    profile: Profile,
    start: int,
    end: int,
    stage_index: int,
    num_stages: int,
    before: tuple[float, float],
    after: tuple[float, float],
) -> float:
    """:func:`stage_comm_s` with the link ``before`` the stage and the one ``after`` it."""
    comm = 0.0
    if stage_index > 0:
        comm += 2.0 * profile.layers[start - 1].activation_bytes / before[0]
        comm += 2.0 * before[1]
    if stage_index < num_stages - 1:
        comm += 2.0 * profile.layers[end - 1].activation_bytes / after[0]
        comm += 2.0 * after[1]
    return comm


@dataclass(frozen=True)
class Partition:
    """Layers per stage and what each stage costs under the partitioner's model."""

    boundaries: tuple[tuple[int, int], ...]
    """Half-open ``(start, end)`` layer range of each stage, in stage order."""

    stage_times: tuple[float, ...]
    """Per-stage time (compute + communication) for one batch, seconds."""

    stage_memory: tuple[int, ...]
    """Per-stage peak memory (weights, gradients, optimizer state, activations), bytes."""

    bottleneck_s: float
    """The slowest stage's time, seconds: the pipeline's time per batch in steady state."""

    stage_compute_s: tuple[float, ...] = ()
    """Per-stage forward + backward time, seconds."""

    stage_comm_s: tuple[float, ...] = ()
    """Per-stage communication time, seconds."""

    weight_copies: tuple[int, ...] = ()
    """Per-stage weight copies the memory figures assume."""

    stage_sync_s: tuple[float, ...] = ()
    """Per-stage gradient synchronisation charged per batch (``sync``), seconds; empty: none."""

    activation_slots: tuple[int, ...] = ()
    """Per-stage activation slots the memory figures assume."""

    recompute: tuple[frozenset[int], ...] = ()
    """Per stage the stage-local units it recomputes (empty: none)."""

    optimizer_shards: int = 1
    """Replicas the optimizer state is sharded over (1: not sharded)."""

    @property
    def recomputes(self) -> bool:
        """Whether any stage recomputes."""
        return any(self.recompute)

    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.boundaries)

    @property
    def bottleneck_stage(self) -> int:
        """Index of the slowest stage (the first one on a tie)."""
        return int(np.argmax(self.stage_times))

    @property
    def peak_memory_bytes(self) -> int:
        """The largest per-stage memory, bytes."""
        return max(self.stage_memory)

    @property
    def peak_memory_stage(self) -> int:
        """Index of the stage with the largest memory (the first one on a tie)."""
        return int(np.argmax(self.stage_memory))

    def stage_graph(self, profile: Profile) -> nx.DiGraph:
        """The stage graph of this partition (see :func:`pipeoptim.plan.graph.stage_graph`)."""
        copies = list(self.weight_copies) or 1
        slots = list(self.activation_slots) or 1
        graph = stage_graph(profile, self.boundaries, weight_copies=copies, activation_slots=slots)
        if self.recomputes or self.optimizer_shards > 1:  # the memory these figures assume
            for k, memory in enumerate(self.stage_memory):
                graph.nodes[k]["memory_bytes"] = memory
        return graph

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of all fields."""
        return {
            "boundaries": [list(b) for b in self.boundaries],
            "stage_times": list(self.stage_times),
            "stage_memory": list(self.stage_memory),
            "bottleneck_s": self.bottleneck_s,
            "stage_compute_s": list(self.stage_compute_s),
            "stage_comm_s": list(self.stage_comm_s),
            "weight_copies": list(self.weight_copies),
            "activation_slots": list(self.activation_slots),
            "stage_sync_s": list(self.stage_sync_s),
            "recompute": [sorted(r) for r in self.recompute],
            "optimizer_shards": self.optimizer_shards,
        }


def evaluate_partition(
    profile: Profile,
    boundaries: Sequence[tuple[int, int]],
    *,
    bandwidth_bytes_per_s: float | str = math.inf,
    latency_s: float = 0.0,
    memory_factors: MemoryFactors | None = None,
    edges: Sequence[tuple[float, float]] | None = None,
    sync: Sync | None = None,
    recompute: Sequence[frozenset[int]] | None = None,
    hold_weights: Sequence[bool] | None = None,
    optimizer_shards: int = 1,
) -> Partition:
    """Cost of a given partition under the module's model (times and memory per stage).

    ``memory_factors`` defaults to one weight copy and one activation slot per stage;
    ``edges`` and ``sync`` as in :func:`~pipeoptim.plan.partition.optimal_partition`;
    ``recompute`` (per stage its recomputed stage-local units), ``hold_weights`` (per stage:
    the recomputation holds Ŵ per slot) and ``optimizer_shards`` as in the module doc.
    """
    stages = validate_boundaries(boundaries, profile.num_layers)
    bandwidth, latency = check_link(bandwidth_bytes_per_s, latency_s)
    num_stages = len(stages)
    links = check_edges(edges, bandwidth, latency, num_stages)
    syncs = check_sync(sync, num_stages)
    copies, slots = resolve_factors(memory_factors, num_stages)
    sets = check_recompute_sets(recompute, stages)
    holds = list(hold_weights) if hold_weights is not None else [False] * num_stages
    units = profile_unit_costs(profile) if any(sets) else None
    d = max(1, int(optimizer_shards))
    compute, comm, memory, synced = [], [], [], []
    for k, (start, end) in enumerate(stages):
        layers = profile.layers[start:end]
        act = stage_kept_bytes(layers)
        extra_s, held = 0.0, 0
        if units is not None and sets[k]:
            r = stage_recompute(units, start, end, sets[k])
            act, extra_s = r.kept_activation_bytes, r.forward_s
            held = slots[k] * r.param_bytes if holds[k] else 0
        compute.append(math.fsum(layer.compute_s for layer in layers) + extra_s)
        before = links[k - 1] if k > 0 else (bandwidth, latency)
        after = links[k] if k < num_stages - 1 else (bandwidth, latency)
        comm.append(_comm(profile, start, end, k, num_stages, before, after))
        if syncs is not None:
            per_byte, fixed = syncs[k]
            synced.append(per_byte * sum(layer.param_bytes for layer in layers) + fixed)
        memory.append(
            stage_memory_bytes(
                sum(layer.param_bytes for layer in layers),
                sum(-(-layer.optimizer_state_bytes // d) for layer in layers),
                act,
                copies[k],
                slots[k],
            )
            + held
        )
    times = tuple(c + m for c, m in zip(compute, comm, strict=True))
    if synced:
        times = tuple(t + x for t, x in zip(times, synced, strict=True))
    return Partition(
        boundaries=tuple(stages),
        stage_times=times,
        stage_memory=tuple(memory),
        bottleneck_s=max(times),
        stage_compute_s=tuple(compute),
        stage_comm_s=tuple(comm),
        weight_copies=tuple(copies),
        activation_slots=tuple(slots),
        stage_sync_s=tuple(synced),
        recompute=tuple(sets) if any(sets) else (),
        optimizer_shards=d,
    )


def check_recompute_sets(
    recompute: Sequence[frozenset[int]] | None, stages: Sequence[tuple[int, int]]
) -> list[frozenset[int]]:
    """One set of stage-local unit indices per stage, each within its stage."""
    if recompute is None:
        return [frozenset()] * len(stages)
    if len(recompute) != len(stages):
        raise PlanError(
            f"recompute needs one set of units per stage (got {len(recompute)} for "
            f"{len(stages)} stages)"
        )
    out = []
    for k, (units, (start, end)) in enumerate(zip(recompute, stages, strict=True)):
        bad = [u for u in units if not 0 <= u < end - start]
        if bad:
            raise PlanError(
                f"stage {k} holds {end - start} units (stage-local 0..{end - start - 1}); "
                f"it cannot recompute unit {bad[0]}"
            )
        out.append(frozenset(units))
    return out
