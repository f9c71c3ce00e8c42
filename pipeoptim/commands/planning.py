"""``pipeoptim profile`` (measure a model per layer) and ``pipeoptim plan`` (partition, search)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from pipeoptim.commands.cluster import (
    add_cluster_flags,
    check_cluster_flags,
    cluster_from_args,
)
from pipeoptim.commands.common import (
    ResultFiles,
    add_json_flag,
    check_number,
    check_output_paths,
    format_table,
    print_json,
)
from pipeoptim.commands.plan_files import write_plan_files
from pipeoptim.errors import PlanError
from pipeoptim.plan.limits import MAX_PROFILE_BATCH, MAX_PROFILE_REPEATS
from pipeoptim.plan.methods import METHODS
from pipeoptim.plan.plan import OPTIMIZER_FAMILIES
from pipeoptim.plan.profile import Profile, conditions_warning
from pipeoptim.plan.risk import depth_advice
from pipeoptim.plan.units import format_bytes, format_distances, parse_bandwidth, parse_bytes
from pipeoptim.planning import Candidate, PlanLimits, plan_for


def register(sub: Any) -> None:
    prof = sub.add_parser(
        "profile",
        help="measure per-layer times and sizes of a model into a profile JSON",
        description=(
            "Run each layer of a built-in model (or module:factory) on a sample batch and "
            "record forward/backward time (median after warm-up), activation, parameter and "
            "optimizer-state bytes. The profile needs no torch to read."
        ),
    )
    prof.add_argument("--model", default="mlp", help="built-in model name or module:factory")
    prof.add_argument("--batch-size", type=int, default=64, help="samples per mini-batch")
    prof.add_argument("--optimizer", choices=OPTIMIZER_FAMILIES, default="sgd")
    prof.add_argument("--repeats", type=int, default=5, help="timed runs per layer")
    prof.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if any)")
    prof.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="pipeline ranks that will share this machine: on CPU profile with cores/ranks "
        "threads, as each rank runs (default: all of the machine's threads)",
    )
    prof.add_argument("--threads", type=int, default=None, help="CPU threads (overrides --ranks)")
    prof.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    add_json_flag(prof)
    prof.set_defaults(func=run_profile)

    plan = sub.add_parser(
        "plan",
        help="partition a profiled model into stages and pick a method",
        description=(
            "Split the profile's layers into P contiguous stages that minimise the slowest "
            "stage within a per-device memory cap (exact dynamic programme), for one method "
            "or, with --method auto, for every method and micro-batch count, ranked by the "
            "simulator's predicted throughput. Writes a plan JSON that `pipeoptim train "
            "--plan` runs and `pipeoptim simulate --plan` predicts."
        ),
    )
    src = plan.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", type=Path, help="profile JSON from `pipeoptim profile`")
    src.add_argument("--model", help="profile this model first (built-in name or module:factory)")
    size = plan.add_mutually_exclusive_group(required=True)
    size.add_argument("--stages", type=int, help="pipeline stages P, one device each")
    size.add_argument(
        "--devices",
        type=int,
        help="devices N: search every P stages x D data-parallel replicas with P x D = N "
        "(PP x DP) and explain the choice",
    )
    plan.add_argument("--method", default="auto", help=f"auto or one of: {', '.join(METHODS)}")
    plan.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="M (default: the search's counts; 1, 2, 4 … P for pipeoptim)",
    )
    plan.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        help="stages per rank v for --method interleaved-1f1b or interleaved-zb (default 2; "
        "zb-v and dualpipev always hold 2)",
    )
    plan.add_argument("--memory-cap", default=None, help="per-device memory, e.g. 8GiB")
    plan.add_argument(
        "--bandwidth",
        default="inf",
        help="link bandwidth (within a node with --gpus-per-node), e.g. 25GB/s",
    )
    plan.add_argument(
        "--latency",
        type=float,
        default=None,
        help="link latency in seconds (within a node with --gpus-per-node; default: a "
        "calibrated profile's, else 0)",
    )
    add_cluster_flags(plan, data_parallel=False)
    plan.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="samples per mini-batch over all replicas, each training 1/D of it (default: "
        "the profile's batch size; the costs scale to it)",
    )
    plan.add_argument("--optimizer", choices=OPTIMIZER_FAMILIES, default=None)
    plan.add_argument("--lr", type=float, default=None, help="learning rate stored in the plan")
    plan.add_argument("--batch-size", type=int, default=64, help="with --model: samples per batch")
    plan.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="plan for batches of up to this many tokens per sample (varying shapes): the "
        "profile's activation bytes and per-sample times scale linearly from the length it "
        "was measured at",
    )
    plan.add_argument("--out", type=Path, default=None, help="plan JSON to write")
    plan.add_argument("--html", type=Path, default=None, help="draw the partition to this page")
    add_json_flag(plan)
    plan.set_defaults(func=run_plan)


def _check_whole(flag: str, value: int, maximum: int, why: str) -> None:
    if not 1 <= value <= maximum:
        raise PlanError(f"{flag} must be between 1 and {maximum:,} (got {value:,}); {why}")


def _check_virtual_stages(virtual_stages: int | None, method: str) -> None:
    """--virtual-stages only with one named method that places several stages per rank."""
    if virtual_stages is None:
        return
    several = [n for n, m in METHODS.items() if m.places_several_stages_per_rank]
    if method.strip().lower() not in several:
        raise PlanError(
            f"--virtual-stages {virtual_stages} sets the stages per rank of a method that "
            f"places several on every rank, but --method is {method}; give --method one of "
            f"{', '.join(several)}, or leave --virtual-stages out"
        )


def _check_batch(batch_size: int) -> None:
    _check_whole(
        "--batch-size",
        batch_size,
        MAX_PROFILE_BATCH,
        "the simulator scales a profile's costs linearly to any batch size, so profile "
        "with a smaller batch, e.g. --batch-size 64",
    )


def _profile_model(
    model: str,
    batch_size: int,
    optimizer: str,
    repeats: int,
    device: str | None,
    progress: bool,
    *,
    ranks: int | None = None,
    threads: int | None = None,
) -> Profile:
    from pipeoptim.workloads.profiling import profile_builtin

    return profile_builtin(
        model,
        batch_size=batch_size,
        optimizer=optimizer,
        repeats=repeats,
        device=device,
        progress=progress,
        ranks=ranks,
        threads=threads,
    )


def run_profile(args: argparse.Namespace) -> int:
    check_output_paths(args, ["--out"])
    _check_batch(args.batch_size)
    _check_whole(
        "--repeats",
        args.repeats,
        MAX_PROFILE_REPEATS,
        "the profile keeps the median, which a few repeats already settle, e.g. --repeats 5",
    )
    for flag, value in (("--ranks", args.ranks), ("--threads", args.threads)):
        if value is not None:
            _check_whole(flag, value, 4096, "e.g. --ranks 2 for a 2-stage run on this machine")
    profile = _profile_model(
        args.model,
        args.batch_size,
        args.optimizer,
        args.repeats,
        args.device,
        progress=not args.json,
        ranks=args.ranks,
        threads=args.threads,
    )
    files = ResultFiles()
    files.write(args.out, profile.save)
    if args.json:
        print_json({"out": str(args.out) if files.ok else None, **profile.to_dict()})
        return files.finish("profile")
    rows = [
        [
            i,
            layer.name,
            layer.forward_s * 1e3,
            layer.backward_s * 1e3,
            format_bytes(layer.activation_bytes),
            format_bytes(layer.param_bytes),
        ]
        for i, layer in enumerate(profile.layers)
    ]
    print(format_table(["#", "layer", "forward ms", "backward ms", "activation", "params"], rows))
    if files.ok:
        threads = profile.meta.get("threads")
        print(
            f"wrote {profile.num_layers}-layer profile ({profile.device}, {threads} thread(s), "
            f"batch {profile.batch_size}) to {args.out}"
        )
    else:  # the measurement is not lost: print it, to be saved by hand
        print(profile.to_json())
    return files.finish("profile")


def _stage_rows(candidate: Candidate, profile: Profile) -> list[list[Any]]:
    """One row per stage; where a rank holds several stages, the rank follows the stage."""
    part = candidate.partition
    assert part is not None  # only feasible candidates get here
    risk = candidate.risk
    ranks = candidate.stage_ranks
    return [
        [
            k,
            *([ranks[k]] if ranks else []),
            f"{a}..{b - 1}",
            b - a,
            part.stage_times[k] * 1e3,
            format_bytes(part.stage_memory[k]),
            part.weight_copies[k] if part.weight_copies else 1,
            risk.distances[k] if risk else 0,
            risk.staleness[k] if risk else 0,
        ]
        for k, (a, b) in enumerate(part.boundaries)
    ]


def run_plan(args: argparse.Namespace) -> int:
    check_output_paths(args, ["--out", "--html"], inputs=["--profile"])
    check_number("--latency", args.latency, minimum=0, example="0.0001 (seconds per transfer)")
    check_number("--lr", args.lr, above=0, example="0.05")
    check_cluster_flags(args)
    for flag, value in (("--devices", args.devices), ("--global-batch", args.global_batch)):
        if value is not None and value < 1:
            raise PlanError(f"{flag} must be a whole number >= 1 (got {value}); e.g. {flag} 64")
    if args.model is not None:
        _check_batch(args.batch_size)
    _check_virtual_stages(args.virtual_stages, args.method)
    if args.profile is not None:
        profile = Profile.load(args.profile)
    else:
        profile = _profile_model(  # under the conditions each of the P ranks will have
            args.model,
            args.batch_size,
            args.optimizer or "sgd",
            5,
            None,
            progress=not args.json,
            ranks=args.stages,
        )
    if args.max_length is not None:
        from pipeoptim.plan.sequence_length import at_length

        profile = at_length(profile, args.max_length)
    if args.stages is not None:
        warning = conditions_warning(profile.device, profile.meta.get("threads"), args.stages)
        if warning:
            print(warning, file=sys.stderr)
    cap = parse_bytes(args.memory_cap) if args.memory_cap else None
    bandwidth = math.inf if args.bandwidth in ("inf", "") else parse_bandwidth(args.bandwidth)
    family = args.optimizer or (
        profile.optimizer if profile.optimizer in OPTIMIZER_FAMILIES else "sgd"
    )
    timed = any(layer.update_s > 0 for layer in profile.layers)
    if timed and family != profile.optimizer and profile.optimizer in OPTIMIZER_FAMILIES:
        # update and prediction times are the optimizer's (Muon's Newton–Schulz costs far
        # more than AdamW's step): planning one with another's hides that
        print(
            f"note: --optimizer {family}, but the profile's update and prediction times are "
            f"{profile.optimizer}'s, so the plan times {family}'s steps as {profile.optimizer}'s; "
            f"profile with `pipeoptim profile --optimizer {family}` for {family}'s own times",
            file=sys.stderr,
        )
    # a calibrated profile knows its run's links
    latency: float = args.latency
    if latency is None:
        latency = float(profile.meta.get("link_latency_s", 0.0))
    cluster = cluster_from_args(args, bandwidth, latency)
    if cluster.gpus_per_node is not None and args.inter_node_bandwidth is None:
        print(
            "note: --gpus-per-node without --inter-node-bandwidth: links between nodes are "
            "taken as fast as those within a node",
            file=sys.stderr,
        )
    limits = PlanLimits(
        memory_cap_bytes=cap,
        cluster=cluster,
        batch_size=args.global_batch,
        micro_batches=args.micro_batches,
        optimizer=family,
        lr=args.lr,
        virtual_stages=args.virtual_stages,
    )
    if args.devices is not None:
        from pipeoptim.commands.plan_devices import run_device_plan

        return run_device_plan(args, profile, limits)
    cluster.check_devices(args.stages)  # (plan_for checks it too; before the note below)
    if args.method == "auto" and args.micro_batches is not None:
        # the search over methods tries its own counts
        print(
            f"note: --micro-batches {args.micro_batches} is not searched with --method "
            f"auto, which tries P, 2P and 4P micro-batches (those that divide the batch) "
            f"for every micro-batching method, and 1, 2, 4 … P for pipeoptim's dial; give "
            f"--method METHOD to plan that count",
            file=sys.stderr,
        )
    choice = plan_for(
        profile,
        stages=args.stages,
        method=args.method,
        limits=limits,
        model=args.model,
        progress=None if args.json else lambda s: print(f"  evaluating {s}", file=sys.stderr),
    )
    plan, ranked, best, summary = choice.plan, choice.ranked, choice.best, choice.why
    assert best.partition is not None  # only a candidate that runs becomes the plan
    files = write_plan_files(args, plan, best.partition, profile, cap, summary)
    # what the convergence study measured of the chosen method under this optimizer at this
    # depth, and the best it found there (None: it converged, or nothing was measured)
    advice = depth_advice(plan.method, plan.num_stages, family, plan.micro_batches)
    table = [
        {
            "method": c.method,
            "micro_batches": c.micro_batches,
            "samples_per_s": c.throughput,
            "bubble_ratio": c.bubble_ratio,
            "max_staleness": c.max_staleness,
            "prediction_distance": list(c.risk.distances) if c.risk else None,
            "staleness": list(c.risk.staleness) if c.risk else None,
            "uncorrected_distance": c.uncorrected,
            "closed": c.risk.closed if c.risk else None,
            "convergence_risk": c.risk.risk if c.risk else None,
            "effective_samples_per_s": c.effective_throughput,
            "peak_memory_bytes": c.peak_memory_bytes,
            "infeasible": c.infeasible,
        }
        for c in ranked
    ]
    if args.json:
        print_json(
            {
                "plan": plan.to_dict(),
                "ranking": table,
                "why": summary,
                "study_advice": advice,
                "out": str(args.out) if args.out and str(args.out) in files.written else None,
            }
        )
        return files.finish("plan")
    print(
        format_table(
            [
                "stage",
                *(["rank"] if best.stage_ranks else []),
                "layers",
                "count",
                "ms per unit",
                "memory",
                "weight copies",
                "s",
                "staleness",
            ],
            _stage_rows(best, profile),
        )
    )
    print()
    if len(ranked) > 1:
        print(
            format_table(
                [
                    "method",
                    "M",
                    "samples/s",
                    "bubble",
                    "staleness",
                    "s per stage",
                    "risk",
                    "effective/s",
                    "peak memory",
                ],
                [
                    [
                        c.method,
                        c.micro_batches,
                        c.throughput,
                        c.bubble_ratio,
                        c.max_staleness,
                        format_distances(c.risk.distances) if c.risk else "-",
                        f"+{100 * c.risk.risk:.0f}%" if c.risk else "-",
                        c.effective_throughput if c.infeasible is None else "-",
                        format_bytes(c.peak_memory_bytes)
                        if c.infeasible is None
                        else "not simulated"
                        if c.skipped
                        else "over cap",
                    ]
                    for c in ranked
                ],
            )
        )
        print()
    print(summary)
    if advice is not None:
        print(f"note: {advice}")
    if args.out is not None and str(args.out) in files.written:
        print(f"wrote plan to {args.out}")
    elif args.out is not None:  # the plan is not lost: print it, to be saved by hand
        print(json.dumps(plan.to_dict(), indent=2))
    return files.finish("plan")
