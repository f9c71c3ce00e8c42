"""Calibration: feed what a run measured back into the simulator and see how close it was.

A runtime Trace carries every action's measured duration and every rank's memory. The
per-stage medians become a :class:`~pipeoptim.sim.costs.CostModel`; the simulator replays
the run's own method and shape on it; the two Traces go through the same metrics function,
and the comparison lists predicted against measured with the relative error. This is the
one place that reads runtime output and drives the simulator; it needs no torch (both sides
speak the shared Trace).

A data-parallel run (``meta["data_parallel"]`` = D replicas; the events are replica 0's)
trains B/(D·M) samples per micro-batch, and every measured update includes the blocking
all-reduce of the stage's gradients. The all-reduce is modelled as the simulator models it
(:mod:`pipeoptim.sim.collectives`, a ring over the stage's D replicas, its gradient one
parameter-sized copy) on :func:`run_cluster`; the rest of the measured update is the
optimizer step, which does not depend on D. So the run's own prediction keeps its measured
update time, and a prediction for another D (:func:`what_if`) swaps the all-reduce only.

The ranks' clocks are put on one clock by their messages first (each rank takes its origin
after a barrier; on a loaded machine they differ by milliseconds: :mod:`pipeoptim.tracefit`).
For a run of several processes the costs are what :func:`machine_fit` fits: every action's
work (under processor sharing where the ranks shared their host's cores: the trace's
machine record, ``meta["machine"]``, else fitted), each message's fixed cost at both ends,
each link's fastest message, and the machine, which the simulator then shares among the
busy ranks where they outnumber its cores. A one-process run (the local transport), and a
trace of a core per rank that recorded no message, keep the per-stage medians. Why the
fit with a core per rank too: the medians leave out the work of taking a message in and
the executor's time before each receive, which on a small model is most of a step; on 2
ranks with a core each they under-predicted the time per mini-batch by 28 % (1f1b), 48 %
(pipeoptim) and 54 % (pipedream) on the digits MLP, the fit by 2.5 %, 4.8 % and 15 %
(issue 34).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipeoptim.errors import PipeoptimError
from pipeoptim.metrics import COMPUTE_KINDS, RunMetrics, compute_metrics
from pipeoptim.plan.machine import Machine
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import Plan
from pipeoptim.plan.profile import LayerProfile, Profile
from pipeoptim.plan.replicas import check_batch_split, check_replicas
from pipeoptim.sim.collectives import Cluster, allreduce_times
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.evaluate import evaluate_trace
from pipeoptim.trace import Trace, TraceEvent
from pipeoptim.tracefit.clocks import align_clocks
from pipeoptim.tracefit.costs import profile_meta, shared_costs, with_profile_machine
from pipeoptim.tracefit.fit import MachineFit, fit_machine


@dataclass(frozen=True)
class Comparison:
    """One quantity, measured against predicted."""

    quantity: str
    measured: float
    predicted: float
    unit: str

    @property
    def relative_error(self) -> float:
        """(predicted - measured) / measured; NaN when nothing was measured."""
        if self.measured == 0:
            return math.nan
        return (self.predicted - self.measured) / self.measured

    def to_dict(self) -> dict[str, float | str]:
        """The row as ``calibrate --json`` prints it."""
        return {
            "quantity": self.quantity,
            "measured": self.measured,
            "predicted": self.predicted,
            "unit": self.unit,
            "relative_error": self.relative_error,
        }


def _plan_of(trace: Trace) -> Plan:
    data = trace.meta.get("plan")
    if trace.meta.get("source") != "runtime" or not isinstance(data, dict):
        raise PipeoptimError(
            "calibration needs a trace written by `pipeoptim train --trace FILE` (its meta "
            f"has source 'runtime' and the plan); this one has source "
            f"{trace.meta.get('source')!r}"
        )
    return Plan.from_dict(data, source="the trace's plan")


def run_replicas(trace: Trace) -> int:
    """D: the replicas of the measured pipeline (``meta["data_parallel"]``, else the plan's;
    1 for a trace from before replicas were recorded)."""
    raw = trace.meta.get("data_parallel")
    if raw is None:
        return _plan_of(trace).data_parallel
    return check_replicas(raw, "the trace's meta data_parallel", error=PipeoptimError)


_CLUSTER_NOTES = ("bandwidth_bytes_per_s", "latency_s", "gpus_per_node")


def cluster_recorded(trace: Trace) -> bool:
    """Whether the run's plan records the cluster it was made for (in its notes)."""
    return any(key in _plan_of(trace).notes for key in _CLUSTER_NOTES)


def run_cluster(trace: Trace) -> Cluster:
    """The links the run's all-reduce is modelled on: the cluster its plan records in its
    notes (a plan from ``pipeoptim plan --devices``; None there is a free bandwidth), else
    one tier at the run's median measured link latency with free bandwidth (the ranks of a
    run on one machine talk over the same transport as its pipeline links)."""
    plan = _plan_of(trace)
    notes = plan.notes
    latencies = link_latencies(align_clocks(trace).trace, plan.shape(1).num_stages)
    measured = statistics.median(latencies) if latencies else 0.0
    if not cluster_recorded(trace):
        return Cluster(math.inf, measured)

    def number(key: str, default: float | None) -> float | None:
        value = notes.get(key, default)
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return None if value is None else float(value)
        raise PipeoptimError(
            f"the trace's plan notes {key} must be a number (got {value!r}); fix the plan's "
            f"notes, or pass the cluster to `pipeoptim calibrate` (--bandwidth, --latency, "
            f"--gpus-per-node, --inter-node-bandwidth, --inter-node-latency)"
        )

    bandwidth = number("bandwidth_bytes_per_s", None)
    latency = number("latency_s", measured)
    gpus = notes.get("gpus_per_node")
    inter_bw = inter_lat = None
    if gpus is not None and "inter_node_bandwidth_bytes_per_s" in notes:
        value = number("inter_node_bandwidth_bytes_per_s", None)
        inter_bw = math.inf if value is None else value
    if gpus is not None:
        inter_lat = number("inter_node_latency_s", None)
    return Cluster(
        math.inf if bandwidth is None else bandwidth,
        measured if latency is None else latency,
        gpus,
        inter_bw,
        inter_lat,
    )


def with_allreduce(costs: CostModel, replicas: int, cluster: Cluster, num_ranks: int) -> CostModel:
    """``costs`` (one replica's, with optimizer-step update times) as ``replicas`` replicas
    whose updates also all-reduce the stage's gradients on ``cluster`` (stage s on pipeline
    rank ``s mod num_ranks``). The pipeline links keep their (measured) costs."""
    return replace(
        costs,
        data_parallel=replicas,
        allreduce_s=allreduce_times(costs.grad_bytes, replicas, cluster, num_ranks),
    )


def run_machine(trace: Trace) -> Machine | None:
    """The host the run's ranks shared, as its trace records it (None: not recorded)."""
    data = trace.meta.get("machine")
    if data is None:
        return None
    try:
        return Machine.from_dict(data, "the trace's machine record")
    except PipeoptimError as err:
        raise PipeoptimError(f"{err} (in the trace's meta)") from None


def machine_fit(trace: Trace) -> MachineFit | None:
    """The machine model fitted from a multi-process run (:mod:`pipeoptim.tracefit`): its
    recorded machine, or one host holding every rank with its cores fitted; None for a
    one-process run (every stage takes turns in one process: nothing to share)."""
    if trace.meta.get("transport") == "local":
        return None
    ranks = len({e.rank for e in trace.events})
    if ranks == 0:
        return None
    threads = trace.meta.get("threads")
    default = Machine(1, ranks, threads if isinstance(threads, int) and threads >= 1 else 1)
    predict = _stage_floats(trace.meta.get("predict_s"))
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
    (:func:`pipeoptim.tracefit.costs.shared_costs`; module docstring: why).

    Under data parallelism (:func:`run_replicas` D > 1) a micro-batch is B/(D·M) samples
    of the global batch B, and each stage's measured update is split into its gradient
    all-reduce, modelled on ``cluster`` (default :func:`run_cluster`), and the optimizer
    step, the rest (never below 0): ``update_s + allreduce_s`` is the measured update.
    """
    plan = _plan_of(trace)
    shape = plan.shape(1)
    stages = shape.num_stages
    replicas = run_replicas(trace)
    durations: dict[tuple[int, str], list[float]] = defaultdict(list)
    sizes: dict[tuple[int, str], list[int]] = defaultdict(list)
    gaps: dict[tuple[int, str], list[float]] = defaultdict(list)
    # A predicted forward's time includes its prediction, which the runtime timed on its
    # own (CPU): the forward cost is what is left, the prediction its own cost, which the
    # simulator adds back on exactly the forwards its version analysis predicts.
    predict = _stage_floats(trace.meta.get("predict_s"))
    # Ŵ a predicted forward's recomputed units hold until its backward (0: none)
    held = {k: int(v) for k, v in _stage_floats(trace.meta.get("recompute_held_bytes")).items()}
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


def _stage_floats(data: object) -> dict[int, float]:
    """``{"0": 0.01, ...}`` from a trace's meta as ``{0: 0.01}`` (nothing when absent)."""
    if not isinstance(data, dict):
        return {}
    return {int(k): float(v) for k, v in data.items()}


def link_latencies(trace: Trace, num_stages: int) -> list[float]:
    """Median arrival delay per edge, both directions: receive end minus the later of the
    send's start and the receive's start (a receive posted late finds the data there)."""
    starts = {
        (e.kind, e.stage, e.mb): e for e in trace.events if e.kind.startswith(("SEND", "RECV"))
    }
    delays: dict[int, list[float]] = defaultdict(list)
    for (kind, stage, mb), recv in starts.items():
        if kind == "RECV_F":
            send, edge = starts.get(("SEND_F", stage - 1, mb)), stage - 1
        elif kind == "RECV_B":
            send, edge = starts.get(("SEND_B", stage + 1, mb)), stage
        else:
            continue
        if send is not None:
            delays[edge].append(max(0.0, recv.end - max(send.start, recv.start)))
    return [statistics.median(delays[k]) if delays[k] else 0.0 for k in range(num_stages - 1)]


def predict_run(trace: Trace, cluster: Cluster | None = None) -> Trace:
    """The simulator's Trace of the measured run's method and shape on calibrated costs
    (its D replicas' all-reduce on ``cluster``, default :func:`run_cluster`)."""
    plan = _plan_of(trace)
    mini_batches = int(trace.meta.get("mini_batches") or 0)
    if mini_batches < 1:
        raise PipeoptimError("the trace records no mini-batches; was the run empty?")
    shape = plan.shape(mini_batches)
    predicted = evaluate_trace(plan.method, shape, costs_from_trace(trace, cluster))
    predicted.meta["batch_size"] = trace.meta.get("batch_size")
    return predicted


def compare(measured: RunMetrics, predicted: RunMetrics, batch_size: float) -> list[Comparison]:
    """Iteration time, throughput, bubble ratio and peak memory, side by side."""

    def per_batch(m: RunMetrics) -> float:
        return batch_size / m.steady_throughput if m.steady_throughput > 0 else 0.0

    rows = [
        Comparison(
            "time per mini-batch (steady state)", per_batch(measured), per_batch(predicted), "s"
        ),
        Comparison("whole-run throughput", measured.throughput, predicted.throughput, "samples/s"),
        Comparison("bubble ratio", measured.bubble_ratio, predicted.bubble_ratio, ""),
    ]
    if measured.peak_memory_bytes is not None and predicted.peak_memory_bytes is not None:
        rows.append(
            Comparison(
                "peak memory, fullest rank",
                float(measured.peak_memory_bytes),
                float(predicted.peak_memory_bytes),
                "B",
            )
        )
    return rows


def calibrate(trace: Trace, cluster: Cluster | None = None) -> tuple[Trace, list[Comparison]]:
    """Predict the measured run and compare; returns the predicted trace and the rows
    (``cluster``: the links of a data-parallel run's all-reduce, default
    :func:`run_cluster`)."""
    predicted = predict_run(trace, cluster)
    batch = float(trace.meta.get("batch_size") or 1)
    return predicted, compare(compute_metrics(trace), compute_metrics(predicted), batch)


BUBBLE_NOTE_RATIO = 1.1
"""Where the simulated actions hold this much more time than the run's compute events,
:func:`bubble_note` says why the bubble ratios differ."""


def compute_seconds(trace: Trace) -> float:
    """The summed durations of a trace's compute events (what its bubble ratio counts busy)."""
    return sum(e.duration for e in trace.events if e.kind in COMPUTE_KINDS)


def compute_ratio(measured: Trace, predicted: Trace) -> float:
    """The simulated actions' time over the run's compute time (nan where the run has none):
    how much of the messages' fixed cost and the executor's time calibration charged to
    the actions."""
    run = compute_seconds(measured)
    return compute_seconds(predicted) / run if run > 0 else math.nan


def bubble_note(measured: Trace, predicted: Trace) -> str | None:
    """Why the bubble ratios of a calibration differ by construction, where they do: the
    simulated actions carry the fixed cost of each message and the executor's time between
    actions (calibration charges them to the actions, so the time per mini-batch comes out
    right), which the run's trace leaves outside its compute events, as idle. None where
    the two hold about the same compute time (large actions: the bubbles compare)."""
    ratio = compute_ratio(measured, predicted)
    if not ratio > BUBBLE_NOTE_RATIO:  # nan (no compute events) included
        return None
    return (
        f"note: the bubble ratios differ by construction here: the simulated actions hold "
        f"{ratio:.1f}x the run's compute time, since they carry each message's fixed "
        f"cost and the executor's time between actions, which the run's trace counts as idle "
        f"(outside its compute events); compare the time per mini-batch and the throughput"
    )


def format_comparison(rows: Sequence[Comparison]) -> list[list[str]]:
    """Table rows: quantity, measured, predicted, relative error in percent."""

    def show(value: float, unit: str) -> str:
        if unit == "B":
            from pipeoptim.plan.units import format_bytes

            return format_bytes(int(value))
        return f"{value:.4g}" + (f" {unit}" if unit else "")

    return [
        [
            r.quantity,
            show(r.measured, r.unit),
            show(r.predicted, r.unit),
            "n/a" if math.isnan(r.relative_error) else f"{100 * r.relative_error:+.1f}%",
        ]
        for r in rows
    ]


def run_boundaries(trace: Trace) -> list[tuple[int, int]]:
    """The layer ranges the measured run's stages held (its plan's, or the even split the
    runtime recorded)."""
    plan = _plan_of(trace)
    raw = plan.boundaries or trace.meta.get("boundaries")
    if not raw:
        raise PipeoptimError(
            "the trace records no layer boundaries (a trace from an older pipeoptim, or a "
            "model that was not split by layers); rerun `pipeoptim train --trace FILE` with "
            "this version"
        )
    return [(int(a), int(b)) for a, b in raw]


def _split(total: float, weights: Sequence[float]) -> list[float]:
    """``total`` in proportion to ``weights`` (evenly when they are all 0)."""
    whole = math.fsum(weights)
    if whole <= 0:
        return [total / len(weights)] * len(weights)
    return [total * w / whole for w in weights]


def _split_int(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` bytes in proportion to ``weights``, summing to ``total`` exactly."""
    parts = [int(x) for x in _split(float(total), weights)]
    parts[-1] += total - sum(parts)
    return parts


def calibrated_profile(
    trace: Trace, profile: Profile | None = None, cluster: Cluster | None = None
) -> Profile:
    """The measured run's costs as a per-layer :class:`Profile` for one replica's mini-batch
    (B/D samples of the global batch B; all of it without replicas). Its update times are
    the optimizer step alone: a data-parallel run's modelled all-reduce (on ``cluster``,
    :func:`costs_from_trace`) is left out, for ``simulate --data-parallel D`` to add.

    Each stage's calibrated costs (:func:`costs_from_trace`) are shared among its layers:
    times in proportion to ``profile``'s layer times, bytes, update and prediction times in
    proportion to its parameter bytes (evenly per layer without a profile). The last layer
    of a stage carries the bytes the stage sends, so cutting this profile at the run's
    boundaries gives back the calibrated costs; cut elsewhere (other stage counts), it
    predicts from measured totals. The part of a time that does not shrink with the batch
    is, at the run's micro-batch size, the same fraction as in ``profile`` (which times
    layers at several sizes); without one, times scale in proportion to the batch. A stage
    whose prediction was not measured (a method that does not predict, the last stage)
    gets ``profile``'s prediction times, else its update time as an estimate of one pass
    over its weights; ``meta["predict_estimated"]`` lists them.
    """
    plan = _plan_of(trace)
    costs = costs_from_trace(trace, cluster)
    bounds = run_boundaries(trace)
    num_layers = bounds[-1][1]
    if profile is not None and profile.num_layers != num_layers:
        raise PipeoptimError(
            f"the profile has {profile.num_layers} layers but the measured run's model has "
            f"{num_layers}; pass the profile of the model that ran"
        )
    m = plan.shape(1).micro_batches
    micro = costs.samples_per_micro_batch
    dtype_bytes = profile.dtype_bytes if profile is not None else 4
    measured_prediction = _stage_floats(trace.meta.get("predict_s"))
    layers: list[LayerProfile] = []
    estimated: list[int] = []
    last = len(bounds) - 1
    for k, (start, end) in enumerate(bounds):
        span = range(start, end)
        offline = [profile.layers[i] for i in span] if profile is not None else None
        time_share = [x.compute_s for x in offline] if offline else [1.0] * len(span)
        byte_share = [float(x.param_bytes) for x in offline] if offline else [1.0] * len(span)
        # Times of one micro-batch of the run, and their fixed parts, scaled to the batch.
        forward_run = _split(costs.forward_s[k], time_share)
        backward_run = _split(costs.backward_s[k], time_share)
        fixed_f = _fixed_fraction(offline, micro, profile, "forward")
        fixed_b = _fixed_fraction(offline, micro, profile, "backward")
        forward_fixed = [fixed_f * t for t in forward_run]
        backward_fixed = [fixed_b * t for t in backward_run]
        forward = [c + (t - c) * m for t, c in zip(forward_run, forward_fixed, strict=True)]
        backward = [c + (t - c) * m for t, c in zip(backward_run, backward_fixed, strict=True)]
        update = _split(costs.update_s[k], byte_share)
        if k in measured_prediction:
            predict = _split(costs.predict_s[k], byte_share)
        elif offline is not None and any(x.predict_s for x in offline):
            predict = [x.predict_s for x in offline]
        else:
            predict = list(update)
            estimated.append(k)
        params = _split_int(costs.param_bytes[k], byte_share)
        state = _split_int(costs.optimizer_state_bytes[k], byte_share)
        saved = costs.activation_bytes[k] * m
        if k < last and len(span) > 1:  # the last layer's output crosses to the next stage
            sent = costs.send_forward_bytes[k] * m
            activations = [*_split_int(max(saved - sent, 0), [1.0] * (len(span) - 1)), sent]
        elif k < last:
            activations = [max(saved, costs.send_forward_bytes[k] * m)]
        else:
            activations = _split_int(saved, [1.0] * len(span))
        names = [x.name for x in offline] if offline else [f"{i}:layer" for i in span]
        for j in range(len(span)):
            layers.append(
                LayerProfile(
                    name=names[j],
                    forward_s=forward[j],
                    backward_s=backward[j],
                    activation_bytes=activations[j],
                    param_bytes=params[j],
                    optimizer_state_bytes=state[j],
                    param_count=params[j] // dtype_bytes,
                    update_s=update[j],
                    predict_s=predict[j],
                    forward_fixed_s=forward_fixed[j],
                    backward_fixed_s=backward_fixed[j],
                )
            )
    latencies = costs.latency_s
    device = str(trace.meta.get("device", "cpu")).split(" ")[0]
    return Profile(
        layers=tuple(layers),
        batch_size=max(1, round(micro * m)),
        optimizer=costs.optimizer,
        device=device,
        dtype_bytes=dtype_bytes,
        meta={
            "source": "pipeoptim calibrate",
            "model": plan.model,
            "calibrated_from": {
                "method": plan.method,
                "stages": len(bounds),
                "micro_batches": m,
                "data_parallel": costs.data_parallel,
            },
            "link_latency_s": statistics.median(latencies) if latencies else 0.0,
            "predict_estimated": estimated,
            **({"threads": trace.meta["threads"]} if "threads" in trace.meta else {}),
            **profile_meta(costs),
        },
    )


def _fixed_fraction(
    layers: Sequence[LayerProfile] | None, samples: float, profile: Profile | None, part: str
) -> float:
    """The fraction of ``layers``' ``part`` time (forward/backward) that is fixed when they
    run ``samples`` samples, by ``profile``'s fit; 0 without a profile."""
    if not layers or profile is None:
        return 0.0
    index = 0 if part == "forward" else 1
    total = math.fsum(x.time_at(samples, profile.batch_size)[index] for x in layers)
    fixed = math.fsum(getattr(x, f"{part}_fixed_s") for x in layers)
    return min(fixed / total, 1.0) if total > 0 else 0.0


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

    plan = _plan_of(trace)
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
