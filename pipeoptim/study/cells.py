"""The study's run records grouped into cells, and the vocabulary every part of the report
shares: which methods are rows, which learning rates were trained, which way a metric is
better.

A cell is every seed of one (method, optimizer, lr, stages); the tables
(:mod:`pipeoptim.study.tables`), the time to target and risk fit
(:mod:`pipeoptim.study.targets`) and the curves (:mod:`pipeoptim.study.plots`) all read
cells, so they are defined once, here.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pipeoptim.plan.methods import METHODS
from pipeoptim.plan.risk import join_row, parse_row, row_label
from pipeoptim.study.grid import StudyConfig
from pipeoptim.study.runs import MODEL_METRIC, RunRecord, split_label

__all__ = [
    "Cell",
    "aggregate",
    "higher_is_better",
    "method_labels",
    "rate_sets",
    "row_micro_batches",
    "schedule_of",
    "synchronous_label",
]


@dataclass(frozen=True)
class Cell:
    """Every seed of one (method, optimizer, lr, stages)."""

    method: str
    optimizer: str
    lr: float
    stages: int
    records: tuple[RunRecord, ...]

    @property
    def finished(self) -> list[RunRecord]:
        return [r for r in self.records if r.diverged_at is None and r.final is not None]

    @property
    def diverged(self) -> int:
        return len(self.records) - len(self.finished)

    def stat(self, pick: Callable[[RunRecord], float]) -> tuple[float, float]:
        """Mean and (sample) standard deviation over the finished seeds."""
        values = [pick(r) for r in self.finished]
        values = [v for v in values if math.isfinite(v)]
        if not values:
            return math.nan, math.nan
        return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan

    @property
    def final_test_loss(self) -> float:
        """Mean final test loss over the finished seeds (nan: none finished)."""
        return self.stat(lambda r: r.final.test_loss if r.final else math.nan)[0]


def aggregate(records: Iterable[RunRecord]) -> dict[tuple[str, str, float, int], Cell]:
    groups: dict[tuple[str, str, float, int], list[RunRecord]] = defaultdict(list)
    for r in records:
        s = r.spec
        groups[(s.label, s.optimizer, s.lr, s.stages)].append(r)
    return {k: Cell(*k, tuple(sorted(v, key=lambda r: r.spec.seed))) for k, v in groups.items()}


def higher_is_better(model: str) -> bool:
    return MODEL_METRIC[model] == "accuracy"


def rate_sets(
    config: StudyConfig, rates: dict[str, tuple[float, float | None]]
) -> list[tuple[str, dict[str, float]]]:
    """The learning rates every method trained at, as (title, optimizer -> lr)."""
    sets = [("chosen rate", {o: rates[o][0] for o in config.optimizers})]
    if config.high_rate:
        high = {o: h for o in config.optimizers if (h := rates[o][1]) is not None}
        if high:
            sets.append(("higher rate", high))
    for opt, extra in config.extra_rates.items():
        for lr in extra:
            sets.append((f"{opt} lr={lr:g}", {opt: lr}))
    return sets


def method_labels(config: StudyConfig) -> list[str]:
    """Table rows: every method, the predicted-backward variants, the other optimizers, the
    dial's rows (each M it trains at some depth), the extrapolation's (each λ) and the
    dial's with the extrapolation (each M and λ)."""
    first = config.optimizers[0]
    dial = sorted({m for p in config.stages for m in config.dial_counts(p)}) if config.dial else []
    extrapolated = dict.fromkeys((*config.extrapolations_every_depth, *config.extrapolations))
    return [
        *config.methods,
        *(f"{m}+Ŵbackward" for m in config.variants),
        *(f"{m} ({o})" for m, o in config.pairs),
        *(
            row_label(config.dial_method, config.trained_as(o), micro_batches=m)
            for o in config.dial
            for m in dial
        ),
        *(
            row_label(method, None if o == first else o, extrapolation=lam)
            for method, o, lam in sorted(extrapolated, key=lambda r: (r[0], r[1], r[2]))
        ),
        *dict.fromkeys(
            row_label(
                config.dial_extrapolated_method,
                config.trained_as(o),
                micro_batches=config.dial_count(p, share),
                extrapolation=lam,
            )
            for o, share, lam in config.dial_extrapolations
            for p in sorted(config.stages)
        ),
    ]


def row_micro_batches(label: str, stages: int) -> int:
    """Micro-batches per update of row ``label`` at ``stages``: its setting (a dial row's
    M), else its method's default."""
    m = parse_row(label).micro_batches
    return m if m is not None else METHODS[schedule_of(label)].default_micro_batches_at(stages)


def synchronous_label(label: str, method: str = "gpipe") -> str:
    """The synchronous row a row is judged against: gpipe (or ``method``, a twin) under the
    same optimizer, ``gpipe (muon)`` for ``pipeoptim+nesterov (muon)`` (docs/design.md,
    "Comparing asynchronous with synchronous training")."""
    return join_row(method, split_label(label)[1])


def schedule_of(label: str) -> str:
    """The registered method a row label runs (``pipeoptim+Ŵbackward``, ``pipeoptim
    (nadam)`` and ``pipeoptim+pipemare`` all follow a registered schedule)."""
    name = parse_row(label).method
    return name if name in METHODS else name.split("+")[0]
