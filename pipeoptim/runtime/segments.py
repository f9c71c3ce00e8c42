"""Segments: the never-flushed pieces a run is cut into, and the schedule of each.

An asynchronous pipeline never flushes, so at no moment inside it are all
stages' weights one consistent state: stage 0 has run forwards that stage 3 has not yet
seen, and the stash of a mini-batch in flight is part of the state. The runtime therefore
runs training as *segments*, each one continuous never-flushed pipeline, cut only every
``checkpoint_every`` (and ``eval_every``) mini-batches and at the end; epochs do not cut.
It checkpoints at segment boundaries, where nothing is in flight. A stage's state there is
exactly: weights, optimizer, scheduler and predictor state, its RNG stream and the step
(mini-batches done; the data position follows from it). Resuming from step n runs the same
segments an uninterrupted run with the same settings runs from n, so it produces the same
weights bit for bit (the segmentation is a function of the step and K, never of where a
run was interrupted) when n is on that grid. A fit that ends off it (``max_steps`` not a
multiple of K) checkpoints where it ended, drained there, which an uninterrupted run is
not: an asynchronous method resumed from it differs by that drain, and the resume says so
in its notes (``checkpoint_folder.py``); a flushing method is exact from any step.

This module is the one home of that logic: where a run is cut (:func:`plan_segments`), how
long one segment may be (:func:`segment_limit`), and each segment's schedule, analysed and
lowered (:func:`segment_plan`; :func:`eval_plan` for evaluation), which the executor runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import lru_cache

from pipeoptim.errors import RuntimeConfigError, ScheduleError
from pipeoptim.plan.actions import SPLIT_BACKWARD, Action, Kind
from pipeoptim.plan.methods import Method
from pipeoptim.plan.passes import add_communication, forwards_first, runs_to_the_end
from pipeoptim.plan.schedules import forward_only, stage_ranks
from pipeoptim.plan.shape import Shape
from pipeoptim.plan.versions import MicroBatchVersions, VersionReport, analyze_versions

__all__ = [
    "SEGMENT_ACTIONS",
    "SEGMENT_PASSES",
    "Segment",
    "SegmentPlan",
    "eval_plan",
    "plan_segments",
    "segment_limit",
    "segment_plan",
    "stop_horizons",
]


@dataclass(frozen=True)
class Segment:
    """Mini-batches ``first_step .. first_step + num_steps - 1``, one unflushed pipeline."""

    index: int
    first_step: int
    num_steps: int


def plan_segments(start: int, total: int, every: Iterable[int | None] = ()) -> Iterator[Segment]:
    """Cut steps ``start .. total-1`` at the multiples of each K in ``every`` (checkpoints,
    evaluations): a pure function of the step, so a resumed run runs the same segments as an
    uninterrupted one. Epochs do not cut: the pipeline runs on across them."""
    periods = [k for k in every if k]
    s, index = start, 0
    while s < total:  # a generator: a run of 10^9 steps holds one segment at a time
        end = min([total] + [(s // k + 1) * k for k in periods])
        yield Segment(index, s, end - s)
        s, index = end, index + 1


SEGMENT_PASSES = 2**16
"""At most this many forward passes (mini-batches x stages x micro-batches) in one
never-flushed segment. A segment's schedule is laid out in advance, so this bounds the
memory of a long run: at 4 stages a drain (P-1 idle steps) every 16,384 mini-batches."""

SEGMENT_ACTIONS = 4_000_000
"""The most compute actions one segment may hold (about 140 B each in the executor); only
absurd shapes reach it (a segment is at most SEGMENT_PASSES passes, or 4P mini-batches)."""


def segment_limit(method: Method, shape: Shape) -> int:
    """Mini-batches per never-flushed segment at most (see SEGMENT_PASSES), checked against
    SEGMENT_ACTIONS."""
    per_step = shape.num_stages * shape.micro_batches
    limit = max(4 * shape.num_ranks, SEGMENT_PASSES // per_step)
    work = method.work(replace(shape, mini_batches=limit))
    if work.actions > SEGMENT_ACTIONS:
        raise RuntimeConfigError(
            f"one never-flushed segment ({limit} mini-batches of "
            f"{shape.num_stages} stages x {shape.micro_batches} micro-batches) "
            f"is about {work.actions:,} actions, over the limit of {SEGMENT_ACTIONS:,}; "
            f"use fewer micro-batches (each carries B/M samples) or fewer stages"
        )
    return limit


@dataclass(frozen=True)
class SegmentPlan:
    """A segment's schedule: version analysis, lowered per-rank actions, stage placement."""

    shape: Shape
    versions: VersionReport | None
    actions: dict[int, list[Action]]
    rank_of: dict[int, int]
    horizons: dict[tuple[int, ...], dict[int, int]] = field(
        default_factory=dict, compare=False, repr=False
    )
    """:func:`stop_horizons` of this plan, by the steps asked (computed once)."""

    def passes(self, stage: int) -> dict[int, MicroBatchVersions]:
        if self.versions is None:
            return {}
        return {mb: v for (k, mb), v in self.versions.passes.items() if k == stage}


@lru_cache(maxsize=8)
def segment_plan(method: Method, shape: Shape, grouped: bool = False) -> SegmentPlan:
    """Schedule, analyse and lower one segment length (a run's segments mostly share one).
    ``grouped``: each rank's forwards between two updates first
    (:func:`~pipeoptim.plan.passes.forwards_first`, the local transport's
    ``forwards_first``), where that order runs to the end; the same weight versions.

    Raises :class:`ScheduleError` on a split backward (I/W) of a method that is not
    synchronous (flush): the stage keeps a micro-batch's graph from I to W, which only a
    flush (no update in between) makes exact.
    """
    order = method.order(shape)
    if not method.keeps_one_version:
        split = next(
            (
                (r, a)
                for r, acts in order.items()
                for a in acts
                if a is not None and a.kind in SPLIT_BACKWARD
            ),
            None,
        )
        if split is not None:
            r, a = split
            raise ScheduleError(
                f"{method.name}: {a} on rank {r} is half of a split backward (I/W), which the "
                f"runtime runs only for synchronous (flush) methods (this one's weight policy "
                f"is {method.version_rule.name}): an update may come between an I and its W; "
                f"merge each I and W into one B "
                f"(pipeoptim.plan.passes.merge_backward) to train it"
            )
    if grouped:
        regrouped = forwards_first(order)
        if runs_to_the_end(regrouped, shape.micro_batches):
            order = regrouped
    return SegmentPlan(
        shape,
        analyze_versions(order, method.version_rule, shape.micro_batches),
        add_communication(order),
        stage_ranks(order),
    )


def step_of(action: Action, micro_batches: int) -> int:
    """The segment's mini-batch an action belongs to (an update names its mini-batch)."""
    return action.mb if action.kind is Kind.UPDATE else action.mb // micro_batches


def stop_horizons(plan: SegmentPlan, steps: tuple[int, ...]) -> dict[int, int]:
    """For each segment step t of ``steps`` (ascending), the last mini-batch any rank can
    have begun while the last stage has not gone past its forward of t's last micro-batch:
    where the loss of t is read. A stop asked there ends the segment after that mini-batch,
    with nothing of a later one run anywhere (``RankExecutor.truncate``).

    Found by running the lowered action lists on their messages alone (every receive waits
    for its send), the last stage's rank held at that forward and every other rank run as
    far as it can. Messages the lists do not show (targets, tied weights) are not waited
    for, so the horizon can only come out later than the true one, never earlier.
    """
    cached = plan.horizons.get(steps)
    if cached is not None:
        return cached
    m = plan.shape.micro_batches
    last = max(plan.rank_of)
    last_rank = plan.rank_of[last]
    lists = plan.actions
    pos = dict.fromkeys(lists, 0)
    sent: set[tuple[Kind, int, int]] = set()
    begun = -1
    out: dict[int, int] = {}

    def runnable(a: Action) -> bool:
        if a.kind is Kind.RECV_F:
            return (Kind.SEND_F, a.stage - 1, a.mb) in sent
        if a.kind is Kind.RECV_B:
            return (Kind.SEND_B, a.stage + 1, a.mb) in sent
        return True

    for t in steps:
        target = Action(last, Kind.FORWARD, t * m + m - 1)
        held = lists[last_rank].index(target, pos[last_rank]) + 1
        progressed = True
        while progressed:
            progressed = False
            for rank, actions in lists.items():
                end = held if rank == last_rank else len(actions)
                i = pos[rank]
                while i < end and runnable(actions[i]):
                    a = actions[i]
                    if a.kind in (Kind.SEND_F, Kind.SEND_B):
                        sent.add((a.kind, a.stage, a.mb))
                    elif a.kind is Kind.FORWARD and a.stage == 0:
                        begun = max(begun, a.mb // m)
                    i += 1
                progressed = progressed or i > pos[rank]
                pos[rank] = i
        if pos[last_rank] < held:
            raise RuntimeError(f"the schedule cannot reach {target} on rank {last_rank}")
        out[t] = max(begun, t)
    plan.horizons[steps] = out
    return out


@lru_cache(maxsize=8)
def eval_plan(rank_of: tuple[tuple[int, int], ...], batches: int) -> SegmentPlan:
    """The forward-only schedule of ``batches`` evaluation batches, lowered."""
    placement = dict(rank_of)
    order = forward_only(placement, batches)
    ranks = len(set(placement.values()))
    return SegmentPlan(Shape(ranks, 1, batches), None, add_communication(order), placement)
