"""What-if: another method, stage count or replica count predicted from a measured run."""

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
