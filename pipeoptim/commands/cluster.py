"""The cluster flags ``simulate`` and ``plan`` share: replicas, GPUs per node, two link tiers.

``--bandwidth``/``--latency`` (each command's own) are the links within a node, and every
link when ``--gpus-per-node`` is not given; ``--inter-node-bandwidth`` and
``--inter-node-latency`` are the links between nodes. A plan records them in its notes
(``bandwidth_bytes_per_s``, ``latency_s``, ``gpus_per_node``,
``inter_node_bandwidth_bytes_per_s``, ``inter_node_latency_s``; None for an infinite
bandwidth), and ``simulate --plan`` reads them back where its own flags are not given.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from typing import Any

from pipeoptim.commands.common import check_number
from pipeoptim.errors import PlanError
from pipeoptim.plan.replicas import check_replicas
from pipeoptim.plan.units import format_bandwidth, parse_bandwidth
from pipeoptim.planning import cluster_notes  # kept here for importers; plan_for writes them
from pipeoptim.sim.collectives import Cluster, group_within_node
from pipeoptim.sim.costs import CostModel

__all__ = [
    "add_cluster_flags",
    "allreduce_lines",
    "check_cluster_flags",
    "cluster_from_args",
    "cluster_notes",
    "global_batch",
    "parse_link",
]


def add_cluster_flags(parser: argparse.ArgumentParser, *, data_parallel: bool) -> None:
    """Add ``--gpus-per-node``, ``--inter-node-bandwidth``, ``--inter-node-latency`` (and
    ``--data-parallel`` where the command takes a replica count)."""
    if data_parallel:
        parser.add_argument(
            "--data-parallel",
            "-D",
            type=int,
            default=None,
            help="replicas D of the pipeline (D x P devices, global rank = replica x P + "
            "pipeline rank); each trains 1/D of every batch and all-reduces its stages' "
            "gradients in every update (default: the plan's, else 1)",
        )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="devices per node G: global rank g sits on node g // G; links within a node "
        "use --bandwidth/--latency, links between nodes --inter-node-bandwidth/-latency "
        "(default: the plan's, else one tier for every link)",
    )
    parser.add_argument(
        "--inter-node-bandwidth",
        default=None,
        help="bandwidth between nodes, e.g. 25GB/s or 200Gbps (needs --gpus-per-node; "
        "default: as within a node)",
    )
    parser.add_argument(
        "--inter-node-latency",
        type=float,
        default=None,
        help="latency between nodes in seconds (needs --gpus-per-node; default: as within a node)",
    )


def parse_link(text: str | None) -> float | None:
    """A bandwidth flag: None when not given, ``inf`` (or empty) for free links."""
    if text is None:
        return None
    return math.inf if text.strip() in ("inf", "") else parse_bandwidth(text)


def check_cluster_flags(args: argparse.Namespace) -> None:
    """Everything about the cluster flags alone, before any file is read."""
    replicas = getattr(args, "data_parallel", None)
    if replicas is not None:
        check_replicas(replicas)
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise PlanError(
            f"--gpus-per-node must be a whole number of devices >= 1 (got "
            f"{args.gpus_per_node}); e.g. --gpus-per-node 8"
        )
    check_number("--inter-node-latency", args.inter_node_latency, minimum=0, example="0.00001")
    parse_link(args.inter_node_bandwidth)  # its own message when malformed


def _note(notes: Mapping[str, Any], key: str, infinite: bool) -> float | None:
    value = notes.get(key)
    if value is None:
        return math.inf if infinite else None
    return float(value)


def cluster_from_args(
    args: argparse.Namespace,
    bandwidth: float,
    latency_s: float,
    notes: Mapping[str, Any] | None = None,
) -> Cluster:
    """The cluster of the flags, falling back to a plan's ``notes`` for each one not given;
    ``bandwidth``/``latency_s`` are the command's resolved within-node link."""
    notes = notes or {}
    gpus = args.gpus_per_node if args.gpus_per_node is not None else notes.get("gpus_per_node")
    inter_bw = parse_link(args.inter_node_bandwidth)
    inter_lat = args.inter_node_latency
    if inter_bw is None and "inter_node_bandwidth_bytes_per_s" in notes:
        inter_bw = _note(notes, "inter_node_bandwidth_bytes_per_s", infinite=True)
    if inter_lat is None and "inter_node_latency_s" in notes:
        inter_lat = _note(notes, "inter_node_latency_s", infinite=False)
    return Cluster(  # refuses inter-node links without nodes
        bandwidth,
        latency_s,
        None if gpus is None else int(gpus),
        inter_bw,
        inter_lat,
    )


def global_batch(args: argparse.Namespace, plan: Any, profile: Any) -> int | None:
    """The global mini-batch the replicas share: ``--batch-size``, the plan's, the profile's,
    else the batch the plan's stage costs were measured on; None for uniform costs (whose
    micro-batch is one sample per replica)."""
    if args.batch_size is not None:
        return int(args.batch_size)
    if plan is not None and plan.batch_size is not None:
        return int(plan.batch_size)
    if profile is not None:
        return int(profile.batch_size)
    if plan is not None and plan.stage_graph is not None and args.uniform is None:
        size = plan.stage_graph.get("graph", {}).get("batch_size")
        return None if size is None else int(size)
    return None


def allreduce_lines(costs: CostModel, num_ranks: int, cluster: Cluster) -> str:
    """One line of every stage's all-reduce per update, runs of equal stages merged:
    ``all-reduce per update over D=4 replicas (ring): stages 0-3 0.0125 s (between
    nodes, 25.00 GB/s)``; stage s on pipeline rank ``s mod num_ranks``."""
    replicas = costs.data_parallel
    parts: list[tuple[int, int, float, bool]] = []  # (first, last, seconds, within a node)
    for k, seconds in enumerate(costs.allreduce_s):
        within = group_within_node(k % num_ranks, num_ranks, replicas, cluster)
        if parts and parts[-1][2:] == (seconds, within) and parts[-1][1] == k - 1:
            parts[-1] = (parts[-1][0], k, seconds, within)
        else:
            parts.append((k, k, seconds, within))

    def tier(within: bool) -> str:
        bw, _ = cluster.tier(within)
        where = "within a node" if within or cluster.gpus_per_node is None else "between nodes"
        return f"{where}, {format_bandwidth(bw)}" if math.isfinite(bw) else f"{where}, free"

    text = ", ".join(
        f"{'stage' if a == b else 'stages'} {a if a == b else f'{a}-{b}'} {s:.4g} s ({tier(w)})"
        for a, b, s, w in parts
    )
    return f"all-reduce per update over D={replicas} replicas (ring): {text}"
