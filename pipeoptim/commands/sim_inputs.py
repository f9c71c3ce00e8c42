"""The costs of a ``pipeoptim simulate`` job, from its flags, a plan and a profile.

One replica's :class:`~pipeoptim.sim.costs.CostModel`: the plan's stage graph, else the
profile cut at the plan's (or even) boundaries, else ``--uniform F,B[,U]``. Links not given
as flags are the plan's (its notes) or a calibrated profile's. With ``--data-parallel D``
each replica's costs are for its share B/D of the global batch; ``simulate`` then places
the replicas (:meth:`CostModel.with_data_parallel`).

Recomputation (``--recompute``, else the plan's ``recompute``) is costed per unit from the
plan's stage graph (a planned one carries per-unit costs) or the profile; with
``--uniform`` each stage is one unit, so only ``full`` and ``stages:K,...`` apply there.
Sharded optimizer state (``--shard-optimizer``, else the plan's) is applied by
``simulate`` after the replicas are placed (:meth:`CostModel.with_sharded_optimizer`).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from typing import Any

from pipeoptim.commands.cluster import global_batch
from pipeoptim.errors import PlanError
from pipeoptim.plan.recompute import check_shard_optimizer, parse_recompute_flag
from pipeoptim.plan.recompute_costs import labels_from_names, stage_unit_sets
from pipeoptim.plan.shape import Shape
from pipeoptim.plan.units import parse_bandwidth, parse_bytes
from pipeoptim.sim.costs import UNIT_KEYS, CostModel, graph_recompute_sets, parse_uniform

__all__ = ["check_costs", "job_costs", "job_links", "job_recompute", "job_shard"]


def job_recompute(args: argparse.Namespace, plan: Any) -> object:
    """What the job recomputes: ``--recompute`` (parsed), else the plan's entries."""
    text = getattr(args, "recompute", None)
    if text is not None:
        return parse_recompute_flag(text)
    return plan.recompute if plan is not None else None


def job_shard(args: argparse.Namespace, plan: Any) -> bool:
    """Whether the job shards its optimizer state: ``--shard-optimizer``, else the plan's;
    refused without data parallelism."""
    shard = bool(getattr(args, "shard_optimizer", False)) or bool(
        plan is not None and plan.shard_optimizer
    )
    return check_shard_optimizer(shard, args.data_parallel, flag="--shard-optimizer")


def _uniform_recompute(requested: object, stages: int) -> list[frozenset[int]] | None:
    """With ``--uniform`` every stage is one unit (named by its stage index)."""
    if requested is None:
        return None
    if isinstance(requested, list) and len(requested) != stages:  # unit selectors
        raise PlanError(
            f"--recompute units:{','.join(map(str, requested))} names units, but --uniform "
            f"costs have none (each stage is one unit); use --recompute full or "
            f"stages:0,1, or give --profile FILE (or a planned --plan) for per-unit costs"
        )
    bounds = [(k, k + 1) for k in range(stages)]
    labels = labels_from_names([str(k) for k in range(stages)])
    return stage_unit_sets(requested, bounds, labels)


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


def job_costs(
    args: argparse.Namespace, shape: Shape, plan: Any, profile: Any, method: Any = None
) -> CostModel:
    """One replica's cost model: the plan's stage graph, else the profile, else uniform.
    From a stage graph or a profile that records the host it was measured on, ``method``'s
    run on that host (:mod:`pipeoptim.sim.host`)."""
    from pipeoptim.sim.host import on_profiled_host

    def hosted(costs: CostModel, source: Any) -> CostModel:
        if method is None:
            return costs
        d = args.data_parallel or 1
        return on_profiled_host(costs, source, method, shape.num_ranks, data_parallel=d)

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
    requested = job_recompute(args, plan)
    if plan is not None and plan.stage_graph is not None:
        from pipeoptim.plan.graph import stage_graph_from_dict

        graph = stage_graph_from_dict(plan.stage_graph)
        costed = all(key in graph.nodes[k] for k in graph.nodes for key in UNIT_KEYS)
        if graph.number_of_nodes() == stages and (requested is None or costed or profile is None):
            if requested is not None:
                options["recompute"] = graph_recompute_sets(graph, requested)
            costs = CostModel.from_stage_graph(graph, shape.micro_batches, **options)
            return hosted(costs, graph.graph)
    if profile is not None:
        from pipeoptim.plan.plan import even_boundaries

        bounds = (
            plan.boundaries
            if plan is not None and plan.boundaries is not None and len(plan.boundaries) == stages
            else even_boundaries(profile.num_layers, stages)
        )
        if requested is not None:
            labels = labels_from_names([x.name for x in profile.layers])
            options["recompute"] = stage_unit_sets(requested, bounds, labels)
        costs = CostModel.from_profile(profile, bounds, shape.micro_batches, **options)
        return hosted(costs, profile)
    if plan is not None and args.uniform is None:
        raise PlanError(
            f"the plan has no stage costs for {stages} stages (no stage graph of that size), "
            f"so there is nothing to simulate with; pass --profile FILE or --uniform F,B"
        )
    f, b, u = parse_uniform(args.uniform or "1,2")
    v = shape.virtual_stages
    costs = CostModel.uniform(
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
    units = _uniform_recompute(requested, stages)
    if units is None:
        return costs
    sent = parse_bytes(args.activation_bytes)
    full = [bool(u) for u in units]
    return replace(
        costs,
        activation_bytes=tuple(
            sent if r else a for r, a in zip(full, costs.activation_bytes, strict=True)
        ),
        rebuilt_activation_bytes=tuple(
            a if r else 0 for r, a in zip(full, costs.activation_bytes, strict=True)
        ),
        recompute_s=tuple(f if r else 0.0 for r, f in zip(full, costs.forward_s, strict=True)),
        held_weight_bytes=tuple(
            p if r else 0 for r, p in zip(full, costs.param_bytes, strict=True)
        ),
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
