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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pipeoptim.plan.actions import Action, B, F, Kind
from pipeoptim.plan.schedules import Order, stage_ranks

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
