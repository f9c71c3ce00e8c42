"""A measured run's costs as simulator costs: per-stage medians of its actions, or, for a
run of several processes, the machine model fitted from it (package docstring: why)."""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict
from dataclasses import replace

from pipeoptim.calibrate.clocks import align_clocks
from pipeoptim.calibrate.fit import MachineFit, fit_machine
from pipeoptim.calibrate.fit_costs import shared_costs
from pipeoptim.calibrate.runs import (
    link_latencies,
    run_cluster,
    run_machine,
    run_replicas,
    stage_floats,
    trace_plan,
)
from pipeoptim.errors import PipeoptimError
from pipeoptim.plan.machine import Machine
from pipeoptim.sim.collectives import Cluster, allreduce_times
from pipeoptim.sim.costs import CostModel
from pipeoptim.trace import Trace, TraceEvent


def with_allreduce(costs: CostModel, replicas: int, cluster: Cluster, num_ranks: int) -> CostModel:
    """``costs`` (one replica's, with optimizer-step update times) as ``replicas`` replicas
    whose updates also all-reduce the stage's gradients on ``cluster`` (stage s on pipeline
    rank ``s mod num_ranks``). The pipeline links keep their (measured) costs."""
    return replace(
        costs,
        data_parallel=replicas,
        allreduce_s=allreduce_times(costs.grad_bytes, replicas, cluster, num_ranks),
    )


def machine_fit(trace: Trace) -> MachineFit | None:
    """The machine model fitted from a multi-process run (:mod:`pipeoptim.calibrate`): its
    recorded machine, or one host holding every rank with its cores fitted; None for a
    one-process run (every stage takes turns in one process: nothing to share)."""
    if trace.meta.get("transport") == "local":
        return None
    ranks = len({e.rank for e in trace.events})
    if ranks == 0:
        return None
    threads = trace.meta.get("threads")
    default = Machine(1, ranks, threads if isinstance(threads, int) and threads >= 1 else 1)
    predict = stage_floats(trace.meta.get("predict_s"))
    return fit_machine(trace, run_machine(trace), default, predict)


def fitted_costs(trace: Trace) -> list[str]:
    """Which costs calibration fitted from ``trace`` beyond the per-stage action times."""
    fit = machine_fit(trace)
    if fit is None:
        return ["one process: per-stage median action times"]
    lines = fit.describe()
    if not _uses_fit(trace, fit):
        return [lines[0], "per-stage median action times (no message recorded to fit)", lines[3]]
    return lines


def _uses_fit(trace: Trace, fit: MachineFit) -> bool:
    """Whether calibration takes ``fit``'s costs: where the ranks shared their cores, and
    with a core per rank where the trace recorded messages (the fit's gain there is their
    work; a trace with no send has none to fit, and keeps the medians)."""
    return fit.machine.shares_cores or any(e.kind in ("SEND_F", "SEND_B") for e in trace.events)


def costs_from_trace(trace: Trace, cluster: Cluster | None = None) -> CostModel:
    """Per-stage medians of the measured actions, as simulator costs.

    A stage's forward and backward include the sender-side time of its transfers (the
    copy into the transport), which occupies the rank; time spent waiting in a receive is
    pipeline bubble, not cost, and is left out. Each link's latency is the median delay
    from a send's start to the end of its receive, counted from when the receiver was
    ready (:func:`link_latencies`).

    A split backward's halves (I and W) make the stage's backward together, the W's share of
    it its weight-gradient fraction. For a run of several processes (:func:`machine_fit`)
    the fitted work, message costs, latencies and machine replace these medians
    (:func:`pipeoptim.calibrate.fit_costs.shared_costs`; module docstring: why).

    Under data parallelism (:func:`run_replicas` D > 1) a micro-batch is B/(D·M) samples
    of the global batch B, and each stage's measured update is split into its gradient
    all-reduce, modelled on ``cluster`` (default :func:`run_cluster`), and the optimizer
    step, the rest (never below 0): ``update_s + allreduce_s`` is the measured update.
    """
    plan = trace_plan(trace)
    shape = plan.shape(1)
    stages = shape.num_stages
    replicas = run_replicas(trace)
    durations: dict[tuple[int, str], list[float]] = defaultdict(list)
    sizes: dict[tuple[int, str], list[int]] = defaultdict(list)
    gaps: dict[tuple[int, str], list[float]] = defaultdict(list)
    # A predicted forward's time includes its prediction, which the runtime timed on its
    # own (CPU): the forward cost is what is left, the prediction its own cost, which the
    # simulator adds back on exactly the forwards its version analysis predicts.
    predict = stage_floats(trace.meta.get("predict_s"))
    # Ŵ a predicted forward's recomputed units hold until its backward (0: none)
    held = {k: int(v) for k, v in stage_floats(trace.meta.get("recompute_held_bytes")).items()}
    for e in trace.events:
        extra = predict.get(e.stage, 0.0) if e.kind == "F" and e.distance > 0 else 0.0
        durations[(e.stage, e.kind)].append(max(e.duration - extra, 0.0))
        sizes[(e.stage, e.kind)].append(e.bytes)

    def med(stage: int, kind: str) -> float:
        values = durations.get((stage, kind))
        return statistics.median(values) if values else 0.0

    def size(stage: int, kind: str) -> int:
        values = sizes.get((stage, kind))
        return int(statistics.median(values)) if values else 0

    # The executor's own time between actions (bookkeeping, launching transfers) occupies
    # the rank too: charge each action the median gap that precedes it on its rank.
    by_rank: dict[int, list[TraceEvent]] = defaultdict(list)
    for e in trace.events:
        by_rank[e.rank].append(e)
    for events in by_rank.values():
        events.sort(key=lambda e: e.start)
        for before, e in itertools.pairwise(events):
            gaps[(e.stage, e.kind)].append(max(0.0, e.start - before.end))

    def cost(stage: int, kind: str) -> float:
        values = gaps.get((stage, kind))
        return med(stage, kind) + (statistics.median(values) if values else 0.0)

    missing = [k for k in range(stages) if (k, "F") not in durations]
    if missing:
        raise PipeoptimError(
            f"the trace has no forward of stages {missing}; calibrate from a run's whole "
            f"trace (every rank's events)"
        )
    # Static memory per stage: the most any sample of the rank holding it shows (optimizer
    # state appears at the first update), split evenly among the rank's stages
    # (interleaved schedules hold several).
    most: dict[tuple[int, str], int] = defaultdict(int)
    for m in trace.memory:
        for key in ("weights", "optimizer"):
            most[(m.rank, key)] = max(most[(m.rank, key)], int(m.detail.get(key, 0)))
    rank_of = {e.stage: e.rank for e in trace.events}
    per_rank: dict[int, int] = defaultdict(int)
    for k in range(stages):
        per_rank[rank_of[k]] += 1

    def static(k: int, key: str) -> int:
        return most[(rank_of[k], key)] // per_rank[rank_of[k]]

    batch = trace.meta.get("batch_size") or 1
    split = [cost(k, "I") + cost(k, "W") for k in range(stages)]  # a split backward's halves
    costs = CostModel(
        forward_s=tuple(cost(k, "F") + cost(k, "SEND_F") for k in range(stages)),
        backward_s=tuple(cost(k, "B") + split[k] + cost(k, "SEND_B") for k in range(stages)),
        weight_grad_fraction=tuple(
            cost(k, "W") / split[k] if split[k] > 0 else 0.5 for k in range(stages)
        ),
        update_s=tuple(cost(k, "U") for k in range(stages)),
        predict_s=tuple(predict.get(k, 0.0) for k in range(stages)),
        param_bytes=tuple(static(k, "weights") for k in range(stages)),
        optimizer_state_bytes=tuple(static(k, "optimizer") for k in range(stages)),
        activation_bytes=tuple(size(k, "F") for k in range(stages)),
        send_forward_bytes=tuple(size(k, "SEND_F") for k in range(stages - 1)),
        send_backward_bytes=tuple(size(k + 1, "SEND_B") for k in range(stages - 1)),
        latency_s=tuple(link_latencies(align_clocks(trace).trace, stages)),
        bandwidth=(math.inf,) * (stages - 1),
        samples_per_micro_batch=float(batch) / (replicas * shape.micro_batches),
        optimizer=plan.optimizer.family,
        held_weight_bytes=tuple(held.get(k, 0) for k in range(stages)),
    )
    fit = machine_fit(trace)
    if fit is not None and _uses_fit(trace, fit):
        costs = shared_costs(costs, fit)
    if replicas == 1:
        return costs
    costs = with_allreduce(costs, replicas, cluster or run_cluster(trace), plan.num_stages)
    step = [max(u - a, 0.0) for u, a in zip(costs.update_s, costs.allreduce_s, strict=True)]
    return replace(costs, update_s=tuple(step))
