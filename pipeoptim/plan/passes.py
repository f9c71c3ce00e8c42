"""Lowering passes: small pure functions from a schedule to a schedule.

``add_communication`` makes the point-to-point transfers explicit, the way
``torch.distributed.pipelining`` lowers a compute-only schedule: a ``SEND_F`` right after
each forward whose next stage lives on another rank, a ``RECV_F`` right before each
forward whose previous stage does, and the same for backwards (``SEND_B``/``RECV_B``).
Stage indices follow PyTorch: a send names the sending stage, a receive the receiving one.
Of a split backward, the input half ``I`` carries the gradient (it receives and sends
like ``B``); the weight half ``W`` communicates nothing.

``split_backward`` and ``merge_backward`` move between the full backward ``B`` and its
split form ``I`` then ``W`` (zero-bubble schedules); the simulator and the runtime run
only ``B``, so a loaded zero-bubble schedule is merged before it is simulated.

``forwards_first`` reorders each rank's actions between two of its updates, forwards first,
for one thread that runs every rank (the local transport); ``runs_to_the_end`` says whether
per-rank lists can all finish under the pipeline's dependencies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pipeoptim.plan.actions import SPLIT_BACKWARD, Action, B, F, Kind, U
from pipeoptim.plan.schedules import Order, dependencies, stage_ranks

_GRADIENT = frozenset((B, Kind.BACKWARD_INPUT))
"""Backward kinds that take the next stage's gradient and pass one to the previous stage."""


def add_communication(schedule: Mapping[int, Sequence[Action | None]]) -> Order:
    """Insert sends and receives between stages on different ranks; idle steps are dropped."""
    rank_of = stage_ranks(schedule)
    last = max(rank_of, default=-1)
    lowered: Order = {}
    for rank, acts in schedule.items():
        out: list[Action] = []
        for a in acts:
            if a is None or a.kind.is_comm:
                if a is not None:
                    out.append(a)
                continue
            k = a.stage
            if a.kind is F and k > 0 and rank_of[k - 1] != rank:
                out.append(Action(k, Kind.RECV_F, a.mb))
            if a.kind in _GRADIENT and k < last and rank_of[k + 1] != rank:
                out.append(Action(k, Kind.RECV_B, a.mb))
            out.append(a)
            if a.kind is F and k < last and rank_of[k + 1] != rank:
                out.append(Action(k, Kind.SEND_F, a.mb))
            if a.kind in _GRADIENT and k > 0 and rank_of[k - 1] != rank:
                out.append(Action(k, Kind.SEND_B, a.mb))
        lowered[rank] = out
    return lowered


def strip_communication(schedule: Mapping[int, Sequence[Action | None]]) -> Order:
    """The compute-only form: drop communication actions and idle steps."""
    return {
        rank: [a for a in acts if a is not None and a.kind.is_compute]
        for rank, acts in schedule.items()
    }


def split_backward(schedule: Mapping[int, Sequence[Action | None]]) -> Order:
    """Each full backward ``B`` becomes its input half ``I`` followed at once by its weight
    half ``W``; idle steps are dropped (place the result with ``schedules.retime``)."""
    out: Order = {}
    for rank, acts in schedule.items():
        row: list[Action] = []
        for a in acts:
            if a is None:
                continue
            if a.kind is B:
                row += [
                    Action(a.stage, Kind.BACKWARD_INPUT, a.mb),
                    Action(a.stage, Kind.BACKWARD_WEIGHT, a.mb),
                ]
            else:
                row.append(a)
        out[rank] = row
    return out


def merge_backward(schedule: Mapping[int, Sequence[Action | None]]) -> Order:
    """Each ``I`` becomes the full backward ``B`` where the ``I`` ran, its ``W`` is dropped;
    idle steps are dropped. The weight gradient then comes as early as the input gradient,
    which keeps every dependency (an update waited for the later ``W``)."""
    return {
        rank: [
            Action(a.stage, B, a.mb) if a.kind is Kind.BACKWARD_INPUT else a
            for a in acts
            if a is not None and a.kind is not Kind.BACKWARD_WEIGHT
        ]
        for rank, acts in schedule.items()
    }


def forwards_first(schedule: Mapping[int, Sequence[Action | None]]) -> Order:
    """Each rank's forwards between two of its updates moved ahead of the other actions
    there, every kind keeping its own order; idle steps are dropped. Compute-only (lower
    communication afterwards).

    Exact: nothing a forward reads changes between two updates of its rank (weights,
    optimizer state, the inputs of a prediction), a forward still precedes its own
    backward, and the backwards keep their order, so every pass meets the same weight
    version and every gradient sums in the same order. Why: one thread running every rank
    (the local transport) then runs each stage's forwards back to back as gpipe does, where
    1F1B alternates forwards and backwards, which costs more on one core (issue 34). The
    price: a rank holds the activations of up to one more mini-batch. The result may not
    run to the end (a forward waiting on a rank held behind its own update); check it with
    :func:`runs_to_the_end`.
    """
    out: Order = {}
    for rank, acts in schedule.items():
        row: list[Action] = []
        forwards: list[Action] = []
        rest: list[Action] = []
        for a in acts:
            if a is None:
                continue
            if a.kind is U:
                row += [*forwards, *rest, a]
                forwards, rest = [], []
            elif a.kind is F:
                forwards.append(a)
            else:
                rest.append(a)
        out[rank] = [*row, *forwards, *rest]
    return out


def runs_to_the_end(schedule: Mapping[int, Sequence[Action | None]], micro_batches: int) -> bool:
    """Whether every rank's compute actions can all run, each rank in its own order, each
    action after those :func:`~pipeoptim.plan.schedules.dependencies` names: ``retime``'s
    verdict, without its clock grid."""
    rows = {
        r: [a for a in acts if a is not None and a.kind.is_compute] for r, acts in schedule.items()
    }
    present = {a for row in rows.values() for a in row}
    num_stages = max((a.stage for a in present), default=-1) + 1
    # which backward form each micro-batch takes matters only where any backward is split
    forms = present if any(a.kind in SPLIT_BACKWARD for a in present) else None
    done: set[Action] = set()
    position = dict.fromkeys(rows, 0)
    waiting = [r for r in rows if rows[r]]
    while waiting:
        progressed = False
        for r in waiting:
            row, i = rows[r], position[r]
            while i < len(row) and all(
                d in done or d not in present
                for d in dependencies(row[i], num_stages, micro_batches, forms)
            ):
                done.add(row[i])
                i += 1
            progressed = progressed or i > position[r]
            position[r] = i
        waiting = [r for r in waiting if position[r] < len(rows[r])]
        if waiting and not progressed:
            return False
    return True
