"""Memory-aware partitioning of a layer chain into pipeline stages.

A pipeline runs at the pace of its slowest stage, so the partitioner cuts the profile's
``L`` layers into ``P`` contiguous stages that minimise the slowest stage's time, subject to
every stage fitting in one device's memory. It is exact: a min–max dynamic programme over
(stage, end layer) with prefix sums, whose inner minimisation over the start layer is one
numpy broadcast per stage — ``O(P·L²)`` arithmetic in ``P`` vectorised steps (1,000 layers
into 64 stages: under a second on a 2-core machine; ``benchmarks/bench_partition.py``).

This module holds the searches (:func:`optimal_partition`, :func:`min_memory_partition`,
the :func:`equal_layer_partition` baseline) and the programme itself. What a stage costs, and
the :class:`~pipeoptim.plan.partition_cost.Partition` they return, is the cost model of
:mod:`pipeoptim.plan.partition_cost`; the per-method weight copies and activation slots are
:mod:`pipeoptim.plan.memory_factors`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from pipeoptim.errors import PlanError
from pipeoptim.plan.kept_bytes import output_kept_bytes, unit_saved_bytes
from pipeoptim.plan.limits import check_partition_size
from pipeoptim.plan.memory_factors import MemoryFactors, resolve_factors
from pipeoptim.plan.partition_cost import (
    Partition,
    Sync,
    check_edges,
    check_link,
    check_sync,
    evaluate_partition,
)
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.recompute_costs import profile_unit_costs
from pipeoptim.plan.recompute_regions import least_kept_band, least_kept_units
from pipeoptim.plan.units import format_bytes, parse_bytes

__all__ = [
    "equal_layer_partition",
    "freeing_units",
    "min_memory_partition",
    "optimal_partition",
]

_INT_LIMIT = 2**62  # caps above this are "no cap" (keeps int64 sums from overflowing)


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
    """Prefix sums of the profile, so a stage's totals are differences of two entries.

    A recomputing stage (``recompute[k]``) recomputes the units that make it keep the least,
    priced as the runtime runs them: each run of consecutive recomputed units is one region
    that keeps only its input (:mod:`pipeoptim.plan.recompute_regions`); where ``hold[k]`` a
    recomputed unit holds its weights per slot. Its activations and extra forward seconds
    are not prefix differences (where a region opens depends on the stage's first unit), so
    they come from a band of every (start, length) the programme tries. Optimizer state is
    sharded ``shards`` ways (``partition_cost``'s doc)."""

    def __init__(
        self,
        profile: Profile,
        copies: list[int],
        slots: list[int],
        recompute: Sequence[bool] | None = None,
        hold: Sequence[bool] | None = None,
        shards: int = 1,
    ) -> None:
        layers = profile.layers
        self.copies = copies
        self.slots = slots
        n = len(copies)
        self.recompute = list(recompute) if recompute is not None else [False] * n
        self.hold = list(hold) if hold is not None else [False] * n
        self.compute: FloatArray = _prefix([la.compute_s for la in layers], np.float64)
        self.act = np.asarray([unit_saved_bytes(la) for la in layers], dtype=np.int64)
        self.out = np.asarray([output_kept_bytes(la) for la in layers], dtype=np.int64)
        self.param: IntArray = _prefix([la.param_bytes for la in layers], np.int64)
        d = max(1, shards)
        self.state: IntArray = _prefix(
            [-(-la.optimizer_state_bytes // d) for la in layers], np.int64
        )
        self.act_sum: IntArray = _prefix(self.act.tolist(), np.int64)
        self._bands: dict[bool, tuple[IntArray, FloatArray]] = {}
        if any(self.recompute):
            units = profile_unit_costs(profile)
            width = len(layers) - n + 1  # the longest stage the programme tries
            for held in {self.hold[k] for k in range(n) if self.recompute[k]}:
                self._bands[held] = least_kept_band(units, held, width)

    def _band(self, k: int, rows: IntArray) -> tuple[IntArray, FloatArray]:
        """Stage ``k``'s least kept bytes per slot and added seconds, start ``rows[r]``, end
        ``rows[c] + 1`` (``c >= r``)."""
        kept, seconds = self._bands[self.hold[k]]
        length = np.clip(rows[None, :] - rows[:, None], 0, kept.shape[1] - 1)
        return kept[rows[:, None], length], seconds[rows[:, None], length]

    def extra_seconds(self, k: int, rows: IntArray) -> FloatArray | float:
        """The recomputation's forward seconds of stage ``k`` (as :meth:`_band`; 0: none)."""
        return self._band(k, rows)[1] if self.recompute[k] else 0.0

    def memory(self, k: int, rows: IntArray) -> IntArray:
        """Stage ``k``'s memory for start ``rows[r]`` and end ``rows[c] + 1``."""
        static = (self.copies[k] + 1) * self.param + self.state
        f = static if self.recompute[k] else static + self.slots[k] * self.act_sum
        out: IntArray = f[rows + 1][None, :] - f[rows][:, None]
        if self.recompute[k]:
            out = out + self.slots[k] * self._band(k, rows)[0]
        else:  # the stage's output, kept until its backward (plan/kept_bytes.py)
            out = out + self.slots[k] * self.out[rows][None, :]
        return out


def freeing_units(profile: Profile, start: int, end: int, hold: bool = False) -> frozenset[int]:
    """The stage-local units of layers ``[start, end)`` whose recomputation makes the stage
    keep the least, regions priced as the runtime runs them (what a recomputing stage of the
    partitioner recomputes)."""
    return least_kept_units(profile_unit_costs(profile), start, end, hold)


def _options(
    recompute_stages: Sequence[bool] | None, num_stages: int
) -> list[frozenset[int]] | None:
    """Placeholders: the full sets are filled in once the boundaries are known."""
    if recompute_stages is None or not any(recompute_stages):
        return None
    if len(recompute_stages) != num_stages:
        raise PlanError(
            f"recompute_stages needs one flag per stage (got {len(recompute_stages)} for "
            f"{num_stages} stages)"
        )
    return []


def _full_sets(
    profile: Profile,
    recompute_stages: Sequence[bool] | None,
    bounds: Sequence[tuple[int, int]],
    hold_weights: Sequence[bool] | None,
) -> list[frozenset[int]] | None:
    if _options(recompute_stages, len(bounds)) is None:
        return None
    assert recompute_stages is not None
    holds = list(hold_weights) if hold_weights is not None else [False] * len(bounds)
    return [
        freeing_units(profile, start, end, holds[k]) if r else frozenset()
        for k, (r, (start, end)) in enumerate(zip(recompute_stages, bounds, strict=True))
    ]


def min_memory_partition(
    profile: Profile,
    num_stages: int,
    *,
    memory_factors: MemoryFactors | None = None,
    bandwidth_bytes_per_s: float | str = math.inf,
    latency_s: float = 0.0,
    recompute_stages: Sequence[bool] | None = None,
    hold_weights: Sequence[bool] | None = None,
    optimizer_shards: int = 1,
) -> Partition:
    """The partition with the smallest peak stage memory (ignoring time).

    What the planner reports when no partition fits a memory cap: the lowest cap that could
    work with this many stages. ``recompute_stages`` (per stage: recompute all its units),
    ``hold_weights`` and ``optimizer_shards`` as in :func:`optimal_partition`.
    """
    _check_stages(profile.num_layers, num_stages)
    copies, slots = resolve_factors(memory_factors, num_stages)
    _options(recompute_stages, num_stages)
    pre = _Prefixes(profile, copies, slots, recompute_stages, hold_weights, optimizer_shards)
    worst = int(np.iinfo(np.int64).max)

    def block(k: int, rows: IntArray) -> IntArray:
        return pre.memory(k, rows)

    bounds = _minmax_dp(profile.num_layers, num_stages, block, worst)
    assert bounds is not None  # no disallowed stages: a split always exists
    return evaluate_partition(
        profile,
        bounds,
        bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        latency_s=latency_s,
        memory_factors=memory_factors,
        recompute=_full_sets(profile, recompute_stages, bounds, hold_weights),
        hold_weights=hold_weights,
        optimizer_shards=optimizer_shards,
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
    recompute_stages: Sequence[bool] | None = None,
    hold_weights: Sequence[bool] | None = None,
    optimizer_shards: int = 1,
) -> Partition:
    """The contiguous partition into ``num_stages`` stages with the fastest slowest stage.

    Exact under the cost model of :mod:`pipeoptim.plan.partition_cost`.
    ``memory_cap_bytes`` (bytes, or a string such as ``"16GiB"``) bounds every stage's
    memory; ``memory_factors`` (default: 1 weight copy, 1 activation slot) comes from
    :func:`~pipeoptim.plan.memory_factors.method_memory_factors`. ``edges`` gives each of the
    ``num_stages - 1`` stage edges its ``(bandwidth, latency)`` in place of the one link;
    ``sync`` adds ``per_byte_k * param bytes + fixed_k`` seconds to stage ``k`` (the cost
    model's doc). ``recompute_stages`` marks the stages that recompute all their units,
    ``hold_weights`` those where that holds Ŵ per activation slot (prediction), and
    ``optimizer_shards`` divides the optimizer state (ZeRO-1), as in the cost model's doc.
    Ties between equally fast
    partitions are broken deterministically. Raises :class:`PlanError` when ``num_stages``
    is not in ``1..num_layers`` or when no partition fits the cap (the message gives the
    smallest cap that would fit).
    """
    num_layers = profile.num_layers
    _check_stages(num_layers, num_stages)
    bandwidth, latency = check_link(bandwidth_bytes_per_s, latency_s)
    cap = None if memory_cap_bytes is None else min(parse_bytes(memory_cap_bytes), _INT_LIMIT)
    links = check_edges(edges, bandwidth, latency, num_stages)
    syncs = check_sync(sync, num_stages)
    copies, slots = resolve_factors(memory_factors, num_stages)
    _options(recompute_stages, num_stages)
    pre = _Prefixes(profile, copies, slots, recompute_stages, hold_weights, optimizer_shards)
    params = pre.param.astype(np.float64)

    # comm terms as vectors over layer index: recv[i] for a stage starting at i, send[j] for
    # one ending at j (formula in partition_cost's docstring), one vector per distinct link
    vectors: dict[tuple[float, float], FloatArray] = {}
    for bw, lat in set(links):
        vector = np.zeros(num_layers + 1, dtype=np.float64)
        vector[1:] = 2.0 * pre.act / bw + 2.0 * lat
        vectors[(bw, lat)] = vector

    def block(k: int, rows: IntArray) -> FloatArray:
        cols = rows + 1
        recv = vectors[links[k - 1]][rows] if k > 0 else 0.0
        send = vectors[links[k]][cols] if k < num_stages - 1 else 0.0
        compute = pre.compute
        end_term = compute[cols] + send
        start_term = compute[rows] - recv
        if syncs is not None:  # the stage's all-reduce: linear in its bytes
            per_byte, fixed = syncs[k]
            end_term = end_term + per_byte * params[cols] + fixed
            start_term = start_term + per_byte * params[rows]
        cost: FloatArray = end_term[None, :] - start_term[:, None] + pre.extra_seconds(k, rows)
        if cap is not None:
            cost = np.where(pre.memory(k, rows) <= cap, cost, np.inf)
        return cost

    bounds = _minmax_dp(num_layers, num_stages, block, math.inf)
    if bounds is None:
        assert cap is not None
        best = min_memory_partition(
            profile,
            num_stages,
            memory_factors=memory_factors,
            recompute_stages=recompute_stages,
            hold_weights=hold_weights,
            optimizer_shards=optimizer_shards,
        )
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
        recompute=_full_sets(profile, recompute_stages, bounds, hold_weights),
        hold_weights=hold_weights,
        optimizer_shards=optimizer_shards,
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
