"""The demo's predicting steps, torch-free: plan and simulate every method on the profile
(step 2), and calibrate the simulator from the measured runs (step 4).

Both turn library objects into plain JSON-able dicts, because each step's result is stored
in its result file (:mod:`pipeoptim.demo.resume`) and the report is drawn from those files
alone, so a resumed demo draws the same report as an uninterrupted one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pipeoptim.calibrate import (
    calibrate,
    calibrated_profile,
    compare,
    compute_ratio,
    fitted_costs,
    with_profile_machine,
)
from pipeoptim.errors import PlanError
from pipeoptim.metrics import RunMetrics, compute_metrics
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import Plan
from pipeoptim.plan.profile import Profile
from pipeoptim.planning import Candidate, PlanLimits, plan_for, plan_from_candidate
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.evaluate import evaluate_trace
from pipeoptim.sim.host import host_notes
from pipeoptim.trace import Trace

__all__ = [
    "SYNCHRONOUS_RIVALS",
    "calibrate_runs",
    "plan_methods",
    "time_per_mini_batch",
]

SYNCHRONOUS_RIVALS = ("zb-h1", "1f1b")
"""The synchronous methods the recommendation is measured against: the strongest of them
that is not the recommendation itself trains beside it."""


def _candidate_row(c: Candidate) -> dict[str, Any]:
    part, risk = c.partition, c.risk
    return {
        "method": c.method,
        "micro_batches": c.micro_batches,
        "samples_per_s": c.throughput,
        "effective_samples_per_s": c.effective_throughput,
        "bubble_ratio": c.bubble_ratio,
        "steady_bubble": c.steady_bubble,
        "peak_memory_bytes": c.peak_memory_bytes,
        "stage_memory_bytes": list(part.stage_memory) if part else [],
        "weight_copies": list(part.weight_copies) if part and part.weight_copies else [],
        "boundaries": [list(b) for b in part.boundaries] if part else [],
        "distances": list(risk.distances) if risk else [],
        "staleness": list(risk.staleness) if risk else [],
        "max_staleness": c.max_staleness,
        "risk": risk.risk if risk else 0.0,
        "infeasible": c.infeasible,
    }


def plan_methods(
    profile: Profile, stages: int, *, optimizer: str, lr: float, model: str, batch_size: int
) -> dict[str, Any]:
    """Step 2: the planner's search over every method and micro-batch count on ``profile``
    (each timed by the simulator on the host the profile recorded, ``host``: what it
    charged), the best candidate of each method, the recommendation and its strongest
    synchronous rival, and the plans the real runs will train."""
    # raises, with the planner's message, when nothing fits
    choice = plan_for(
        profile,
        stages=stages,
        limits=PlanLimits(batch_size=batch_size, optimizer=optimizer, lr=lr),
        model=model,
    )
    ranked, why, best = choice.ranked, choice.why, choice.best
    feasible = [c for c in ranked if c.infeasible is None]
    rival = next(
        (c for c in feasible if c.method in SYNCHRONOUS_RIVALS and c.method != best.method), None
    )
    if rival is None:
        raise PlanError(
            f"no synchronous method ({', '.join(SYNCHRONOUS_RIVALS)}) can run {stages} stages "
            f"of {model} at batch {batch_size}: the demo compares the recommendation against "
            f"one; use a batch size that {stages} micro-batches divide"
        )
    per_method: dict[str, Candidate] = {}
    for c in feasible:
        per_method.setdefault(c.method, c)

    def plan_of(c: Candidate) -> dict[str, Any]:
        plan = plan_from_candidate(
            c,
            profile,
            optimizer=choice.plan.optimizer,
            model=model,
            batch_size=batch_size,
            notes={"predicted_samples_per_s": c.throughput, "source": "pipeoptim demo"},
            stage_graph=False,  # the demo's plans train the model it built, by boundaries
        )
        return plan.to_dict()

    return {
        "recommended": best.method,
        "rival": rival.method,
        "why": why,
        "host": host_notes(profile, stages),
        "methods": [_candidate_row(c) for c in per_method.values()],
        "not_run": [
            {"method": c.method, "micro_batches": c.micro_batches, "why": c.infeasible}
            for c in ranked
            if c.infeasible is not None
        ],
        "plans": {c.method: plan_of(c) for c in (best, rival)},
    }


def time_per_mini_batch(metrics: RunMetrics, batch_size: float) -> float:
    """Steady-state seconds per mini-batch (nan when nothing ran)."""
    rate = metrics.steady_throughput
    return batch_size / rate if rate > 0 else math.nan


def _cross(source: Trace, target: Trace, profile: Profile) -> Trace:
    """``target``'s method, shape and partition simulated on the costs ``source`` measured
    (the offline ``profile`` gives each layer's share and the fixed part of its times)."""
    plan = Plan.from_dict(target.meta["plan"], source="the measured trace's plan")
    shape = plan.shape(int(target.meta.get("mini_batches") or 1))
    calibrated = calibrated_profile(source, profile)
    bounds = plan.boundaries or []
    costs = CostModel.from_profile(
        calibrated,
        bounds,
        shape.micro_batches,
        batch_size=float(calibrated.batch_size),
        latency_s=float(calibrated.meta.get("link_latency_s", 0.0)),
    )
    run_ranks = Plan.from_dict(source.meta["plan"], source="the measured trace's plan").num_stages
    costs = with_profile_machine(costs, calibrated.meta, run_ranks, shape.num_ranks)
    predicted = evaluate_trace(get_method(plan.method), shape, costs)
    predicted.meta["batch_size"] = target.meta.get("batch_size")
    return predicted


def calibrate_runs(
    measured: Mapping[str, Trace], profile: Profile
) -> tuple[dict[str, Any], dict[str, Trace]]:
    """Step 4: each run's own calibration (its measured costs simulated, against what it
    measured), and each run predicted from the other run's costs. Returns the result and
    the predicted traces by method."""
    runs: dict[str, Any] = {}
    predicted: dict[str, Trace] = {}
    for method, trace in measured.items():
        sim, rows = calibrate(trace)
        predicted[method] = sim
        batch = float(trace.meta.get("batch_size") or 1)
        runs[method] = {
            "rows": [r.to_dict() for r in rows],
            "measured_s_per_mini_batch": time_per_mini_batch(compute_metrics(trace), batch),
            "predicted_s_per_mini_batch": time_per_mini_batch(compute_metrics(sim), batch),
            "measured_stage_memory_bytes": _stage_peaks(compute_metrics(trace)),
            "compute_ratio": _finite_or_none(compute_ratio(trace, sim)),
            "fitted": fitted_costs(trace),
        }
    cross = []
    for source, target in ((a, b) for a in measured for b in measured if a != b):
        sim = _cross(measured[source], measured[target], profile)
        batch = float(measured[target].meta.get("batch_size") or 1)
        rows = compare(compute_metrics(measured[target]), compute_metrics(sim), batch)
        cross.append({"from": source, "method": target, "rows": [r.to_dict() for r in rows[:1]]})
    return {"runs": runs, "cross": cross}, predicted


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _stage_peaks(metrics: RunMetrics) -> list[int | None]:
    return [metrics.stages[k].peak_memory_bytes for k in sorted(metrics.stages)]
