"""Version analysis: which weight version every forward and backward of a schedule uses.

Derived from the schedule, never hard-coded: the prediction distance ``s(k, t)`` is the
number of updates stage k performs between mini-batch t's forward and its backward, so
the same code gives ``min(t, P-1-k)`` for asynchronous 1F1B and the right value for any
micro-batched or interleaved schedule. ``W^(j)`` is a stage's weights after j updates.

A split backward (I then W, see :mod:`pipeoptim.plan.zero_bubble`) counts as one backward:
its weight half W takes the backward's place (it closes the micro-batch: the activations
are held until it ends, and the update applies its gradient), and the input half I reads
the same version as its W (in a synchronous schedule both run on the forward's ``W^(t)``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from pipeoptim.errors import ScheduleError
from pipeoptim.plan.actions import Action
from pipeoptim.plan.methods import Method, WeightPolicy
from pipeoptim.plan.orders import (
    KIND_B,
    KIND_F,
    KIND_I,
    KIND_U,
    KIND_W,
    IntArray,
    KeyIndex,
    OrderArrays,
)
from pipeoptim.plan.shape import Shape

BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class MicroBatchVersions:
    """The versions one micro-batch met on one stage."""

    stage: int
    mb: int
    mini_batch: int
    forward_base: int
    """Updates the stage had made when the forward ran (the weights actually present)."""
    forward_version: int
    """Version the forward's weights stand for: the stash, the buffer, or the prediction target."""
    backward_version: int
    """Version the backward's weights are."""
    distance: int
    """s: updates the stage made between this forward and its backward."""
    predicted: bool
    """The forward ran on predicted weights (PREDICT policy and s > 0)."""

    @property
    def inconsistency(self) -> int:
        """Versions between forward and backward weights that nothing compensates."""
        return self.backward_version - self.forward_version


@dataclass(frozen=True)
class UpdateVersions:
    """One optimizer update of one stage."""

    stage: int
    mini_batch: int
    applied_to: int
    """Version the update is applied to (produces ``applied_to + 1``)."""
    gradient_version: int
    """Oldest weight version the applied gradient was computed on."""

    @property
    def staleness(self) -> int:
        return self.applied_to - self.gradient_version


@dataclass(frozen=True)
class PassArrays:
    """One entry per forward, grouped by stage, each stage's in execution order."""

    stage: IntArray
    mb: IntArray
    forward_base: IntArray
    forward_version: IntArray
    backward_version: IntArray
    distance: IntArray
    predicted: BoolArray


@dataclass(frozen=True)
class UpdateArrays:
    """One entry per update, grouped by stage, each stage's in execution order."""

    stage: IntArray
    mini_batch: IntArray
    applied_to: IntArray
    gradient_version: IntArray


@dataclass(frozen=True)
class ActionVersions:
    """Per action of the analysed order (its index): the weight version it uses, and for a
    forward its prediction distance and whether it ran on predicted weights."""

    version: IntArray
    distance: IntArray
    predicted: BoolArray


class VersionReport:
    """Everything about weight versions in one schedule under one weight policy.

    Held as arrays (a run of a million actions is analysed in numpy); ``passes`` and
    ``updates`` build their per-entry objects on first use.
    """

    def __init__(
        self,
        policy: WeightPolicy,
        micro_batches: int,
        pass_arrays: PassArrays,
        update_arrays: UpdateArrays,
        weight_copies: dict[int, int],
        max_in_flight: dict[int, int],
        actions: ActionVersions,
    ) -> None:
        self.policy = policy
        self.micro_batches = micro_batches
        self.pass_arrays = pass_arrays
        self.update_arrays = update_arrays
        self.weight_copies = weight_copies
        """Most weight versions a stage holds at once (predicted copy included)."""
        self.max_in_flight = max_in_flight
        """Most micro-batches whose forward ran and backward has not (activations kept)."""
        self.actions = actions
        self._passes: dict[tuple[int, int], MicroBatchVersions] | None = None
        self._updates: dict[tuple[int, int], UpdateVersions] | None = None
        self._max_distance = _max_per_stage(pass_arrays.stage, pass_arrays.distance)
        self._max_staleness = _max_per_stage(
            update_arrays.stage, update_arrays.applied_to - update_arrays.gradient_version
        )
        self._max_inconsistency = _max_per_stage(
            pass_arrays.stage, np.abs(pass_arrays.backward_version - pass_arrays.forward_version)
        )

    @property
    def passes(self) -> dict[tuple[int, int], MicroBatchVersions]:
        """Keyed by (stage, global micro-batch id)."""
        if self._passes is None:
            a = self.pass_arrays
            m = self.micro_batches
            self._passes = {
                (k, mb): MicroBatchVersions(k, mb, mb // m, base, fwd, bwd, dist, pred)
                for k, mb, base, fwd, bwd, dist, pred in zip(
                    a.stage.tolist(),
                    a.mb.tolist(),
                    a.forward_base.tolist(),
                    a.forward_version.tolist(),
                    a.backward_version.tolist(),
                    a.distance.tolist(),
                    a.predicted.tolist(),
                    strict=True,
                )
            }
        return self._passes

    @property
    def updates(self) -> dict[tuple[int, int], UpdateVersions]:
        """Keyed by (stage, mini-batch)."""
        if self._updates is None:
            a = self.update_arrays
            self._updates = {
                (k, t): UpdateVersions(k, t, applied, grad)
                for k, t, applied, grad in zip(
                    a.stage.tolist(),
                    a.mini_batch.tolist(),
                    a.applied_to.tolist(),
                    a.gradient_version.tolist(),
                    strict=True,
                )
            }
        return self._updates

    @property
    def stages(self) -> list[int]:
        return sorted(self.weight_copies)

    def distance(self, stage: int, mini_batch: int) -> int:
        """s(k, t): the largest prediction distance among the micro-batches of t."""
        m = self.micro_batches
        return max(self.passes[(stage, mini_batch * m + j)].distance for j in range(m))

    def max_distance(self, stage: int) -> int:
        return self._max_distance.get(stage, 0)

    def max_staleness(self, stage: int) -> int:
        return self._max_staleness.get(stage, 0)

    def max_inconsistency(self, stage: int) -> int:
        return self._max_inconsistency.get(stage, 0)


def _max_per_stage(stage: IntArray, values: IntArray) -> dict[int, int]:
    """The largest value per stage, for entries grouped by stage."""
    if len(stage) == 0:
        return {}
    starts = np.flatnonzero(np.r_[True, stage[1:] != stage[:-1]])
    return dict(
        zip(stage[starts].tolist(), np.maximum.reduceat(values, starts).tolist(), strict=True)
    )


def prediction_distance(s: int, offset: int = 0) -> int:
    """The distance a predictor uses: the derived ``s`` shifted by a constant option.

    The public reference code of PipeOptim predicts ``D - rank`` steps, one more than
    the derived steady-state ``s = D - 1 - rank``; ``offset=1`` reproduces it.
    """
    return max(0, s + offset)


def analyze_versions(
    schedule: Mapping[int, Sequence[Action | None]],
    policy: WeightPolicy,
    micro_batches: int = 1,
) -> VersionReport:
    """Walk every stage's actions in execution order and apply ``policy``."""
    return analyze_order(OrderArrays.from_order(schedule), policy, micro_batches)


def analyze_order(order: OrderArrays, policy: WeightPolicy, m: int = 1) -> VersionReport:
    """:func:`analyze_versions` of an order in array form.

    Each stage's actions are taken in execution order (a stage runs on one rank). The
    update count before every action gives each forward its base and each backward its
    version; the policy maps them to the versions used. The weight copies a stage holds are
    counted as distinct versions alive after every forward and update: a version is alive
    while it is current or some in-flight micro-batch keeps it (STASH, DOUBLE_BUFFER).
    """
    # Every stage's actions together, each stage in execution order (a stable sort).
    perm = np.argsort(order.stage, kind="stable")
    stage, kind, mb = order.stage[perm], order.kind[perm], order.mb[perm]
    n = len(stage)
    is_f, is_u = kind == KIND_F, kind == KIND_U
    is_b = (kind == KIND_B) | (kind == KIND_W)  # a W stands for its split backward
    first = np.r_[True, stage[1:] != stage[:-1]] if n else np.zeros(0, dtype=bool)
    group_start = np.flatnonzero(first)
    group = np.cumsum(first) - 1
    group_end = np.r_[group_start[1:], n][group]  # per position: its stage's end
    updates_done = np.cumsum(is_u) - is_u
    before = updates_done - updates_done[group_start][group]  # the stage's updates so far
    num_stages = int(stage.max()) + 1 if n else 1

    f_pos, b_pos, u_pos = np.flatnonzero(is_f), np.flatnonzero(is_b), np.flatnonzero(is_u)
    f_keys = mb[f_pos] * num_stages + stage[f_pos]
    b_keys = mb[b_pos] * num_stages + stage[b_pos]
    f_index, b_index = KeyIndex(f_keys), KeyIndex(b_keys)
    for name, index, pos in (("forward", f_index, f_pos), ("backward", b_index, b_pos)):
        twice = index.duplicate()
        if twice is not None:
            raise ScheduleError(
                f"{order.name(int(perm[pos[twice[0]]]))} appears twice in the order; every "
                f"{name} runs once per stage and micro-batch"
            )
    i_pos = np.flatnonzero(kind == KIND_I)
    i_keys = mb[i_pos] * num_stages + stage[i_pos]
    i_index = KeyIndex(i_keys)
    twice = i_index.duplicate()
    if twice is not None:
        raise ScheduleError(
            f"{order.name(int(perm[i_pos[twice[0]]]))} appears twice in the order; every "
            f"input-gradient half (I) runs once per stage and micro-batch"
        )
    i_match = b_index.find(i_keys)
    unpaired = np.flatnonzero(i_match < 0)
    if not len(unpaired):
        halves = b_pos[i_match]
        unpaired = np.flatnonzero(kind[halves] != KIND_W)
    w_pos = np.flatnonzero(kind == KIND_W)
    orphans = i_index.find(mb[w_pos] * num_stages + stage[w_pos]) < 0
    if len(unpaired) or orphans.any():
        q = int(i_pos[unpaired[0]]) if len(unpaired) else int(w_pos[int(np.argmax(orphans))])
        k, j = int(stage[q]), int(mb[q])
        raise ScheduleError(
            f"stage {k}: {order.name(int(perm[q]))} has no other half; a split backward "
            f"runs {k}I{j} and {k}W{j} (and no {k}B{j})"
        )
    match = b_index.find(f_keys)
    if (match < 0).any():
        i = f_pos[int(np.argmax(match < 0))]
        k, j = int(stage[i]), int(mb[i])
        raise ScheduleError(f"stage {k}: {k}F{j} has no backward {k}B{j}")
    f_base = before[f_pos]
    b_at = b_pos[match]
    b_base = before[b_at]
    distance = b_base - f_base
    t = mb[f_pos] // m
    if policy is WeightPolicy.PREDICT:
        forward = backward = b_base
    elif policy is WeightPolicy.DOUBLE_BUFFER:
        forward = backward = np.maximum(t - 1, 0)
        bad = (f_base < forward) | (f_base > forward + 1) | (b_base > forward + 1)
        if bad.any():
            q = int(np.argmax(bad))
            k, j, fwd = int(stage[f_pos[q]]), int(mb[f_pos[q]]), int(forward[q])
            raise ScheduleError(
                f"stage {k}: mini-batch {int(t[q])} must run on W^({fwd}) (one version "
                f"behind), but {k}F{j} runs after {int(f_base[q])} updates and {k}B{j} "
                f"after {int(b_base[q])}, so two buffers cannot hold it; use at least "
                f"as many micro-batches as stages"
            )
    else:
        forward = backward = f_base
    predicted = (distance > 0) if policy is WeightPolicy.PREDICT else np.zeros_like(is_f[f_pos])
    passes = PassArrays(stage[f_pos], mb[f_pos], f_base, forward, backward, distance, predicted)

    # Updates: the version each is applied to and the oldest version its gradient saw.
    applied = before[u_pos]
    gradient = applied.copy()
    for q in range(m):
        found = f_index.find((mb[u_pos] * m + q) * num_stages + stage[u_pos])
        if (found < 0).any():
            i = u_pos[int(np.argmax(found < 0))]
            k, j = int(stage[i]), int(mb[i]) * m + q
            raise ScheduleError(
                f"stage {k}: update {k}U{int(mb[i])} needs micro-batch {j}, which has no "
                f"forward {k}F{j} before its backward; every update follows the forward and "
                f"backward of all {m} micro-batch(es) of its mini-batch"
            )
        gradient = np.minimum(gradient, backward[found]) if q else backward[found]
    b_pass = f_index.find(b_keys)
    gradient = _accumulated_versions(gradient, u_pos, b_pos, b_pass, backward, group_start, group)
    update_arrays = UpdateArrays(stage[u_pos], mb[u_pos], applied, gradient)

    # Per action, back in the order's indices.
    version = before.copy()
    version[f_pos] = forward
    has_pass = b_pass >= 0
    version[b_pos[has_pass]] = backward[b_pass[has_pass]]
    i_pass = f_index.find(i_keys)
    has_pass = i_pass >= 0
    version[i_pos[has_pass]] = backward[i_pass[has_pass]]
    action_distance = np.zeros(n, dtype=np.int64)
    action_distance[f_pos] = distance
    action_predicted = np.zeros(n, dtype=bool)
    action_predicted[f_pos] = predicted
    unsort = np.empty_like(perm)
    unsort[perm] = np.arange(n)
    actions = ActionVersions(version[unsort], action_distance[unsort], action_predicted[unsort])

    # Weight copies: distinct versions alive after each forward and each update.
    if policy in (WeightPolicy.STASH, WeightPolicy.DOUBLE_BUFFER) and n:
        alive = _distinct_alive(n, group, group_end, before, is_u, u_pos, f_pos, b_at, forward)
    else:
        alive = np.ones(n, dtype=np.int64)
    sampled = np.where(is_f | is_u, alive, 0)
    sampled[f_pos] += predicted  # the predicted copy exists during the forward
    stages = stage[group_start].tolist()
    copies = np.maximum(np.maximum.reduceat(sampled, group_start), 1) if n else sampled
    # In flight: forwards whose backward has not run (a backward before its forward leaves
    # that micro-batch in flight for good, as a walk of the order would).
    step = np.bincount(f_pos, minlength=n + 1)
    closes = b_at > f_pos
    step -= np.bincount(b_at[closes], minlength=n + 1)
    level = np.cumsum(step)[:n]
    level -= (level - step[:n])[group_start][group]
    flight = np.maximum.reduceat(np.where(is_f, level, 0), group_start) if n else level
    return VersionReport(
        policy,
        m,
        passes,
        update_arrays,
        dict(zip(stages, copies.tolist(), strict=True)),
        dict(zip(stages, flight.tolist(), strict=True)),
        actions,
    )


def _accumulated_versions(
    gradient: IntArray,
    u_pos: IntArray,
    b_pos: IntArray,
    b_pass: IntArray,
    backward: IntArray,
    group_start: IntArray,
    group: IntArray,
) -> IntArray:
    """The oldest backward version among every backward an update applies: those since the
    stage's previous update (more than its own mini-batch's under accumulation), given the
    oldest of its own mini-batch (``gradient``). Positions are stage-grouped: ``group`` is
    each position's stage group, ``group_start`` each group's first position."""
    if not len(u_pos):
        return gradient
    previous = np.r_[-1, u_pos[:-1]]
    same_stage = np.r_[False, group[u_pos[1:]] == group[u_pos[:-1]]]
    previous = np.where(same_stage, previous, group_start[group[u_pos]] - 1)
    lo = np.asarray(np.searchsorted(b_pos, previous, side="right"), dtype=np.int64)
    hi = np.asarray(np.searchsorted(b_pos, u_pos), dtype=np.int64)
    versions = np.where(b_pass >= 0, backward[np.maximum(b_pass, 0)], np.iinfo(np.int64).max)
    out = gradient.copy()
    for i in np.flatnonzero(hi - lo > 1).tolist():  # only accumulated windows hold more
        out[i] = min(int(out[i]), int(versions[lo[i] : hi[i]].min()))
    return out


def _distinct_alive(
    n: int,
    group: IntArray,
    group_end: IntArray,
    before: IntArray,
    is_u: BoolArray,
    u_pos: IntArray,
    f_pos: IntArray,
    b_at: IntArray,
    kept: IntArray,
) -> IntArray:
    """Distinct weight versions alive after each position (stage-grouped positions).

    Version v is alive while it is current (from the update that made it to the next one)
    or kept by an in-flight micro-batch (from its forward to its backward). The intervals
    of one (stage, version) are merged, and the merged intervals are counted per position.
    """
    current_from = np.unique(np.r_[np.flatnonzero(np.r_[True, group[1:] != group[:-1]]), u_pos])
    current_to = np.r_[current_from[1:], n]
    current_version = before[current_from] + is_u[current_from]
    stash_to = np.where(b_at > f_pos, b_at, group_end[f_pos])
    lo = np.r_[current_from, f_pos]
    hi = np.r_[current_to, stash_to]
    version = np.r_[current_version, kept]
    keep = hi > lo
    lo, hi, version = lo[keep], hi[keep], version[keep]
    owner = group[lo] * (n + 2) + version  # one key per (stage, version)
    # Merge each key's intervals: sweep its +1/-1 events (ends before starts at a tie).
    pos = np.r_[lo, hi]
    delta = np.r_[np.ones(len(lo), dtype=np.int64), -np.ones(len(hi), dtype=np.int64)]
    key = np.r_[owner, owner]
    by = np.lexsort((delta, pos, key))
    pos, delta = pos[by], delta[by]
    after = np.cumsum(delta)
    prior = after - delta
    opens = pos[(prior == 0) & (after > 0)]
    closes = pos[(prior > 0) & (after == 0)]
    count = np.bincount(opens, minlength=n + 1) - np.bincount(closes, minlength=n + 1)
    return np.cumsum(count)[:n]


def gradient_delays(
    passes: Iterable[MicroBatchVersions], policy: WeightPolicy, accumulation: int = 1
) -> dict[int, int]:
    """τ of each update j of one stage (in updates): ``j`` minus the oldest weight version
    that was present at a forward of the mini-batches it applies (the stash or the buffer a
    forward reads; under prediction the live weights Ŵ was extrapolated from, since the
    gradient still carries that much delay: a prediction fixes the forward's weights, not
    the update's lag). Update j applies mini-batches ``j·A … j·A + A − 1`` of the segment
    (``accumulation`` A, 1 but under a bounded delay), so with A = 1 it is mini-batch j's."""
    oldest: dict[int, int] = {}
    for v in passes:
        seen = v.forward_base if policy is WeightPolicy.PREDICT else v.forward_version
        j = v.mini_batch // accumulation
        oldest[j] = min(oldest.get(j, seen), seen)
    return {j: max(0, j - base) for j, base in oldest.items()}


def steady_delays(method: Method, shape: Shape) -> dict[int, int]:
    """τ_k per stage in the steady state (:func:`gradient_delays` of a late mini-batch):
    ``P−1−k`` for PipeDream and PipeOptim, 1 for PipeDream-2BW and XPipe, 0 for a flush.

    Read off the method's own schedule, long enough to reach its steady state (2P + 2
    mini-batches), so it is right for any schedule; the warm-up's smaller delays are what a
    delay correction sees step by step (``Stage.begin_segment``)."""
    long = replace(shape, mini_batches=max(shape.mini_batches, 2 * shape.num_stages + 2))
    report = analyze_order(method.order_arrays(long), method.version_rule, long.micro_batches)
    by_stage: dict[int, list[MicroBatchVersions]] = {}
    for (stage, _), v in report.passes.items():
        by_stage.setdefault(stage, []).append(v)
    p = long.num_stages
    return {
        k: max(
            gradient_delays(vs, method.version_rule, method.accumulation(k, p)).values(),
            default=0,
        )
        for k, vs in sorted(by_stage.items())
    }
