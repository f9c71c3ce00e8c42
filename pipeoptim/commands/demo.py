"""``pipeoptim demo``: profile, plan, simulate, train for real, calibrate, compare
convergence, and write one report (the whole product on an embedded default).

The work is :mod:`pipeoptim.demo`'s; this module reads the command line, picks the model's
optimizer as ``pipeoptim train`` does, and prints the summary table and the report's path.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipeoptim.commands.common import add_json_flag, format_table, print_json
from pipeoptim.commands.train import MODEL_OPTIMIZER
from pipeoptim.plan.optimizer_families import optimizer_family

__all__ = ["register", "run"]

_EPILOG = """\
steps (each writes its result into --out; a rerun skips the steps that are current):
  1 profile    the model's per-layer costs, as each of the P ranks will run it
  2 plan       partition P stages, simulate every method, recommend one and its rival
  3 train      the recommended method and the strongest synchronous rival (zb-h1 or
               1f1b) for real, one process per stage over gloo
  4 calibrate  the simulator from both runs: predicted against measured
  5 converge   the same two methods emulated on one device: loss and test metric
  6 report     OUT/report.html (offline) and OUT/figures/*.json

examples:
  pipeoptim demo                         # digits MLP, 4 stages: under a minute on 2 quiet cores
  pipeoptim demo --quick --out /tmp/d    # 2 stages, a few dozen mini-batches
  pipeoptim demo --model gpt --stages 2  # the character language model
  pipeoptim demo --model examples/custom_model.py:make_model
"""


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "demo",
        help="the whole product on one model: plan, simulate, train, calibrate, one report",
        description="Profile a model, plan P stages and simulate every method, train the "
        "recommended method and its strongest synchronous rival for real, calibrate the "
        "simulator from both runs, compare their convergence on one device, and write one "
        "self-contained HTML report. Interrupted, it keeps what it finished; run again, it "
        "resumes.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("pipeoptim-demo"),
        metavar="DIR",
        help="folder for the report and every step's files (created; default pipeoptim-demo)",
    )
    p.add_argument(
        "--model",
        default="mlp",
        help="mlp (default), gpt, cnn, transformer, or module:factory / path.py:factory",
    )
    p.add_argument(
        "--stages",
        type=int,
        default=None,
        metavar="P",
        help="pipeline stages, one process each (default 4; 2 with --quick)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="the smallest run that still shows every part (seconds, not minutes)",
    )
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeoptim.demo import DemoOptions, run_demo
    from pipeoptim.demo.options import check_out_dir, check_stages, sizes_for

    stages = args.stages if args.stages is not None else (2 if args.quick else 4)
    check_stages(stages)
    check_out_dir(args.out)
    family, lr = MODEL_OPTIMIZER.get(args.model, ("sgd", None))
    options = DemoOptions(
        out=args.out,
        model=args.model,
        stages=stages,
        optimizer=family,
        lr=lr if lr is not None else optimizer_family(family).default_lr,
        quick=args.quick,
        sizes=sizes_for(args.model, args.quick),
    )
    outcome = run_demo(options)
    if args.json:
        print_json(
            {
                "report": str(outcome.report),
                "recommendation": outcome.recommendation,
                "study_advice": outcome.study_advice,
                "summary": [
                    dict(zip(outcome.headers, row, strict=True)) for row in outcome.summary
                ],
                "steps": [{"step": s, "how": how, "seconds": t} for s, how, t in outcome.steps],
                "files": outcome.files,
                "results": outcome.results,
            }
        )
        return 0
    print(format_table(outcome.headers, outcome.summary))
    print()
    print(outcome.recommendation)
    if outcome.study_advice is not None:
        print(f"note: {outcome.study_advice}")
    skipped = [s for s, how, _ in outcome.steps if how == "skipped"]
    if skipped:
        print(f"resumed: {len(skipped)} step(s) were already done ({', '.join(skipped)})")
    print(f"report: {outcome.report}")
    return 0
