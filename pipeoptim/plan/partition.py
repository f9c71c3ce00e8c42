"""Memory-aware partitioning of a layer chain into pipeline stages.

A pipeline runs at the pace of its slowest stage, so the partitioner cuts the profile's
``L`` layers into ``P`` contiguous stages that minimise the slowest stage's time, subject to
every stage fitting in one device's memory. It is exact: a min–max dynamic programme over
(stage, end layer) with prefix sums, whose inner minimisation over the start layer is one
numpy broadcast per stage — ``O(P·L²)`` arithmetic in ``P`` vectorised steps (1,000 layers
into 64 stages: under a second on a 2-core machine; ``benchmarks/bench_partition.py``).

Cost model (``a_l`` = output activation bytes of layer ``l``, ``bw`` =
``bandwidth_bytes_per_s``, ``lat`` = ``latency_s``). Stage ``k`` of ``P`` holding layers
``[i, j)``::

    time_k   = Σ_{l=i}^{j-1} (forward_s_l + backward_s_l) + comm_k
    comm_k   = [k > 0]     · (2·a_{i-1} / bw + 2·lat)   # receive activation, send its gradient
             + [k < P - 1] · (2·a_{j-1} / bw + 2·lat)   # send activation, receive its gradient
    memory_k = (weight_copies_k + 1)·Σ param_bytes + Σ optimizer_state_bytes
             + activation_slots_k·Σ_{l=i}^{j-1} a_l      # "+ 1": the gradients

Communication is counted in full on both ends of a link and is not overlapped with compute
(a conservative, per-batch model). ``weight_copies_k`` and
``activation_slots_k`` depend on the training method: see :func:`method_memory_factors`.

Two options serve data-parallel plans (PP x DP), where links come in tiers and updates
all-reduce: ``edges`` gives every stage edge its own ``(bw, lat)`` in place of one link, and
``sync`` charges stage ``k`` ``per_byte_k · Σ param_bytes + fixed_k`` seconds more (its
gradient all-reduce, shared among the units of an update: linear in the stage's bytes, so
the programme stays exact).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np
import numpy.typing as npt

from pipeoptim.errors import PlanError
from pipeoptim.plan.graph import stage_graph, stage_memory_bytes, validate_boundaries
from pipeoptim.plan.limits import check_partition_size
from pipeoptim.plan.methods import METHODS
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.units import format_bytes, parse_bandwidth, parse_bytes

__all__ = [
    "MEMORY_METHODS",
    "MemoryFactors",
    "Partition",
    "equal_layer_partition",
    "evaluate_partition",
    "method_memory_factors",
    "min_memory_partition",
    "optimal_partition",
    "stage_comm_s",
]

MemoryFactors = Callable[[int, int], tuple[int, int]]
"""``(stage_index, num_stages) -> (weight_copies, activation_slots)`` of one stage."""

MEMORY_METHODS = tuple(METHODS)
"""Methods :func:`method_memory_factors` knows."""

_INT_LIMIT = 2**62  # caps above this are "no cap" (keeps int64 sums from overflowing)


def _factor_rule(method: str, micro_batches: int) -> Callable[[int, int], tuple[int, int]]:
    m = micro_batches
    rules: dict[str, Callable[[int, int], tuple[int, int]]] = {
        # flush methods: one weight version; activations of the micro-batches in flight
        "gpipe": lambda k, p: (1, m),
        "1f1b": lambda k, p: (1, min(p - k, m)),
        "interleaved-1f1b": lambda k, p: (1, min(p - k, m)),
        # weight stashing: one version per mini-batch in flight (d_k + 1 = P - k)
        "pipedream": lambda k, p: (p - k, p - k),
        # double-buffered weights, 1F1B over micro-batches
        "2bw": lambda k, p: (2, min(p - k, m)),
        # prediction methods: current + predicted weights (the last stage, s = 0, predicts
        # nothing); async 1F1B, P - k units in flight
        "spectrain": lambda k, p: (1 if k == p - 1 else 2, p - k),
        "xpipe": lambda k, p: (1 if k == p - 1 else 2, p - k),
        "pipeoptim": lambda k, p: (1 if k == p - 1 else 2, p - k),
        # zero bubble: activations held from F until the deferred W, P micro-batches
        "zb-h1": lambda k, p: (1, min(p, m)),
        # zb-v: over its 2P stages (the V), stage k holds min(2P - k, M)
        "zb-v": lambda k, p: (1, min(p - k, m)),
    }
    return rules[method]


def method_memory_factors(method: str, num_stages: int, micro_batches: int) -> MemoryFactors:
    """The ``(weight_copies, activation_slots)`` of each stage under ``method``.

    ``P`` stages, ``M`` micro-batches, stage ``k`` (0-based); an activation slot holds the
    activations of one pipeline unit of ``Profile.batch_size`` samples:

    ==================  =========================  ===================
    method              weight copies              activation slots
    ==================  =========================  ===================
    gpipe               1                          M
    1f1b                1                          min(P-k, M)
    interleaved-1f1b    1 (treated as 1f1b)        min(P-k, M)
    pipedream           P-k (stashed versions)     P-k
    2bw                 2                          min(P-k, M)
    spectrain           2, last stage 1            P-k
    xpipe               2, last stage 1            P-k (async: no flush)
    pipeoptim           2, last stage 1            P-k
    zb-h1               1                          min(P, M) (held until W)
    zb-v                1                          min(P-k, M), P = 2 x ranks
    ==================  =========================  ===================

    The returned function computes from the ``num_stages`` it is called with (so a search
    over stage counts can reuse it); ``num_stages`` here is only validated.
    """
    key = method.strip().lower()
    if key not in MEMORY_METHODS:
        raise PlanError(f"unknown method {method!r}; valid methods are {', '.join(MEMORY_METHODS)}")
    for name, value in (("num_stages", num_stages), ("micro_batches", micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name} must be a whole number >= 1, got {value!r}")
    rule = _factor_rule(key, micro_batches)

    def factors(stage_index: int, num_stages: int) -> tuple[int, int]:
        if not 0 <= stage_index < num_stages:
            raise PlanError(
                f"stage index {stage_index} is outside 0..{num_stages - 1} for {num_stages} stages"
            )
        return rule(stage_index, num_stages)

    factors.__name__ = f"{key}_memory_factors"
    return factors


def _unit_factors(stage_index: int, num_stages: int) -> tuple[int, int]:
    return (1, 1)


def _resolve_factors(
    memory_factors: MemoryFactors | None, num_stages: int
) -> tuple[list[int], list[int]]:
    rule = _unit_factors if memory_factors is None else memory_factors
    copies: list[int] = []
    slots: list[int] = []
    for k in range(num_stages):
        pair = rule(k, num_stages)
        try:
            wc, sl = pair
        except (TypeError, ValueError):
            raise PlanError(
                f"memory_factors({k}, {num_stages}) returned {pair!r}; it must return a pair "
                "(weight_copies, activation_slots) of whole numbers"
            ) from None
        for name, value, low in (("weight_copies", wc, 1), ("activation_slots", sl, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise PlanError(
                    f"memory_factors({k}, {num_stages}) gave {name}={value!r}; it must be a "
                    f"whole number >= {low}"
                )
        copies.append(int(wc))
        slots.append(int(sl))
    return copies, slots


def _check_link(bandwidth_bytes_per_s: float | str, latency_s: float) -> tuple[float, float]:
    bandwidth = parse_bandwidth(bandwidth_bytes_per_s)  # inf passes: free communication
    if isinstance(latency_s, bool) or not isinstance(latency_s, (int, float)):
        raise PlanError(f"latency_s must be a number of seconds >= 0, got {latency_s!r}")
    if not math.isfinite(latency_s) or latency_s < 0:
        raise PlanError(f"latency_s must be a finite number of seconds >= 0, got {latency_s!r}")
    return bandwidth, float(latency_s)


def _check_stages(num_layers: int, num_stages: int) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int):
        raise PlanError(f"the number of stages must be a whole number, got {num_stages!r}")
    if num_stages < 1:
        raise PlanError(f"the number of stages must be at least 1, got {num_stages}; use 1 or more")
    if num_stages > num_layers:
        raise PlanError(
            f"cannot split {num_layers} layers into {num_stages} stages; "
            f"use at most {num_layers} stages"
        )
    check_partition_size(num_layers, num_stages)


Sync = Sequence[tuple[float, float]]
"""Per stage ``(seconds per parameter byte, fixed seconds)`` added to its time."""


def _edges(
    edges: Sequence[tuple[float, float]] | None, bandwidth: float, latency: float, num_stages: int
) -> list[tuple[float, float]]:
    """One checked ``(bandwidth, latency)`` per stage edge: ``edges``, or the one link."""
    if edges is None:
        return [(bandwidth, latency)] * (num_stages - 1)
    if len(edges) != num_stages - 1:
        raise PlanError(
            f"edges needs one (bandwidth, latency) per stage edge (got {len(edges)} for "
            f"{num_stages} stages); pass {num_stages - 1}"
        )
    return [_check_link(bw, lat) for bw, lat in edges]


def _sync(sync: Sync | None, num_stages: int) -> list[tuple[float, float]] | None:
    if sync is None:
        return None
    if len(sync) != num_stages:
        raise PlanError(
            f"sync needs one (seconds per byte, seconds) per stage (got {len(sync)} for "
            f"{num_stages} stages); pass {num_stages}"
        )
    out = []
    for k, (per_byte, fixed) in enumerate(sync):
        if not (math.isfinite(per_byte) and per_byte >= 0 and math.isfinite(fixed) and fixed >= 0):
            raise PlanError(
                f"sync of stage {k} must be finite numbers >= 0 (got {(per_byte, fixed)!r})"
            )
        out.append((float(per_byte), float(fixed)))
    return out


def stage_comm_s(
    profile: Profile,
    start: int,
    end: int,
    stage_index: int,
    num_stages: int,
    *,
    bandwidth_bytes_per_s: float = math.inf,
    latency_s: float = 0.0,
) -> float:
    """Communication time of stage ``stage_index`` holding layers ``[start, end)``, seconds.

    Formula in the module docstring: each boundary of the stage costs an activation one way
    and its gradient the other (``2·bytes/bw + 2·latency``); the first stage has no boundary
    before it, the last none after it.
    """
    link = (bandwidth_bytes_per_s, latency_s)
    return _comm(profile, start, end, stage_index, num_stages, link, link)


def _comm(
    profile: Profile,
    start: int,
    end: int,
    stage_index: int,
    num_stages: int,
    before: tuple[float, float],
    after: tuple[float, float],
) -> float:
    """:func:`stage_comm_s` with the link ``before`` the stage and the one ``after`` it."""
    comm = 0.0
    if stage_index > 0:
        comm += 2.0 * profile.layers[start - 1].activation_bytes / before[0]
        comm += 2.0 * before[1]
    if stage_index < num_stages - 1:
        comm += 2.0 * profile.layers[end - 1].activation_bytes / after[0]
        comm += 2.0 * after[1]
    return comm


@dataclass(frozen=True)
class Partition:
    """Layers per stage and what each stage costs under the partitioner's model."""

    boundaries: tuple[tuple[int, int], ...]
    """Half-open ``(start, end)`` layer range of each stage, in stage order."""

    stage_times: tuple[float, ...]
    """Per-stage time (compute + communication) for one batch, seconds."""

    stage_memory: tuple[int, ...]
    """Per-stage peak memory (weights, gradients, optimizer state, activations), bytes."""

    bottleneck_s: float
    """The slowest stage's time, seconds: the pipeline's time per batch in steady state."""

    stage_compute_s: tuple[float, ...] = ()
    """Per-stage forward + backward time, seconds."""

    stage_comm_s: tuple[float, ...] = ()
    """Per-stage communication time, seconds."""

    weight_copies: tuple[int, ...] = ()
    """Per-stage weight copies the memory figures assume."""

    stage_sync_s: tuple[float, ...] = ()
    """Per-stage gradient synchronisation charged per batch (``sync``), seconds; empty: none."""

    activation_slots: tuple[int, ...] = ()
    """Per-stage activation slots the memory figures assume."""

    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.boundaries)

    @property
    def bottleneck_stage(self) -> int:
        """Index of the slowest stage (the first one on a tie)."""
        return int(np.argmax(self.stage_times))

    @property
    def peak_memory_bytes(self) -> int:
        """The largest per-stage memory, bytes."""
        return max(self.stage_memory)

    @property
    def peak_memory_stage(self) -> int:
        """Index of the stage with the largest memory (the first one on a tie)."""
        return int(np.argmax(self.stage_memory))

    def stage_graph(self, profile: Profile) -> nx.DiGraph:
        """The stage graph of this partition (see :func:`pipeoptim.plan.graph.stage_graph`)."""
        copies = list(self.weight_copies) or 1
        slots = list(self.activation_slots) or 1
        return stage_graph(profile, self.boundaries, weight_copies=copies, activation_slots=slots)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of all fields."""
        return {
            "boundaries": [list(b) for b in self.boundaries],
            "stage_times": list(self.stage_times),
            "stage_memory": list(self.stage_memory),
            "bottleneck_s": self.bottleneck_s,
            "stage_compute_s": list(self.stage_compute_s),
            "stage_comm_s": list(self.stage_comm_s),
            "weight_copies": list(self.weight_copies),
            "activation_slots": list(self.activation_slots),
            "stage_sync_s": list(self.stage_sync_s),
        }


def evaluate_partition(
    profile: Profile,
    boundaries: Sequence[tuple[int, int]],
    *,
    bandwidth_bytes_per_s: float | str = math.inf,
    latency_s: float = 0.0,
    memory_factors: MemoryFactors | None = None,
    edges: Sequence[tuple[float, float]] | None = None,
    sync: Sync | None = None,
) -> Partition:
    """Cost of a given partition under the module's model (times and memory per stage).

    ``memory_factors`` defaults to one weight copy and one activation slot per stage;
    ``edges`` and ``sync`` as in :func:`optimal_partition`.
    """
    stages = validate_boundaries(boundaries, profile.num_layers)
    bandwidth, latency = _check_link(bandwidth_bytes_per_s, latency_s)
    num_stages = len(stages)
    links = _edges(edges, bandwidth, latency, num_stages)
    syncs = _sync(sync, num_stages)
    copies, slots = _resolve_factors(memory_factors, num_stages)
    compute, comm, memory, synced = [], [], [], []
    for k, (start, end) in enumerate(stages):
        layers = profile.layers[start:end]
        compute.append(math.fsum(layer.compute_s for layer in layers))
        before = links[k - 1] if k > 0 else (bandwidth, latency)
        after = links[k] if k < num_stages - 1 else (bandwidth, latency)
        comm.append(_comm(profile, start, end, k, num_stages, before, after))
        if syncs is not None:
            per_byte, fixed = syncs[k]
            synced.append(per_byte * sum(layer.param_bytes for layer in layers) + fixed)
        memory.append(
            stage_memory_bytes(
                sum(layer.param_bytes for layer in layers),
                sum(layer.optimizer_state_bytes for layer in layers),
                sum(layer.activation_bytes for layer in layers),
                copies[k],
                slots[k],
            )
        )
    times = tuple(c + m for c, m in zip(compute, comm, strict=True))
    if synced:
        times = tuple(t + x for t, x in zip(times, synced, strict=True))
    return Partition(
        boundaries=tuple(stages),
        stage_times=times,
        stage_memory=tuple(memory),
        bottleneck_s=max(times),
        stage_compute_s=tuple(compute),
        stage_comm_s=tuple(comm),
        weight_copies=tuple(copies),
        activation_slots=tuple(slots),
        stage_sync_s=tuple(synced),
    )


# --------------------------------------------------------------------------- the DP
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BlockFn = Callable[[int, IntArray], npt.NDArray[Any]]


def _minmax_dp(
    num_layers: int, num_stages: int, block: BlockFn, worst: float | int
) -> list[tuple[int, int]] | None:
    """Exact min–max split of ``num_layers`` into ``num_stages`` contiguous ranges.

    ``block(k, rows)`` returns the cost matrix of stage ``k`` for start layers ``rows`` and
    end layers ``rows + 1`` (entry ``[r, c]`` = start ``rows[r]``, end ``rows[c] + 1``; only
    ``c >= r`` is read), holding ``worst`` where the stage is not allowed. Stage ``k`` can
    only start in ``k .. k + n - 1`` with ``n = L - P + 1`` (every other stage needs a layer),
    so each step is one ``n × n`` broadcast. Returns the boundaries, or ``None`` when every
    split contains a disallowed stage.
    """
    n = num_layers - num_stages + 1
    cols = np.arange(n)
    upper = cols[None, :] >= cols[:, None]
    dtype = np.float64 if isinstance(worst, float) else np.int64
    prev = np.full(num_layers + 1, worst, dtype=dtype)
    prev[0] = 0
    choice = np.empty((num_stages, n), dtype=np.int64)
    for k in range(num_stages):
        rows = np.arange(k, k + n, dtype=np.int64)
        cand = np.maximum(prev[k : k + n, None], block(k, rows))
        cand = np.where(upper, cand, worst)
        arg = cand.argmin(axis=0)
        best = cand[arg, cols]
        if best.min() >= worst:
            return None  # no allowed split of the first k + 1 stages: stop early
        choice[k] = arg + k
        prev = np.full(num_layers + 1, worst, dtype=dtype)
        prev[k + 1 : k + 1 + n] = best
    if prev[num_layers] >= worst:
        return None
    bounds: list[tuple[int, int]] = []
    end = num_layers
    for k in range(num_stages - 1, -1, -1):
        start = int(choice[k, end - (k + 1)])
        bounds.append((start, end))
        end = start
    bounds.reverse()
    return bounds


def _prefix(values: Sequence[float] | Sequence[int], dtype: type[Any]) -> npt.NDArray[Any]:
    out = np.zeros(len(values) + 1, dtype=dtype)
    np.cumsum(np.asarray(values, dtype=dtype), out=out[1:])
    return out


class _Prefixes:
    """Prefix sums of the profile, so a stage's totals are differences of two entries."""

    def __init__(self, profile: Profile, copies: list[int], slots: list[int]) -> None:
        layers = profile.layers
        self.copies = copies
        self.slots = slots
        self.compute: FloatArray = _prefix([la.compute_s for la in layers], np.float64)
        self.act = np.asarray([la.activation_bytes for la in layers], dtype=np.int64)
        self.param: IntArray = _prefix([la.param_bytes for la in layers], np.int64)
        self.state: IntArray = _prefix([la.optimizer_state_bytes for la in layers], np.int64)
        self.act_sum: IntArray = _prefix(self.act.tolist(), np.int64)

    def memory(self, k: int) -> IntArray:
        """``F`` with stage memory of layers ``[i, j)`` on stage ``k`` = ``F[j] - F[i]``."""
        out: IntArray = (
            (self.copies[k] + 1) * self.param + self.state + self.slots[k] * self.act_sum
        )
        return out


def min_memory_partition(
    profile: Profile,
    num_stages: int,
    *,
    memory_factors: MemoryFactors | None = None,
    bandwidth_bytes_per_s: float | str = math.inf,
    latency_s: float = 0.0,
) -> Partition:
    """The partition with the smallest peak stage memory (ignoring time).

    What the planner reports when no partition fits a memory cap: the lowest cap that could
    work with this many stages.
    """
    _check_stages(profile.num_layers, num_stages)
    copies, slots = _resolve_factors(memory_factors, num_stages)
    pre = _Prefixes(profile, copies, slots)
    worst = int(np.iinfo(np.int64).max)

    def block(k: int, rows: IntArray) -> IntArray:
        f = pre.memory(k)
        out: IntArray = f[rows + 1][None, :] - f[rows][:, None]
        return out

    bounds = _minmax_dp(profile.num_layers, num_stages, block, worst)
    assert bounds is not None  # no disallowed stages: a split always exists
    return evaluate_partition(
        profile,
        bounds,
        bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        latency_s=latency_s,
        memory_factors=memory_factors,
    )


def optimal_partition(
    profile: Profile,
    num_stages: int,
    *,
    bandwidth_bytes_per_s: float | str = math.inf,
    latency_s: float = 0.0,
    memory_cap_bytes: int | float | str | None = None,
    memory_factors: MemoryFactors | None = None,
    edges: Sequence[tuple[float, float]] | None = None,
    sync: Sync | None = None,
) -> Partition:
    """The contiguous partition into ``num_stages`` stages with the fastest slowest stage.

    Exact under the module's cost model. ``memory_cap_bytes`` (bytes, or a string such as
    ``"16GiB"``) bounds every stage's memory; ``memory_factors`` (default: 1 weight copy, 1
    activation slot) comes from :func:`method_memory_factors`. ``edges`` gives each of the
    ``num_stages - 1`` stage edges its ``(bandwidth, latency)`` in place of the one link;
    ``sync`` adds ``per_byte_k * param bytes + fixed_k`` seconds to stage ``k`` (module
    doc). Ties between equally fast
    partitions are broken deterministically. Raises :class:`PlanError` when ``num_stages``
    is not in ``1..num_layers`` or when no partition fits the cap (the message gives the
    smallest cap that would fit).
    """
    num_layers = profile.num_layers
    _check_stages(num_layers, num_stages)
    bandwidth, latency = _check_link(bandwidth_bytes_per_s, latency_s)
    cap = None if memory_cap_bytes is None else min(parse_bytes(memory_cap_bytes), _INT_LIMIT)
    links = _edges(edges, bandwidth, latency, num_stages)
    syncs = _sync(sync, num_stages)
    copies, slots = _resolve_factors(memory_factors, num_stages)
    pre = _Prefixes(profile, copies, slots)
    params = pre.param.astype(np.float64)

    # comm terms as vectors over layer index: recv[i] for a stage starting at i, send[j] for
    # one ending at j (formula in the module docstring), one vector per distinct link
    vectors: dict[tuple[float, float], FloatArray] = {}
    for bw, lat in set(links):
        vector = np.zeros(num_layers + 1, dtype=np.float64)
        vector[1:] = 2.0 * pre.act / bw + 2.0 * lat
        vectors[(bw, lat)] = vector
    inner = np.arange(num_layers - num_stages + 1)

    def block(k: int, rows: IntArray) -> FloatArray:
        cols = rows + 1
        recv = vectors[links[k - 1]][rows] if k > 0 else 0.0
        send = vectors[links[k]][cols] if k < num_stages - 1 else 0.0
        end_term = pre.compute[cols] + send
        start_term = pre.compute[rows] - recv
        if syncs is not None:  # the stage's all-reduce: linear in its bytes
            per_byte, fixed = syncs[k]
            end_term = end_term + per_byte * params[cols] + fixed
            start_term = start_term + per_byte * params[rows]
        cost: FloatArray = end_term[None, :] - start_term[:, None]
        if cap is not None:
            f = pre.memory(k)
            # memory is nondecreasing in the end layer: stage from i fits iff end <= last_end
            last_end = np.searchsorted(f, f[rows] + cap, side="right") - 1
            cost = np.where(inner[None, :] <= (last_end - (k + 1))[:, None], cost, np.inf)
        return cost

    bounds = _minmax_dp(num_layers, num_stages, block, math.inf)
    if bounds is None:
        assert cap is not None
        best = min_memory_partition(profile, num_stages, memory_factors=memory_factors)
        peak, stage = best.peak_memory_bytes, best.peak_memory_stage
        start, end = best.boundaries[stage]
        raise PlanError(
            f"no partition of {num_layers} layers into {num_stages} stages fits the memory "
            f"cap of {format_bytes(cap)} ({cap} bytes) per device; the smallest possible peak "
            f"is {format_bytes(peak, round_up=True)} ({peak} bytes) on stage {stage} (layers "
            f"{start}..{end - 1}); raise --memory-cap to at least "
            f"{format_bytes(peak, round_up=True)} or use more stages"
        )
    return evaluate_partition(
        profile,
        bounds,
        bandwidth_bytes_per_s=bandwidth,
        latency_s=latency,
        memory_factors=memory_factors,
        edges=edges,
        sync=sync,
    )


def equal_layer_partition(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """The naive baseline: the same number of layers per stage (the first ``L mod P`` stages
    get one more)."""
    _check_stages(num_layers, num_stages)
    size, extra = divmod(num_layers, num_stages)
    bounds = []
    start = 0
    for k in range(num_stages):
        end = start + size + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
