"""One validator for every schedule, generated or imported.

Checks, in order: each stage sits on one rank, no action twice, every micro-batch's
forward and backward on every stage, updates after their mini-batch's backwards, the
per-rank orders run without deadlock, and on the clock grid every action comes after its
dependencies. Errors name rank, step and action and show the grid with the step marked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pipeoptim.errors import ScheduleError
from pipeoptim.plan.actions import Action, B, F, Schedule, U, format_grid
from pipeoptim.plan.schedules import dependencies, retime

_WINDOW = 24  # grid steps shown around a marked error


def _fail(schedule: Mapping[int, Sequence[Action | None]], rank: int, step: int, msg: str) -> None:
    grid = format_grid(schedule, mark=(rank, step), max_steps=_WINDOW)
    raise ScheduleError(f"rank {rank}, step {step}: {msg}\n{grid}")


def infer_micro_batches(schedule: Mapping[int, Sequence[Action | None]]) -> int:
    """Micro-batches per mini-batch, from the number of updates per stage (1 without any)."""
    mbs: set[int] = set()
    updates: dict[int, int] = {}
    for acts in schedule.values():
        for a in acts:
            if a is None:
                continue
            if a.kind is F:
                mbs.add(a.mb)
            elif a.kind is U:
                updates[a.stage] = updates.get(a.stage, 0) + 1
    if not updates:
        return 1
    per_stage = max(updates.values())
    if per_stage == 0 or len(mbs) % per_stage:
        raise ScheduleError(
            f"{len(mbs)} micro-batches cannot be split evenly into {per_stage} updates per "
            f"stage; every mini-batch needs the same number of micro-batches"
        )
    return len(mbs) // per_stage


def validate(
    schedule: Mapping[int, Sequence[Action | None]], micro_batches: int | None = None
) -> int:
    """Raise :class:`ScheduleError` on the first broken rule; return the micro-batch count."""
    if not schedule or all(not any(a is not None for a in acts) for acts in schedule.values()):
        raise ScheduleError("the schedule is empty: expected per-rank action lists")
    position: dict[Action, tuple[int, int]] = {}
    stage_rank: dict[int, int] = {}
    for rank in sorted(schedule):
        for step, a in enumerate(schedule[rank]):
            if a is None:
                continue
            if a in position:
                r0, s0 = position[a]
                _fail(schedule, rank, step, f"{a} appears twice (first at rank {r0}, step {s0})")
            position[a] = (rank, step)
            owner = stage_rank.setdefault(a.stage, rank)
            if owner != rank:
                _fail(
                    schedule,
                    rank,
                    step,
                    f"{a} runs stage {a.stage} on rank {rank}, but rank {owner} also runs "
                    f"stage {a.stage}; a stage's actions must all be on one rank",
                )
    num_stages = max(stage_rank) + 1
    missing_stages = _missing(sorted(stage_rank), num_stages)
    if missing_stages:
        more = " (and more)" if len(missing_stages) >= 10 else ""
        raise ScheduleError(
            f"stages {missing_stages}{more} have no actions; stages must be numbered "
            f"0..{num_stages - 1}"
        )
    m = micro_batches if micro_batches is not None else infer_micro_batches(schedule)
    _check_counts(schedule, position, num_stages, stage_rank)
    _check_updates(schedule, position, m)
    retime(schedule, m)  # raises on deadlock, with the blocked actions named
    for a, (rank, step) in position.items():
        for d in dependencies(a, num_stages, m):
            where = position.get(d)
            if where is not None and where[1] >= step:
                _fail(
                    schedule,
                    rank,
                    step,
                    f"{a} runs at step {step} but needs {d}, which runs at step {where[1]} "
                    f"on rank {where[0]}; move {a} after step {where[1]} (or pass the "
                    f"orders through schedules.retime)",
                )
    return m


def _missing(present: Sequence[int], count: int, most: int = 10) -> list[int]:
    """Up to ``most`` numbers of ``0..count-1`` not in the sorted ``present`` (without
    building the range: a stray stage id of 10**9 must not allocate 10**9 entries)."""
    out: list[int] = []
    expected = 0
    for k in [*present, count]:
        while expected < k and len(out) < most:
            out.append(expected)
            expected += 1
        if len(out) >= most:
            break
        expected = k + 1
    return out


def _check_counts(
    schedule: Mapping[int, Sequence[Action | None]],
    position: Mapping[Action, tuple[int, int]],
    num_stages: int,
    stage_rank: Mapping[int, int],
) -> None:
    mbs = sorted({a.mb for a in position if a.kind is F or a.kind is B})
    for mb in mbs:
        for k in range(num_stages):
            fwd, bwd = Action(k, F, mb), Action(k, B, mb)
            if fwd not in position and bwd not in position:
                raise ScheduleError(
                    f"micro-batch {mb} never runs on stage {k} (rank {stage_rank[k]}): "
                    f"add {fwd} and {bwd}"
                )
            if bwd not in position:
                r, s = position[fwd]
                _fail(schedule, r, s, f"{fwd} has no backward: add {bwd} after it on rank {r}")
            if fwd not in position:
                r, s = position[bwd]
                _fail(schedule, r, s, f"{bwd} has no forward: add {fwd} before it on rank {r}")
            if position[bwd][1] <= position[fwd][1]:
                r, s = position[bwd]
                _fail(schedule, r, s, f"{bwd} runs before its forward {fwd}; move it later")


def _check_updates(
    schedule: Mapping[int, Sequence[Action | None]],
    position: Mapping[Action, tuple[int, int]],
    m: int,
) -> None:
    for a, (rank, step) in position.items():
        if a.kind is not U:
            continue
        for j in range(m):
            b = Action(a.stage, B, a.mb * m + j)
            if b not in position:
                _fail(
                    schedule,
                    rank,
                    step,
                    f"{a} updates stage {a.stage} for mini-batch {a.mb}, whose micro-batch "
                    f"{b.mb} has no backward {b} on this stage",
                )
            if position[b][1] >= step:
                _fail(schedule, rank, step, f"{a} runs before {b}, whose gradient it applies")


def validated(schedule: Schedule, micro_batches: int | None = None) -> Schedule:
    """Validate and return the schedule, for use in expressions."""
    validate(schedule, micro_batches)
    return schedule
