"""``pipeoptim schedule`` (print, export or check a schedule) and ``pipeoptim methods``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pipeoptim.commands.common import (
    ResultFiles,
    add_json_flag,
    check_output_paths,
    format_table,
    print_json,
)
from pipeoptim.errors import PlanError
from pipeoptim.plan.actions import format_grid, format_schedule, load_csv, schedule_to_csv
from pipeoptim.plan.methods import METHODS, build_schedule, get_method
from pipeoptim.plan.validate import as_grid, validate
from pipeoptim.plan.versions import VersionReport, analyze_versions


def register(sub: Any) -> None:
    p = sub.add_parser(
        "schedule",
        help="print a method's schedule grid, export it as CSV, or check an imported one",
        description=(
            "Generate a method's schedule for P stages, M micro-batches and N mini-batches "
            "and print it as a grid (one row per rank, one column per clock step) or as the "
            "per-rank CSV that torch.distributed.pipelining reads. With --load, validate and "
            "print a CSV schedule instead: pipeoptim's own, or PyTorch's _dump_csv output in "
            "either format (compute_only, or the lowered compute_comms, whose FSDP and "
            "data-parallel actions UNSHARD/RESHARD/REDUCE_GRAD are dropped with a note)."
        ),
    )
    p.add_argument("--method", help=f"one of: {', '.join(METHODS)}")
    p.add_argument("--stages", type=int, help="pipeline ranks P")
    p.add_argument("--micro-batches", type=int, help="micro-batches M per mini-batch")
    p.add_argument("--mini-batches", type=int, help="mini-batches N in the run")
    p.add_argument("--virtual-stages", type=int, help="stages per rank (interleaved-1f1b)")
    p.add_argument("--format", choices=("grid", "csv"), default="grid")
    p.add_argument("--out", type=Path, help="write the CSV (or grid) to this file")
    p.add_argument("--load", type=Path, help="validate and print this CSV schedule")
    p.add_argument(
        "--torch-compatible",
        action="store_true",
        help="leave update (U) actions out of the CSV, which PyTorch does not parse",
    )
    add_json_flag(p)
    p.set_defaults(func=run_schedule)

    m = sub.add_parser("methods", help="list the pipeline methods")
    add_json_flag(m)
    m.set_defaults(func=run_methods)


def run_methods(args: argparse.Namespace) -> int:
    rows = [
        {
            "name": m.name,
            "weight_policy": m.version_rule.value,
            "asynchronous": not m.flushes,
            "micro_batched": not m.runs_whole_mini_batches,
            "description": m.description,
        }
        for m in METHODS.values()
    ]
    if args.json:
        print_json(rows)
    else:
        print(
            format_table(["method", "description"], [[r["name"], r["description"]] for r in rows])
        )
    return 0


def _version_summary(report: VersionReport) -> list[dict[str, int]]:
    return [
        {
            "stage": k,
            "max_distance": report.max_distance(k),
            "max_staleness": report.max_staleness(k),
            "weight_copies": report.weight_copies[k],
            "max_in_flight": report.max_in_flight[k],
        }
        for k in report.stages
    ]


def run_schedule(args: argparse.Namespace) -> int:
    check_output_paths(args, ["--out"])
    notes: list[str] = []  # what the load left out (PyTorch's FSDP/DP cells), said once
    if args.load is not None:
        schedule = as_grid(load_csv(args.load, notes=notes), source=str(args.load), notes=notes)
        m = validate(schedule)
        source = str(args.load)
        report = None
    else:
        if args.method is None or args.stages is None:
            raise PlanError(
                "schedule needs --method and --stages (or --load FILE); e.g. "
                "`pipeoptim schedule --method pipeoptim --stages 4`"
            )
        schedule, shape = build_schedule(
            args.method, args.stages, args.micro_batches, args.mini_batches, args.virtual_stages
        )
        m = validate(schedule, shape.micro_batches)
        source = args.method
        report = analyze_versions(schedule, get_method(args.method).version_rule, m)
    if args.format == "csv":
        text = schedule_to_csv(schedule, include_updates=not args.torch_compatible)
    else:
        text = format_grid(schedule) + "\n"
    files = ResultFiles()
    if args.out is not None and not files.write(args.out, lambda p: p.write_text(text)):
        args.out = None  # not written: print the schedule instead, so it is not lost
    if args.json:
        print_json(
            {
                "source": source,
                "micro_batches": m,
                "ranks": len(schedule),
                "steps": max(len(a) for a in schedule.values()),
                "schedule": format_schedule(schedule),
                "versions": _version_summary(report) if report else None,
                "out": str(args.out) if args.out else None,
                "notes": notes,
            }
        )
    elif args.out is None:
        print(text, end="")
        if report is not None:
            print()
            print(
                format_table(
                    ["stage", "max s", "max staleness", "weight copies", "max in flight"],
                    [list(r.values()) for r in _version_summary(report)],
                )
            )
    else:
        print(f"wrote {args.format} schedule ({source}, {len(schedule)} ranks) to {args.out}")
    if not args.json:
        # A CSV on stdout stays a clean CSV: the note goes to stderr there.
        stream = sys.stderr if args.format == "csv" and args.out is None else sys.stdout
        for note in notes:
            print(note, file=stream)
    return files.finish("schedule")
