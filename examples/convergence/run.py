"""The convergence study: every method, optimizer and depth on the digits MLP, the digits
CNN and the character-level GPT; tables, curves, time to accuracy and prediction closure.

    python examples/convergence/run.py                 # everything (about an hour on 2 cores)
    python examples/convergence/run.py --models mlp    # one model
    python examples/convergence/run.py --report-only   # redraw from results/runs.jsonl

Runs are appended to ``results/<model>/runs.jsonl`` as they finish; rerunning resumes.
A report of every model also rewrites the planner's measured tables
(``pipeoptim/plan/data/risk_tables.json``, ``--tables``) from the report's ``risk_fit.json``.
The same study for one model from the command line: ``pipeoptim compare --model mlp``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from pipeoptim.plan.risk_tables import packaged_path, risk_tables_json
from pipeoptim.study.grid import (
    StudyConfig,
    check_model,
    load_records,
    print_progress,
    run_specs,
    run_study,
    with_methods,
)
from pipeoptim.study.parts import PARTS, estimated_seconds, part_order, part_specs
from pipeoptim.study.report import write_study_report
from pipeoptim.study.risk_fit import risk_tables_from_fit

RESULTS = Path(__file__).resolve().parent / "results"

DIGITS_EPOCH = 44  # 1,437 training samples in mini-batches of 32

LM_RECIPE: dict[str, Any] = {
    "seeds": 1,
    "rates": {"adamw": (2e-3,)},
    "high_rate": False,
    "eval_samples": 1024,
    "warmup": 0.1,
    "final_lr": 0.1,
    "grad_clip": 1.0,
    "weight_decay": 0.01,
}
"""The language-model studies' recipe (gpt-deep, gpt-deeper): one seed at the gpt's best
AdamW rate, 10 % warm-up, cosine to 0.1x, clipping 1.0, weight decay 0.01."""

ONE_STEP = ("xpipe", "2bw")
"""The one-step family (a delay of one update: XPipe predicting it, PipeDream-2BW not),
whose rows make the ``--part one-step``."""

EXTRAPOLATE = "xpipe+extrapolate"
"""The one-step family's update-level correction, x_{t+1} = x_t − η[(1+λ)u_t − λu_{t−1}]."""


LM_DEPTH_ROWS: dict[str, Any] = {
    # the dial between PipeOptim (M = 1) and XPipe (M = P): M = P/4 and P/2 at every depth
    "dial": ("adamw", "muon"),
    # the equal-time runs: the one-step family, the dial (pipeoptim names its dial rows) and
    # the best λ of the extrapolation, under AdamW and Muon
    "equal_time": tuple(
        row
        for optimizer in (None, "muon")
        for row in (
            *(m if optimizer is None else f"{m} ({optimizer})" for m in ONE_STEP),
            "pipeoptim" if optimizer is None else f"pipeoptim ({optimizer})",
            EXTRAPOLATE if optimizer is None else f"{EXTRAPOLATE} ({optimizer})",
        )
    ),
}
"""The rows issue 65 adds to both language-model studies besides their pairs."""

STUDIES = {
    # 15 epochs, 21 under Adam: gpipe needs up to 5 epochs to reach 95 % test accuracy at
    # the chosen SGD and AdamW rates and 6-7 at Adam's, and the curves run at least 3x that.
    "mlp": StudyConfig(
        "mlp",
        steps=15 * DIGITS_EPOCH,
        eval_every=DIGITS_EPOCH,
        steps_by_optimizer={"adam": 21 * DIGITS_EPOCH},
        variants=("pipeoptim",),
    ),
    "cnn": StudyConfig(
        "cnn",
        steps=15 * DIGITS_EPOCH,
        eval_every=DIGITS_EPOCH,
        steps_by_optimizer={"adam": 21 * DIGITS_EPOCH},
        high_rate_seeds=1,
        variants=("pipeoptim",),
    ),
    # The language model costs ~10x a digits run: AdamW only (its tuned optimizer), one seed.
    "gpt": StudyConfig(
        "gpt",
        steps=400,
        eval_every=100,
        optimizers=("adamw",),
        seeds=1,
        rates={"adamw": (5e-4, 1e-3, 2e-3)},
        high_rate=False,
        # gpipe's best rate (2e-3) already stalls the asynchronous methods: also train
        # every method at the lowest candidate, where they can learn
        extra_rates={"adamw": (5e-4,)},
        eval_samples=512,
        variants=("pipeoptim",),
    ),
    # The language model at depth, with the recipe language models are trained with: AdamW
    # (weight decay 0.01), 10 % linear warm-up, cosine decay to 0.1x, clipping 1.0, and long
    # enough (2,000 updates) that gpipe's loss has flattened, on windows of 32 characters
    # (half the gpt's, so that all of it trains in under 90 minutes on 2 cores; the runs go
    # longest first). The rate is the gpt's measured best (GPT_DEFAULTS); 1f1b and zb-h1
    # make gpipe's updates, so they are not trained.
    "gpt-deep": StudyConfig(
        "gpt-deep",
        steps=2000,
        eval_every=250,
        methods=(
            "gpipe",
            "2bw",
            "xpipe",
            "pipedream",
            "spectrain",
            "pipeoptim",
            "pipedream+pipemare",
            "pipeoptim+pipemare",
            "pipeoptim+shrink",
            "pipedream+bounded",
            "pipeoptim+bounded",
            "pipeoptim+qk-clip",
        ),
        optimizers=("adamw",),
        stages=(8, 16, 4),
        sweep_stages=8,
        **LM_RECIPE,
        pairs=(
            ("gpipe", "nadam"),
            ("pipeoptim", "nadam"),
            ("pipedream+nesterov", "nadam"),
            ("pipeoptim+nesterov", "nadam"),
            ("pipeoptim", "muon"),
            ("gpipe", "muon"),
            ("pipedream", "muon"),
            ("pipeoptim+shrink", "muon"),
            ("pipeoptim+nesterov", "muon"),
            ("pipeoptim+bounded", "muon"),
            ("gpipe", "basis-rotation"),
            ("pipeoptim", "basis-rotation"),
            ("pipeoptim+qk-clip", "muon"),
            ("pipeoptim+nesterov", "basis-rotation"),
            # the one-step family under every optimizer (xpipe and 2bw under AdamW are
            # methods above), at every depth
            ("xpipe", "muon"),
            ("2bw", "muon"),
            ("xpipe", "nadam"),
            ("2bw", "nadam"),
            ("xpipe", "basis-rotation"),
            ("2bw", "basis-rotation"),
            # NAdam as AsyncPP trains it (β1 = 0.99): does the slower momentum make the one
            # update ahead foreseeable, where torch's β1 = 0.9 left it half new gradient?
            ("gpipe", "nadam β1=0.99"),
            ("xpipe", "nadam β1=0.99"),
            ("2bw", "nadam β1=0.99"),
        ),
        # the optimizer rows that ask one question each, at 8 stages only; the corrections
        # (nesterov) and the best row with its reference (muon) train at every depth
        pairs_only_at_sweep_depth=(
            "pipeoptim (nadam)",
            "pipeoptim+nesterov (nadam)",
            "pipedream (muon)",
            "pipeoptim+shrink (muon)",
            "pipeoptim+qk-clip (muon)",
        ),
        twins=("1f1b", "zb-h1"),
        # the best never-micro-batched row at 8 stages and its base without the momentum
        # rule, and gpipe itself (the reference every excess is taken against), on two
        # more seeds
        repeat=("gpipe", "pipeoptim (muon)", "pipeoptim+nesterov (muon)"),
        repeat_seeds=3,
        repeat_stages=8,
        **LM_DEPTH_ROWS,
        # the λ scan at 8 stages, the middle λ at every depth; and at 8 stages the middle λ on
        # 2bw under Muon, the one-step row that predicts nothing (no Newton–Schulz to pay)
        extrapolations=(
            *((EXTRAPOLATE, o, lam) for o in ("adamw", "muon") for lam in (0.25, 1.0)),
            ("2bw+extrapolate", "muon", 0.5),
        ),
        extrapolations_every_depth=tuple((EXTRAPOLATE, o, 0.5) for o in ("adamw", "muon")),
        # the dial's fast end (M = P/4) with the middle λ under Muon: can the extrapolation
        # close a delay of several updates as it closes one?
        dial_extrapolations=(("muon", 0.25, 0.5),),
    ),
    # A deeper model and a shorter run: 16 blocks cut in halves (35 units, so 32 stages
    # exist), 1,000 updates, gpt-deep's recipe and windows; the reference rows and the best
    # few of gpt-deep, at 8 stages and at 32, one seed.
    "gpt-deeper": StudyConfig(
        "gpt-deeper",
        steps=1000,
        eval_every=250,
        methods=("gpipe", "xpipe", "pipeoptim", "2bw"),
        optimizers=("adamw",),
        stages=(8, 32),
        sweep_stages=8,
        **LM_RECIPE,
        pairs=(
            ("gpipe", "muon"),
            ("pipeoptim", "muon"),
            ("pipeoptim+nesterov", "muon"),
            ("gpipe", "basis-rotation"),
            ("pipeoptim", "basis-rotation"),
            ("xpipe", "muon"),
            ("2bw", "muon"),
        ),
        twins=("1f1b", "zb-h1"),
        **LM_DEPTH_ROWS,
        # the middle λ of gpt-deep's scan, at both depths
        extrapolations_every_depth=tuple((EXTRAPOLATE, o, 0.5) for o in ("adamw", "muon")),
    ),
}


def write_risk_tables(results: Path, path: Path) -> None:
    """Write the planner's tables to ``path`` from the report's ``results/risk_fit.json``."""
    fit = json.loads((results / "risk_fit.json").read_text())
    path.write_text(risk_tables_json(risk_tables_from_fit(fit)))


def run_part(
    config: StudyConfig,
    out: Path,
    part: str,
    *,
    workers: int,
    threads: int | None,
    stages: tuple[int, ...] | None = None,
) -> None:
    """Train ``part`` of ``config``'s study into ``out/runs.jsonl`` (resuming), Muon and
    AdamW rows first, the longest first within them, with progress on stderr; ``stages``:
    only the runs at those depths (None: every depth)."""
    check_model(out, config.model)
    specs, notes = part_specs(config, out, part, one_step=ONE_STEP)
    specs = [s for s in specs if stages is None or s.stages in stages]
    for note in notes:
        print(f"{config.model}, part {part}: left out {note}", flush=True)
    done = {r.spec.key for r in load_records(out / "runs.jsonl")}
    todo = [s for s in dict.fromkeys(specs) if s.key not in done]
    guess = estimated_seconds(todo, load_records(out / "runs.jsonl"), workers)
    print(
        f"{config.model}, part {part}: {len(todo)} runs to do, {len(specs) - len(todo)} on "
        f"file; estimated {guess / 60:.0f} min on {workers} workers (from the measured "
        f"seconds per unit of relative_cost of the runs on file: an estimate)",
        flush=True,
    )
    run_specs(
        specs,
        out / "runs.jsonl",
        workers=workers,
        threads=threads,
        progress=print_progress,
        order=part_order(("muon", "adamw")),
    )


def depths(config: StudyConfig, stages: str | None) -> tuple[int, ...]:
    """The comma-separated depths ``stages`` of ``config``'s own (None: all of them), so that a
    part can be trained a depth at a time; the refusal names the depths it has."""
    if stages is None:
        return config.stages
    wanted = tuple(int(p) for p in stages.split(",") if p.strip())
    unknown = sorted(set(wanted) - set(config.stages))
    if not wanted or unknown:
        raise SystemExit(
            f"--stages {stages!r}: {config.model} trains at {list(config.stages)} stages; "
            f"name some of those, e.g. --stages {config.stages[0]}"
        )
    return wanted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", default="mlp,cnn,gpt,gpt-deep,gpt-deeper", help="comma-separated"
    )
    parser.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods to train in place of each study's own (e.g. "
        "gpipe,dualpipev,interleaved-zb); default: the study's",
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument(
        "--part",
        choices=PARTS,
        default=None,
        help="train one resumable part of the study (its rows at the rates on file; "
        "equal-time last, from the rows it compares), then write the report; default: the "
        "whole grid but equal-time",
    )
    parser.add_argument(
        "--stages",
        default=None,
        help="with --part: comma-separated depths to train now, of each study's own (e.g. "
        "8,16); the report still covers every depth. Default: all of them",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--tables",
        type=Path,
        default=packaged_path(),
        help="where a report of every model writes the planner's risk tables",
    )
    args = parser.parse_args()
    models = args.models.split(",")
    configs = [
        STUDIES[m] if args.methods is None else with_methods(STUDIES[m], args.methods)
        for m in models
    ]
    for model, config in zip(models, configs, strict=True):
        out = args.out / model
        if args.report_only:
            continue
        start = time.perf_counter()
        if args.part is None:
            if args.stages is not None:
                raise SystemExit("--stages trains a part a depth at a time; give --part too")
            run_study(config, out, workers=args.workers, threads=args.threads)
        else:
            run_part(
                config,
                out,
                args.part,
                workers=args.workers,
                threads=args.threads,
                stages=depths(config, args.stages),
            )
        print(f"{model}: {args.part or 'study'} ran in {time.perf_counter() - start:.0f} s")
    write_study_report(args.out, configs)
    if set(models) == set(STUDIES) and args.methods is None:
        write_risk_tables(args.out, args.tables)
        print(f"wrote the planner's risk tables to {args.tables}")
    else:
        print(
            f"left the planner's risk tables ({args.tables}) as they are: they are fitted "
            f"over every model; report all of them ({','.join(STUDIES)}), without --methods, to "
            f"rewrite them"
        )


if __name__ == "__main__":
    main()
