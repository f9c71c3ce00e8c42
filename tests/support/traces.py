"""Simulated traces dressed as the runtime's, for the calibration tests."""

from __future__ import annotations

from pipeoptim.trace import Trace, TraceEvent


def add_receive_waits(trace: Trace) -> None:
    """The runtime waits for an input inside a receive: its events fill the idle time
    before each F and B, as the simulator's trace leaves it empty."""
    waits = []
    for rank in {e.rank for e in trace.events}:
        mine = sorted((e for e in trace.events if e.rank == rank), key=lambda e: e.start)
        end = 0.0
        for e in mine:
            if e.start > end and e.kind in ("F", "B"):
                kind = "RECV_F" if e.kind == "F" else "RECV_B"
                waits.append(TraceEvent(rank, e.stage, kind, e.mb, end, e.start))
            end = max(end, e.end)
    trace.events.extend(waits)
