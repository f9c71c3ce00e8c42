"""The machine model fitted from a trace: cores, the work of each action, each message's cost.

Given the trace on one clock (:mod:`~pipeoptim.calibrate.clocks`) and its busy pieces
(:mod:`~pipeoptim.calibrate.busy`):

* **cores** — the machine record's (``meta["machine"]``), else fitted: under the right core
  count the work of every instance of one action (stage and kind) is alike whatever ran
  beside it, so the fit takes the count (1 up to the ranks' demand) whose works spread
  least (mean absolute log deviation from their median), where it spreads them at most
  half as much as a core per rank does. A run whose actions always met the same company
  cannot tell; a core per rank is taken then.
* **sharing** — where the ranks share the cores, how: by processor sharing, or with the
  ranks in actions first (:mod:`~pipeoptim.calibrate.busy`), whichever leaves the works of
  one action's instances less spread. A real host's short actions run at full speed while
  the ranks woken beside them wait: divided by processor sharing, a 1f1b run's actions
  came out up to 2 times too small and its receives that much too large, which its own
  replay does not show (it has as many of both) but a method with fewer messages per
  action does (pipeoptim at one micro-batch was predicted 20 % to 31 % fast from 1f1b on 2
  ranks of one core; 5 % to 10 % with the actions first).
* **work** — per stage and kind, the mean work of its instances in the steady state (the
  middle half of the run, as :func:`pipeoptim.metrics.steady_state_throughput` measures)
  and the mean work of the executor's time before them. The mean, not the median: where
  cores are shared the run's time is the machine's total work over its cores, and that is
  a sum.
* **messages** — the fixed cost of a message at each end, whatever its size: at the sender
  the mean work of a send and of the executor's time before it, at the receiver the mean
  work of taking a message in (a receive's time after its message arrived) and of the time
  before the receive.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pipeoptim.calibrate.busy import (
    ACTIONS_FIRST,
    PROCESSOR_SHARING,
    Concurrency,
    Piece,
    busy_pieces,
)
from pipeoptim.calibrate.clocks import align_clocks
from pipeoptim.calibrate.links import fit_links
from pipeoptim.metrics import COMPUTE_KINDS
from pipeoptim.plan.machine import Machine
from pipeoptim.trace import Trace

__all__ = ["MachineFit", "fit_machine"]


@dataclass(frozen=True)
class MachineFit:
    """What calibration fitted from a run beyond per-action medians."""

    machine: Machine
    """The host the ranks shared: recorded, or with its cores fitted."""
    cores_fitted: bool
    """Whether the cores were fitted from the trace (else the machine record's)."""
    work_s: dict[tuple[int, str], float]
    """Per (stage, kind) the mean work of an action, with the executor's time before it."""
    message_send_s: float
    """Fixed work the sending rank spent on each message."""
    message_receive_s: float
    """Fixed work the receiving rank spent on each message."""
    latency_s: dict[int, float]
    """Per stage edge the latency of its messages (:mod:`pipeoptim.calibrate.links`)."""
    clock_offsets: dict[int, float] = field(default_factory=dict)
    """Seconds each rank's clock was ahead of the lowest rank's."""
    spread: dict[int, float] = field(default_factory=dict)
    """The core counts tried, each with the spread of the works it gave."""
    sharing: str = PROCESSOR_SHARING
    """How the busy ranks shared the cores (:data:`~pipeoptim.calibrate.busy.ACTIONS_FIRST`
    or processor sharing; the latter where they did not share)."""
    sharing_spread: dict[str, float] = field(default_factory=dict)
    """Where they shared: each rule tried, with the spread of the works it gave."""

    def describe(self) -> list[str]:
        """One line per fitted cost, for ``pipeoptim calibrate`` and the demo's report."""
        m = self.machine
        source = (
            f"fitted from the trace; tried {', '.join(map(str, self.spread))}"
            if self.cores_fitted
            else "the run's machine record"
        )
        sharing = (
            f"{m.ranks_per_host} rank(s) of {m.threads_per_rank} thread(s) per host on "
            f"{m.cores} core(s) ({source}): "
            + (
                f"the busy ranks share the cores ({self.sharing})"
                if m.shares_cores
                else "a core per rank"
            )
        )
        skew = max((abs(v) for v in self.clock_offsets.values()), default=0.0)
        return [
            f"core sharing: {sharing}",
            f"per-message fixed cost: {_us(self.message_send_s)} at the sender, "
            f"{_us(self.message_receive_s)} at the receiver (fitted)",
            "link latency (fastest message less its receive): "
            + (
                ", ".join(f"edge {k} {_us(v)}" for k, v in sorted(self.latency_s.items())) or "none"
            ),
            f"rank clocks aligned by their messages (largest offset {_us(skew)})",
        ]


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs"


def fit_machine(
    trace: Trace,
    recorded: Machine | None,
    default: Machine,
    predict_s: Mapping[int, float] | None = None,
) -> MachineFit:
    """The machine model of a runtime trace (module docstring). ``recorded``: the run's
    machine record, whose cores are used as they are; ``default``: the hosts and threads
    to assume where there is no record (its cores are fitted). ``predict_s``: per stage
    the measured prediction a predicted forward ran first, left out of its work (the
    simulator adds it back on the forwards it predicts)."""
    ahead = predict_s or {}
    clocks = align_clocks(trace)
    links = fit_links(clocks.trace)
    pieces = busy_pieces(clocks.trace, links.arrivals)
    layout = recorded or default
    concurrency = Concurrency(pieces, layout)
    steady = _steady_pieces(clocks.trace, pieces)
    everything = [p for own in pieces.values() for p in own]
    if recorded is not None:
        cores, spread = recorded.cores, {}
    else:
        # the whole run: its filling and draining is where the company of an action varies
        spread = {c: _spread(everything, concurrency, c) for c in _candidates(layout.demand)}
        least = min(spread.values())
        cores = max(c for c, s in spread.items() if s <= least + 1e-9)
        if spread[cores] > _CLEAR * spread[layout.demand]:  # not clearly better: no sharing
            cores = layout.demand
    machine = Machine(cores, layout.ranks_per_host, layout.threads_per_rank)
    sharing, tried = PROCESSOR_SHARING, {}
    if machine.shares_cores:
        tried = {rule: _spread(everything, concurrency, cores, rule) for rule in _RULES}
        # a tie keeps the simulator's own rule
        if tried.get(ACTIONS_FIRST, math.inf) < tried[PROCESSOR_SHARING] - 1e-9:
            sharing = ACTIONS_FIRST
    role = sharing == ACTIONS_FIRST

    def work(p: Piece) -> float:
        return concurrency.work(p.event.rank, p.start, p.end, cores, p.role if role else None)

    groups: dict[tuple[int, str], list[float]] = defaultdict(list)
    before: dict[tuple[int, str], list[float]] = defaultdict(list)
    sends: list[float] = []
    receives: list[float] = []
    before_message: dict[str, list[float]] = defaultdict(list)
    for p in steady:
        kind = p.event.kind
        if p.role == "gap":
            if kind in COMPUTE_KINDS:
                before[(p.event.stage, kind)].append(work(p))
            else:
                before_message[kind[:4]].append(work(p))
        elif p.role == "action":
            extra = ahead.get(p.event.stage, 0.0) if kind == "F" and p.event.distance else 0.0
            groups[(p.event.stage, kind)].append(max(work(p) - extra, 0.0))
        elif p.role == "send":
            sends.append(work(p))
        else:
            receives.append(work(p))
    work_s = {key: _mean(ws) + _mean(before.get(key, [])) for key, ws in groups.items()}
    return MachineFit(
        machine=machine,
        cores_fitted=recorded is None,
        work_s=work_s,
        message_send_s=_mean(sends) + _mean(before_message["SEND"]),
        message_receive_s=_mean(receives) + _mean(before_message["RECV"]),
        latency_s=links.latency_s,
        clock_offsets=clocks.offsets,
        spread=spread,
        sharing=sharing,
        sharing_spread=tried,
    )


def _candidates(demand: int) -> list[int]:
    """Core counts to try: every count up to 8, then halvings of the ranks' demand (a
    machine's cores are few or a round number), the demand itself last."""
    halvings = {max(1, demand >> k) for k in range(demand.bit_length())}
    return sorted({c for c in range(1, 9) if c <= demand} | halvings | {demand})


_CLEAR = 0.5
"""A fitted core count is taken only where it halves the spread of the works that a core
per rank leaves (noise alone must not turn a run on a big machine into a shared one)."""


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0


def _steady_pieces(trace: Trace, pieces: dict[int, list[Piece]]) -> list[Piece]:
    """The pieces that start in the run's steady state: between the updates of the last
    stage a quarter and three quarters of the way through (all of them when there are too
    few updates to tell)."""
    last = max((e.stage for e in trace.events), default=0)
    ends = sorted(e.end for e in trace.events if e.kind == "U" and e.stage == last)
    everything = [p for own in pieces.values() for p in own]
    if len(ends) < 4:
        return everything
    cut = len(ends) // 4
    lo, hi = ends[cut], ends[len(ends) - 1 - cut]
    return [p for p in everything if lo <= p.start < hi]


_RULES = (PROCESSOR_SHARING, ACTIONS_FIRST)
"""The sharing rules the fit tries where the ranks shared the cores."""


def _spread(
    pieces: Sequence[Piece],
    concurrency: Concurrency,
    cores: int,
    sharing: str = PROCESSOR_SHARING,
) -> float:
    """How unlike each other the works of one action's instances are under ``cores``,
    shared by the rule ``sharing``."""
    role = "action" if sharing == ACTIONS_FIRST else None
    groups: dict[tuple[int, str], list[float]] = defaultdict(list)
    for p in pieces:
        if p.role == "action":
            w = concurrency.work(p.event.rank, p.start, p.end, cores, role)
            groups[(p.event.stage, p.event.kind)].append(w)
    deviations = []
    for ws in groups.values():
        middle = statistics.median(ws)
        if len(ws) >= 3 and middle > 0:
            deviations += [abs(math.log(max(w, 1e-12) / middle)) for w in ws]
    return _mean(deviations)
