"""When each rank used a core, how many ranks of a host did at once, and what work that was.

A rank is busy (wants a core) during its actions, its sends, the executor's own work between
two events, and the part of a receive after its message arrived (taking it in); it is not
busy while a receive waits for its message (a blocked receive sleeps). A message arrives at
its send's start plus its link's latency (:mod:`pipeoptim.calibrate.clocks`), or at the
receive's start if that is later.

Under processor sharing (:mod:`pipeoptim.sim.sharing`) n busy ranks of a host with C cores
and T threads each progress at ``min(1, C / (n T))``, so a piece of busy time from a to b
did ``∫ min(1, C / (n(t) T)) dt`` seconds of work: :meth:`Concurrency.work`.

Real hosts need not share so: where a rank's actions are short beside the scheduler's time
slice, the rank computing an action keeps its core, and a rank woken by its message waits
for a core to come free (its receive or the executor's time before its next action gets
longer, not the action). Under that rule (:data:`ACTIONS_FIRST`) the ``a`` ranks in
actions share the cores among themselves, each at ``min(1, C / (a T))``, and the ranks busy
otherwise share what is left, each at ``min(1, max(0, C - a T) / (o T))``; the host does
the same work in all as under processor sharing, and only whose work it was differs. On 4
ranks of a 16 x Linear(128) model on 2 cores (1f1b, 4 micro-batches) and on 2 ranks pinned
to one core, an action took as long whether 1 or 3 other ranks were busy beside it, where
processor sharing would have stretched it up to 2 times; the fit takes the rule whose
works of one action are most alike (:func:`pipeoptim.calibrate.fit.fit_machine`).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from pipeoptim.plan.machine import Machine
from pipeoptim.trace import Trace, TraceEvent

__all__ = ["ACTIONS_FIRST", "PROCESSOR_SHARING", "Concurrency", "Piece", "busy_pieces"]

PROCESSOR_SHARING = "processor sharing"
"""Every busy rank of a host progresses alike (the simulator's rule)."""
ACTIONS_FIRST = "actions first"
"""The ranks in actions share the cores first, the others what is left (module docstring)."""


@dataclass(frozen=True)
class Piece:
    """A stretch of time one rank was busy."""

    start: float
    end: float
    role: str
    """``"action"`` (a compute event), ``"send"``, ``"receive"`` (after its message arrived)
    or ``"gap"`` (the executor's work before ``event``)."""
    event: TraceEvent
    """The event it belongs to (for a gap, the event that follows it)."""


def busy_pieces(trace: Trace, arrivals: Mapping[int, float]) -> dict[int, list[Piece]]:
    """Every rank's busy pieces, in time order (``arrivals``: ``id`` of a receive event ->
    when its message arrived; a receive without one is busy throughout)."""
    by_rank: dict[int, list[TraceEvent]] = defaultdict(list)
    for e in trace.events:
        by_rank[e.rank].append(e)
    out: dict[int, list[Piece]] = {}
    for rank, events in by_rank.items():
        events.sort(key=lambda e: (e.start, e.end))
        pieces: list[Piece] = []
        before: TraceEvent | None = None
        for e in events:
            if before is not None and e.start > before.end:
                pieces.append(Piece(before.end, e.start, "gap", e))
            if e.kind.startswith("RECV_"):
                came = min(max(arrivals.get(id(e), e.start), e.start), e.end)
                pieces.append(Piece(came, e.end, "receive", e))
            else:
                role = "send" if e.kind.startswith("SEND_") else "action"
                pieces.append(Piece(e.start, e.end, role, e))
            before = e if before is None or e.end > before.end else before
        out[rank] = pieces
    return out


class Concurrency:
    """How many ranks of each host were busy at every moment (a step function), in all and
    in actions."""

    def __init__(self, pieces: Mapping[int, list[Piece]], machine: Machine) -> None:
        self.machine = machine
        changes: dict[int, list[tuple[float, int, int]]] = defaultdict(list)
        for rank, own in pieces.items():
            host = machine.host_of(rank)
            for p in own:
                if p.end > p.start:
                    act = int(p.role == "action")
                    changes[host] += [(p.start, 1, act), (p.end, -1, -act)]
        self.times: dict[int, list[float]] = {}
        self.counts: dict[int, list[int]] = {}
        self.acting: dict[int, list[int]] = {}
        """Per host, the ranks in actions from each time on."""
        for host, points in changes.items():
            points.sort(key=lambda point: point[0])
            times: list[float] = []
            counts: list[int] = []
            acting: list[int] = []
            busy = computing = 0
            for t, step, action_step in points:
                busy += step
                computing += action_step
                if times and times[-1] == t:
                    counts[-1], acting[-1] = busy, computing
                else:
                    times.append(t)
                    counts.append(busy)
                    acting.append(computing)
            self.times[host], self.counts[host], self.acting[host] = times, counts, acting

    def work(
        self, rank: int, start: float, end: float, cores: int, role: str | None = None
    ) -> float:
        """Seconds of work a busy piece of ``rank`` from ``start`` to ``end`` did when its
        host's busy ranks shared ``cores`` cores: by processor sharing (each at
        ``min(1, cores / (n T))``) where ``role`` is None, else by :data:`ACTIONS_FIRST`
        for a piece of that role (module docstring)."""
        if end <= start:
            return 0.0
        host = self.machine.host_of(rank)
        times, counts = self.times.get(host, []), self.counts.get(host, [])
        acting = self.acting.get(host, [])
        threads = self.machine.threads_per_rank
        i = bisect.bisect_right(times, start) - 1
        done, t = 0.0, start
        while t < end:
            busy = max(counts[i], 1) if i >= 0 else 1  # the piece itself is busy
            until = min(times[i + 1], end) if i + 1 < len(times) else end
            if role is None:
                rate = min(1.0, cores / (busy * threads))
            elif role == "action":
                rate = min(1.0, cores / (max(acting[i] if i >= 0 else 1, 1) * threads))
            else:  # what the ranks in actions leave, shared by the others
                computing = acting[i] if i >= 0 else 0
                others = max(busy - computing, 1)
                rate = min(1.0, max(0.0, cores - computing * threads) / (others * threads))
            done += (until - t) * rate
            t, i = until, i + 1
        return done
