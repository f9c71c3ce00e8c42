"""One clock for every rank of a trace, from the messages between them.

Each rank of a multi-process run times its events from an origin it takes after a barrier;
on a loaded machine the ranks leave the barrier at different moments, so their clocks can
differ by milliseconds, and a receive can seem to end before its message was sent. A
message from rank a to rank b takes some time ``d >= 0`` from its send's start to its
receive's end; with ``o`` the amount b's clock is ahead of a's, every a → b message shows
``recv end - send start = d + o`` and every b → a message ``d' - o``. Taking the fastest
message each way as equally fast (the NTP estimate) gives
``o = (min b→a - min a→b) / 2``.

Offsets are chained from the lowest rank along the ranks that exchange messages both ways
(neighbouring stages); a rank without such a partner keeps its clock.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass

from pipeoptim.trace import Trace, TraceEvent

__all__ = ["ClockFit", "Message", "align_clocks", "messages"]


@dataclass(frozen=True)
class Message:
    """One message of a trace: its send on one rank and its receive on another."""

    send: TraceEvent
    receive: TraceEvent

    @property
    def edge(self) -> int:
        """The stage edge it crossed (edge k joins stages k and k+1)."""
        return min(self.send.stage, self.receive.stage)

    @property
    def delay(self) -> float:
        """Receive end less send start, on the trace's clocks."""
        return self.receive.end - self.send.start


def messages(trace: Trace) -> list[Message]:
    """Every receive with the send that fed it (a forward from stage k-1, a gradient from
    stage k+1, of the same micro-batch), between two ranks."""
    sends = {(e.kind[-1], e.stage, e.mb): e for e in trace.events if e.kind.startswith("SEND_")}
    out = []
    for e in trace.events:
        if not e.kind.startswith("RECV_"):
            continue
        way = e.kind[-1]
        send = sends.get((way, e.stage - 1 if way == "F" else e.stage + 1, e.mb))
        if send is not None and send.rank != e.rank:
            out.append(Message(send, e))
    return out


@dataclass(frozen=True)
class ClockFit:
    """The trace on one clock, and what the messages told."""

    trace: Trace
    """Every event moved to the lowest rank's clock."""
    offsets: dict[int, float]
    """Seconds each rank's clock was ahead of the lowest rank's (subtracted from its times)."""


def align_clocks(trace: Trace) -> ClockFit:
    """The trace with every rank's times on the lowest rank's clock (module docstring)."""
    fastest: dict[tuple[int, int], float] = defaultdict(lambda: math.inf)  # (from, to) rank
    for m in messages(trace):
        key = (m.send.rank, m.receive.rank)
        fastest[key] = min(fastest[key], m.delay)
    ranks = sorted({e.rank for e in trace.events})
    offsets: dict[int, float] = {ranks[0]: 0.0} if ranks else {}
    pairs = [(a, b) for a, b in list(fastest) if a < b and fastest.get((b, a), math.inf) < math.inf]
    changed = True
    while changed:  # chain the offsets outwards from the lowest rank
        changed = False
        for a, b in pairs:
            ahead = (fastest[(a, b)] - fastest[(b, a)]) / 2  # b's clock less a's
            if a in offsets and b not in offsets:
                offsets[b] = offsets[a] + ahead
                changed = True
            elif b in offsets and a not in offsets:
                offsets[a] = offsets[b] - ahead
                changed = True
    for r in ranks:
        offsets.setdefault(r, 0.0)
    if not any(offsets.values()):
        return ClockFit(trace, offsets)
    events = [
        dataclasses.replace(e, start=e.start - offsets[e.rank], end=e.end - offsets[e.rank])
        for e in trace.events
    ]
    memory = [dataclasses.replace(m, time=m.time - offsets.get(m.rank, 0.0)) for m in trace.memory]
    return ClockFit(Trace(events=events, memory=memory, meta=trace.meta), offsets)
