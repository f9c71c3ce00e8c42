"""``pipeoptim simulate``: simulate one method or all of them and compare.

Prints one row per method (throughput, bubble ratio, peak memory of the fullest stage,
staleness, weight copies) and writes the HTML report, the traces and chrome traces on
request. Costs come from ``--uniform F,B[,U]`` (the default, ``1,2``), a ``--profile`` or a
``--plan``. With ``--method all`` methods that do not micro-batch run with M=1, interleaved
1F1B with v=2, and methods whose shape rules reject the sizes are skipped with a note.

Uniform costs describe the model cut into P stages (one per rank): F and B seconds per
micro-batch and stage. Interleaved 1F1B cuts it into P*v chunks, each 1/v of a stage.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pipeoptim.commands.cluster import (
    add_cluster_flags,
    allreduce_lines,
    check_cluster_flags,
    cluster_from_args,
    global_batch,
)
from pipeoptim.commands.common import (
    ResultFiles,
    add_json_flag,
    check_number,
    check_output_paths,
    format_table,
    print_json,
)
from pipeoptim.commands.sim_inputs import (
    check_costs,
    job_costs,
    job_links,
    job_recompute,
    job_shard,
)
from pipeoptim.errors import PlanError
from pipeoptim.metrics import RunMetrics, compute_metrics
from pipeoptim.plan.limits import (
    MAX_JITTER,
    check_total,
    check_work,
    fit_budget,
    max_actions,
)
from pipeoptim.plan.methods import METHODS, Method
from pipeoptim.plan.plan import OPTIMIZER_FAMILIES
from pipeoptim.plan.replicas import check_batch_split
from pipeoptim.plan.risk import method_risk
from pipeoptim.plan.shape import Shape
from pipeoptim.plan.units import format_bytes, format_distances
from pipeoptim.planning import resolve_methods
from pipeoptim.sim.costs import CostModel
from pipeoptim.trace import Trace

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Add the ``simulate`` sub-command."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="simulate methods and compare throughput, bubbles, memory and staleness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--method",
        default=None,
        help="method name, comma-separated names, or 'all' (default: all, or the "
        "plan's method with --plan)",
    )
    p.add_argument(
        "--stages",
        "-P",
        type=int,
        default=None,
        help="pipeline ranks P (required unless --plan gives it)",
    )
    p.add_argument(
        "--micro-batches",
        "-M",
        type=int,
        default=None,
        help="micro-batches per mini-batch (default: P; 1 for pipeoptim and for methods that do "
        "not micro-batch)",
    )
    p.add_argument(
        "--mini-batches",
        "-N",
        type=int,
        default=None,
        help="mini-batches in the run (default: 2P asynchronous, 2 flushed)",
    )
    p.add_argument(
        "--virtual-stages",
        "-v",
        type=int,
        default=None,
        help="stages per rank for interleaved-1f1b (default 2)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--uniform",
        default=None,
        metavar="F,B[,U]",
        help="forward, backward (and update) seconds per stage and micro-batch (default 1,2)",
    )
    src.add_argument("--profile", type=Path, default=None, help="per-layer profile JSON")
    p.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="with --profile: simulate batches of this many tokens per sample (the profile's "
        "activation bytes and per-sample times scale linearly from its measured length)",
    )
    p.add_argument(
        "--plan",
        type=Path,
        default=None,
        help="plan JSON: method, sizes, optimizer, boundaries, stage costs",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="samples per mini-batch for --profile/--plan costs (default: the "
        "plan's, else the profile's batch size)",
    )
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZER_FAMILIES,
        default=None,
        help="optimizer family, sets the optimizer state size (default sgd)",
    )
    p.add_argument(
        "--param-bytes",
        default="1GiB",
        help="with --uniform: bytes of one weight copy per stage (default 1GiB)",
    )
    p.add_argument(
        "--activation-bytes",
        default="128MiB",
        help="with --uniform: activation bytes per micro-batch and stage, also "
        "sent across each stage boundary (default 128MiB)",
    )
    p.add_argument(
        "--bandwidth",
        default=None,
        help="link bandwidth (within a node with --gpus-per-node), e.g. 25GB/s or 100Gbps "
        "(default: the plan's, else free)",
    )
    p.add_argument(
        "--latency",
        type=float,
        default=None,
        help="link latency in seconds (within a node with --gpus-per-node; default: the "
        "plan's, a calibrated profile's, else 0)",
    )
    add_cluster_flags(p, data_parallel=True)
    p.add_argument(
        "--recompute",
        default=None,
        metavar="MODE",
        help="activation recomputation: none, full, stages:0,1 (those stages in full) or "
        "units:NAME,... (units by index, name or class); default: the plan's, else none",
    )
    p.add_argument(
        "--shard-optimizer",
        action="store_true",
        default=False,
        help="shard each stage's optimizer state over its --data-parallel replicas (ZeRO-1): "
        "1/D of the state each, plus a weight all-gather per update (default: the plan's)",
    )
    p.add_argument(
        "--no-contention", action="store_true", help="transfers never queue on a link (pure delays)"
    )
    p.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        help="lognormal sigma of a random factor on every duration (what-if runs)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed for --jitter")
    p.add_argument(
        "--engine",
        choices=("simpy", "fast"),
        default="simpy",
        help="simpy (queues links) or the fast evaluator (no link contention)",
    )
    p.add_argument("--html", type=Path, default=None, help="write the HTML report here")
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="write the trace JSON here (one file per method: NAME-METHOD.json when several)",
    )
    p.add_argument(
        "--chrome-trace",
        type=Path,
        default=None,
        help="write chrome-trace JSON (Perfetto) here, one per method likewise",
    )
    add_json_flag(p)
    p.set_defaults(func=run)


def _per_method_path(path: Path, method: str, several: bool) -> Path:
    return path.with_name(f"{path.stem}-{method}{path.suffix}") if several else path


def _methods(text: str) -> list[Method]:
    """The methods of ``--method`` (``all``, or names by commas), resolved once, where plan
    search resolves them (:func:`pipeoptim.planning.resolve_methods`)."""
    if text == "all":
        return list(METHODS.values())
    return resolve_methods([name.strip() for name in text.split(",") if name.strip()])


def _shape(method: Method, args: argparse.Namespace, num_ranks: int, every: bool) -> Shape:
    m = args.micro_batches
    if method.runs_whole_mini_batches and every:
        m = None
    v = method.virtual_stages_for(args.virtual_stages)
    return method.shape(num_ranks, m, args.mini_batches, v)


def _check_args(args: argparse.Namespace) -> None:
    """Everything about the flags alone, before any file is read or work is done."""
    check_output_paths(
        args, ["--html", "--trace", "--chrome-trace"], inputs=["--plan", "--profile"]
    )
    check_number("--latency", args.latency, minimum=0, example="0.0001 (seconds per transfer)")
    check_number("--jitter", args.jitter, minimum=0, maximum=MAX_JITTER, example="0.1")
    check_cluster_flags(args)
    if args.virtual_stages is not None and args.virtual_stages < 1:
        raise PlanError(
            f"--virtual-stages must be at least 1 stage per rank (got {args.virtual_stages}); "
            f"pass 2 (the default) or more for interleaved-1f1b, or leave it out"
        )
    if args.batch_size is not None and args.batch_size < 1:
        raise PlanError(
            f"--batch-size must be at least 1 sample per mini-batch (got {args.batch_size}); "
            f"e.g. --batch-size 64"
        )


def _fit(
    jobs: list[tuple[Method, Shape]], every: bool, skipped: list[tuple[str, str]]
) -> list[tuple[Method, Shape]]:
    """Refuse (one method) or skip with a note (several) what is over the work limit."""
    estimates = [method.work(shape) for method, shape in jobs]
    if not every:
        check_total(estimates)
        return jobs
    keep = fit_budget([e.cost for e in estimates])
    if not any(keep):  # even the smallest is over: its own message has the numbers and fix
        check_work(min(estimates, key=lambda e: e.cost))
    limit = max_actions()
    for e, kept in zip(estimates, keep, strict=True):
        if not kept:
            why = (
                f"about {e.amount()}, over the limit of {limit:,}; use fewer --mini-batches"
                if e.cost > limit
                else f"about {e.amount()}, and with the others over the limit of "
                f"{limit:,}; simulate it alone with --method {e.method}"
            )
            skipped.append((e.method, why))
    return [job for job, kept in zip(jobs, keep, strict=True) if kept]


def run(args: argparse.Namespace) -> int:
    """Simulate, print the table (or JSON), write the requested files."""
    from pipeoptim.sim.engine import simulate
    from pipeoptim.sim.evaluate import evaluate_trace

    _check_args(args)

    plan = profile = None
    if args.plan is not None:
        from pipeoptim.plan.plan import Plan

        plan = Plan.load(args.plan)
    if args.profile is not None:
        from pipeoptim.plan.profile import Profile

        profile = Profile.load(args.profile)
        if args.max_length is not None:
            from pipeoptim.plan.sequence_length import at_length

            profile = at_length(profile, args.max_length)
    elif args.max_length is not None:
        raise PlanError(
            "--max-length scales a profile's costs to a sequence length: give --profile FILE "
            "(a uniform cost model has no length)"
        )
    method_text = args.method or (plan.method if plan is not None else "all")
    num_ranks = args.stages if args.stages is not None else (plan.num_stages if plan else None)
    if num_ranks is None:
        raise PlanError("simulate needs the pipeline size: pass --stages P (or --plan FILE)")
    if plan is not None:
        if args.micro_batches is None and plan.micro_batches > 1:
            args.micro_batches = plan.micro_batches
        if args.mini_batches is None and plan.mini_batches is not None:
            args.mini_batches = plan.mini_batches
        if args.virtual_stages is None and plan.virtual_stages > 1:
            args.virtual_stages = plan.virtual_stages
        if args.data_parallel is None:
            args.data_parallel = plan.data_parallel
    if args.data_parallel is None:
        args.data_parallel = 1
    shard = job_shard(args, plan)
    job_recompute(args, plan)  # a bad --recompute fails before any work
    links = job_links(args, plan, profile)
    cluster = cluster_from_args(
        args, links.get("bandwidth", math.inf), links["latency_s"], plan.notes if plan else {}
    )
    cluster.check_devices(num_ranks * args.data_parallel)
    from pipeoptim.plan.profile import conditions_warning

    warning = None
    if profile is not None:
        warning = conditions_warning(profile.device, profile.meta.get("threads"), num_ranks)
    elif plan is not None and plan.stage_graph is not None:
        graph = plan.stage_graph.get("graph", {})
        warning = conditions_warning(str(graph.get("device", "")), graph.get("threads"), num_ranks)
    if warning:
        print(warning, file=sys.stderr)
    methods = _methods(method_text)
    every = len(methods) > 1

    jobs: list[tuple[Method, Shape]] = []
    skipped: list[tuple[str, str]] = []
    batch = global_batch(args, plan, profile) if args.data_parallel > 1 else None
    for method in methods:
        try:
            shape = _shape(method, args, num_ranks, every)
            if batch is not None:
                check_batch_split(batch, args.data_parallel, shape.micro_batches)
            jobs.append((method, shape))
        except PlanError as err:
            if not every:
                raise
            skipped.append((method.name, str(err)))
    if jobs:
        jobs = _fit(jobs, every, skipped)
    if not jobs:
        raise PlanError(
            "no method accepts these sizes: " + "; ".join(f"{name}: {why}" for name, why in skipped)
        )
    big = sum(s.num_ranks * s.total_micro_batches * 2 * s.virtual_stages for _, s in jobs)
    traces: dict[str, Trace] = {}
    metrics: dict[str, RunMetrics] = {}
    used: dict[str, CostModel] = {}
    bar = tqdm(
        jobs,
        desc="simulate",
        unit="method",
        file=sys.stderr,
        disable=True if (len(jobs) < 3 and big < 200_000) else None,
    )
    for method, shape in bar:
        bar.set_postfix_str(method.name)
        costs = job_costs(args, shape, plan, profile, method)
        if args.data_parallel > 1 or cluster.gpus_per_node is not None:
            costs = costs.with_data_parallel(args.data_parallel, cluster, num_ranks=num_ranks)
        if shard:
            costs = costs.with_sharded_optimizer(cluster, num_ranks=num_ranks)
        check_costs(costs, args)
        if args.engine == "fast":
            trace = evaluate_trace(method, shape, costs, jitter=args.jitter, seed=args.seed)
        else:
            trace = simulate(
                method,
                shape,
                costs,
                jitter=args.jitter,
                seed=args.seed,
                contention=not args.no_contention,
            )
        traces[method.name] = trace
        metrics[method.name] = compute_metrics(trace)
        used[method.name] = costs
    bar.close()
    notes = [f"skipped {name}: {why}" for name, why in skipped]

    several = len(traces) > 1
    files = ResultFiles()
    for name, trace in traces.items():
        if args.trace is not None:
            files.write(_per_method_path(args.trace, name, several), trace.save)
        if args.chrome_trace is not None:
            files.write(_per_method_path(args.chrome_trace, name, several), trace.save_chrome_trace)
    if args.html is not None:
        from pipeoptim.viz.report import write_report

        files.write(args.html, lambda p: write_report(p, traces, metrics=metrics, notes=notes))
    written = files.written

    if args.json:
        print_json(
            {
                "runs": {
                    name: {"shape": _shape_dict(traces[name]), **m.as_dict()}
                    for name, m in metrics.items()
                },
                "data_parallel": args.data_parallel,
                "allreduce_s": {name: list(c.allreduce_s) for name, c in used.items()},
                "gather_s": {name: list(c.gather_s) for name, c in used.items()},
                "recompute_s": {name: list(c.recompute_s) for name, c in used.items()},
                "shard_optimizer": shard,
                "skipped": [{"method": n, "reason": why} for n, why in skipped],
                "written": written,
                "not_written": files.failed,
            }
        )
        return files.finish("simulate")
    family = args.optimizer or (plan.optimizer.family if plan is not None else "sgd")
    headers = [
        "method",
        "P",
        "M",
        "N",
        "v",
        "makespan s",
        "samples/s",
        "steady/s",
        "bubble",
        "peak memory",
        "max staleness",
        "s per stage",
        "conv. risk",
        "copies",
    ]
    rows = []
    for name, m in metrics.items():
        meta = traces[name].meta
        rows.append(
            [
                name,
                meta["num_ranks"],
                meta["micro_batches"],
                meta["mini_batches"],
                meta["virtual_stages"],
                m.span_s,
                m.throughput,
                m.steady_throughput,
                round(m.bubble_ratio, 4),
                format_bytes(m.peak_memory_bytes) if m.peak_memory_bytes else "-",
                m.max_staleness,
                format_distances([st.max_distance for _, st in sorted(m.stages.items())]),
                _risk_text(traces[name].meta.get("method", name), m, family),
                _copies(traces[name]),
            ]
        )
    if args.data_parallel > 1:  # the replicas, after P
        headers.insert(2, "D")
        for row in rows:
            row.insert(2, args.data_parallel)
    print(format_table(headers, rows))
    if args.data_parallel > 1:  # once for the methods that share it
        lines = (allreduce_lines(c, num_ranks, cluster) for c in used.values())
        print("\n".join(dict.fromkeys(lines)))
    for note in notes:
        print(f"note: {note}")
    for path in written:
        print(f"wrote {path}")
    return files.finish("simulate")


def _risk_text(method: str, m: RunMetrics, optimizer: str) -> str:
    """Extra samples to accuracy the convergence study predicts (``plan/risk.py``)."""
    spec = METHODS.get(method)
    if spec is None:
        return "-"
    stages = [st for _, st in sorted(m.stages.items())]
    risk = method_risk(
        spec, optimizer, [st.max_distance for st in stages], [st.max_staleness for st in stages]
    )
    return f"+{100 * risk.risk:.0f}%"


def _copies(trace: Trace) -> str:
    """Weight copies per stage, run-length coded: ``2``, ``4,3,2,1``, ``2x63,1``."""
    weights = trace.meta.get("weight_copies", {})
    copies = [int(v) for _, v in sorted(weights.items(), key=lambda kv: int(kv[0]))]
    return format_distances(copies) if copies else "-"


def _shape_dict(trace: Trace) -> dict[str, Any]:
    meta = trace.meta
    keys = ("num_ranks", "num_stages", "micro_batches", "mini_batches", "virtual_stages")
    return {k: meta.get(k) for k in keys}
