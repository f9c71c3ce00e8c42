"""``pipeoptim compare``: the convergence study of every method on one built-in model.

Sweeps gpipe's learning rate per optimizer, trains every method at the best rate (and the
next one up) at each depth and seed, all stages in one process, then writes the report:
``README.md`` (final tables, prediction closure, time to target), ``curves.html`` and
``risk_fit.json``. Runs are appended to ``OUT/<model>/runs.jsonl``; rerunning resumes.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from pipeoptim.commands.common import check_number
from pipeoptim.errors import OutputPathError, RuntimeConfigError
from pipeoptim.plan.methods import METHODS
from pipeoptim.study.grid import ALL_METHODS, DEFAULT_RATES, StudyConfig

STUDIED = tuple(DEFAULT_RATES)

_EPILOG = """\
examples:
  pipeoptim compare --model mlp --out study            # 7 methods x 3 optimizers x P=4,8 x 3 seeds
  pipeoptim compare --model cnn --optimizers adam --stages 8 --seeds 2 --out study
  pipeoptim compare --model mlp --methods gpipe,pipeoptim --lr-candidates adam=1e-3,2e-3 --out s

every stage of a run trains in this process (the local transport, bitwise equal to the
distributed run): P stages are emulated on one device. The full digits study
(examples/convergence/run.py) takes about half an hour on 2 cores.
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "compare",
        help="train every method on one model and compare accuracy, loss and time to target",
        description=__doc__.split("\n\n")[0] + ".",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="mlp",
        help="mlp, cnn, transformer, gpt, gpt-deep or gpt-deeper (default mlp)",
    )
    p.add_argument(
        "--methods",
        default=",".join(ALL_METHODS),
        help=f"comma-separated, any of {', '.join(METHODS)} (default {','.join(ALL_METHODS)})",
    )
    p.add_argument(
        "--optimizers", default="sgd,adam,adamw", help="comma-separated, of " + ", ".join(STUDIED)
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=0.0,
        help="share of each run in a linear lr warm-up, e.g. 0.1 (default 0: none)",
    )
    p.add_argument(
        "--final-lr",
        type=float,
        default=1.0,
        help="cosine-decay the rate after the warm-up to this share of it, e.g. 0.1 "
        "(default 1: constant)",
    )
    p.add_argument("--grad-clip", type=float, default=None, help="clip each stage's grad norm")
    p.add_argument("--weight-decay", type=float, default=0.0, help="optimizer weight decay")
    p.add_argument("--stages", default="4,8", help="depths, comma-separated (default 4,8)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per configuration (default 3)")
    p.add_argument("--epochs", type=int, default=15, help="epochs per run (default 15)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per mini-batch")
    p.add_argument(
        "--eval-every", type=int, default=None, help="mini-batches between evaluations (1 epoch)"
    )
    p.add_argument(
        "--lr-candidates",
        action="append",
        default=[],
        metavar="OPT=LR,LR,...",
        help="rates the gpipe sweep tries for one optimizer, ascending (repeatable)",
    )
    p.add_argument(
        "--no-high-rate", action="store_true", help="skip the runs at the rate above the best"
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="hardware for the time to target: `pipeoptim profile` of the same model there "
        "(default: this machine, one thread per stage)",
    )
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="parallel runs")
    p.add_argument("--out", type=Path, required=True, help="folder for runs and the report")
    p.add_argument("--quiet", action="store_true", help="no line per finished run")
    p.set_defaults(func=run)


def _names(flag: str, text: str, allowed: tuple[str, ...] | None = None) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise RuntimeConfigError(f"{flag} needs at least one name (got {text!r})")
    if allowed is not None:
        bad = [n for n in names if n not in allowed]
        if bad:
            raise RuntimeConfigError(
                f"{flag}: unknown {', '.join(bad)}; choose from {', '.join(allowed)}"
            )
    return names


def _rates(entries: list[str], optimizers: tuple[str, ...]) -> dict[str, tuple[float, ...]]:
    """The candidate rates per optimizer: the defaults, replaced by each ``--lr-candidates``
    entry, which must name an optimizer the study trains and list its rates ascending."""
    rates = dict(DEFAULT_RATES)
    for entry in entries:
        opt, sep, values = entry.partition("=")
        opt = opt.strip()
        try:
            parsed = tuple(float(v) for v in values.split(","))
        except ValueError:
            parsed = ()
        if not sep or not parsed or any(not (v > 0 and math.isfinite(v)) for v in parsed):
            raise RuntimeConfigError(
                f"--lr-candidates takes OPT=LR,LR,... with positive finite rates (got "
                f"{entry!r}); e.g. --lr-candidates adam=5e-4,1e-3,2e-3"
            )
        if opt not in optimizers:
            raise RuntimeConfigError(
                f"--lr-candidates {entry} gives rates for {opt}, which this study does not "
                f"train (--optimizers {','.join(optimizers)}); add {opt} to --optimizers or "
                f"drop the entry"
            )
        ascending = tuple(sorted(set(parsed)))
        if parsed != ascending:
            raise RuntimeConfigError(
                f"--lr-candidates {entry}: the rates must be ascending, each once (got "
                f"{', '.join(f'{v:g}' for v in parsed)}); give {opt}="
                f"{','.join(f'{v:g}' for v in ascending)} (the rate above the sweep's best is "
                f"the next one in this order)"
            )
        rates[opt] = parsed
    return rates


def check_out_folder(out: Path) -> None:
    """Before any training: ``--out`` is, or can become, a writable folder (the study
    writes its runs and report files into it)."""
    try:
        if out.exists() and not out.is_dir():
            raise OutputPathError(
                f"--out {str(out)!r} is a file, not a folder; compare writes a folder (the "
                f"runs, README.md, curves.html, risk_fit.json): give a folder path, which is "
                f"created if missing"
            )
        existing = next(p for p in (out, *out.absolute().parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise OutputPathError(
                f"--out {str(out)!r}: cannot create or write it under {str(existing)!r}; give "
                f"a folder you can write"
            )
    except OSError as err:
        raise OutputPathError(
            f"--out {str(out)!r} cannot be used as a folder ({err.strerror or err}); choose "
            f"another path"
        ) from None


def config_from_args(args: argparse.Namespace) -> StudyConfig:
    from pipeoptim.workloads.loader import BUILTIN_MODELS, build_model

    for flag, value in (
        ("--seeds", args.seeds),
        ("--epochs", args.epochs),
        ("--batch-size", args.batch_size),
        ("--workers", args.workers),
    ):
        check_number(flag, value, minimum=1, example="1")
    if args.eval_every is not None:
        check_number("--eval-every", args.eval_every, minimum=1, example="44")
    if args.model not in BUILTIN_MODELS:
        raise RuntimeConfigError(
            f"compare trains a built-in model (got {args.model!r}); choose one of "
            f"{', '.join(BUILTIN_MODELS)}"
        )
    try:
        stages = tuple(int(v) for v in args.stages.split(","))
    except ValueError:
        stages = ()
    if not stages or min(stages) < 1:
        raise RuntimeConfigError(f"--stages takes depths >= 1 like 4,8 (got {args.stages!r})")
    _, data = build_model(args.model, 0)
    per_epoch = len(data.train_x) // args.batch_size
    if per_epoch < 1:
        raise RuntimeConfigError(
            f"model {args.model!r} has {len(data.train_x)} training samples, fewer than one "
            f"batch of {args.batch_size}; use a smaller --batch-size"
        )
    optimizers = _names("--optimizers", args.optimizers, STUDIED)
    return StudyConfig(
        args.model,
        steps=args.epochs * per_epoch,
        eval_every=args.eval_every or per_epoch,
        methods=_names("--methods", args.methods, tuple(METHODS)),
        optimizers=optimizers,
        stages=stages,
        seeds=args.seeds,
        batch_size=args.batch_size,
        rates=_rates(args.lr_candidates, optimizers),
        high_rate=not args.no_high_rate,
        sweep_stages=min(stages),
        warmup=args.warmup,
        final_lr=args.final_lr,
        grad_clip=args.grad_clip,
        weight_decay=args.weight_decay,
    )


def command_line(args: argparse.Namespace) -> str:
    """The ``pipeoptim compare`` command of ``args``, as the report names what produced it
    (every option that shapes the runs; not --workers, --quiet or the profile's path)."""
    parts = [
        "pipeoptim compare",
        f"--model {args.model}",
        f"--methods {args.methods}",
        f"--optimizers {args.optimizers}",
        f"--stages {args.stages}",
        f"--seeds {args.seeds}",
        f"--epochs {args.epochs}",
        f"--batch-size {args.batch_size}",
    ]
    if args.eval_every is not None:
        parts.append(f"--eval-every {args.eval_every}")
    for flag, value, default in (
        ("--warmup", args.warmup, 0.0),
        ("--final-lr", args.final_lr, 1.0),
        ("--weight-decay", args.weight_decay, 0.0),
    ):
        if value != default:
            parts.append(f"{flag} {value:g}")
    if args.grad_clip is not None:
        parts.append(f"--grad-clip {args.grad_clip:g}")
    for entry in args.lr_candidates:
        opt, _, values = entry.partition("=")
        parts.append(
            f"--lr-candidates {opt.strip()}={','.join(f'{float(v):g}' for v in values.split(','))}"
        )
    if args.no_high_rate:
        parts.append("--no-high-rate")
    if args.profile is not None:
        parts.append("--profile PROFILE")
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    from pipeoptim.study.grid import run_study
    from pipeoptim.study.report import write_study_report

    check_out_folder(args.out)
    config = config_from_args(args)
    profiles = None
    if args.profile is not None:  # checked before any training, not after the study
        from pipeoptim.plan.profile import Profile
        from pipeoptim.study.targets import check_profile

        profiles = {config.model: Profile.load(args.profile)}
        check_profile(profiles[config.model], config.model)
    start = time.perf_counter()
    rates, records = run_study(
        config, args.out / config.model, workers=args.workers, quiet=args.quiet
    )
    path = write_study_report(args.out, [config], profiles, produced_by=command_line(args))
    diverged = sum(r.diverged_at is not None for r in records)
    print(
        f"{len(records)} runs ({diverged} diverged) in {time.perf_counter() - start:.0f} s; "
        f"rates: " + ", ".join(f"{o} {b:g}" for o, (b, _) in rates.items()),
        file=sys.stderr,
    )
    print(path.read_text())
    print(f"wrote {path}, {args.out / 'curves.html'}, {args.out / 'risk_fit.json'}")
    return 0
