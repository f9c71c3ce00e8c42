"""When each message arrived, and the latency of each link, from a trace on one clock.

The simulator sends a message when the action that produced it has ended (its send cost
included) and delivers it a link latency ``L`` later; the receiver then spends its fixed
receive cost taking it in. In a trace that reads: a receive posted after its message
arrived lasts only that receive cost ``r``; one posted before ends ``L + r`` after its
send ended, at the least. So per stage edge, with ``D`` the smallest ``receive end - send
end`` of its messages and ``r`` the shortest receive that found its message waiting
(posted at least ``D`` after the send ended), ``L = max(0, D - r)``, and a message arrived
at its send's end plus ``L``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from pipeoptim.calibrate.clocks import messages
from pipeoptim.trace import Trace

__all__ = ["LinkFit", "fit_links"]


@dataclass(frozen=True)
class LinkFit:
    """The links of a trace on one clock."""

    latency_s: dict[int, float]
    """Per stage edge: the latency of its messages (module docstring)."""
    arrivals: dict[int, float]
    """``id`` of a receive event -> when its message arrived (its send's end plus the
    latency, or the receive's start if that was later)."""


def fit_links(trace: Trace) -> LinkFit:
    """Latencies and arrivals of ``trace``'s messages (the trace on one clock)."""
    found = messages(trace)
    fastest: dict[int, float] = defaultdict(lambda: math.inf)
    for m in found:
        fastest[m.edge] = min(fastest[m.edge], m.receive.end - m.send.end)
    # the shortest receive posted after its message was there: the receive cost alone
    posted_late: dict[int, float] = defaultdict(lambda: math.inf)
    for m in found:
        if m.receive.start >= m.send.end + max(fastest[m.edge], 0.0):
            posted_late[m.edge] = min(posted_late[m.edge], m.receive.duration)
    latency = {
        edge: max(0.0, d - (posted_late[edge] if posted_late[edge] < math.inf else 0.0))
        for edge, d in fastest.items()
    }
    arrivals = {
        id(m.receive): min(max(m.send.end + latency[m.edge], m.receive.start), m.receive.end)
        for m in found
    }
    return LinkFit(latency, arrivals)
