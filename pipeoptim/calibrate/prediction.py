"""What-if: another method, stage count or replica count predicted from a measured run.

The measured run's actions hold its own weight policy's work around the passes (a flush's,
a stash's, a prediction's: :data:`pipeoptim.workloads.profiling.POLICY_METHODS`); another
method whose stages do more per action (pipeoptim predicts and swaps its weights around
each forward, keeps a copy at each update) does that work on top. Where the profile passed
in measured each policy's fixed work per action (``runtime_costs``, from ``pipeoptim
profile --ranks P``), the prediction charges the asked method's beyond the run's, per
action kind (:func:`policy_excess`); without one, none (a 1f1b run's calibration predicted
pipeoptim at one micro-batch 28 % fast on 2 ranks of 16 x Linear(128), where the offline
prediction that charges the policy's work was 1 % off).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pipeoptim.calibrate.fit_costs import with_profile_machine
from pipeoptim.calibrate.layer_costs import calibrated_profile
from pipeoptim.calibrate.runs import run_boundaries, run_cluster, run_replicas, trace_plan
from pipeoptim.calibrate.trace_costs import costs_from_trace, with_allreduce
from pipeoptim.metrics import RunMetrics, compute_metrics
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.replicas import check_batch_split, check_replicas
from pipeoptim.plan.runtime_costs import RuntimeCosts
from pipeoptim.sim.collectives import Cluster
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.evaluate import evaluate_trace
from pipeoptim.trace import Trace


@dataclass(frozen=True)
class WhatIf:
    """One prediction from a measured run for another method or shape."""

    method: str
    num_stages: int
    micro_batches: int
    trace: Trace
    """The simulator's trace of it."""
    metrics: RunMetrics
    notes: tuple[str, ...] = ()
    data_parallel: int = 1
    """Replicas D of the predicted pipeline, each training 1/D of the global batch."""

    @property
    def time_per_mini_batch(self) -> float:
        batch = float(self.trace.meta.get("batch_size") or 1)
        steady = self.metrics.steady_throughput
        return batch / steady if steady > 0 else math.nan


def what_if(
    trace: Trace,
    method: str,
    *,
    stages: int | None = None,
    micro_batches: int | None = None,
    profile: Profile | None = None,
    data_parallel: int | None = None,
    cluster: Cluster | None = None,
) -> WhatIf:
    """Predict ``method`` (at ``stages``, ``micro_batches`` and ``data_parallel`` replicas,
    default the run's stage count, the method's default M and the run's D) from the
    measured run's calibrated costs.

    The run's own stages keep its boundaries and per-link latencies; another stage count
    re-partitions :func:`calibrated_profile` with the partitioner (the median latency on
    every link). The simulated run has as many mini-batches as the measured one, of the
    run's global batch B: each of D replicas trains B/D of it, and its updates all-reduce
    the stage's gradients on ``cluster`` (default :func:`run_cluster`) on top of the
    measured optimizer step.
    """
    from pipeoptim.plan.memory_factors import method_memory_factors
    from pipeoptim.plan.partition import optimal_partition

    plan = trace_plan(trace)
    spec = get_method(method)
    ranks = stages if stages is not None else plan.num_stages
    n = max(1, int(trace.meta.get("mini_batches") or 1))
    shape = spec.shape(ranks, micro_batches, n)
    cluster = cluster or run_cluster(trace)
    calibrated = calibrated_profile(trace, profile, cluster)
    run_d = run_replicas(trace)
    d = run_d if data_parallel is None else check_replicas(data_parallel, "--predict-data-parallel")
    batch = float(trace.meta.get("batch_size") or calibrated.batch_size * run_d)
    if d != run_d and batch.is_integer():  # the run's own split held; another one may not
        check_batch_split(int(batch), d, shape.micro_batches)
    run_bounds = run_boundaries(trace)
    notes: list[str] = []
    if shape.num_stages == len(run_bounds):
        bounds = run_bounds
    else:
        factors = method_memory_factors(spec.name, shape.num_stages, shape.micro_batches)
        bounds = list(
            optimal_partition(calibrated, shape.num_stages, memory_factors=factors).boundaries
        )
        notes.append(f"re-partitioned into {shape.num_stages} stages: {bounds}")
    costs = CostModel.from_profile(
        calibrated,
        bounds,
        shape.micro_batches,
        batch_size=batch / d,  # one replica's share of the global batch
        latency_s=float(calibrated.meta.get("link_latency_s", 0.0)),
    )
    if bounds == run_bounds:  # the run's own links: their measured (or fitted) latencies
        costs = replace(costs, latency_s=costs_from_trace(trace, cluster).latency_s)
    costs = with_profile_machine(costs, calibrated.meta, len(run_bounds), shape.num_ranks)
    if d > 1:
        costs = with_allreduce(costs, d, cluster, shape.num_ranks)
    excess = policy_excess(profile.runtime_costs if profile else None, plan.method, spec.name)
    if any(excess):
        costs = replace(costs, action_s=excess)
        notes.append(
            f"{spec.name}'s weight policy ({spec.version_rule.value}) charged its measured work "
            f"per action beyond {plan.method}'s ({get_method(plan.method).version_rule.value}): "
            + ", ".join(
                f"{k} {v * 1e6:.0f} µs" for k, v in zip("FBUIW", excess, strict=True) if v > 0
            )
        )
    if spec.predicts and calibrated.meta.get("predict_estimated"):
        notes.append(
            "prediction time estimated (not measured in this run) for the layers of stages "
            f"{calibrated.meta['predict_estimated']} of the run"
        )
    predicted = evaluate_trace(spec, shape, costs)
    predicted.meta["batch_size"] = batch  # global: what all D replicas train
    return WhatIf(
        spec.name,
        shape.num_stages,
        shape.micro_batches,
        predicted,
        compute_metrics(predicted),
        tuple(notes),
        d,
    )


def policy_excess(
    runtime: RuntimeCosts | None, measured: str, asked: str
) -> tuple[float, float, float, float, float]:
    """The fixed seconds of an F, B, U, I and W action that ``asked``'s weight policy costs
    beyond ``measured``'s, by ``runtime``'s measured work per action of each policy (never
    below 0: a measured run's actions hold its own policy's work already); nothing without
    a record, or for the same policy."""
    if runtime is None:
        return 0.0, 0.0, 0.0, 0.0, 0.0
    have = runtime.actions(get_method(measured).version_rule.value)
    want = runtime.actions(get_method(asked).version_rule.value)
    f, b, u, i, w = (max(0.0, x - y) for x, y in zip(want, have, strict=True))
    return f, b, u, i, w
