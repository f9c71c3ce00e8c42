"""The costs of a ``pipeoptim simulate`` job, from its flags, a plan and a profile.

One replica's :class:`~pipeoptim.sim.costs.CostModel`: the plan's stage graph, else the
profile cut at the plan's (or even) boundaries, else ``--uniform F,B[,U]``. Links not given
as flags are the plan's (its notes) or a calibrated profile's. With ``--data-parallel D``
each replica's costs are for its share B/D of the global batch; ``simulate`` then places
the replicas (:meth:`CostModel.with_data_parallel`).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from pipeoptim.commands.cluster import global_batch
from pipeoptim.errors import PlanError
from pipeoptim.plan.schedules import Shape
from pipeoptim.plan.units import parse_bandwidth, parse_bytes
from pipeoptim.sim.costs import CostModel, parse_uniform

__all__ = ["check_costs", "job_costs", "job_links"]


def job_links(args: argparse.Namespace, plan: Any, profile: Any) -> dict[str, Any]:
    """``latency_s`` and, where known, ``bandwidth`` of the links (within a node)."""
    # Links not given here: those the plan was made for, or a calibrated profile's.
    notes = plan.notes if plan is not None else {}
    latency = args.latency
    if latency is None and notes.get("latency_s") is not None:
        latency = float(notes["latency_s"])
    if latency is None:
        latency = float(profile.meta.get("link_latency_s", 0.0)) if profile is not None else 0.0
    links: dict[str, Any] = {"latency_s": latency}
    if args.bandwidth in ("inf", ""):  # free links, as `plan --bandwidth inf`
        links["bandwidth"] = math.inf
    elif args.bandwidth is not None:
        links["bandwidth"] = parse_bandwidth(args.bandwidth)
    elif notes.get("bandwidth_bytes_per_s") is not None:
        links["bandwidth"] = float(notes["bandwidth_bytes_per_s"])
    return links


def job_costs(args: argparse.Namespace, shape: Shape, plan: Any, profile: Any) -> CostModel:
    """One replica's cost model: the plan's stage graph, else the profile, else uniform."""
    links = job_links(args, plan, profile)
    options: dict[str, Any] = dict(links)
    optimizer = args.optimizer or (plan.optimizer.family if plan is not None else None)
    if optimizer:
        options["optimizer"] = optimizer
    d = args.data_parallel
    batch = (
        global_batch(args, plan, profile)
        if d > 1
        else args.batch_size or (plan.batch_size if plan is not None else None)
    )
    if batch is not None:
        options["batch_size"] = batch / d  # each replica's share
    stages = shape.num_stages
    if plan is not None and plan.stage_graph is not None:
        from pipeoptim.plan.graph import stage_graph_from_dict

        graph = stage_graph_from_dict(plan.stage_graph)
        if graph.number_of_nodes() == stages:
            return CostModel.from_stage_graph(graph, shape.micro_batches, **options)
    if profile is not None:
        from pipeoptim.plan.plan import even_boundaries

        bounds = (
            plan.boundaries
            if plan is not None and plan.boundaries is not None and len(plan.boundaries) == stages
            else even_boundaries(profile.num_layers, stages)
        )
        return CostModel.from_profile(profile, bounds, shape.micro_batches, **options)
    if plan is not None and args.uniform is None:
        raise PlanError(
            f"the plan has no stage costs for {stages} stages (no stage graph of that size), "
            f"so there is nothing to simulate with; pass --profile FILE or --uniform F,B"
        )
    f, b, u = parse_uniform(args.uniform or "1,2")
    v = shape.virtual_stages
    return CostModel.uniform(
        stages,
        f / v,
        b / v,
        u / v,
        param_bytes=parse_bytes(args.param_bytes) // v,
        activation_bytes=parse_bytes(args.activation_bytes) // v,
        boundary_bytes=parse_bytes(args.activation_bytes),
        optimizer=optimizer or "sgd",
        **links,
    )


def check_costs(costs: CostModel, args: argparse.Namespace) -> None:
    """A run whose forwards and backwards take no time has no throughput to report."""
    if not any(f + b > 0 for f, b in zip(costs.forward_s, costs.backward_s, strict=True)):
        source = (
            f"--profile {args.profile}"
            if args.profile is not None
            else f"--plan {args.plan}"
            if args.uniform is None and args.plan is not None
            else f"--uniform {args.uniform}"
        )
        raise PlanError(
            f"every stage's forward and backward take 0 s (from {source}), so the run takes "
            f"no time and has no throughput; give positive times, e.g. --uniform 1,2"
        )
