"""Schedule generators: pure functions from a shape to per-rank action orders.

A generator returns each rank's actions in execution order (no idle steps); :func:`retime`
places those orders on a clock grid, one action per step, each action at the first step
after its dependencies, which gives the ``Schedule`` the rest of the toolkit prints,
validates and simulates. Asynchronous generators cover a whole run of N mini-batches as
one continuous pipeline: they never flush.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence

import numpy as np

from pipeoptim.errors import ScheduleError
from pipeoptim.plan.actions import (
    SPLIT_BACKWARD,
    Action,
    B,
    F,
    Kind,
    Schedule,
    U,
    format_grid,
)
from pipeoptim.plan.orders import KIND_B, KIND_F, KIND_U, OrderArrays
from pipeoptim.plan.shape import Shape

Order = dict[int, list[Action]]
"""Per-rank actions in execution order, without idle steps."""


def dependencies(
    action: Action,
    num_stages: int,
    micro_batches: int,
    present: Container[Action] | None = None,
) -> list[Action]:
    """Actions that must finish before ``action`` may start, on any rank.

    F of stage k needs F of stage k-1. A backward is either one B or split into I (input
    gradient) then W (weight gradient): B and I of stage k need their own F and the
    gradient from stage k+1's B or I; W needs its own I; an update needs every B or W of
    its mini-batch. Which of the two forms a micro-batch takes is read from ``present``
    (the schedule's actions); without it, the full backward B.
    """
    k, mb = action.stage, action.mb
    kind = action.kind
    if kind is F:
        return [Action(k - 1, F, mb)] if k > 0 else []
    if kind is B or kind is Kind.BACKWARD_INPUT:
        own = Action(k, F, mb)
        if k == num_stages - 1:
            return [own]
        return [_either(Action(k + 1, B, mb), Action(k + 1, Kind.BACKWARD_INPUT, mb), present), own]
    if kind is Kind.BACKWARD_WEIGHT:
        return [Action(k, Kind.BACKWARD_INPUT, mb)]
    if kind is U:
        first = mb * micro_batches
        return [
            _either(Action(k, B, j), Action(k, Kind.BACKWARD_WEIGHT, j), present)
            for j in range(first, first + micro_batches)
        ]
    return []


def _either(full: Action, split: Action, present: Container[Action] | None) -> Action:
    """``split`` where the schedule holds it instead of ``full``, else ``full``."""
    if present is not None and full not in present and split in present:
        return split
    return full


def _one_f_one_b(
    forwards: Sequence[Action],
    backwards: Sequence[Action],
    warmup: int,
) -> list[Action]:
    """``warmup`` forwards, then alternate one forward / one backward, then drain backwards."""
    warmup = min(warmup, len(forwards))
    order = list(forwards[:warmup])
    next_f = warmup
    for b in backwards:
        if next_f < len(forwards):
            order.append(forwards[next_f])
            next_f += 1
        order.append(b)
    return order


def gpipe(shape: Shape) -> Order:
    """GPipe: all forwards, all backwards, one update, flush; per mini-batch."""
    m = shape.micro_batches
    order: Order = {}
    for k in range(shape.num_ranks):
        acts: list[Action] = []
        for t in range(shape.mini_batches):
            acts += [Action(k, F, t * m + j) for j in range(m)]
            acts += [Action(k, B, t * m + j) for j in range(m)]
            acts.append(Action(k, U, t))
        order[k] = acts
    return order


def one_f_one_b(shape: Shape) -> Order:
    """1F1B with a flush per mini-batch (PipeDream-Flush / DAPPLE)."""
    p, m = shape.num_ranks, shape.micro_batches
    order: Order = {}
    for k in range(p):
        acts: list[Action] = []
        for t in range(shape.mini_batches):
            mbs = range(t * m, (t + 1) * m)
            acts += _one_f_one_b(
                [Action(k, F, i) for i in mbs], [Action(k, B, i) for i in mbs], p - 1 - k
            )
            acts.append(Action(k, U, t))
        order[k] = acts
    return order


def async_one_f_one_b(shape: Shape) -> Order:
    """Asynchronous 1F1B, never flushed: stage k keeps ``P-1-k`` forwards in flight.

    With M > 1 (PipeDream-2BW, XPipe) micro-batches stream continuously and each stage
    updates after the last backward of every mini-batch. The Action form of
    :func:`async_one_f_one_b_arrays`.
    """
    return async_one_f_one_b_arrays(shape).to_order()


def async_one_f_one_b_arrays(shape: Shape) -> OrderArrays:
    """:func:`async_one_f_one_b` built with numpy, without an object per action.

    Rank k runs ``w = P-1-k`` forwards, then for every micro-batch i the group
    ``[F(w+i) while any is left, B(i), U(i // M) after a mini-batch's last backward]``.
    """
    p, m = shape.num_ranks, shape.micro_batches
    total = shape.total_micro_batches
    i = np.arange(total, dtype=np.int64)
    warm = np.minimum(p - 1 - np.arange(p, dtype=np.int64), total)[:, None]  # w per rank
    # every rank runs each F and B once and ``total // m`` updates
    length = 2 * total + total // m
    bounds = np.arange(p + 1, dtype=np.int64) * length
    stage = np.repeat(np.arange(p, dtype=np.int64), length)
    kind, mb = np.empty_like(stage), np.empty_like(stage)
    start = bounds[:-1, None]
    first = np.arange(int(warm.max(initial=0)), dtype=np.int64)
    is_warm = first < warm
    put = (start + first)[is_warm]
    kind[put], mb[put] = KIND_F, np.broadcast_to(first, is_warm.shape)[is_warm]
    # group i starts after the w warm-up forwards and groups 0..i-1, which hold i
    # backwards, min(i, total - w) forwards and i // m updates
    later = warm + i  # the forward of group i, where one is left
    group = start + later + np.minimum(i, total - warm) + i // m
    forward = later < total
    put = group[forward]
    kind[put], mb[put] = KIND_F, later[forward]
    backward = group + forward
    kind[backward], mb[backward] = KIND_B, i
    last = i % m == m - 1  # a mini-batch's last backward: its update follows
    put = backward[:, last] + 1
    kind[put], mb[put] = KIND_U, (i // m)[last]
    return OrderArrays(tuple(range(p)), bounds, stage, kind, mb)


def accumulation_steps(delay: int, max_delay: int) -> int:
    """A_k = ⌈τ_k / D⌉ (at least 1): the mini-batches a stage of delay τ_k accumulates
    its gradients over so that a forward meets at most D of its updates before its
    backward (the updates come A_k times rarer than the mini-batches)."""
    if max_delay < 1:
        raise ScheduleError(
            f"a bounded delay counts the updates a forward may meet before its backward and "
            f"must be at least 1 (got {max_delay}); use 1 for PipeDream-2BW's delay"
        )
    return max(1, -(-delay // max_delay))


def bounded_async_one_f_one_b_arrays(shape: Shape, max_delay: int) -> OrderArrays:
    """Asynchronous 1F1B of whole mini-batches (M = 1) with the delay bounded by local
    gradient accumulation (PACI, arXiv 2606.07881; PipeDream-2BW's bound at full-size
    forwards): stage k keeps :func:`async_one_f_one_b_arrays`' order but updates only after
    every ``A_k``-th backward, ``A_k = accumulation_steps(P−1−k, max_delay)``, and after
    the last mini-batch of the run, so no gradient is left unapplied; ``U(t)`` applies the
    mini-batches since the stage's previous update."""
    if shape.micro_batches != 1:
        raise ScheduleError(
            f"a bounded-delay schedule accumulates whole mini-batches (M = 1; got "
            f"{shape.micro_batches} micro-batches); leave --micro-batches out"
        )
    order = async_one_f_one_b_arrays(shape)
    p, n = shape.num_ranks, shape.mini_batches
    every = np.array([accumulation_steps(p - 1 - k, max_delay) for k in range(p)])
    is_u = order.kind == KIND_U
    keep = ~is_u | ((order.mb + 1) % every[order.stage] == 0) | (order.mb == n - 1)
    rank = order.rank_of()[keep]
    per_rank = {
        r: (order.stage[keep][rank == r], order.kind[keep][rank == r], order.mb[keep][rank == r])
        for r in order.ranks
    }
    return OrderArrays.from_rank_arrays(per_rank)


def interleaved_one_f_one_b(shape: Shape) -> Order:
    """Interleaved 1F1B (Megatron-LM): rank r holds stages r, r+P, ...; flush per mini-batch.

    Micro-batches go through a rank's chunks in groups of P, the order of Megatron-LM's
    schedule, which is deadlock-free when M is a multiple of P.
    """
    p, m, v = shape.num_ranks, shape.micro_batches, shape.virtual_stages
    per_round = p * v
    order: Order = {}
    for r in range(p):
        warmup = (p - r - 1) * 2 + (v - 1) * p if v > 1 else p - r - 1
        acts: list[Action] = []
        for t in range(shape.mini_batches):

            def item(i: int, backward: bool, t: int = t, r: int = r) -> Action:
                group, within = divmod(i, per_round)
                chunk = within // p
                if backward:
                    chunk = v - 1 - chunk
                return Action(r + chunk * p, B if backward else F, t * m + group * p + within % p)

            acts += _one_f_one_b(
                [item(i, False) for i in range(m * v)],
                [item(i, True) for i in range(m * v)],
                warmup,
            )
            acts += [Action(r + c * p, U, t) for c in range(v)]
        order[r] = acts
    return order


def forward_only(rank_of: Mapping[int, int], micro_batches: int) -> Order:
    """Evaluation: every micro-batch forward through every stage, no backward, no update.

    Each rank runs its stages' forwards in (micro-batch, stage) order, a topological order of
    the forward dependencies, so any placement of stages on ranks finishes.
    """
    order: Order = {rank: [] for rank in sorted(set(rank_of.values()))}
    stages = sorted(rank_of)
    for mb in range(micro_batches):
        for k in stages:
            order[rank_of[k]].append(Action(k, F, mb))
    return order


def stage_ranks(order: Mapping[int, Sequence[Action | None]]) -> dict[int, int]:
    """Which rank runs each stage (every stage's actions sit on one rank)."""
    where: dict[int, int] = {}
    for rank, acts in order.items():
        for a in acts:
            if a is not None:
                where.setdefault(a.stage, rank)
    return where


def retime(order: Mapping[int, Sequence[Action | None]], micro_batches: int) -> Schedule:
    """Place per-rank orders on a clock grid: each action at the first step after its deps.

    An overlapped step (a forward marked ``overlapped`` and the backward after it) starts
    when both may start and fills two consecutive steps of its rank. Idle steps already in
    ``order`` are dropped first. Raises :class:`ScheduleError` with the partial grid and the
    blocked actions marked when the orders deadlock.
    """
    queues = {r: [a for a in acts if a is not None] for r, acts in order.items()}
    num_stages = max((a.stage for acts in queues.values() for a in acts), default=-1) + 1
    present = {a for acts in queues.values() for a in acts}
    # which backward form each micro-batch takes matters only where any backward is split
    forms = present if any(a.kind in SPLIT_BACKWARD for a in present) else None
    done: dict[Action, int] = {}
    grid: Schedule = {r: [] for r in queues}
    cursor = dict.fromkeys(queues, 0)
    remaining = sum(len(q) for q in queues.values())
    step = 0
    partner_next: set[int] = set()  # ranks whose overlapped step's backward comes next
    while remaining:
        placed: list[tuple[int, Action]] = []
        for r, q in queues.items():
            if cursor[r] >= len(q):
                continue
            act = q[cursor[r]]
            # an overlapped step starts when both its actions may: the pair stays adjacent
            step_acts = q[cursor[r] : cursor[r] + 2] if act.overlapped else [act]
            if r in partner_next or all(
                d in done and done[d] < step
                for a in step_acts
                for d in dependencies(a, num_stages, micro_batches, forms)
                if d in present
            ):
                placed.append((r, act))
        partner_next = {r for r, act in placed if act.overlapped}
        if not placed:
            raise _deadlock_error(queues, cursor, grid, done, num_stages, micro_batches, present)
        placed_ranks = {r for r, _ in placed}
        for r in queues:
            grid[r].append(None)
        for r, act in placed:
            grid[r][step] = act
            done[act] = step
            cursor[r] += 1
        remaining -= len(placed_ranks)
        step += 1
    for r in grid:  # trailing idle steps carry no information
        while grid[r] and grid[r][-1] is None:
            grid[r].pop()
    return grid


def _deadlock_error(
    queues: Mapping[int, list[Action]],
    cursor: Mapping[int, int],
    grid: Schedule,
    done: Mapping[Action, int],
    num_stages: int,
    micro_batches: int,
    present: Container[Action],
) -> ScheduleError:
    blocked = []
    shown: Schedule = {r: [*acts] for r, acts in grid.items()}
    for r, q in queues.items():
        if cursor[r] < len(q):
            act = q[cursor[r]]
            missing = [
                str(d)
                for d in dependencies(act, num_stages, micro_batches, present)
                if d in present and d not in done
            ]
            blocked.append(f"rank {r} waits at {act} for {', '.join(missing)}")
            shown[r] = [*shown[r], act]
    step = len(next(iter(grid.values()), []))
    first = min((r for r in queues if cursor[r] < len(queues[r])), default=0)
    return ScheduleError(
        f"schedule deadlocks at step {step}: no rank can run its next action.\n"
        + "\n".join(blocked)
        + "\nEach rank's next action waits for an action that comes later in some rank's"
        " order; reorder so dependencies run first.\n"
        + format_grid(shown, mark=(first, step), max_steps=24)
    )
