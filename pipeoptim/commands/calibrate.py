"""``pipeoptim calibrate``: how close the simulator's prediction of a measured run is."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipeoptim.calibrate import (
    WhatIf,
    bubble_note,
    calibrate,
    calibrated_profile,
    cluster_recorded,
    costs_from_trace,
    fitted_costs,
    format_comparison,
    run_cluster,
    run_replicas,
    what_if,
)
from pipeoptim.commands.cluster import (
    add_cluster_flags,
    allreduce_lines,
    check_cluster_flags,
    cluster_from_args,
    cluster_notes,
    parse_link,
)
from pipeoptim.commands.common import (
    ResultFiles,
    add_json_flag,
    check_number,
    check_output_paths,
    format_table,
    print_json,
)
from pipeoptim.errors import PipeoptimError
from pipeoptim.plan.limits import check_work
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import Plan
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.units import format_bytes
from pipeoptim.runtime.comm.process_model import ProcessModel
from pipeoptim.sim.collectives import Cluster
from pipeoptim.trace import Trace

_LOCAL_NOTE = (
    "note: this run used --transport local, where every stage runs in turn on one device; "
    "the prediction is for one device per stage, as --transport dist runs it"
)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "calibrate",
        help="simulate a measured run from its own timings and compare",
        description=(
            "Read a trace written by `pipeoptim train --trace FILE`, turn the measured "
            "per-stage action times (medians, with the executor's gaps and send costs) and "
            "memory into simulator costs (where the ranks shared fewer cores than they "
            "asked for: each action's work under processor sharing and each message's fixed "
            "cost at both ends, fitted from the run), simulate the run's method and shape, "
            "say which costs were fitted, and print "
            "predicted against measured: time per mini-batch, throughput, bubble ratio, peak "
            "memory, with the relative error. --predict asks what other methods, stage "
            "counts (--stages), micro-batch counts (--micro-batches) and replica counts "
            "(--predict-data-parallel) would do on the same measured costs; --out-profile "
            "saves those costs as a profile. A data-parallel run's all-reduce is modelled "
            "as `simulate --data-parallel` models it, on the plan's cluster, the flags "
            "below, or the run's measured link latency with free bandwidth."
        ),
    )
    p.add_argument("--trace", type=Path, required=True, help="runtime trace JSON")
    p.add_argument(
        "--predict",
        default=None,
        metavar="METHOD[,METHOD...]",
        help="also predict these methods from the measured costs (what if)",
    )
    p.add_argument("--stages", type=int, default=None, help="with --predict: stages P")
    p.add_argument("--micro-batches", type=int, default=None, help="with --predict: M")
    p.add_argument(
        "--predict-data-parallel",
        type=int,
        default=None,
        metavar="D",
        help="with --predict: D replicas sharing the run's global batch (default: the run's D)",
    )
    p.add_argument(
        "--bandwidth",
        default=None,
        help="bandwidth of the replicas' all-reduce (within a node with --gpus-per-node), "
        "e.g. 25GB/s (default: the plan's, else free)",
    )
    p.add_argument(
        "--latency",
        type=float,
        default=None,
        help="latency in seconds of each all-reduce step (within a node with "
        "--gpus-per-node; default: the plan's, else the run's median measured link latency)",
    )
    add_cluster_flags(p, data_parallel=False)
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="the offline profile of the model: shares a stage's measured time among its "
        "layers, and gives the fixed part of times and unmeasured prediction times",
    )
    p.add_argument(
        "--out-profile",
        type=Path,
        default=None,
        help="write the calibrated costs as a profile (for simulate, plan, train --plan)",
    )
    p.add_argument("--html", type=Path, default=None, help="report with both timelines")
    p.add_argument("--out-trace", type=Path, default=None, help="write the predicted trace")
    add_json_flag(p)
    p.set_defaults(func=run_calibrate)


def _check_measured(trace: Trace, source: str) -> None:
    """The sizes calibration will build, checked before it builds them: the plan's stage
    count against the stages the trace measured, and the simulated run against the work
    limit (a trace edited by hand can claim 10**9 stages or mini-batches)."""
    data = trace.meta.get("plan")
    if not isinstance(data, dict):
        return  # calibrate() says what a runtime trace needs
    plan = Plan.from_dict(data, source=f"the plan in {source}")
    stages = plan.num_stages * plan.virtual_stages
    measured = len({e.stage for e in trace.events if e.kind == "F"})
    if stages > measured:
        raise PipeoptimError(
            f"the plan in {source} has {stages:,} stages, but the trace has forwards of "
            f"{measured:,}; calibrate from the whole trace of one run (every rank's events)"
        )
    mini_batches = trace.meta.get("mini_batches")
    if isinstance(mini_batches, int) and mini_batches >= 1:
        estimate = plan.method_spec.work(plan.shape(mini_batches))
        check_work(estimate, what="calibrating")


def _cluster(args: argparse.Namespace, measured: Trace) -> Cluster:
    """The all-reduce's links: each flag given, else the trace's (:func:`run_cluster`)."""
    check_cluster_flags(args)
    check_number("--latency", args.latency, minimum=0, example="0.00001 (seconds per step)")
    base = run_cluster(measured)
    bandwidth = parse_link(args.bandwidth)
    return cluster_from_args(
        args,
        base.bandwidth if bandwidth is None else bandwidth,
        base.latency_s if args.latency is None else args.latency,
        cluster_notes(base),
    )


def _what_if(
    args: argparse.Namespace, measured: Trace, profile: Profile | None, cluster: Cluster
) -> list[WhatIf]:
    shaping = (args.stages, args.micro_batches, args.predict_data_parallel)
    if args.predict is None:
        if any(value is not None for value in shaping):
            raise PipeoptimError(
                "--stages, --micro-batches and --predict-data-parallel shape the --predict "
                "runs; add --predict METHOD (e.g. --predict pipeoptim,1f1b)"
            )
        return []
    names = [n.strip() for n in args.predict.split(",") if n.strip()]
    if not names:
        raise PipeoptimError("--predict needs a method, e.g. --predict pipeoptim,1f1b")
    flags = ("--stages", "--micro-batches", "--predict-data-parallel")
    for flag, value in zip(flags, shaping, strict=True):
        if value is not None and value < 1:
            raise PipeoptimError(f"{flag} must be at least 1 (got {value})")
    out = []
    for name in names:
        spec = get_method(name)  # the error lists the methods
        m = None if spec.runs_whole_mini_batches else args.micro_batches
        out.append(
            what_if(
                measured,
                name,
                stages=args.stages,
                micro_batches=m,
                profile=profile,
                data_parallel=args.predict_data_parallel,
                cluster=cluster,
            )
        )
    return out


def _allreduce_notes(args: argparse.Namespace, measured: Trace, cluster: Cluster) -> list[str]:
    """What a data-parallel run's updates were split into, and where the split is forced."""
    if run_replicas(measured) == 1:
        return []
    costs = costs_from_trace(measured, cluster)
    ranks = Plan.from_dict(measured.meta["plan"], source="the trace's plan").num_stages
    steps = ", ".join(f"{s:.4g}" for s in costs.update_s)
    notes = [
        f"modelled {allreduce_lines(costs, ranks, cluster)}; the rest of each measured "
        f"update is the optimizer step: {steps} s per stage"
    ]
    flags = (args.bandwidth, args.latency, args.gpus_per_node, args.inter_node_bandwidth)
    if not cluster_recorded(measured) and all(flag is None for flag in flags):
        notes.append(
            "note: the all-reduce's links are assumed (the run's median link latency, free "
            "bandwidth; the plan records no cluster): an all-reduce slower than that stays in "
            "the optimizer step, which another --predict-data-parallel does not scale; pass "
            "--bandwidth (with --gpus-per-node and --inter-node-bandwidth across nodes)"
        )
    for k, (step, ar) in enumerate(zip(costs.update_s, costs.allreduce_s, strict=True)):
        if step == 0 and ar > 0:
            notes.append(
                f"note: stage {k}'s modelled all-reduce ({ar:.4g} s) is longer than its whole "
                f"measured update: the given links are slower than the run's; the prediction "
                f"of the run takes the modelled time"
            )
    return notes


def _what_if_rows(results: list[WhatIf], measured_s: float) -> list[list[str]]:
    rows = []
    for r in results:
        t = r.time_per_mini_batch
        peak = r.metrics.peak_memory_bytes
        rows.append(
            [
                r.method,
                str(r.num_stages),
                str(r.micro_batches),
                str(r.data_parallel),
                f"{t:.4g} s",
                f"{r.metrics.steady_throughput:.4g}",
                f"{r.metrics.bubble_ratio:.3f}",
                "-" if not peak else format_bytes(peak),
                f"{measured_s / t:.2f}x as fast" if t > 0 and measured_s > 0 else "n/a",
            ]
        )
    return rows


def run_calibrate(args: argparse.Namespace) -> int:
    check_output_paths(
        args, ["--html", "--out-trace", "--out-profile"], inputs=["--trace", "--profile"]
    )
    measured = Trace.load(args.trace)
    _check_measured(measured, str(args.trace))
    profile = Profile.load(args.profile) if args.profile is not None else None
    cluster = _cluster(args, measured)
    predicted, rows = calibrate(measured, cluster)
    results = _what_if(args, measured, profile, cluster)
    measured_s = rows[0].measured  # time per mini-batch, steady state
    local = measured.meta.get("transport") == ProcessModel.ONE_PROCESS.value
    fitted = fitted_costs(measured)
    notes = [_LOCAL_NOTE] if local else []
    bubble = bubble_note(measured, predicted)
    notes += [bubble] if bubble is not None else []
    if bubble is not None and results:
        notes.append(
            "note: the what-if bubble column is simulated on the same charged actions: "
            "compare it with the predicted bubble ratio above and between the what-if rows, "
            "not with the measured one"
        )
    notes += _allreduce_notes(args, measured, cluster)
    notes += [f"{r.method}: {note}" for r in results for note in r.notes]
    files = ResultFiles()
    if args.out_trace is not None:
        files.write(args.out_trace, predicted.save)
    if args.out_profile is not None:
        calibrated = calibrated_profile(measured, profile, cluster)
        files.write(args.out_profile, calibrated.save)
    if args.html is not None:
        from pipeoptim.viz.report import render_calibration

        page = render_calibration(
            measured,
            predicted,
            format_comparison(rows),
            # the page's what-if table has no D column (viz.report): the notes say D
            [row[:3] + row[4:] for row in _what_if_rows(results, measured_s)],
            notes=notes,
        )
        files.write(args.html, lambda p: Path(p).write_text(page, encoding="utf-8"))
    if args.json:
        print_json(
            {
                "method": measured.meta.get("method"),
                "rows": [r.to_dict() for r in rows],
                "transport": measured.meta.get("transport"),
                "fitted": fitted,
                "data_parallel": run_replicas(measured),
                "allreduce_s": predicted.meta.get("allreduce_s", {}),
                "notes": notes,
                "what_if": [
                    {
                        "method": r.method,
                        "num_stages": r.num_stages,
                        "micro_batches": r.micro_batches,
                        "data_parallel": r.data_parallel,
                        "allreduce_s": r.trace.meta.get("allreduce_s", {}),
                        "time_per_mini_batch_s": r.time_per_mini_batch,
                        "steady_throughput": r.metrics.steady_throughput,
                        "bubble_ratio": r.metrics.bubble_ratio,
                        "peak_memory_bytes": r.metrics.peak_memory_bytes,
                        "notes": list(r.notes),
                    }
                    for r in results
                ],
                "written": files.written,
                "not_written": files.failed,
            }
        )
        return files.finish("calibrate")
    print(format_table(["quantity", "measured", "predicted", "error"], format_comparison(rows)))
    print("fitted from the run:")
    for line in fitted:
        print(f"  {line}")
    if results:
        print()
        print("what if, from the measured costs:")
        head = ["method", "P", "M", "D", "time/mini-batch", "samples/s", "bubble", "peak memory"]
        print(format_table([*head, "vs measured"], _what_if_rows(results, measured_s)))
    for note in notes:
        print(note)
    for path in files.written:
        print(f"wrote {path}")
    return files.finish("calibrate")
