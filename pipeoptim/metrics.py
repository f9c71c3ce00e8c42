"""Run metrics from any Trace, simulated or measured: one function, one typed result.

Definitions (all times in the trace's seconds):

* **span**: last end minus first start over compute events (F, B, U) of all ranks.
* **samples**: micro-batches that ran a forward on the first stage, times the samples per
  micro-batch. That is ``meta["batch_size"] / meta["micro_batches"]`` (batch size = samples
  per mini-batch) when the trace's meta has a ``batch_size``, else
  ``meta["samples_per_micro_batch"]``, else 1 sample per micro-batch. A data-parallel run
  (``meta["data_parallel"]`` replicas) records the global batch of all replicas there, so
  samples and throughput count every replica.
* **throughput**: whole run, ``samples / span`` (warm-up and drain included).
* **steady-state throughput**: from the completion times of the last stage's updates (one
  per mini-batch). With ``n`` updates, the first and last ``n // 4`` are dropped (warm-up and
  drain); the rate is mini-batches per second between the first and last kept update, times
  samples per mini-batch. With fewer than 2 updates it is the whole-run throughput. For a
  flushed method this is the per-mini-batch rate including each flush's bubble; for an
  asynchronous one it converges to ``1 / max_k(F_k + B_k + U_k)`` per micro-batch.
* **bubble ratio** of a rank: ``1 - busy / span`` with busy the summed durations of its
  compute events; overall: ``1 - sum(busy) / (ranks * span)``. Communication events are not
  compute: a rank that only waits for a transfer is idle. Each stage reports the bubble of
  the rank it runs on (equal to its own when every rank runs one stage).
* **staleness** of update U(t) on stage k: its ``weight_version`` (the version it is
  applied to) minus the oldest version the backwards of mini-batch t used on stage k.
* **inconsistency** of a micro-batch on a stage: its backward's version minus its forward's
  (0 when the forward's weights, stashed or predicted, stand for the backward's version).
* **peak memory** per stage: the largest ``"stage:<k>"`` entry of the memory samples'
  detail, or, for ranks that run a single stage, the rank's largest sample.
* **weight copies** per stage: ``meta["weight_copies"]`` where the producer recorded it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeoptim.trace import Trace

__all__ = ["RunMetrics", "StageMetrics", "compute_metrics", "steady_state_throughput"]

COMPUTE_KINDS = frozenset({"F", "B", "I", "W", "U"})


@dataclass(frozen=True)
class StageMetrics:
    """Metrics of one pipeline stage."""

    stage: int
    rank: int
    """Rank (device) the stage ran on."""
    busy_s: float
    """Summed duration of the stage's compute events."""
    bubble_ratio: float
    """Idle fraction of the stage's rank over the span."""
    updates: int
    """Optimizer updates the stage made."""
    max_staleness: int
    mean_staleness: float
    max_inconsistency: int
    """Largest |backward version - forward version| over the stage's micro-batches."""
    mean_inconsistency: float
    max_distance: int
    """Largest prediction distance s of the stage's forwards."""
    peak_memory_bytes: int | None
    """None when the trace has no memory samples for the stage."""
    weight_copies: int | None
    """None when the producer did not record it."""


@dataclass(frozen=True)
class RunMetrics:
    """Everything :func:`compute_metrics` derives from one trace."""

    method: str | None
    source: str | None
    """``sim`` or ``runtime`` (from the trace's meta)."""
    num_ranks: int
    num_stages: int
    span_s: float
    samples: float
    micro_batches: int
    """Micro-batches that ran (forwards on the first stage)."""
    throughput: float
    """Whole-run samples per second."""
    steady_throughput: float
    """Steady-state samples per second (module docstring)."""
    bubble_ratio: float
    """Overall idle fraction of all ranks."""
    rank_bubble: dict[int, float]
    stages: dict[int, StageMetrics]
    peak_memory_bytes: int | None
    """Peak of the fullest stage."""
    max_staleness: int
    max_inconsistency: int
    max_weight_copies: int | None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form (stage keys as strings)."""
        out: dict[str, Any] = {
            k: v for k, v in self.__dict__.items() if k not in ("stages", "rank_bubble")
        }
        out["rank_bubble"] = {str(k): v for k, v in self.rank_bubble.items()}
        out["stages"] = {str(k): dict(s.__dict__) for k, s in self.stages.items()}
        return out


def steady_state_throughput(
    update_ends: Sequence[float], samples_per_update: float
) -> float | None:
    """Samples per second between the kept updates (module docstring); None if < 2."""
    ends = sorted(update_ends)
    n = len(ends)
    if n < 2:
        return None
    cut = n // 4
    lo, hi = cut, n - 1 - cut
    if hi <= lo:
        lo, hi = 0, n - 1
    window = ends[hi] - ends[lo]
    if window <= 0:
        return None
    return (hi - lo) * samples_per_update / window


def _int_keys(value: Any) -> dict[int, int]:
    if not isinstance(value, Mapping):
        return {}
    return {int(k): int(v) for k, v in value.items()}


def compute_metrics(trace: Trace) -> RunMetrics:
    """Throughput, bubbles, staleness, inconsistency and memory of a run (see module doc)."""
    meta = trace.meta
    compute = [e for e in trace.events if e.kind in COMPUTE_KINDS]
    m = int(meta.get("micro_batches") or 1)
    if meta.get("batch_size") is not None:
        per_micro = float(meta["batch_size"]) / m
    else:
        per_micro = float(meta.get("samples_per_micro_batch") or 1.0)
    if not compute:
        return RunMetrics(
            meta.get("method"),
            meta.get("source"),
            0,
            0,
            0.0,
            0.0,
            0,
            0.0,
            0.0,
            0.0,
            {},
            {},
            None,
            0,
            0,
            None,
        )
    first = min(e.start for e in compute)
    span = max(e.end for e in compute) - first
    rank_busy: dict[int, float] = {}
    stage_busy: dict[int, float] = {}
    stage_rank: dict[int, int] = {}
    forwards: dict[tuple[int, int], int] = {}
    backwards: dict[tuple[int, int], int] = {}
    updates: dict[int, list[tuple[int, int, float]]] = {}  # stage -> (t, version, end)
    distance: dict[int, int] = {}
    for e in compute:
        d = e.end - e.start
        rank_busy[e.rank] = rank_busy.get(e.rank, 0.0) + d
        stage_busy[e.stage] = stage_busy.get(e.stage, 0.0) + d
        stage_rank.setdefault(e.stage, e.rank)
        if e.kind == "F":
            forwards[(e.stage, e.mb)] = e.weight_version
            distance[e.stage] = max(distance.get(e.stage, 0), e.distance)
        elif e.kind in ("B", "W"):  # a split backward's W makes the gradient, as a B does
            backwards[(e.stage, e.mb)] = e.weight_version
        elif e.kind == "U":
            updates.setdefault(e.stage, []).append((e.mb, e.weight_version, e.end))
    stages_sorted = sorted(stage_busy)
    first_stage = stages_sorted[0]
    micro = sum(1 for (k, _) in forwards if k == first_stage)
    samples = micro * per_micro
    throughput = samples / span if span > 0 else 0.0
    last_updates = [end for _, _, end in updates.get(stages_sorted[-1], [])]
    steady = steady_state_throughput(last_updates, per_micro * m)
    bubble = {r: (1.0 - b / span if span > 0 else 0.0) for r, b in sorted(rank_busy.items())}
    overall = 1.0 - sum(rank_busy.values()) / (span * len(rank_busy)) if span > 0 else 0.0

    staleness: dict[int, list[int]] = {}
    for k, ups in updates.items():
        for t, version, _ in ups:
            used = [backwards[(k, t * m + j)] for j in range(m) if (k, t * m + j) in backwards]
            if used:
                staleness.setdefault(k, []).append(version - min(used))
    inconsistency: dict[int, list[int]] = {}
    for key, fv in forwards.items():
        if key in backwards:
            inconsistency.setdefault(key[0], []).append(backwards[key] - fv)

    peaks = _peak_memory(trace, stage_rank)
    copies = _int_keys(meta.get("weight_copies"))
    stages: dict[int, StageMetrics] = {}
    for k in stages_sorted:
        st = staleness.get(k, [])
        inc = [abs(v) for v in inconsistency.get(k, [])]
        r = stage_rank[k]
        stages[k] = StageMetrics(
            stage=k,
            rank=r,
            busy_s=stage_busy[k],
            bubble_ratio=bubble[r],
            updates=len(updates.get(k, [])),
            max_staleness=max(st, default=0),
            mean_staleness=sum(st) / len(st) if st else 0.0,
            max_inconsistency=max(inc, default=0),
            mean_inconsistency=sum(inc) / len(inc) if inc else 0.0,
            max_distance=distance.get(k, 0),
            peak_memory_bytes=peaks.get(k),
            weight_copies=copies.get(k),
        )
    return RunMetrics(
        method=meta.get("method"),
        source=meta.get("source"),
        num_ranks=len(rank_busy),
        num_stages=len(stages),
        span_s=span,
        samples=samples,
        micro_batches=micro,
        throughput=throughput,
        steady_throughput=throughput if steady is None else steady,
        bubble_ratio=overall,
        rank_bubble=bubble,
        stages=stages,
        peak_memory_bytes=max(peaks.values()) if peaks else None,
        max_staleness=max((s.max_staleness for s in stages.values()), default=0),
        max_inconsistency=max((s.max_inconsistency for s in stages.values()), default=0),
        max_weight_copies=max(copies.values()) if copies else None,
    )


def _peak_memory(trace: Trace, stage_rank: Mapping[int, int]) -> dict[int, int]:
    """Peak bytes per stage from memory samples (module docstring)."""
    peaks: dict[int, int] = {}
    rank_peak: dict[int, int] = {}
    for sample in trace.memory:
        rank_peak[sample.rank] = max(rank_peak.get(sample.rank, 0), sample.bytes)
        for key, value in sample.detail.items():
            if key.startswith("stage:") and key[6:].isdigit():
                k = int(key[6:])
                peaks[k] = max(peaks.get(k, 0), int(value))
    per_rank: dict[int, list[int]] = {}
    for k, r in stage_rank.items():
        per_rank.setdefault(r, []).append(k)
    for r, ks in per_rank.items():
        if len(ks) == 1 and ks[0] not in peaks and r in rank_peak:
            peaks[ks[0]] = rank_peak[r]
    return peaks
