"""The trace of the ranks one process runs: action times and memory samples.

Apart from the executor because timing is a concern of its own (CUDA events resolved at
segment ends, a cap on what is kept) that the fit loop and the ``Pipeline`` also hold and
read, while the executor only marks the start and end of each action.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pipeoptim.trace import MemorySample, TraceEvent

__all__ = ["Mark", "Recorder"]

Mark = float | torch.cuda.Event


class Recorder:
    """Trace events and memory samples of the ranks one process runs.

    Times are seconds since ``origin``, a ``perf_counter`` value taken after all ranks met
    (ranks of one machine share the clock). On CUDA actions are timed with events, resolved
    at segment ends, so timing never stalls the device mid-segment; resolved events are
    recorded again later instead of creating two new ones per action. At most ``limit``
    events (and as many memory samples) are kept, the first ones of the run: a trace of a
    very long run shows its beginning and ``truncated`` says so.
    """

    def __init__(self, device: torch.device, origin: float, limit: int = 500_000) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.origin = origin
        self.limit = limit
        self.truncated = False
        self.events: list[TraceEvent] = []
        self.memory: list[MemorySample] = []
        self._pending: list[tuple[TraceEvent | MemorySample, Any, Any]] = []
        self._spare: list[torch.cuda.Event] = []  # resolved events, free to record again
        self._base = torch.cuda.Event(enable_timing=True) if self.cuda else None  # type: ignore[no-untyped-call]
        if self._base is not None:
            self._base.record()
        self._base_time = time.perf_counter() - origin

    def mark(self) -> Mark:
        if self.cuda:
            ev = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            ev.record()
            return ev
        return time.perf_counter() - self.origin

    @property
    def full(self) -> bool:
        return len(self.events) + len(self._pending) >= self.limit

    def add(self, item: TraceEvent | MemorySample, start: Mark, end: Mark) -> None:
        if self.full:
            self.truncated = True
            return
        if isinstance(start, float) and isinstance(end, float):
            self._store(item, start, end)
        else:
            self._pending.append((item, start, end))

    def _store(self, item: TraceEvent | MemorySample, start: float, end: float) -> None:
        if isinstance(item, TraceEvent):
            # built field by field: dataclasses.replace costs a few microseconds per action
            self.events.append(
                TraceEvent(
                    item.rank,
                    item.stage,
                    item.kind,
                    item.mb,
                    start,
                    end,
                    item.weight_version,
                    item.bytes,
                    item.distance,
                )
            )
        else:
            self.memory.append(MemorySample(item.rank, end, item.bytes, item.detail))

    def resolve(self) -> None:
        """Turn pending CUDA events into times (one device synchronisation)."""
        if not self._pending or self._base is None:
            return
        torch.cuda.synchronize(self.device)
        base = self._base
        spare: dict[int, torch.cuda.Event] = {}  # an event may mark two items' times
        for item, start, end in self._pending:
            t0 = self._base_time + base.elapsed_time(start) / 1e3
            self._store(item, t0, self._base_time + base.elapsed_time(end) / 1e3)
            spare[id(start)], spare[id(end)] = start, end
        self._spare.extend(spare.values())
        self._pending = []
