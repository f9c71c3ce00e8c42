"""The work a busy piece did on a shared host, by hand: processor sharing against the ranks
in actions first, which hands the same core time to other pieces."""

from __future__ import annotations

import pytest

from pipeoptim.calibrate.busy import Concurrency, Piece
from pipeoptim.plan.machine import Machine
from pipeoptim.trace import TraceEvent


def _piece(rank: int, start: float, end: float, role: str) -> Piece:
    kind = "F" if role == "action" else "RECV_F"
    return Piece(start, end, role, TraceEvent(rank, rank, kind, 0, start, end))


def test_an_action_keeps_its_core_and_the_woken_receive_waits() -> None:
    """One core: rank 0 computes from 0 to 2, rank 1's message arrives at 1 and it is done
    at 3. Processor sharing halves both from 1 to 2 (1.5 s of work each); with the actions
    first the action did 2 s and the receive 1 s, the core's 3 s either way."""
    action, receive = _piece(0, 0.0, 2.0, "action"), _piece(1, 1.0, 3.0, "receive")
    busy = Concurrency({0: [action], 1: [receive]}, Machine(1, 2, 1))
    shared = [busy.work(p.event.rank, p.start, p.end, 1) for p in (action, receive)]
    first = [busy.work(p.event.rank, p.start, p.end, 1, p.role) for p in (action, receive)]
    assert shared == pytest.approx([1.5, 1.5])
    assert first == pytest.approx([2.0, 1.0])
    assert sum(first) == pytest.approx(sum(shared))


def test_actions_share_the_cores_among_themselves_first() -> None:
    """Two cores, three ranks in actions and one in a send from 0 to 1: each action gets
    2/3 of a core, the send nothing; by processor sharing each gets half."""
    pieces = {r: [_piece(r, 0.0, 1.0, "action")] for r in range(3)}
    pieces[3] = [_piece(3, 0.0, 1.0, "send")]
    busy = Concurrency(pieces, Machine(2, 4, 1))
    assert busy.work(0, 0.0, 1.0, 2, "action") == pytest.approx(2 / 3)
    assert busy.work(3, 0.0, 1.0, 2, "send") == pytest.approx(0.0)
    assert busy.work(0, 0.0, 1.0, 2) == pytest.approx(0.5)
    assert busy.work(3, 0.0, 1.0, 2) == pytest.approx(0.5)
