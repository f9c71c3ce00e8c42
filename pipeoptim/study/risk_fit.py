"""The study's risk fit: what the report writes to ``risk_fit.json`` and the planner's tables.

:class:`RiskFitParts` gathers, model by model, what the convergence-risk model is fitted
to (the samples-to-target points, the prediction closure, the corrections' gains, the
language model's losses at depth, and there each row's simulated speed over zb-h1's and its
loss at equal time); :meth:`RiskFitParts.fit` is ``risk_fit.json`` and
:func:`risk_tables_from_fit` turns that into the tables the planner reads from
``pipeoptim/plan/data/risk_tables.json`` (:mod:`pipeoptim.plan.risk_tables`).
:func:`study_risk_fit` is the report's risk part alone: no profiling or figure (the speeds
are simulated on the profiles kept beside the runs), so a test can check the package's
tables against the committed study in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeoptim.errors import PipeoptimError
from pipeoptim.plan.delay_risk import fit_risk_curves
from pipeoptim.plan.risk import (
    WITHIN,
    RiskFitPoint,
    closure_from_rows,
    fit_risk,
    gain_delay_table,
    gain_table,
)
from pipeoptim.plan.risk_tables import RiskTables, risk_tables_from_json
from pipeoptim.study.cells import Cell, aggregate, method_labels, synchronous_label
from pipeoptim.study.equal_time import EqualTimeResult, SecondsPerSample, equal_time_results
from pipeoptim.study.grid import StudyConfig, choose_rates, load_records, main_specs
from pipeoptim.study.runs import RunRecord, split_label
from pipeoptim.study.tables import closure_rows, gaps, peak_copies
from pipeoptim.study.targets import (
    Targets,
    correction_gains,
    gpipe_finals,
    kept_profiles,
    risk_points,
    seconds_per_sample_of,
)
from pipeoptim.study.variants import is_variant

__all__ = [
    "TABLES_META",
    "TARGETS",
    "RiskFitParts",
    "model_targets",
    "risk_tables_from_fit",
    "study_risk_fit",
]

TARGETS: dict[str, float | None] = {
    "mlp": 0.95,
    "cnn": 0.95,
    "transformer": 0.95,
    "gpt": 12.0,
    "gpt-deep": None,
    "gpt-deeper": None,
}
"""The metric a run must reach to count as trained: test accuracy for the digits models,
test perplexity (at most) for the language model; None: gpipe's own final test loss at
each depth plus the goal's 3 % (how soon a method gets where synchronous training gets)."""

TABLES_META: dict[str, Any] = {
    "about": "The convergence study's measured tables read by pipeoptim.plan.risk "
    "(see that module for what each means).",
    "produced_by": "python examples/convergence/run.py --report-only",
    "source": "examples/convergence/results/<model>/runs.jsonl of the models mlp, cnn, gpt, "
    "gpt-deep and gpt-deeper, through the report's risk_fit.json",
    "derived_from_committed_results": [
        "closure",
        "kappa",
        "risk_curve",
        "correction_gain",
        "correction_gain_delay",
        "depth_excess",
        "depth_copies",
        "depth_excess_first",
        "depth_speed",
        "depth_equal_time",
    ],
    "not_derived": [],
}
"""What ``risk_tables.json`` says of itself: every table is derived from committed runs."""

Rates = dict[str, tuple[float, float | None]]
"""Per optimizer: the rate the sweep chose and the next one above it (or None)."""

Cells = dict[tuple[str, str, float, int], Cell]
"""A model's runs grouped by (method label, optimizer, rate, stages)."""


def model_targets(config: StudyConfig, cells: Cells, rates: Rates) -> Targets:
    """Each synchronous yardstick's target for ``config``'s model: the fixed metric of
    :data:`TARGETS`, else gpipe's final under the row's own optimizer plus :data:`WITHIN`
    (yardsticks without one are left out)."""
    fixed = TARGETS.get(config.model)
    yardsticks = dict.fromkeys(synchronous_label(m) for m in method_labels(config))
    targets: Targets = {
        sync: fixed
        if fixed is not None
        else gpipe_finals(config, cells, rates, within=WITHIN, label=sync)
        for sync in yardsticks
    }
    return {s: t for s, t in targets.items() if not isinstance(t, Mapping) or t}


def closure_rates(config: StudyConfig, rates: Rates) -> dict[str, float]:
    """The rate whose closure rows count, per optimizer: each optimizer's chosen rate, and
    the first optimizer's for the rows of other optimizers (NAdam, Muon), which train at it."""
    rate_of = {o: r[0] for o, r in rates.items()}
    rate_of.update({o: rates[config.optimizers[0]][0] for _, o in config.pairs})
    return rate_of


@dataclass
class RiskFitParts:
    """What the risk fit is made of, gathered model by model (:meth:`add_model`)."""

    points: list[RiskFitPoint] = field(default_factory=list)
    closure: list[dict[str, Any]] = field(default_factory=list)
    gains: list[dict[str, Any]] = field(default_factory=list)
    depth_excess: dict[int, dict[str, float]] = field(default_factory=dict)
    depth_copies: dict[int, dict[str, int]] = field(default_factory=dict)
    depth_excess_first: dict[int, dict[str, float]] = field(default_factory=dict)
    depth_speed: dict[int, dict[str, float]] = field(default_factory=dict)
    """Stages -> row -> its simulated samples/s over zb-h1's under the same optimizer."""
    depth_equal_time: dict[int, dict[str, float]] = field(default_factory=dict)
    """Stages -> row -> its equal-time run's final test loss over zb-h1's, minus 1."""

    def add_model(
        self,
        config: StudyConfig,
        cells: Cells,
        rates: Rates,
        targets: Targets,
        closure: Sequence[dict[str, Any]],
        *,
        seconds_per_sample: SecondsPerSample | None = None,
        equal: Sequence[EqualTimeResult] = (),
    ) -> None:
        """Add one model's parts (``closure``: its :func:`closure_rows`;
        ``seconds_per_sample``: each row's simulated time per sample, None where the model
        has no profile; ``equal``: its :func:`equal_time_results`). Rows under an
        optimizer with settings of its family (``nadam β1=0.99``) are left out: the
        planner's tables are keyed by family."""
        cells = {k: c for k, c in cells.items() if not is_variant(split_label(k[0])[1])}
        closure = [r for r in closure if not is_variant(r["optimizer"])]
        equal = [r for r in equal if not is_variant(split_label(r.label)[1])]
        if TARGETS.get(config.model) is None:
            self._add_time(config, gaps(config, cells, rates), seconds_per_sample, equal)
            # the planner's table: at a depth two models measured, the first model's rows
            # (gpt-deep's grid) and only the rows it lacks from the next (gpt-deeper)
            for p, rows in gaps(config, cells, rates).items():
                excess = self.depth_excess.setdefault(p, {})
                copies = self.depth_copies.setdefault(p, {})
                for k, v in rows.items():
                    excess.setdefault(k, round(v, 4))
                    copies.setdefault(k, peak_copies(k, p))
            for p, rows in gaps(config, cells, rates, same_optimizer=False).items():
                first = self.depth_excess_first.setdefault(p, {})
                for k, v in rows.items():
                    first.setdefault(k, round(v, 4))
        rate_of = closure_rates(config, rates)
        self.closure += [r for r in closure if r["lr"] == rate_of.get(r["optimizer"])]
        self.points += risk_points(config, cells, rates, targets, closure)
        self.gains += correction_gains(config, cells, rates)

    def _add_time(
        self,
        config: StudyConfig,
        rows_by_depth: Mapping[int, Mapping[str, float]],
        seconds_per_sample: SecondsPerSample | None,
        equal: Sequence[EqualTimeResult],
    ) -> None:
        """The language model's speed and equal-time tables, at a depth two models measured
        the first model's rows and only the rows it lacks from the next (as the losses)."""
        ref = config.equal_time_reference
        if seconds_per_sample is not None:
            for p, rows in rows_by_depth.items():
                speed = self.depth_speed.setdefault(p, {})
                for label in rows:
                    try:
                        own = seconds_per_sample(label, p)
                        zb = seconds_per_sample(synchronous_label(label, ref), p)
                    except PipeoptimError:  # a schedule the simulator refuses: no speed
                        continue
                    speed.setdefault(label, round(zb / own, 4))
        for result in equal:
            # the reference's own row (its loss is gpipe's) says nothing
            mine = result.label != synchronous_label(result.label, ref)
            if mine and result.run and math.isfinite(result.excess):
                at = self.depth_equal_time.setdefault(result.stages, {})
                at.setdefault(result.label, round(result.excess, 4))

    def fit(self) -> dict[str, Any]:
        """The content of ``risk_fit.json``."""
        return {
            "kappa": {o: round(k, 4) for o, (k, _) in sorted(fit_risk(self.points).items())},
            "risk_curve": {
                o: c.to_json()
                for o, c in fit_risk_curves(
                    (p.optimizer, p.uncorrected, p.extra_samples) for p in self.points
                ).items()
            },
            "closure_table": {
                f"{rule}/{opt}": by_s
                for (rule, opt), by_s in closure_from_rows(self.closure).items()
            },
            "closure": self.closure,
            "correction_gain": gain_table(self.gains),
            "correction_gain_delay": gain_delay_table(self.gains),
            "correction_gains": self.gains,
            "depth_excess": {str(p): rows for p, rows in sorted(self.depth_excess.items())},
            "depth_copies": {str(p): rows for p, rows in sorted(self.depth_copies.items())},
            "depth_excess_first": {
                str(p): rows for p, rows in sorted(self.depth_excess_first.items())
            },
            "depth_speed": {str(p): rows for p, rows in sorted(self.depth_speed.items()) if rows},
            "depth_equal_time": {
                str(p): rows for p, rows in sorted(self.depth_equal_time.items()) if rows
            },
            "points": [p.to_dict() for p in self.points],
        }


def model_records(
    out: Path, config: StudyConfig
) -> tuple[list[RunRecord], list[RunRecord], Rates] | None:
    """``config``'s records under ``out`` (None: none yet), those of its main grid at the
    rates its sweep chose, and those rates."""
    records = load_records(out / config.model / "runs.jsonl")
    if not records:
        return None
    rates = choose_rates(config, records)
    main = {s.key for s in main_specs(config, rates)}
    return records, [r for r in records if r.spec.key in main], rates


def study_risk_fit(out: Path, configs: Iterable[StudyConfig]) -> dict[str, Any]:
    """``risk_fit.json`` of the study under ``out``, as :func:`~pipeoptim.study.report.
    write_study_report` writes it, without the rest of the report: the speeds are simulated
    on the profiles the report keeps beside the runs (:func:`kept_profiles`; none on file:
    no speed, no equal time)."""
    parts = RiskFitParts()
    for config in configs:
        found = model_records(out, config)
        if found is None:
            continue
        records, mine, rates = found
        cells = aggregate(mine)
        targets = model_targets(config, cells, rates)
        per_sample, equal = model_time(out, config, cells, rates, records)
        parts.add_model(
            config,
            cells,
            rates,
            targets,
            closure_rows(mine),
            seconds_per_sample=per_sample,
            equal=equal,
        )
    return parts.fit()


def model_time(
    out: Path,
    config: StudyConfig,
    cells: Cells,
    rates: Rates,
    records: Sequence[RunRecord],
) -> tuple[SecondsPerSample | None, list[EqualTimeResult]]:
    """A language model's time per sample (on its kept profiles) and equal-time results;
    (None, []) for a model held to a fixed target or without a profile on file."""
    if TARGETS.get(config.model) is not None:
        return None, []
    kept = kept_profiles(out / config.model, config)
    if kept is None:
        return None, []
    per_sample = seconds_per_sample_of(config, *kept)
    equal = (
        equal_time_results(config, rates, cells, records, per_sample) if config.equal_time else []
    )
    return per_sample, equal


def risk_tables_from_fit(fit: Mapping[str, Any]) -> RiskTables:
    """The planner's tables (``risk_tables.json``) from a ``risk_fit.json``'s content."""
    closure: dict[str, dict[str, dict[str, float]]] = {}
    for (rule, optimizer), by_s in closure_from_rows(fit["closure"]).items():
        closure.setdefault(rule, {})[optimizer] = {str(s): c for s, c in by_s.items()}
    return risk_tables_from_json(
        {
            "meta": TABLES_META,
            "closure": closure,
            "kappa": fit["kappa"],
            # a fit written before the curves has none: the risk model keeps κ
            "risk_curve": fit.get("risk_curve", {}),
            "correction_gain": fit["correction_gain"],
            "correction_gain_delay": fit.get("correction_gain_delay", {}),
            "depth_excess": fit["depth_excess"],
            "depth_copies": fit["depth_copies"],
            "depth_excess_first": fit["depth_excess_first"],
            # a fit written before the study measured time has neither
            "depth_speed": fit.get("depth_speed", {}),
            "depth_equal_time": fit.get("depth_equal_time", {}),
        }
    )
