"""Data parallelism around a pipeline: the ring all-reduce and where every rank sits.

D replicas of a P-stage pipeline run as D x P processes. The runtime lays them out as a
DeviceMesh of shape (D, P): global rank ``g = d * P + p`` for replica ``d`` and pipeline
rank ``p``, so the ranks of one pipeline are contiguous. With G GPUs per node, rank ``g``
sits on node ``g // G``. Links come in two tiers, within a node (NVLink, PCIe) and between
nodes (InfiniBand, Ethernet); a :class:`Cluster` holds both.

Placement decides the tier of every link the simulator times:

* pipeline edge ``k`` (stage ``k`` to ``k + 1``) is within a node only when it is in every
  replica; else it runs at the inter-node tier, because replicas synchronise at every update
  and the slowest one sets the pace;
* the data-parallel group of pipeline rank ``p`` (ranks ``d * P + p`` for every ``d``) is
  within a node only when all its ranks are on one node; else its ring is as slow as its
  slowest link, the inter-node tier.

The all-reduce of a stage's gradients runs inside its update, blocking, before the
optimizer step (the next forward on the stage reads the weights the step writes, so it
cannot overlap it). Ring all-reduce in the alpha-beta model: ``n`` bytes over ``D`` ranks
take ``2 (D - 1) alpha + 2 (D - 1) / D * n / beta`` (a reduce-scatter and an all-gather of
``D - 1`` steps each, every step moving ``n / D`` bytes), 0 for ``D = 1``.

With the optimizer state sharded (ZeRO-1), each replica updates its 1/D of the stage and
the updated weights are then gathered: a ring all-gather of the stage's weights, ``(D - 1)
alpha + (D - 1) / D * n / beta``, after the step, inside the update (the next forward reads
the gathered weights).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipeoptim.errors import PlanError
from pipeoptim.plan.replicas import check_replicas

__all__ = [
    "Cluster",
    "allgather_times",
    "allreduce_times",
    "edge_links",
    "edge_within_node",
    "group_within_node",
    "ring_allgather_s",
    "ring_allreduce_s",
]


def ring_allreduce_s(num_bytes: float, replicas: int, bandwidth: float, latency_s: float) -> float:
    """Seconds a ring all-reduce of ``num_bytes`` over ``replicas`` ranks takes (module doc):
    ``2 (D - 1) latency + 2 (D - 1) / D * bytes / bandwidth``; 0 for one replica, and the
    bytes cost nothing at infinite bandwidth."""
    d = check_replicas(replicas, "the replica count")
    if d == 1:
        return 0.0
    return 2 * (d - 1) * latency_s + 2 * (d - 1) / d * num_bytes / bandwidth  # bytes/inf = 0


def ring_allgather_s(num_bytes: float, replicas: int, bandwidth: float, latency_s: float) -> float:
    """Seconds a ring all-gather of ``num_bytes`` (the whole, each rank holding ``1/D``)
    over ``replicas`` ranks takes: ``(D - 1) latency + (D - 1) / D * bytes / bandwidth``;
    0 for one replica."""
    d = check_replicas(replicas, "the replica count")
    if d == 1:
        return 0.0
    return (d - 1) * latency_s + (d - 1) / d * num_bytes / bandwidth


def _link(name: str, bandwidth: float, latency_s: float, fix: str) -> None:
    if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or not bandwidth > 0:
        raise PlanError(
            f"the {name} bandwidth must be a number of bytes per second > 0 (got "
            f"{bandwidth!r}); {fix}, e.g. 25GB/s, or inf for free links"
        )
    bad = isinstance(latency_s, bool) or not isinstance(latency_s, (int, float))
    if bad or not math.isfinite(latency_s) or latency_s < 0:
        raise PlanError(
            f"the {name} latency must be a finite number of seconds >= 0 (got {latency_s!r}); "
            f"{fix}, e.g. 0.00001"
        )


@dataclass(frozen=True)
class Cluster:
    """Links between devices in two tiers, and how many devices share a node."""

    bandwidth: float = math.inf
    """Bytes per second of a link within a node; the only tier without ``gpus_per_node``."""
    latency_s: float = 0.0
    """Seconds every transfer within a node takes on top of bytes / bandwidth."""
    gpus_per_node: int | None = None
    """Devices (ranks) per node, G: rank ``g`` is on node ``g // G``. None: one tier, every
    link runs at ``bandwidth``."""
    inter_node_bandwidth: float | None = None
    """Bytes per second of a link between nodes; None: as within a node."""
    inter_node_latency_s: float | None = None
    """Seconds every transfer between nodes takes on top of bytes / bandwidth; None: as
    within a node."""

    def __post_init__(self) -> None:
        _link("within-node", self.bandwidth, self.latency_s, "pass --bandwidth")
        g = self.gpus_per_node
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise PlanError(
                f"--gpus-per-node must be a whole number of devices >= 1 (got {g!r}); "
                f"e.g. --gpus-per-node 8"
            )
        inter = (self.inter_node_bandwidth, self.inter_node_latency_s)
        if g is None and any(v is not None for v in inter):
            raise PlanError(
                "an inter-node bandwidth or latency needs --gpus-per-node G, which says "
                "which ranks share a node (rank g is on node g // G); pass --gpus-per-node, "
                "or drop --inter-node-bandwidth/--inter-node-latency for one tier"
            )
        _link(
            "inter-node",
            self.inter_bandwidth,
            self.inter_latency_s,
            "pass --inter-node-bandwidth/--inter-node-latency",
        )

    @property
    def inter_bandwidth(self) -> float:
        """Bytes per second between nodes (the within-node value when not given)."""
        b = self.inter_node_bandwidth
        return self.bandwidth if b is None else b

    @property
    def inter_latency_s(self) -> float:
        """Latency between nodes (the within-node value when not given)."""
        lat = self.inter_node_latency_s
        return self.latency_s if lat is None else lat

    @property
    def tiered(self) -> bool:
        """Whether placement matters: nodes are known and the two tiers differ."""
        return self.gpus_per_node is not None and (
            self.inter_bandwidth != self.bandwidth or self.inter_latency_s != self.latency_s
        )

    def node(self, rank: int) -> int:
        """The node of global ``rank`` (0 for every rank without ``gpus_per_node``)."""
        return 0 if self.gpus_per_node is None else rank // self.gpus_per_node

    def within_node(self, ranks: Sequence[int]) -> bool:
        """Whether all ``ranks`` share one node."""
        return len({self.node(r) for r in ranks}) <= 1

    def tier(self, within_node: bool) -> tuple[float, float]:
        """``(bandwidth, latency_s)`` of the within-node or the inter-node tier."""
        if within_node:
            return self.bandwidth, self.latency_s
        return self.inter_bandwidth, self.inter_latency_s

    def check_devices(self, devices: int) -> None:
        """A job over several nodes takes whole nodes: torchrun starts the same number of
        processes on every node, so ``devices`` must be a multiple of ``gpus_per_node`` once
        it is more than one node."""
        g = self.gpus_per_node
        if g is None or devices <= g or devices % g == 0:
            return
        lower, upper = devices // g * g, (devices // g + 1) * g
        raise PlanError(
            f"{devices} devices on nodes of {g} GPUs leave the last node part-used "
            f"({devices / g:.3g} nodes), but torchrun starts the same number of processes "
            f"on every node; use a multiple of --gpus-per-node ({lower} or {upper} devices) "
            f"or the node size the job really has per node"
        )


def _ranks_of(num_stages: int, num_ranks: int | None) -> int:
    p = num_stages if num_ranks is None else num_ranks
    if p < 1 or num_stages % p:
        raise PlanError(
            f"{num_stages} stages cannot sit on {p} pipeline ranks; the stage count must be "
            f"a multiple of the ranks (stage s on rank s mod P)"
        )
    return p


def edge_within_node(edge: int, num_ranks: int, replicas: int, cluster: Cluster) -> bool:
    """Whether pipeline edge ``edge`` (stage ``edge`` to ``edge + 1``; stage s on pipeline rank
    ``s mod num_ranks``) stays within a node in every replica."""
    p, g = num_ranks, cluster.gpus_per_node
    if g is None:
        return True
    a, b = edge % p, (edge + 1) % p
    # which node a rank is on repeats every g // gcd(p, g) replicas: check one period
    period = min(replicas, g // math.gcd(p, g))
    return all(cluster.within_node((d * p + a, d * p + b)) for d in range(period))


def group_within_node(pipeline_rank: int, num_ranks: int, replicas: int, cluster: Cluster) -> bool:
    """Whether the data-parallel group of ``pipeline_rank`` (ranks ``d * P + p``) is one node."""
    # the ranks ascend, so the group is one node when its first and last rank are
    last = (replicas - 1) * num_ranks + pipeline_rank
    return cluster.within_node((pipeline_rank, last))


def edge_links(
    num_stages: int, replicas: int, cluster: Cluster, num_ranks: int | None = None
) -> list[tuple[float, float]]:
    """``(bandwidth, latency_s)`` of every pipeline edge under the placement (module doc);
    stage s on pipeline rank ``s mod num_ranks`` (default: one stage per rank)."""
    check_replicas(replicas, "the replica count")
    p = _ranks_of(num_stages, num_ranks)
    return [cluster.tier(edge_within_node(k, p, replicas, cluster)) for k in range(num_stages - 1)]


def allreduce_times(
    grad_bytes: Sequence[int],
    replicas: int,
    cluster: Cluster,
    num_ranks: int | None = None,
) -> tuple[float, ...]:
    """Seconds of the gradient all-reduce of every stage's update (``grad_bytes[k]``: the
    stage's gradient, one parameter-sized copy) over its data-parallel group, at the group's
    tier; stage s on pipeline rank ``s mod num_ranks``."""
    check_replicas(replicas, "the replica count")
    p = _ranks_of(len(grad_bytes), num_ranks)
    return tuple(
        ring_allreduce_s(n, replicas, *cluster.tier(group_within_node(k % p, p, replicas, cluster)))
        for k, n in enumerate(grad_bytes)
    )


def allgather_times(
    param_bytes: Sequence[int],
    replicas: int,
    cluster: Cluster,
    num_ranks: int | None = None,
) -> tuple[float, ...]:
    """Seconds of the weight all-gather of every stage's sharded update
    (``param_bytes[k]``: one weight copy of the stage) over its data-parallel group, at the
    group's tier; stage s on pipeline rank ``s mod num_ranks``."""
    check_replicas(replicas, "the replica count")
    p = _ranks_of(len(param_bytes), num_ranks)
    return tuple(
        ring_allgather_s(n, replicas, *cluster.tier(group_within_node(k % p, p, replicas, cluster)))
        for k, n in enumerate(param_bytes)
    )
