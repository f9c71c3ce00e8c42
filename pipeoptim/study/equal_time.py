"""Equal time: the loss each row reaches in the same simulated wall-clock budget.

The budget of a row at P stages is the time its reference (``StudyConfig.
equal_time_reference``, zb-h1) under the row's optimizer needs for the study's updates: the
reference's simulated time per sample x the run's samples. The row trains as many updates
as its own simulated throughput buys in that budget (:func:`equal_time_steps`), with the
study's schedule (warm-up share, cosine to the final rate) ending at that step count, as a
run of its own (``RunSpec.equal_time``). zb-h1 makes gpipe's updates, so its loss in the
budget is gpipe's final loss under the same optimizer. A row whose throughput buys exactly
the study's updates needs no run of its own: its equal-sample run is its equal-time run.

Which rows: ``StudyConfig.equal_time`` (a row, its dial rows, and its best extrapolation
row at each depth), in the first optimizer's column at its chosen rate, seed 0.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from pipeoptim.errors import PlanError, RuntimeConfigError
from pipeoptim.plan.risk import parse_row, row_label
from pipeoptim.study.cells import Cell, synchronous_label
from pipeoptim.study.grid import StudyConfig, main_specs
from pipeoptim.study.runs import RunRecord, RunSpec

__all__ = [
    "EqualTimeResult",
    "equal_time_bases",
    "equal_time_results",
    "equal_time_rows",
    "equal_time_spec",
    "equal_time_specs",
    "equal_time_steps",
]

SecondsPerSample = Callable[[str, int], float]
"""A row label and a depth -> the row's simulated seconds per sample there (under the
row's optimizer: :func:`pipeoptim.study.targets.row_seconds_per_sample`)."""


def equal_time_steps(
    steps: int, reference_seconds_per_sample: float, seconds_per_sample: float
) -> int:
    """Updates a row makes in the time the reference needs for ``steps`` updates of the
    same mini-batch: ``steps`` x the ratio of the row's throughput to the reference's,
    rounded to a whole update (at least one)."""
    for name, value in (
        ("reference_seconds_per_sample", reference_seconds_per_sample),
        ("seconds_per_sample", seconds_per_sample),
    ):
        if not (math.isfinite(value) and value > 0):
            raise RuntimeConfigError(
                f"{name} must be a positive, finite simulated time (got {value}); simulate "
                f"the row on a profile of the model"
            )
    return max(1, round(steps * reference_seconds_per_sample / seconds_per_sample))


def _family(label: str) -> str:
    """A row label without its settings: ``pipeoptim M=2 (muon)`` -> ``pipeoptim (muon)``."""
    row = parse_row(label)
    return row_label(row.method, row.optimizer, predicted_backward=row.predicted_backward)


def equal_time_rows(
    config: StudyConfig,
    specs: list[RunSpec],
    cells: Mapping[tuple[str, str, float, int], Cell],
) -> list[RunSpec]:
    """Of ``specs`` (one depth's, seed 0), those ``config.equal_time`` names: a named row
    and its dial rows, and of its extrapolation rows the one with the lowest final test loss
    there (none while none has finished)."""
    named = set(config.equal_time)
    out: list[RunSpec] = []
    best: dict[str, tuple[float, RunSpec]] = {}
    for spec in specs:
        family = _family(spec.label)
        if family not in named:
            continue
        if spec.extrapolation is None:
            out.append(spec)
            continue
        cell = cells.get((spec.label, spec.optimizer, spec.lr, spec.stages))
        loss = math.nan if cell is None else cell.final_test_loss
        if math.isfinite(loss) and (family not in best or loss < best[family][0]):
            best[family] = (loss, spec)
    return out + [spec for _, spec in best.values()]


def equal_time_bases(
    config: StudyConfig,
    rates: dict[str, tuple[float, float | None]],
    cells: Mapping[tuple[str, str, float, int], Cell],
) -> list[RunSpec]:
    """The equal-sample specs whose rows train at equal time: :func:`equal_time_rows` at
    every depth, at the first optimizer's chosen rate, seed 0."""
    first = config.optimizers[0]
    lr = rates[first][0]
    grid = [s for s in main_specs(config, rates) if s.seed == 0 and s.lr == lr]
    return [
        spec
        for p in config.stages
        for spec in equal_time_rows(
            config, [s for s in grid if s.stages == p and s.optimizer == first], cells
        )
    ]


def equal_time_spec(
    config: StudyConfig, spec: RunSpec, seconds_per_sample: SecondsPerSample
) -> RunSpec:
    """The equal-time run of the row of ``spec``: the updates its throughput buys in the
    reference's time for ``spec.steps`` (:func:`equal_time_steps`), its schedule ending
    there; ``spec`` itself where that is its own step count (nothing new to train)."""
    p = spec.stages
    reference = synchronous_label(spec.label, config.equal_time_reference)
    steps = equal_time_steps(
        spec.steps, seconds_per_sample(reference, p), seconds_per_sample(spec.label, p)
    )
    if steps == spec.steps:
        return spec
    return dataclasses.replace(spec, steps=steps, equal_time=True, closure=False)


def equal_time_specs(
    config: StudyConfig,
    rates: dict[str, tuple[float, float | None]],
    cells: Mapping[tuple[str, str, float, int], Cell],
    seconds_per_sample: SecondsPerSample,
) -> list[RunSpec]:
    """The equal-time runs of ``config`` at the rates its sweep chose
    (:func:`equal_time_bases`, each through :func:`equal_time_spec`)."""
    return [
        equal_time_spec(config, spec, seconds_per_sample)
        for spec in equal_time_bases(config, rates, cells)
    ]


@dataclass(frozen=True)
class EqualTimeResult:
    """One row's equal-time run at one depth, or the reference's (its loss: gpipe's)."""

    label: str
    stages: int
    steps: int
    """Updates the row makes in the budget (the reference's: the study's updates)."""
    loss: float
    """Final test loss of the run (nan: not run yet, or diverged)."""
    reference_loss: float
    """The reference's loss in the budget: gpipe's final under the row's optimizer (nan:
    gpipe did not finish there)."""
    run: bool
    """The run is on file (a diverged run too)."""
    not_simulated: str = ""
    """Why the row has no budget (the simulator refused its schedule; "" where it has)."""
    key: str = ""
    """The equal-time run's key ("" for the reference and a row without a budget)."""
    reached_share: float = math.nan
    """The share of the budget at the run's first evaluation at or below the reference's
    loss: its time to gpipe's final loss over the reference's (nan: not within the budget,
    or not run; 1 for the reference itself)."""

    @property
    def excess(self) -> float:
        """The row's loss over the reference's, minus 1 (nan where either is missing)."""
        return self.loss / self.reference_loss - 1.0


def _budgetless(spec: RunSpec) -> str:
    """``spec``'s key without its step count (an equal-time run's budget)."""
    return dataclasses.replace(spec, steps=0, equal_time=True, closure=False).key


def _reason(err: PlanError) -> str:
    """The rule a refusal states, without its fix (a table cell)."""
    return str(err).split(";")[0]


def reached_share(record: RunRecord, loss: float) -> float:
    """The share of ``record``'s updates at its first evaluation whose test loss is at or
    below ``loss`` (nan: none is): an equal-time run's time to that loss over its budget."""
    steps = record.spec.steps
    for point in record.curve:
        if math.isfinite(point.test_loss) and point.test_loss <= loss:
            return point.step / steps
    return math.nan


def equal_time_results(
    config: StudyConfig,
    rates: dict[str, tuple[float, float | None]],
    cells: Mapping[tuple[str, str, float, int], Cell],
    records: Iterable[RunRecord],
    seconds_per_sample: SecondsPerSample,
) -> list[EqualTimeResult]:
    """Per depth, the reference row under each optimizer the equal-time rows train (its
    loss: gpipe's final) and each row of :func:`equal_time_specs` with its run's final test
    loss where the run is on file (``records``)."""
    first = config.optimizers[0]
    lr = rates[first][0]
    records = list(records)
    by_key = {r.spec.key: r for r in records}
    # an equal-time run whose budget was simulated on a profile since taken again: the run
    # on file is the row's, with the updates it was given
    timed = {_budgetless(r.spec): r for r in records if r.spec.equal_time}
    named = set(config.equal_time)
    out: list[EqualTimeResult] = []

    def gpipe_loss(label: str, stages: int) -> float:
        cell = cells.get((synchronous_label(label), first, lr, stages))
        return math.nan if cell is None else cell.final_test_loss

    bases = equal_time_bases(config, rates, cells)
    grid = [s for s in main_specs(config, rates) if s.seed == 0 and s.lr == lr]
    for p in config.stages:
        here = [s for s in bases if s.stages == p]
        # extrapolation rows named whose best λ is unknown here: none has finished yet
        chosen = {_family(s.label) for s in here if s.extrapolation is not None}
        pending = dict.fromkeys(
            _family(s.label)
            for s in grid
            if s.stages == p and s.extrapolation is not None and _family(s.label) in named
        )
        references = dict.fromkeys(
            synchronous_label(s.label, config.equal_time_reference) for s in here
        )
        for ref in references:
            steps = config.steps_by_optimizer.get(first, config.steps)
            loss = gpipe_loss(ref, p)
            out.append(
                EqualTimeResult(ref, p, steps, loss, loss, math.isfinite(loss), reached_share=1.0)
            )
        for base in here:
            try:
                spec = equal_time_spec(config, base, seconds_per_sample)
            except PlanError as err:  # a row the simulator cannot run yet has no budget
                out.append(
                    EqualTimeResult(
                        base.label, p, 0, math.nan, gpipe_loss(base.label, p), False, _reason(err)
                    )
                )
                continue
            record = by_key.get(spec.key) or timed.get(_budgetless(spec))
            final = None if record is None or record.diverged_at is not None else record.final
            loss = math.nan if final is None else final.test_loss
            reference = gpipe_loss(spec.label, p)
            out.append(
                EqualTimeResult(
                    spec.label,
                    p,
                    spec.steps if record is None else record.spec.steps,
                    loss,
                    reference,
                    record is not None,
                    key=spec.key if record is None else record.spec.key,
                    reached_share=(
                        math.nan
                        if record is None or final is None
                        else reached_share(record, reference)
                    ),
                )
            )
        for family in pending:
            if family not in chosen:
                row = parse_row(family)
                label = row_label(f"{row.method} best λ", row.optimizer)
                missing = EqualTimeResult(label, p, 0, math.nan, gpipe_loss(family, p), False)
                out.append(missing)
    return out
