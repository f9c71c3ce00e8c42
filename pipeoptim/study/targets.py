"""What the study's runs say against a target metric: samples to reach it, the time that
takes on a hardware profile (samples x the simulated time per sample), and the points the
convergence-risk fit of :mod:`pipeoptim.plan.risk` is fitted to.

The time per sample comes from the simulator on a profile: the one given, checked against
the model (:func:`check_profile`), or this machine's (:func:`machine_profile`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.methods import WeightPolicy, get_method
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.risk import RiskFitPoint, schedule_versions, uncorrected_distance
from pipeoptim.study.cells import Cell, higher_is_better, method_labels
from pipeoptim.study.grid import StudyConfig
from pipeoptim.study.runs import RunRecord

__all__ = [
    "TimeToTarget",
    "check_profile",
    "machine_profile",
    "risk_points",
    "samples_to_target",
    "simulated_seconds_per_sample",
    "time_to_target",
]


def samples_to_target(record: RunRecord, target: float) -> int | None:
    """Samples seen at the first evaluation that reached ``target`` (None: never)."""
    if not record.curve:
        return None
    better = higher_is_better(record.spec.model)
    for point in record.curve:
        value = point.test_metric
        if math.isfinite(value) and (value >= target if better else value <= target):
            return point.samples
    return None


def simulated_seconds_per_sample(profile: Profile, method: str, stages: int) -> float:
    """Time per sample of ``method`` on ``profile``, the study's even partition, no link
    cost: the simulator's steady state."""
    from pipeoptim.plan.methods import get_method
    from pipeoptim.plan.plan import even_boundaries
    from pipeoptim.sim.costs import CostModel
    from pipeoptim.sim.evaluate import compile_method, evaluate_program

    spec = get_method(method)
    m = stages if spec.micro_batched else 1
    shape = spec.shape(stages, m, 4 * stages)
    costs = CostModel.from_profile(profile, even_boundaries(profile.num_layers, stages), m)
    result = evaluate_program(compile_method(method, shape), costs)
    return 1.0 / result.steady_throughput


def machine_profile(model: str, batch_size: int, optimizer: str) -> Profile:
    """This machine's profile of ``model``, one thread (the thread a stage of the study
    runs on)."""
    import torch

    from pipeoptim.workloads.profiling import profile_builtin

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return profile_builtin(model, batch_size=batch_size, optimizer=optimizer, repeats=7)
    finally:
        torch.set_num_threads(threads)


def check_profile(profile: Profile, model: str) -> None:
    """Refuse a hardware profile taken of another model (another layer count)."""
    from pipeoptim.workloads.loader import build_model

    layers = len(build_model(model, 0)[0])
    if profile.num_layers != layers:
        raise RuntimeConfigError(
            f"the profile for {model} has {profile.num_layers} layers but the model has "
            f"{layers}; profile the same model (pipeoptim profile --model {model} --out FILE "
            f"on the target hardware)"
        )


@dataclass(frozen=True)
class TimeToTarget:
    method: str
    optimizer: str
    stages: int
    reached: int
    seeds: int
    samples: float
    """Median samples to the target over the seeds that reached it (nan: none did)."""
    seconds_per_sample: float

    @property
    def seconds(self) -> float:
        return self.samples * self.seconds_per_sample


def time_to_target(
    config: StudyConfig,
    cells: dict[tuple[str, str, float, int], Cell],
    rates: dict[str, tuple[float, float | None]],
    target: float,
    profile: Profile,
) -> list[TimeToTarget]:
    out = []
    per_sample: dict[tuple[str, int], float] = {}  # the same for every optimizer
    for opt in config.optimizers:
        lr = rates[opt][0]
        for p in config.stages:
            for method in method_labels(config):
                cell = cells.get((method, opt, lr, p))
                if cell is None:
                    continue
                hits = [samples_to_target(r, target) for r in cell.records]
                reached = [h for h in hits if h is not None]
                base = method.split("+")[0]  # a variant runs its method's schedule
                if (base, p) not in per_sample:
                    per_sample[(base, p)] = simulated_seconds_per_sample(profile, base, p)
                out.append(
                    TimeToTarget(
                        method,
                        opt,
                        p,
                        len(reached),
                        len(hits),
                        statistics.median(reached) if reached else math.nan,
                        per_sample[(base, p)],
                    )
                )
    return out


def risk_points(
    config: StudyConfig,
    cells: dict[tuple[str, str, float, int], Cell],
    rates: dict[str, tuple[float, float | None]],
    target: float,
    closure: Sequence[dict[str, Any]],
) -> list[RiskFitPoint]:
    """(optimizer, uncorrected distance, extra samples to target over gpipe) per cell."""
    points = []
    for opt in config.optimizers:
        lr = rates[opt][0]
        for p in config.stages:
            base = cells.get(("gpipe", opt, lr, p))
            if base is None:
                continue
            base_hits = [samples_to_target(r, target) for r in base.records]
            if any(h is None for h in base_hits):
                continue
            reference = statistics.median([h for h in base_hits if h is not None])
            for method in config.methods:
                cell = cells.get((method, opt, lr, p))
                if cell is None:
                    continue
                measured = {
                    r["stage"]: r["closed"]
                    for r in closure
                    if (r["method"], r["optimizer"], r["lr"], r["stages"]) == (method, opt, lr, p)
                }
                hits = [samples_to_target(r, target) for r in cell.records]
                # a seed that never reached the target counts as the whole run
                worst = cell.records[0].spec.steps * config.batch_size
                samples = statistics.median([worst if h is None else h for h in hits])
                points.append(
                    RiskFitPoint(
                        config.model,
                        method,
                        opt,
                        p,
                        _measured_distance(method, opt, p, measured),
                        samples / reference - 1.0,
                    )
                )
    return points


def _measured_distance(method: str, optimizer: str, stages: int, closed: dict[int, float]) -> float:
    """e at the stage where it is largest, from the closure measured in this cell alone (so
    the fit never reads the constants it produces). A predicting method's stages without a
    measurement hold no weights (a lone ReLU) or never predict (s = 0): nothing is stale."""
    distances, staleness = schedule_versions(method, stages, stages)
    predicting = get_method(method).weight_policy is WeightPolicy.PREDICT
    values = [
        uncorrected_distance(method, optimizer, s, old, closed.get(k, 0.0))
        for k, (s, old) in enumerate(zip(distances, staleness, strict=True))
        if not predicting or k in closed
    ]
    return max(values, default=0.0)
