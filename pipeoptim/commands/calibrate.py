"""``pipeoptim calibrate``: how close the simulator's prediction of a measured run is."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipeoptim.calibrate import calibrate, format_comparison
from pipeoptim.commands.common import (
    ResultFiles,
    add_json_flag,
    check_output_paths,
    format_table,
    print_json,
)
from pipeoptim.errors import PipeoptimError
from pipeoptim.plan.limits import check_work, estimate_work
from pipeoptim.plan.plan import Plan
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
            "memory into simulator costs, simulate the run's method and shape, and print "
            "predicted against measured: time per mini-batch, throughput, bubble ratio, peak "
            "memory, with the relative error."
        ),
    )
    p.add_argument("--trace", type=Path, required=True, help="runtime trace JSON")
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
        estimate = estimate_work(plan.method_spec, plan.shape(mini_batches))
        check_work(estimate, what="calibrating")


def run_calibrate(args: argparse.Namespace) -> int:
    check_output_paths(args, ["--html", "--out-trace"], inputs=["--trace"])
    measured = Trace.load(args.trace)
    _check_measured(measured, str(args.trace))
    predicted, rows = calibrate(measured)
    local = measured.meta.get("transport") == "local"
    files = ResultFiles()
    if args.out_trace is not None:
        files.write(args.out_trace, predicted.save)
    if args.html is not None:
        from pipeoptim.viz.report import write_report

        files.write(
            args.html,
            lambda p: write_report(
                p,
                {"measured": measured, "predicted": predicted},
                title="pipeoptim calibration: measured run against the simulator",
                notes=[_LOCAL_NOTE] if local else [],
            ),
        )
    if args.json:
        print_json(
            {
                "method": measured.meta.get("method"),
                "rows": [
                    {
                        "quantity": r.quantity,
                        "measured": r.measured,
                        "predicted": r.predicted,
                        "unit": r.unit,
                        "relative_error": r.relative_error,
                    }
                    for r in rows
                ],
                "transport": measured.meta.get("transport"),
                "written": files.written,
                "not_written": files.failed,
            }
        )
        return files.finish("calibrate")
    print(format_table(["quantity", "measured", "predicted", "error"], format_comparison(rows)))
    if local:
        print(_LOCAL_NOTE)
    for path in files.written:
        print(f"wrote {path}")
    return files.finish("calibrate")
