"""One validator for every schedule, generated or imported.

Checks, in order: each stage sits on one rank, no action twice, every micro-batch's
forward and backward on every stage (a backward is one B, or split into I then W, never
both), updates after their mini-batch's backwards, the per-rank orders run without
deadlock, and on the clock grid every action comes after its dependencies. Errors name
rank, step and action and show the grid with the step marked.

A lowered schedule (one holding sends and receives, like PyTorch's ``compute_comms`` dump
or :func:`~pipeoptim.plan.passes.add_communication`'s output) is a per-rank order, not a
clock grid: lowering drops the lock-step of the ranks, so its cells line up with nothing
on other ranks. Its cross-rank dependencies are checked by running the orders
(:func:`~pipeoptim.plan.schedules.retime`), not by comparing columns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pipeoptim.errors import ScheduleError
from pipeoptim.plan.actions import Action, B, F, Kind, Schedule, U, format_grid
from pipeoptim.plan.schedules import dependencies, retime

_WINDOW = 24  # grid steps shown around a marked error
_I, _W = Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT
_PER_MICRO_BATCH = frozenset((F, B, _I, _W))


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
    lowered = any(a.kind.is_comm for a in position)
    _check_overlaps(schedule, lowered)
    _check_counts(schedule, position, num_stages, stage_rank)
    _check_updates(schedule, position, m)
    retime(schedule, m)  # raises on deadlock, with the blocked actions named
    if lowered:
        return m  # a lowered order: its columns are not clock steps (see the module doc)
    for a, (rank, step) in position.items():
        for d in dependencies(a, num_stages, m, position):
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


def _check_overlaps(schedule: Mapping[int, Sequence[Action | None]], lowered: bool) -> None:
    """An overlapped step (PyTorch's OVERLAP_F_B) is a forward then, on the next step of its
    rank, a backward (B or I) of another micro-batch; in a lowered order sends and
    receives may come between them. Each half obeys every other rule on its own."""
    for rank, acts in schedule.items():
        for step, a in enumerate(acts):
            if a is None or not a.overlapped:
                continue
            if a.kind is not F:
                _fail(
                    schedule,
                    rank,
                    step,
                    f"{a} is marked as the forward of an overlapped step but is not a "
                    f"forward; an OVERLAP_F_B step is a forward then a backward, e.g. "
                    f"'(0F7;7B3)OVERLAP_F_B'",
                )
            nxt = step + 1
            while lowered and nxt < len(acts):
                between = acts[nxt]
                if between is None or not between.kind.is_comm:
                    break
                nxt += 1
            partner = acts[nxt] if nxt < len(acts) else None
            if partner is None or partner.kind not in (B, _I) or partner.mb == a.mb:
                got = "nothing" if partner is None else str(partner)
                _fail(
                    schedule,
                    rank,
                    step,
                    f"the overlapped step of {a} needs a backward (B or I) of another "
                    f"micro-batch right after it on rank {rank} (got {got}); write the pair "
                    f"as one cell '({a};<stage>B<micro-batch>)OVERLAP_F_B'",
                )


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
    def fail(a: Action, msg: str) -> None:
        _fail(schedule, *position[a], msg)

    mbs = sorted({a.mb for a in position if a.kind in _PER_MICRO_BATCH})
    for mb in mbs:
        for k in range(num_stages):
            fwd, bwd = Action(k, F, mb), Action(k, B, mb)
            inp, wgt = Action(k, _I, mb), Action(k, _W, mb)
            r = stage_rank[k]
            if not any(a in position for a in (fwd, bwd, inp, wgt)):
                raise ScheduleError(
                    f"micro-batch {mb} never runs on stage {k} (rank {r}): add {fwd} and {bwd}"
                )
            if bwd in position and (inp in position or wgt in position):
                half = inp if inp in position else wgt
                fail(
                    half,
                    f"{half} splits the backward of micro-batch {mb} on stage {k}, which also "
                    f"has the full backward {bwd}; keep either {bwd} or {inp} then {wgt}",
                )
            if wgt in position and inp not in position:
                fail(
                    wgt,
                    f"{wgt} has no input backward: add {inp} before it on rank {r} (or run "
                    f"the full backward {bwd} instead of {wgt})",
                )
            if inp in position and wgt not in position:
                fail(
                    inp,
                    f"{inp} has no weight backward: add {wgt} after it on rank {r} (or run "
                    f"the full backward {bwd} instead of {inp})",
                )
            back = bwd if bwd in position else inp
            if back not in position:
                fail(fwd, f"{fwd} has no backward: add {bwd} (or {inp} then {wgt}) after it")
            if fwd not in position:
                fail(back, f"{back} has no forward: add {fwd} before it on rank {r}")
            if position[back][1] <= position[fwd][1]:
                fail(back, f"{back} runs before its forward {fwd}; move it later")
            if wgt in position and position[wgt][1] <= position[inp][1]:
                fail(
                    wgt,
                    f"{wgt} runs before {inp}: the weight gradient needs the output gradient "
                    f"{inp} takes in; move {wgt} after {inp}",
                )


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
            w = Action(a.stage, _W, b.mb)
            last = w if b not in position and w in position else b
            if last not in position:
                _fail(
                    schedule,
                    rank,
                    step,
                    f"{a} updates stage {a.stage} for mini-batch {a.mb}, whose micro-batch "
                    f"{b.mb} has no backward {b} (or {w}) on this stage",
                )
            if position[last][1] >= step:
                _fail(
                    schedule,
                    rank,
                    step,
                    f"{a} runs before {last}, whose gradient it applies; move {a} after it",
                )


ORDER_NOTE = (
    "note: {source} holds overlapped steps (OVERLAP_F_B) and is a per-rank order, not a "
    "clock grid (PyTorch's DualPipeV writes its order without idle steps): placed on the "
    "grid with schedules.retime"
)


def as_grid(
    schedule: Schedule,
    micro_batches: int | None = None,
    *,
    source: str = "the schedule",
    notes: list[str] | None = None,
) -> Schedule:
    """A loaded schedule on the clock grid: a compute-only one holding overlapped steps
    (PyTorch's DualPipeV dump: per-rank orders, no idle steps) placed by
    :func:`~pipeoptim.plan.schedules.retime` with a note; any other returned as it is."""
    acts = [a for row in schedule.values() for a in row if a is not None]
    if not any(a.overlapped for a in acts) or any(a.kind.is_comm for a in acts):
        return schedule
    _check_overlaps(schedule, lowered=False)  # a malformed pair would deadlock the placing
    if notes is not None:
        notes.append(ORDER_NOTE.format(source=source))
    m = micro_batches if micro_batches is not None else infer_micro_batches(schedule)
    return retime(schedule, m)


def validated(schedule: Schedule, micro_batches: int | None = None) -> Schedule:
    """Validate and return the schedule, for use in expressions."""
    validate(schedule, micro_batches)
    return schedule
