"""Ranks that share a host's cores: processor sharing, for both engines.

When the busy ranks of a host ask for more cores than it has (:class:`Machine`), each of
the ``n`` busy ranks progresses at ``rate(n) = min(1, cores / (n * threads_per_rank))`` of
its own speed, so an action of ``d`` seconds of work takes longer while others run. A rank
waiting for its input is not busy (a blocked receive sleeps), so it leaves its share to the
others.

:class:`HostCores` keeps one host's arithmetic in *virtual time*: the work each busy rank
has done since time 0, which grows at ``rate(n)``. An action that starts at virtual time
``v`` with ``d`` seconds of work ends when virtual time reaches ``v + d`` (its tag), so no
action's remaining work is updated at every event and rounding cannot reorder finishes.
The fast evaluator (:func:`shared_schedule`) and the SimPy engine
(:mod:`pipeoptim.sim.engine`) drive the same class with the same calls, so they agree to
the bit: every finish is computed as ``now + (tag - virtual) / rate`` at the host's latest
event, which is also the delay a SimPy timeout started then adds to ``env.now``.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from pipeoptim.plan.machine import Machine
from pipeoptim.sim.program import Program, Timing

__all__ = ["HostCores", "shared_schedule"]


class HostCores:
    """Processor sharing of one host's cores among its busy ranks (virtual-time form)."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        self.now = 0.0
        """Time of the host's latest event (a start or a finish)."""
        self.virtual = 0.0
        """Work each busy rank has done from time 0 to :attr:`now`."""
        self.rate = 1.0
        """Speed of each busy rank now."""
        self.tags: dict[int, float] = {}
        """Busy rank -> the virtual time its action ends at."""

    def start(self, rank: int, work: float, now: float) -> list[tuple[int, float]]:
        """Rank ``rank`` starts ``work`` seconds of work at ``now``; returns (rank, end) of
        the actions that ended at ``now`` or earlier (finishes come before starts)."""
        done = self.finish(now)
        if now > self.now:
            self.virtual += (now - self.now) * self.rate
            self.now = now
        self.tags[rank] = self.virtual + work
        self.rate = self.machine.rate(len(self.tags))
        return done

    def delay(self) -> float:
        """Seconds from :attr:`now` to the earliest finish, unless another rank starts
        first (a SimPy timeout of this delay, asked for at :attr:`now`, fires at
        :meth:`next_finish`). Only while some rank is busy."""
        return max(min(self.tags.values()) - self.virtual, 0.0) / self.rate

    def next_finish(self) -> float | None:
        """When the earliest busy rank finishes, unless another starts first (None: idle)."""
        return self.now + self.delay() if self.tags else None

    def finish(self, now: float) -> list[tuple[int, float]]:
        """Retire every action that ends at ``now`` or earlier; returns (rank, end) of each.
        Virtual time is set to each finisher's tag, and is not moved otherwise, so a
        wake-up that finds nothing due leaves the host as it was."""
        done: list[tuple[int, float]] = []
        while self.tags:
            end = self.now + self.delay()
            if end > now:
                break
            tag = min(self.tags.values())
            finished = [r for r, t in self.tags.items() if t == tag]
            for r in finished:
                del self.tags[r]
            done += [(r, end) for r in finished]
            self.now, self.virtual = end, tag
            self.rate = self.machine.rate(len(self.tags)) if self.tags else 1.0
        return done


def shared_schedule(
    program: Program, durations: Sequence[float], transfers: Sequence[float], machine: Machine
) -> Timing:
    """Start and end of every action when the ranks of each host share its cores.

    An event-driven walk: a rank starts its next action when the previous one has ended and
    its cross-rank input has arrived (``end of the input + transfer``); the action's
    duration is work, done at its host's processor-sharing rate. A zero-length action takes
    no core. Ranks are placed on hosts of ``machine.ranks_per_host`` consecutive ranks.
    """
    return _SharedRun(program, durations, transfers, machine).run()


_FINISH, _ARRIVAL = 0, 1
"""Event kinds, in the order they are handled at one time."""


class _SharedRun:
    """One run of :func:`shared_schedule`: ranks as cursors over their actions."""

    def __init__(
        self,
        program: Program,
        durations: Sequence[float],
        transfers: Sequence[float],
        machine: Machine,
    ) -> None:
        self.program, self.durations, self.transfers = program, durations, transfers
        n = program.size
        self.starts, self.ends = [0.0] * n, [-1.0] * n
        self.arrived = [False] * n  # whether each action's cross-rank input is there
        self.feeds = program.consumers()
        self.position = {r: p for p, r in enumerate(program.ranks)}
        self.cursor = [lo for lo, _ in program.rank_bounds]
        self.stop = [hi for _, hi in program.rank_bounds]
        self.busy = [False] * len(program.ranks)
        self.machine = machine
        self.hosts: dict[int, HostCores] = {}
        for r in program.ranks:
            self.hosts.setdefault(machine.host_of(r), HostCores(machine))
        self.events: list[tuple[float, int, int, int]] = []  # (time, kind, sequence, what)
        self.sequence = 0

    def run(self) -> Timing:
        for p in range(len(self.cursor)):
            self.advance(p, 0.0)
        events, hosts = self.events, self.hosts
        while events:
            now, kind, _, what = heapq.heappop(events)
            if kind == _FINISH:
                done = hosts[what].finish(now)
                if done:
                    self.retire(done)
                    self.wake(what)
            else:
                self.arrived[what] = True
                self.advance(self.position[self.program.rank_of[what]], now)
        if min(self.ends, default=0.0) < 0.0:
            raise self.program.stuck_error(self.ends)
        return Timing(self.starts, self.ends)

    def push(self, time: float, kind: int, what: int) -> None:
        heapq.heappush(self.events, (time, kind, self.sequence, what))
        self.sequence += 1

    def wake(self, host: int) -> None:
        """Schedule the host's next finish (an earlier wake-up may be stale: it finds
        nothing due and changes nothing)."""
        when = self.hosts[host].next_finish()
        if when is not None:
            self.push(when, _FINISH, host)

    def advance(self, p: int, now: float) -> None:
        """Start rank position ``p``'s next actions at ``now`` while it is free and their
        inputs are there (a zero-length action ends at once and the next one may start)."""
        program = self.program
        while not self.busy[p] and self.cursor[p] < self.stop[p]:
            i = self.cursor[p]
            if program.dep[i] >= 0 and not self.arrived[i]:
                return
            self.starts[i] = now
            work = self.durations[i]
            if work > 0.0:
                rank = program.ranks[p]
                self.busy[p] = True
                host = self.machine.host_of(rank)
                self.retire(self.hosts[host].start(rank, work, now))
                self.wake(host)
            else:
                self.ended(p, now)

    def retire(self, done: list[tuple[int, float]]) -> None:
        for rank, end in done:
            p = self.position[rank]
            self.busy[p] = False
            self.ended(p, end)
            self.advance(p, end)

    def ended(self, p: int, now: float) -> None:
        """Rank position ``p``'s current action ended at ``now``: hand its output on, at
        once or after its transfer (an arrival event either way, so no rank starts inside
        another's step)."""
        i = self.cursor[p]
        self.ends[i] = now
        c = self.feeds[i]
        if c >= 0:
            self.push(now + self.transfers[c], _ARRIVAL, c)
        self.cursor[p] = i + 1
