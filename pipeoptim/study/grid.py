"""The study's grid: a learning-rate sweep on gpipe, then every method at the chosen rates.

Rates: for each optimizer, the sweep trains gpipe (synchronous, so the rate is the
model's, not the method's) with each candidate rate on seed 0 and keeps the one with the
best final test metric; every method then trains at that rate and, where
``StudyConfig.high_rate`` is set, at the next candidate above it (where staleness bites).
Every method of a model sees the same samples per update and the same number of updates.

Runs go to worker processes (one thread each) and are appended to ``runs.jsonl`` as they
finish, so an interrupted study resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.methods import METHODS
from pipeoptim.plan.optimizer_families import FAMILIES, find_family
from pipeoptim.plan.risk import parse_row
from pipeoptim.study.runs import MODEL_METRIC, RunRecord, RunSpec, run_one
from pipeoptim.study.variants import family_of, optimizer_options

__all__ = [
    "ALL_METHODS",
    "DEFAULT_RATES",
    "StudyConfig",
    "check_model",
    "choose_rates",
    "load_records",
    "main_specs",
    "relative_cost",
    "run_specs",
    "run_study",
    "sweep_specs",
    "with_methods",
]

ALL_METHODS = ("gpipe", "1f1b", "zb-h1", "pipedream", "2bw", "spectrain", "xpipe", "pipeoptim")
"""The methods a study trains by default: every method with one stage per rank (zb-h1 is in
for its time to accuracy, the synchronous rival's). interleaved-1f1b, zb-v, dualpipev and
interleaved-zb train when named (``StudyConfig.methods``, :func:`with_methods`, or
``examples/convergence/run.py --methods``); their rows equal gpipe's, the same updates."""
PREDICTING = frozenset(name for name, m in METHODS.items() if m.predicts)
"""Methods whose forward runs on predicted weights (the closure is measured for them)."""
DEFAULT_RATES: dict[str, tuple[float, ...]] = {
    name: family.study_lrs for name, family in FAMILIES.items() if family.study_lrs
}
"""The learning rates the study sweeps per family it studies (each family's ``study_lrs``)."""


@dataclass(frozen=True)
class StudyConfig:
    """What one model's study trains."""

    model: str
    """Built-in model name."""
    steps: int
    """Mini-batches per run (equal for every method)."""
    eval_every: int
    """Mini-batches between test evaluations (each drains the pipeline, as a checkpoint
    does: the first P−1 mini-batches after it run with a smaller s)."""
    methods: tuple[str, ...] = ALL_METHODS
    optimizers: tuple[str, ...] = ("sgd", "adam", "adamw")
    stages: tuple[int, ...] = (4, 8)
    seeds: int = 3
    """Seeds of every main run (weights and data order)."""
    batch_size: int = 32
    rates: dict[str, tuple[float, ...]] = field(default_factory=lambda: dict(DEFAULT_RATES))
    """Candidate learning rates per optimizer, ascending."""
    high_rate: bool = True
    """Also train every method at the candidate above the sweep's best."""
    high_rate_seeds: int | None = None
    """Seeds at the high rate (None: ``seeds``)."""
    sweep_stages: int = 4
    eval_samples: int | None = None
    """Evaluate on the first this many test samples (None: all)."""
    extra_rates: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Further rates per optimizer at which every method also trains (``high_rate_seeds``
    seeds), e.g. a lower one where gpipe's best rate stalls the asynchronous methods."""
    steps_by_optimizer: dict[str, int] = field(default_factory=dict)
    """Longer (or shorter) runs for some optimizers, e.g. where gpipe needs more epochs to
    reach the target and the curves must run 3x that; still equal for every method."""
    warmup: float = 0.0
    """Share of every run in a linear learning-rate warm-up (0: none)."""
    final_lr: float = 1.0
    """Rate at the end of a cosine decay after the warm-up, as a share of the rate (1: a
    constant rate after the warm-up)."""
    grad_clip: float | None = None
    """Gradient-norm clipping of every stage (None: none)."""
    weight_decay: float = 0.0
    """The optimizer's weight decay (decoupled for AdamW and NAdam)."""
    pairs: tuple[tuple[str, str], ...] = ()
    """(method, optimizer) also trained in the column of the first optimizer at its chosen
    rate, as a row ``method (optimizer)``: NAdam and Muon, whose prediction rules are
    PipeOptim's own, without every method trained under them."""
    pairs_only_at_sweep_depth: tuple[str, ...] = ()
    """Pair rows (``method (optimizer)`` labels) trained only at ``sweep_stages``: rows
    that answer a question at one depth and would cost a run at every other."""
    twins: tuple[str, ...] = ()
    """Methods not trained because they make gpipe's updates exactly (a flush with the same
    micro-batches: 1f1b, zb-h1); their time to target is gpipe's samples times their own
    time per sample."""
    repeat: tuple[str, ...] = ()
    """Methods (or pair rows) trained with ``repeat_seeds`` seeds at ``repeat_stages``."""
    repeat_stages: int = 8
    repeat_seeds: int = 1
    variants: tuple[str, ...] = ()
    """Predicting methods also trained with ``predicted_backward`` (beyond the paper: input
    gradients through Ŵ as well), at every rate, depth and seed of the main runs."""
    dial: tuple[str, ...] = ()
    """Optimizers under which ``dial_method`` also trains with M = P·share micro-batches per
    update for each of ``dial_shares``, at every depth, in the first optimizer's column at
    its chosen rate (rows ``pipeoptim M=2``, ``pipeoptim M=2 (muon)``): the dial between
    PipeOptim (M = 1) and XPipe (M = P). An M equal to the method's own default is its
    plain row and is not trained twice."""
    dial_method: str = "pipeoptim"
    """The asynchronous method the dial's rows train."""
    dial_shares: tuple[float, ...] = (0.25, 0.5)
    """The dial's micro-batches per update as shares of the depth (M = round(P·share), at
    least 1)."""
    extrapolations: tuple[tuple[str, str, float], ...] = ()
    """(method, optimizer, λ) rows of the extrapolation correction (``Pipeline(
    extrapolation=λ)``) trained at ``sweep_stages`` only, in the first optimizer's column at
    its chosen rate (``xpipe+extrapolate λ=0.25 (muon)``): the λ scan."""
    extrapolations_every_depth: tuple[tuple[str, str, float], ...] = ()
    """(method, optimizer, λ) rows trained at every depth, as ``extrapolations``: the λ
    carried to depth."""
    dial_extrapolations: tuple[tuple[str, float, float], ...] = ()
    """(optimizer, share, λ) rows of the dial with the extrapolation correction:
    ``dial_method+extrapolate`` at M = round(P·share) micro-batches per update and λ, at
    every depth, in the first optimizer's column at its chosen rate (``pipeoptim+extrapolate
    M=4 λ=0.5 (muon)``): the dial's fast settings, whose stages lag several updates, with
    the short-delay correction."""
    equal_time: tuple[str, ...] = ()
    """Rows, as ``method`` or ``method (optimizer)`` without settings, that also train at
    equal time (:mod:`pipeoptim.study.equal_time`): the row itself, each of its dial rows
    (``pipeoptim (muon)`` names ``pipeoptim M=2 (muon)`` too), and of its extrapolation rows
    the one with the lowest final test loss at each depth; seed 0, wherever the row trained."""
    equal_time_reference: str = "zb-h1"
    """The synchronous method whose simulated time for the study's updates (under the row's
    optimizer) is the equal-time budget; a twin of gpipe, so its loss in that budget is
    gpipe's final loss."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.optimizers) - set(self.rates))
        if unknown:
            raise RuntimeConfigError(
                f"no candidate learning rates for optimizer(s) {unknown}; give them in rates "
                f"(known: {sorted(self.rates)})"
            )
        for name, value in (
            ("steps", self.steps),
            ("eval_every", self.eval_every),
            ("seeds", self.seeds),
            ("batch_size", self.batch_size),
        ):
            if value < 1:
                raise RuntimeConfigError(f"{name} must be at least 1 (got {value})")
        if not 0.0 <= self.warmup < 1.0:
            raise RuntimeConfigError(
                f"warmup is a share of the run in [0, 1) (got {self.warmup}); e.g. 0.1"
            )
        if not 0.0 < self.final_lr <= 1.0:
            raise RuntimeConfigError(
                f"final_lr is a share of the rate in (0, 1] (got {self.final_lr}); e.g. 0.1, "
                f"or 1 for no decay"
            )
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise RuntimeConfigError(
                f"grad_clip must be positive (got {self.grad_clip}); e.g. 1.0, or leave it out"
            )
        extrapolated = (*self.extrapolations, *self.extrapolations_every_depth)
        unknown_methods = sorted(
            {
                *self.methods,
                *self.twins,
                *(m for m, _ in self.pairs),
                *([self.dial_method] if self.dial else []),
                *(m for m, _, _ in extrapolated),
                *([self.dial_extrapolated_method] if self.dial_extrapolations else []),
            }
            - set(METHODS)
        )
        if unknown_methods:
            raise RuntimeConfigError(
                f"unknown method(s) {unknown_methods}; choose from {', '.join(METHODS)}"
            )
        bad = sorted(set(self.variants) - PREDICTING)
        if bad:
            raise RuntimeConfigError(
                f"variants {bad} do not predict weights; the predicted-backward variant "
                f"applies to {sorted(PREDICTING)}"
            )
        for _, optimizer in self.pairs:
            family, _ = optimizer_options(optimizer)  # its settings read, or why not
            if find_family(family) is None:
                raise RuntimeConfigError(
                    f"pair optimizer {optimizer!r} names no optimizer family; choose from "
                    f"{', '.join(FAMILIES)}, with settings as 'nadam β1=0.99'"
                )
        pair_labels = {f"{m} ({o})" for m, o in self.pairs}
        stray = sorted(set(self.pairs_only_at_sweep_depth) - pair_labels)
        if stray:
            raise RuntimeConfigError(
                f"pairs_only_at_sweep_depth names rows that are not pairs: {stray}; a pair "
                f"row is 'method (optimizer)', one of {sorted(pair_labels)}"
            )
        if self.pairs_only_at_sweep_depth and self.sweep_stages not in self.stages:
            raise RuntimeConfigError(
                f"pairs_only_at_sweep_depth trains rows at sweep_stages={self.sweep_stages}, "
                f"which is not among stages {list(self.stages)}; add it to stages"
            )
        lost = sorted(set(self.repeat) & set(self.pairs_only_at_sweep_depth))
        if lost and self.repeat_seeds > 1 and self.repeat_stages != self.sweep_stages:
            raise RuntimeConfigError(
                f"repeat rows {lost} train only at sweep_stages={self.sweep_stages}, but "
                f"repeat_stages={self.repeat_stages}: their seed 0 would be missing there; "
                f"set repeat_stages to {self.sweep_stages} or train them at every depth"
            )
        for _, share, lam in self.dial_extrapolations:
            if not (share > 0.0 and math.isfinite(lam) and lam >= 0.0):
                raise RuntimeConfigError(
                    f"dial_extrapolations are (optimizer, share, λ) with a share of the depth "
                    f"above 0 and λ >= 0 (got share {share}, λ {lam}); e.g. ('muon', 0.25, 0.5)"
                )
        if any(not share > 0.0 for share in self.dial_shares):
            raise RuntimeConfigError(
                f"dial_shares are shares of the depth above 0 (got {list(self.dial_shares)}); "
                f"e.g. (0.25, 0.5) for M = P/4 and P/2"
            )
        if extrapolated and self.sweep_stages not in self.stages:
            raise RuntimeConfigError(
                f"extrapolations train at sweep_stages={self.sweep_stages}, which is not "
                f"among stages {list(self.stages)}; add it to stages"
            )
        if self.model not in MODEL_METRIC:
            raise RuntimeConfigError(
                f"the study knows the test metric of {sorted(MODEL_METRIC)} (got {self.model!r})"
            )

    def spec(
        self,
        method: str,
        optimizer: str,
        lr: float,
        stages: int,
        seed: int,
        predicted_backward: bool = False,
        trained_optimizer: str | None = None,
        micro_batch_count: int | None = None,
        extrapolation: float | None = None,
    ) -> RunSpec:
        return RunSpec(
            self.model,
            method,
            optimizer,
            lr,
            stages,
            seed,
            self.steps_by_optimizer.get(optimizer, self.steps),
            self.eval_every,
            self.batch_size,
            closure=seed == 0 and method in PREDICTING,
            eval_samples=self.eval_samples,
            weight_decay=self.weight_decay,
            predicted_backward=predicted_backward,
            warmup=self.warmup,
            final_lr=self.final_lr,
            grad_clip=self.grad_clip,
            trained_optimizer=trained_optimizer,
            micro_batch_count=micro_batch_count,
            extrapolation=extrapolation,
        )

    def trained_as(self, optimizer: str) -> str | None:
        """A row's ``trained_optimizer`` for ``optimizer``: None for the first optimizer
        (its rows carry no optimizer in their names), else the optimizer."""
        return None if optimizer == self.optimizers[0] else optimizer

    @property
    def dial_extrapolated_method(self) -> str:
        """The method of ``dial_extrapolations``' rows: the dial's with the extrapolation."""
        return f"{self.dial_method}+extrapolate"

    @staticmethod
    def dial_count(stages: int, share: float) -> int:
        """The dial's micro-batches per update at ``stages`` for a ``share`` of the depth:
        round(P·share), at least 1."""
        return max(1, round(stages * share))

    def dial_counts(self, stages: int) -> list[int]:
        """The dial's micro-batches per update at ``stages`` stages, ascending, without the
        method's own default (its plain row)."""
        default = METHODS[self.dial_method].default_micro_batches_at(stages)
        counts = {self.dial_count(stages, share) for share in self.dial_shares}
        return sorted(counts - {default})

    def extrapolation_rows(self, stages: int) -> list[tuple[str, str, float]]:
        """The (method, optimizer, λ) extrapolation rows trained at ``stages`` stages."""
        rows = list(self.extrapolations_every_depth)
        if stages == self.sweep_stages:
            rows += [r for r in self.extrapolations if r not in rows]
        return rows

    def setting_specs(self, lr: float, stages: int, seed: int) -> list[RunSpec]:
        """The dial's and the extrapolation's rows at ``stages`` (first optimizer's column)."""
        first = self.optimizers[0]
        specs = [
            self.spec(
                self.dial_method,
                first,
                lr,
                stages,
                seed,
                trained_optimizer=self.trained_as(o),
                micro_batch_count=m,
            )
            for o in self.dial
            for m in self.dial_counts(stages)
        ]
        specs += [
            self.spec(
                method,
                first,
                lr,
                stages,
                seed,
                trained_optimizer=self.trained_as(o),
                extrapolation=lam,
            )
            for method, o, lam in self.extrapolation_rows(stages)
        ]
        specs += [
            self.spec(
                self.dial_extrapolated_method,
                first,
                lr,
                stages,
                seed,
                trained_optimizer=self.trained_as(o),
                micro_batch_count=self.dial_count(stages, share),
                extrapolation=lam,
            )
            for o, share, lam in self.dial_extrapolations
        ]
        return specs


def with_methods(config: StudyConfig, names: str) -> StudyConfig:
    """``config`` training the comma-separated ``names`` (any registered method, those
    that place several stages per rank included) in place of its own methods."""
    methods = tuple(name.strip() for name in names.split(",") if name.strip())
    if not methods:
        raise RuntimeConfigError(
            f"--methods names no method (got {names!r}); give names by commas, e.g. gpipe,dualpipev"
        )
    return dataclasses.replace(config, methods=methods)


def sweep_specs(config: StudyConfig) -> list[RunSpec]:
    """gpipe on seed 0 at every candidate rate of every optimizer."""
    return [
        config.spec("gpipe", opt, lr, config.sweep_stages, 0)
        for opt in config.optimizers
        for lr in config.rates[opt]
    ]


def _score(record: RunRecord) -> float:
    """Higher is better: accuracy, or minus perplexity; a diverged run scores -inf."""
    last = record.final
    if record.diverged_at is not None or last is None or not math.isfinite(last.test_metric):
        return -math.inf
    higher = MODEL_METRIC[record.spec.model] == "accuracy"
    return last.test_metric if higher else -last.test_metric


def choose_rates(
    config: StudyConfig, records: Iterable[RunRecord]
) -> dict[str, tuple[float, float | None]]:
    """Per optimizer: (best rate of the sweep, the next candidate above it or None)."""
    by_key = {r.spec.key: r for r in records}
    out: dict[str, tuple[float, float | None]] = {}
    for opt in config.optimizers:
        candidates = config.rates[opt]
        scored = []
        for spec in (config.spec("gpipe", opt, lr, config.sweep_stages, 0) for lr in candidates):
            if spec.key not in by_key:
                raise RuntimeConfigError(f"the sweep run {spec.key} is missing; run the sweep")
            rec = by_key[spec.key]
            final = rec.final
            scored.append((_score(rec), -(final.train_loss if final else math.inf), spec.lr))
        best = max(scored)[2]
        i = candidates.index(best)
        out[opt] = (best, candidates[i + 1] if i + 1 < len(candidates) else None)
    return out


def main_specs(config: StudyConfig, rates: dict[str, tuple[float, float | None]]) -> list[RunSpec]:
    """Every method x optimizer x depth x seed at the chosen rate (and the high rate); the
    pair rows at the first optimizer's chosen rate, at every depth or, for those in
    ``pairs_only_at_sweep_depth``, at ``sweep_stages``; the dial's and the extrapolation's
    rows there too (:meth:`StudyConfig.setting_specs`); the repeated rows' further seeds."""
    specs: list[RunSpec] = []
    for opt in config.optimizers:
        best, high = rates[opt]
        plans = [(best, config.seeds)]
        if config.high_rate and high is not None:
            plans.append((high, config.high_rate_seeds or config.seeds))
        plans += [
            (lr, config.high_rate_seeds or config.seeds) for lr in config.extra_rates.get(opt, ())
        ]
        for lr, seeds in plans:
            for p in config.stages:
                for seed in range(seeds):
                    specs.extend(config.spec(m, opt, lr, p, seed) for m in config.methods)
                    specs.extend(
                        config.spec(m, opt, lr, p, seed, predicted_backward=True)
                        for m in config.variants
                    )
                    if opt == config.optimizers[0] and lr == best:
                        specs.extend(
                            config.spec(m, opt, lr, p, seed, trained_optimizer=o)
                            for m, o in config.pairs
                            if p == config.sweep_stages
                            or f"{m} ({o})" not in config.pairs_only_at_sweep_depth
                        )
                        specs.extend(config.setting_specs(lr, p, seed))
    first = config.optimizers[0]
    best = rates[first][0]
    for seed in range(1, config.repeat_seeds):
        for label in config.repeat:
            row = parse_row(label)
            specs.append(
                config.spec(
                    row.method,
                    first,
                    best,
                    config.repeat_stages,
                    seed,
                    predicted_backward=row.predicted_backward,
                    trained_optimizer=row.optimizer,
                    micro_batch_count=row.micro_batches,
                    extrapolation=row.extrapolation,
                )
            )
    return specs


def relative_cost(spec: RunSpec) -> float:
    """A run's cost relative to a one-micro-batch AdamW run of the same steps, from the study's
    measured run times on CPU: every micro-batch forward and backward adds a fixed overhead
    per stage, and Muon's Newton-Schulz iterations add about 40 %, charged to every family
    whose step cost follows the matrix shapes (only the order matters: it is what
    ``run_specs`` schedules the longest runs first by)."""
    micro = spec.micro_batches
    per_step = 1.0 + 0.25 * (micro - 1) * max(1, spec.stages) / 16
    family = find_family(family_of(spec.trained_optimizer or spec.optimizer))
    if family is not None and family.shaped_step:
        per_step += 0.4
    return per_step * spec.steps


def load_records(path: Path) -> list[RunRecord]:
    """The records of ``runs.jsonl``, one per configuration (a torn line, from an
    interrupted study, is skipped: that run is simply done again)."""
    if not path.exists():
        return []
    out: dict[str, RunRecord] = {}
    for line in path.read_text().splitlines():
        try:
            record = RunRecord.from_dict(json.loads(line))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        out[record.spec.key] = record  # a run done twice (two studies at once): the last
    return list(out.values())


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def run_specs(
    specs: Sequence[RunSpec],
    path: Path,
    *,
    workers: int = 1,
    threads: int | None = None,
    progress: Callable[[RunRecord, int, int], None] | None = None,
    order: Callable[[RunSpec], Any] | None = None,
) -> list[RunRecord]:
    """Run the specs not yet in ``path`` (appending each record as it finishes); returns
    the records of every spec, old and new. ``order``: a sort key of the runs to do
    (default: the longest first, :func:`relative_cost`)."""
    done = {r.spec.key: r for r in load_records(path)}
    # the longest first, so two workers end together instead of one finishing a long run
    # alone (a stable sort: equal estimates keep the grid's order)
    todo = sorted(
        (s for s in dict.fromkeys(specs) if s.key not in done),
        key=order or (lambda s: -relative_cost(s)),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    threads = threads or max(1, (os.cpu_count() or 1) // max(1, workers))
    finished = 0
    torn = False
    if path.exists() and path.stat().st_size > 0:
        with path.open("rb") as f:
            f.seek(-1, os.SEEK_END)  # the last byte only: the file can be long
            torn = f.read(1) != b"\n"
    with path.open("a") as out:
        if torn:  # end an interrupted write's line, so the next record starts clean
            out.write("\n")

        def keep(record: RunRecord) -> None:
            nonlocal finished
            out.write(json.dumps(record.to_dict()) + "\n")
            out.flush()
            done[record.spec.key] = record
            finished += 1
            if progress is not None:
                progress(record, finished, len(todo))

        if workers <= 1:
            _init_worker(threads)
            for spec in todo:
                keep(run_one(spec))
        else:
            with ProcessPoolExecutor(
                workers,
                mp_context=get_context("spawn"),
                initializer=_init_worker,
                initargs=(threads,),
            ) as pool:
                pending: set[Future[RunRecord]] = {pool.submit(run_one, s) for s in todo}
                while pending:
                    ready, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in ready:
                        keep(fut.result())
    return [done[s.key] for s in specs]


def print_progress(record: RunRecord, finished: int, total: int) -> None:
    final = record.final
    metric = f"{final.test_metric:.4g}" if final else "-"
    stop = f", diverged at step {record.diverged_at}" if record.diverged_at is not None else ""
    print(
        f"[{finished}/{total}] {record.spec.key}: test {metric} in {record.seconds:.1f} s{stop}",
        file=sys.stderr,
        flush=True,
    )


def model_fingerprint(model: str) -> dict[str, object]:
    """What a run key does not say of a built-in model: its units, weights and samples (a
    changed definition, e.g. another context, makes old records another model's)."""
    from pipeoptim.workloads.loader import build_model

    layers, data = build_model(model, 0)
    return {
        "model": model,
        "units": len(layers),
        "parameters": sum(p.numel() for layer in layers for p in layer.parameters()),
        "sample_shape": list(data.train_x.shape[1:]),
        "train_samples": len(data.train_x),
    }


def check_model(out_dir: Path, model: str) -> None:
    """Refuse to add runs to ``out_dir`` when its records were trained on another definition
    of ``model`` (``model.json`` there); write it where there is none."""
    path = out_dir / "model.json"
    now = model_fingerprint(model)
    if path.exists():
        before = json.loads(path.read_text())
        if before != now:
            raise RuntimeConfigError(
                f"{out_dir} holds runs of {model} as it was defined then ({before}); it is now "
                f"{now}, so new runs would mix with runs of another model. Move {out_dir} "
                f"away or give another output folder"
            )
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(now, indent=1) + "\n")


def run_study(
    config: StudyConfig,
    out_dir: Path,
    *,
    workers: int = 1,
    threads: int | None = None,
    quiet: bool = False,
) -> tuple[dict[str, tuple[float, float | None]], list[RunRecord]]:
    """Sweep, choose the rates, run every method; records go to ``out_dir/runs.jsonl``."""
    path = out_dir / "runs.jsonl"
    check_model(out_dir, config.model)
    show = None if quiet else print_progress
    if all(len(config.rates[opt]) == 1 for opt in config.optimizers):
        # one candidate per optimizer: the rates are known, so the sweep's runs (main runs
        # too) go into one pool with the rest instead of leaving a worker idle
        rates: dict[str, tuple[float, float | None]] = {
            opt: (config.rates[opt][0], None) for opt in config.optimizers
        }
        first = sweep_specs(config)
        every = run_specs(
            [*first, *main_specs(config, rates)],
            path,
            workers=workers,
            threads=threads,
            progress=show,
        )
        return rates, every[len(first) :]
    sweep = run_specs(sweep_specs(config), path, workers=workers, threads=threads, progress=show)
    rates = choose_rates(config, sweep)
    main = run_specs(
        main_specs(config, rates), path, workers=workers, threads=threads, progress=show
    )
    return rates, main
