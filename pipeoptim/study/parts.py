"""The study in resumable parts: the rows issue 65 adds, each trainable on its own
(``examples/convergence/run.py --part``), resuming from ``runs.jsonl`` as the whole study
does.

* ``main``: the grid as it was (methods, pairs, variants, repeats);
* ``one-step``: the rows of the one-step family (``one_step`` methods, e.g. xpipe and 2bw,
  under every optimizer), without settings;
* ``dial``: the dial's rows (``pipeoptim M=2``...);
* ``extrapolate``: the extrapolation's rows (``xpipe+extrapolate λ=0.5``...);
* ``equal-time``: the equal-time runs (:mod:`pipeoptim.study.equal_time`), from the rows on
  file (the best λ is read off the extrapolation's finished runs), on the pinned profiles.

Within a part the runs go in :func:`part_order`: rows under the ``first`` optimizers (Muon,
AdamW) before the others, the longest first within each.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path

from pipeoptim.errors import PlanError, RuntimeConfigError
from pipeoptim.plan.profile import Profile
from pipeoptim.study.cells import aggregate
from pipeoptim.study.equal_time import equal_time_bases, equal_time_spec
from pipeoptim.study.grid import StudyConfig, choose_rates, load_records, main_specs, relative_cost
from pipeoptim.study.runs import RunRecord, RunSpec
from pipeoptim.study.targets import pinned_profiles, seconds_per_sample_of

__all__ = ["PARTS", "estimated_seconds", "part_of", "part_order", "part_specs"]

PARTS = ("main", "one-step", "dial", "extrapolate", "equal-time")
"""The study's parts, in the order a whole study trains them."""


def part_of(spec: RunSpec, one_step: Collection[str]) -> str:
    """The part a run of the grid belongs to (:data:`PARTS`)."""
    if spec.equal_time:
        return "equal-time"
    if spec.micro_batch_count is not None:
        return "dial"
    if spec.extrapolation is not None:
        return "extrapolate"
    if spec.method in one_step:
        return "one-step"
    return "main"


def part_order(first: Collection[str]) -> Callable[[RunSpec], tuple[int, float]]:
    """A sort key for :func:`~pipeoptim.study.grid.run_specs`: rows trained under an
    optimizer of ``first`` before the others, the longest first within each."""

    def key(spec: RunSpec) -> tuple[int, float]:
        trained = spec.trained_optimizer or spec.optimizer
        return (0 if trained in first else 1, -relative_cost(spec))

    return key


def _rates(
    config: StudyConfig, records: Iterable[RunRecord]
) -> dict[str, tuple[float, float | None]]:
    if all(len(config.rates[opt]) == 1 for opt in config.optimizers):
        return {opt: (config.rates[opt][0], None) for opt in config.optimizers}
    return choose_rates(config, records)


def part_specs(
    config: StudyConfig,
    out_dir: Path,
    part: str,
    *,
    one_step: Collection[str],
    profile: Profile | None = None,
) -> tuple[list[RunSpec], list[str]]:
    """The runs of ``part`` for ``config`` whose records go to ``out_dir/runs.jsonl``
    (done ones included: :func:`~pipeoptim.study.grid.run_specs` skips them), and a note
    per equal-time row left out because the simulator refuses its schedule (no budget).
    The rates come from the sweep on file (refused where it is missing); ``profile``: the
    hardware the equal-time budget is simulated on (default: the pinned one beside the
    runs)."""
    if part not in PARTS:
        raise RuntimeConfigError(f"unknown part {part!r}; choose from {', '.join(PARTS)}")
    records = load_records(out_dir / "runs.jsonl")
    rates = _rates(config, records)
    grid = main_specs(config, rates)
    if part != "equal-time":
        return [s for s in grid if part_of(s, one_step) == part], []
    keys = {s.key for s in grid}
    cells = aggregate(r for r in records if r.spec.key in keys)
    chosen, trained = pinned_profiles(out_dir, config, profile)
    per_sample = seconds_per_sample_of(config, chosen, trained)
    specs: list[RunSpec] = []
    notes: list[str] = []
    for base in equal_time_bases(config, rates, cells):
        try:
            specs.append(equal_time_spec(config, base, per_sample))
        except PlanError as err:
            notes.append(f"{base.label} at P={base.stages}: no budget ({err})")
    return specs, notes


def estimated_seconds(
    specs: Sequence[RunSpec], records: Sequence[RunRecord], workers: int = 1
) -> float:
    """The run time of ``specs`` on ``workers`` workers, estimated from the measured seconds
    of ``records`` per unit of :func:`relative_cost`: for each spec the median over the
    most similar records on file (the same method and depth, else the same depth, else
    all). An estimate, as good as the cost model (nan where nothing is on file)."""
    rates = [(r.spec, r.seconds / relative_cost(r.spec)) for r in records if r.seconds > 0]
    if not rates:
        return math.nan
    total = 0.0
    for spec in specs:
        same_depth = [(o, v) for o, v in rates if o.stages == spec.stages]
        same_method = [(o, v) for o, v in same_depth if o.method == spec.method]
        pool = same_method or same_depth or rates
        total += statistics.median(v for _, v in pool) * relative_cost(spec)
    return total / max(1, workers)
