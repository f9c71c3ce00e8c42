"""How far the demo's real runs move when nothing but the machine changes.

Run from the repository root::

    .venv/bin/python benchmarks/bench_demo_repeat.py               # 4 stages, 4 repeats (~2 min)
    .venv/bin/python benchmarks/bench_demo_repeat.py --repeats 8   # more repeats
    .venv/bin/python benchmarks/bench_demo_repeat.py --quick       # 2 stages, a few seconds a run

It runs ``pipeoptim demo`` once (``--out``, a temporary folder by default; a finished demo
there is reused), then trains the demo's two plans for real again ``--repeats`` times, in
turn (recommended, rival, recommended, ...), each with the demo's own mini-batch count,
processes and settings. Nothing changes between the repeats: the plan, the seed, the code
and the step count are the same, so their spread is the machine's.

For each repeat it prints every method's measured steady rate (samples/s, from its trace,
as the demo's ``measured/s``) and the error of the demo's offline prediction
(``simulated/s``) against it; then per method the median, the lowest and highest rate, the
spread (highest / lowest) and how many repeats the offline prediction was within 15 % of;
and the measured ratio of the two methods against the predicted one, which a drift common
to both runs moves less.

Issue 34 asks the offline prediction to be within 15 % of the measured rate on a 2-core
machine with 4 ranks. Where the repeats themselves spread by more than 1.15 / 0.85, no
prediction made before a run can be within 15 % of every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipeoptim.demo import measure
from pipeoptim.demo.options import DemoOptions, check_stages, sizes_for
from pipeoptim.demo.predict import time_per_mini_batch
from pipeoptim.demo.run import run_demo
from pipeoptim.errors import PipeoptimError
from pipeoptim.metrics import compute_metrics
from pipeoptim.plan.plan import Plan
from pipeoptim.trace import Trace

WITHIN = 0.15
"""The issue's bound on the offline prediction's relative error."""


def measured_rate(trace_path: Path, batch_size: int) -> float:
    """The steady samples/s of one real run, as the demo's ``measured/s`` computes it."""
    seconds = time_per_mini_batch(compute_metrics(Trace.load(trace_path)), batch_size)
    return batch_size / seconds


def repeat_runs(options: DemoOptions, repeats: int, work: Path) -> dict[str, Any]:
    """The demo in ``options.out`` (run or reused), then its two plans trained ``repeats``
    times more in turn. Returns the methods, their offline predictions and every repeat's
    rates (what :func:`summary` reads)."""
    run_demo(options, log=lambda line: print(f"  demo: {line}", file=sys.stderr, flush=True))
    out = options.out
    plan = json.loads((out / "steps" / "plan.json").read_text())["result"]
    methods = [plan["recommended"], plan["rival"]]
    train_step = json.loads((out / "steps" / f"train-{methods[0]}.json").read_text())
    steps = int(train_step["inputs"]["steps"])
    simulated = {r["method"]: float(r["samples_per_s"]) for r in plan["methods"]}
    rates: dict[str, list[float]] = {m: [] for m in methods}
    for index in range(repeats):
        for method in methods:
            trace = work / f"trace-{method}-{index}.json"
            measure.train_for_real(options, Plan.from_dict(plan["plans"][method]), trace, steps)
            rate = measured_rate(trace, options.batch_size)
            rates[method].append(rate)
            error = simulated[method] / rate - 1
            print(
                f"repeat {index + 1}: {method:<10} {rate:>9,.0f} samples/s, "
                f"offline {simulated[method]:,.0f} ({error:+.0%})",
                flush=True,
            )
    return {"methods": methods, "simulated": simulated, "rates": rates}


def summary(found: dict[str, Any]) -> list[str]:
    """The lines printed after the repeats: per method, and the two methods' ratio."""
    lines = []
    simulated, rates = found["simulated"], found["rates"]
    for method in found["methods"]:
        mine = rates[method]
        within = sum(abs(simulated[method] / r - 1) <= WITHIN for r in mine)
        lines.append(
            f"{method}: median {statistics.median(mine):,.0f} samples/s, lowest "
            f"{min(mine):,.0f}, highest {max(mine):,.0f}, spread {max(mine) / min(mine):.2f}x; "
            f"offline {simulated[method]:,.0f} within {WITHIN:.0%} of {within} of {len(mine)}"
        )
    first, second = found["methods"]
    measured = [a / b for a, b in zip(rates[first], rates[second], strict=True)]
    predicted = simulated[first] / simulated[second]
    lines.append(
        f"{first} / {second}: measured {statistics.median(measured):.2f}x (lowest "
        f"{min(measured):.2f}x, highest {max(measured):.2f}x), offline {predicted:.2f}x"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=4, help="real runs of each method")
    parser.add_argument(
        "--stages", type=int, default=None, help="the demo's --stages (4; 2 with --quick)"
    )
    parser.add_argument("--quick", action="store_true", help="the demo's --quick sizes")
    parser.add_argument(
        "--out", type=Path, default=None, help="the demo's folder (default: a temporary one)"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1 (got {args.repeats})")
    stages = args.stages if args.stages is not None else (2 if args.quick else 4)
    try:
        check_stages(stages)  # the demo's own rule, before anything runs
    except PipeoptimError as err:
        parser.error(str(err))
    with tempfile.TemporaryDirectory(prefix="bench-demo-repeat-") as tmp:
        work = Path(tmp)
        options = DemoOptions(
            out=args.out or work / "demo",
            stages=stages,
            quick=args.quick,
            sizes=sizes_for("mlp", args.quick),
        )
        found = repeat_runs(options, args.repeats, work)
    for line in summary(found):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
