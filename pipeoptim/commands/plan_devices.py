"""``pipeoptim plan --devices N``: split N devices into P stages x D replicas, and say why.

The search and the plan are :func:`pipeoptim.planning.plan_for` (``devices``): the plan file
holds ``num_stages`` P, ``data_parallel`` D, the global ``batch_size`` and the cluster in
its notes; this module prints a table of the best candidate of every factorisation and the
explanation.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from pipeoptim.commands.common import format_table, print_json
from pipeoptim.commands.plan_files import write_plan_files
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.units import format_bytes
from pipeoptim.planning import Candidate, DeviceSearch, PlanLimits, plan_for, shares

__all__ = ["run_device_plan"]


def run_device_plan(args: argparse.Namespace, profile: Profile, limits: PlanLimits) -> int:
    """Search (:func:`~pipeoptim.planning.plan_for` with ``devices``), write the plan (and
    page), print the tables and the explanation."""
    choice = plan_for(
        profile,
        devices=args.devices,
        method=args.method,
        limits=limits,
        model=args.model,
        progress=None if args.json else lambda s: print(f"  evaluating {s}", file=sys.stderr),
    )
    result, best, plan, summary = choice.devices, choice.best, choice.plan, choice.why
    assert result is not None and best.partition is not None
    cap = limits.memory_cap_bytes
    files = write_plan_files(args, plan, best.partition, profile, cap, summary)
    written = args.out is not None and str(args.out) in files.written
    searched = [m.name for m in choice.methods]
    dropped = dropped_notes(result, searched, args.micro_batches)
    if args.json:
        print_json(
            {
                "plan": plan.to_dict(),
                "factorisations": _factorisation_dicts(result),
                "ranking": [_candidate_dict(c, result.batch_size) for c in result.ranked],
                "why": summary,
                "dropped": dropped,
                "out": str(args.out) if written else None,
            }
        )
        return files.finish("plan")
    print(format_table(_STAGE_HEADERS, _stage_rows(best)))
    print()
    print(format_table(_TABLE_HEADERS, _factorisation_rows(result)))
    print()
    print(summary)
    for note in dropped:
        print(f"note: {note}")
    if written:
        print(f"wrote plan to {args.out}")
    elif args.out is not None:  # the plan is not lost: print it, to be saved by hand
        print(json.dumps(plan.to_dict(), indent=2))
    return files.finish("plan")


def dropped_notes(
    result: DeviceSearch, searched: list[str], micro_batches: int | None
) -> list[str]:
    """Why each searched method is missing from a factorisation that has candidates, one
    note per reason: the runtime splits every replica's batch evenly into M micro-batches
    (``planning.devices._options``), and a method's own rule (e.g. M >= P) refuses others."""
    notes: list[str] = []
    batch = result.batch_size
    for f in result.factorisations:
        if f.excluded is not None and not f.candidates:
            continue  # the table says why the whole factorisation cannot run
        share = batch // f.replicas
        present = {c.method for c in f.candidates}
        missing = [n for n in searched if n not in present]
        if missing:
            need = (
                f"do not split into {micro_batches} micro-batches"
                if micro_batches is not None
                else f"are fewer than the {f.stages} micro-batches they need at least"
            )
            fix = (
                f"pass a --micro-batches that divides {share:,}, or a --global-batch "
                f"divisible by {f.replicas} x {micro_batches} = {f.replicas * micro_batches:,}"
                if micro_batches is not None
                else f"pass a --global-batch of at least {f.stages * f.replicas}"
            )
            notes.append(
                f"{f.label}: {_names(missing)} dropped: a replica's {share:,} samples {need} "
                f"(the runtime splits each replica's batch evenly into the micro-batches); "
                f"{fix}"
            )
        for c in f.candidates:
            if c.infeasible is not None and not c.skipped and "memory" not in c.infeasible:
                notes.append(f"{f.label}: {c.method} (M={c.micro_batches}) dropped: {c.infeasible}")
    return notes


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" and {names[-1]}"


_STAGE_HEADERS = ["stage", "layers", "count", "ms per unit", "memory", "all-reduce s", "s"]
_TABLE_HEADERS = [
    "P",
    "D",
    "method",
    "M",
    "samples/mb",
    "samples/s",
    "effective/s",
    "vs best",
    "all-reduce",
    "idle",
    "peak memory",
]


def _stage_rows(best: Candidate) -> list[list[Any]]:
    part = best.partition
    assert part is not None
    reduce = list(best.allreduce_s) or [0.0] * part.num_stages
    return [
        [
            k,
            f"{a}..{b - 1}",
            b - a,
            part.stage_times[k] * 1e3,
            format_bytes(part.stage_memory[k]),
            reduce[k],
            best.risk.distances[k] if best.risk else 0,
        ]
        for k, (a, b) in enumerate(part.boundaries)
    ]


def _factorisation_rows(result: DeviceSearch) -> list[list[Any]]:
    """The best candidate of every factorisation, then those that cannot run."""
    top = result.best.effective_throughput
    rows: list[list[Any]] = []
    for f in result.factorisations:
        c = f.best
        if c is None:
            why = f.excluded or "-"
            rows.append([f.stages, f.replicas, "-", "-", "-", "-", "-", "-", "-", "-", why])
            continue
        s = shares(c, result.batch_size)
        ratio = top / c.effective_throughput if c.effective_throughput > 0 else math.inf
        rows.append(
            [
                f.stages,
                f.replicas,
                c.method,
                c.micro_batches,
                result.batch_size / (c.data_parallel * c.micro_batches),
                c.throughput,
                c.effective_throughput,
                "best" if c is result.best else f"{ratio:.3g}x slower",
                f"{s.allreduce:.0%}",
                f"{s.idle:.0%}",
                format_bytes(c.peak_memory_bytes),
            ]
        )
    return rows


def _candidate_dict(c: Candidate, batch_size: int) -> dict[str, Any]:
    s = shares(c, batch_size) if c.infeasible is None else None
    return {
        "stages": c.stages,
        "data_parallel": c.data_parallel,
        "method": c.method,
        "micro_batches": c.micro_batches,
        "samples_per_s": c.throughput,
        "effective_samples_per_s": c.effective_throughput,
        "update_period_s": c.update_period_s,
        "allreduce_s": list(c.allreduce_s),
        "allreduce_share": s.allreduce if s else None,
        "idle_share": s.idle if s else None,
        "convergence_risk": c.risk.risk if c.risk else None,
        "max_staleness": c.max_staleness,
        "peak_memory_bytes": c.peak_memory_bytes,
        "infeasible": c.infeasible,
    }


def _factorisation_dicts(result: DeviceSearch) -> list[dict[str, Any]]:
    return [
        {
            "stages": f.stages,
            "data_parallel": f.replicas,
            "best": None if f.best is None else _candidate_dict(f.best, result.batch_size),
            "excluded": f.excluded,
            "inter_node_edges": f.inter_node_edges,
            "inter_node_groups": f.inter_node_groups,
        }
        for f in result.factorisations
    ]
