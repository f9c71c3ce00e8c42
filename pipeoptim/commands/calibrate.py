"""``pipeoptim calibrate``: how close the simulator's prediction of a measured run is."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipeoptim.calibrate import calibrate, format_comparison
from pipeoptim.commands.common import add_json_flag, format_table, print_json
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


def run_calibrate(args: argparse.Namespace) -> int:
    measured = Trace.load(args.trace)
    predicted, rows = calibrate(measured)
    local = measured.meta.get("transport") == "local"
    if args.out_trace is not None:
        predicted.save(args.out_trace)
    if args.html is not None:
        from pipeoptim.viz.report import write_report

        write_report(
            args.html,
            {"measured": measured, "predicted": predicted},
            title="pipeoptim calibration: measured run against the simulator",
            notes=[_LOCAL_NOTE] if local else [],
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
            }
        )
        return 0
    print(format_table(["quantity", "measured", "predicted", "error"], format_comparison(rows)))
    if local:
        print(_LOCAL_NOTE)
    return 0
