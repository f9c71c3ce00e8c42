"""Calibration fits the machine model from a run: core count, per-message cost, latency,
the ranks' clock offsets and every action's work, recovered from a synthetic trace whose
values are known; and a machine record that breaks the rules is refused."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import pytest

from pipeoptim.calibrate import calibrate, costs_from_trace, fitted_costs, machine_fit, what_if
from pipeoptim.calibrate.busy import ACTIONS_FIRST, PROCESSOR_SHARING
from pipeoptim.errors import PipeoptimError
from pipeoptim.metrics import compute_metrics
from pipeoptim.plan.machine import Machine
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.sim import Program
from pipeoptim.sim.sharing import HostCores
from pipeoptim.trace import Trace, TraceEvent

WORK = {"F": 0.010, "B": 0.020, "U": 0.004}
SEND, RECEIVE, LATENCY = 0.003, 0.002, 0.001


@dataclass
class _Rank:
    pieces: list[tuple[str, int, float]]  # (kind, action, work) in order
    at: int = 0
    posted: float = 0.0  # when the current piece became the rank's next
    events: list[TraceEvent] = field(default_factory=list)


class _ActionsFirstHost:
    """A host whose ranks in actions share its cores first, the others what is left (the
    rule :data:`ACTIONS_FIRST` of the fit), event by event; the calls of :class:`HostCores`."""

    def __init__(self, machine: Machine) -> None:
        self.cores = machine.cores
        self.now = 0.0
        self.left: dict[int, float] = {}  # busy rank -> work left
        self.acting: dict[int, bool] = {}

    def _rates(self) -> dict[int, float]:
        a = sum(self.acting[r] for r in self.left)
        o = len(self.left) - a
        act = min(1.0, self.cores / a) if a else 0.0
        other = min(1.0, max(0.0, self.cores - a) / o) if o else 0.0
        return {r: act if self.acting[r] else other for r in self.left}

    def _advance(self, t: float) -> None:
        rates = self._rates()
        for r in self.left:
            self.left[r] -= (t - self.now) * rates[r]
        self.now = t

    def next_finish(self) -> float | None:
        rates = self._rates()
        ends = [self.now + w / rates[r] for r, w in self.left.items() if rates[r] > 0]
        return min(ends) if ends else None

    def finish(self, now: float) -> list[tuple[int, float]]:
        done: list[tuple[int, float]] = []
        while self.left:
            end = self.next_finish()
            if end is None or end > now + 1e-12:
                break
            self._advance(end)
            for r in [r for r, w in self.left.items() if w <= 1e-12]:
                del self.left[r], self.acting[r]
                done.append((r, end))
        return done

    def start(self, rank: int, work: float, now: float, acting: bool) -> list[tuple[int, float]]:
        done = self.finish(now)
        if now > self.now:
            self._advance(now)
        self.left[rank], self.acting[rank] = work, acting
        return done


def synthetic_run(
    method: str,
    stages: int,
    mini_batches: int,
    cores: int,
    offsets: dict[int, float],
    sharing: str = PROCESSOR_SHARING,
    passes: float = 1.0,
) -> Trace:
    """A run as a gloo pipeline records it, made by processor sharing of known work.

    Every action is its receive (when its input comes from another rank: ``RECEIVE`` s of
    work once the message is there), its compute (``WORK``) and its send (when its output
    goes to another rank: ``SEND`` s); a message leaves at its send's end and arrives
    ``LATENCY`` s later. The ranks share ``cores`` cores of one host; each rank's clock is
    then moved ahead by ``offsets[rank]``, as ranks leaving a barrier apart would see it.
    ``sharing``: processor sharing, or :data:`ACTIONS_FIRST` (a real host's short actions);
    ``passes``: how many times ``WORK``'s a forward and a backward take (a bigger batch)."""
    spec = get_method(method)
    shape = spec.shape(stages, None, mini_batches)
    program = Program(spec.order_arrays(shape), shape.micro_batches, spec.weight_policy)
    feeds = program.consumers()
    ranks = {}
    for r, (lo, hi) in zip(program.ranks, program.rank_bounds, strict=True):
        pieces = []
        for i in range(lo, hi):
            if program.dep[i] >= 0:
                pieces.append(("RECV", i, RECEIVE))
            kind = spec_kind(program, i)
            pieces.append((kind, i, WORK[kind] * (passes if kind != "U" else 1.0)))
            if feeds[i] >= 0:
                pieces.append(("SEND", i, SEND))
        ranks[r] = _Rank(pieces)
    machine = Machine(cores, len(ranks))
    first = _ActionsFirstHost(machine) if sharing == ACTIONS_FIRST else None
    host = first or HostCores(machine)

    def start(r: int, work: float, now: float, acting: bool) -> list[tuple[int, float]]:
        return first.start(r, work, now, acting) if first else host.start(r, work, now)

    arrived: dict[int, float] = {}  # consumer action -> arrival of its input
    heap: list[tuple[float, int, int, int]] = []  # (time, order, kind 0 finish/1 arrive, what)
    order = 0
    started: dict[int, float] = {}

    def push(time: float, kind: int, what: int) -> None:
        nonlocal order
        heapq.heappush(heap, (time, order, kind, what))
        order += 1

    def try_start(r: int, now: float) -> None:
        rank = ranks[r]
        if r in started or rank.at >= len(rank.pieces):
            return
        kind, i, work = rank.pieces[rank.at]
        if kind == "RECV" and i not in arrived:
            return
        started[r] = now
        for done, end in start(r, work, now, kind not in ("RECV", "SEND")):
            finish(done, end)
        when = host.next_finish()
        if when is not None:
            push(when, 0, -1)

    def finish(r: int, now: float) -> None:
        rank = ranks[r]
        kind, i, _ = rank.pieces[rank.at]
        begin = started.pop(r)
        stage, mb = program.stage[i], program.mb[i]
        if kind == "RECV":
            way = "F" if program.kind[i] == 0 else "B"
            rank.events.append(TraceEvent(r, stage, f"RECV_{way}", mb, rank.posted, now))
        elif kind == "SEND":
            way = "F" if program.kind[i] == 0 else "B"
            rank.events.append(TraceEvent(r, stage, f"SEND_{way}", mb, begin, now))
            push(now + LATENCY, 1, feeds[i])
        else:
            rank.events.append(TraceEvent(r, stage, kind, mb, begin, now))
        rank.at += 1
        rank.posted = now
        try_start(r, now)

    for r in ranks:
        try_start(r, 0.0)
    while heap:
        now, _, kind, what = heapq.heappop(heap)
        if kind == 0:
            for r, end in host.finish(now):
                finish(r, end)
            when = host.next_finish()
            if when is not None:
                push(when, 0, -1)
        else:
            arrived[what] = now
            r = program.rank_of[what]
            try_start(r, now)
    events = [
        TraceEvent(e.rank, e.stage, e.kind, e.mb, e.start + offsets.get(e.rank, 0.0),
                   e.end + offsets.get(e.rank, 0.0))
        for rank in ranks.values()
        for e in rank.events
    ]  # fmt: skip
    m = shape.micro_batches
    plan = Plan(method, stages, micro_batches=m, optimizer=OptimizerSpec("sgd", 0.1), batch_size=8)
    meta = {
        "source": "runtime",
        "plan": plan.to_dict(),
        "batch_size": 8,
        "mini_batches": mini_batches,
        "micro_batches": m,
        "transport": "dist",
        "threads": 1,
        "boundaries": [[k, k + 1] for k in range(stages)],
    }
    return Trace(events=sorted(events, key=lambda e: (e.start, e.rank)), meta=meta)


def spec_kind(program: Program, i: int) -> str:
    return "FBU"[program.kind[i]]


OFFSETS = {1: 0.004, 2: -0.0025, 3: 0.0007}


@pytest.mark.parametrize("cores", [1, 2, 3, 4])
def test_the_core_count_is_recovered(cores: int) -> None:
    trace = synthetic_run("pipedream", 4, 24, cores, OFFSETS)
    fit = machine_fit(trace)
    assert fit is not None and fit.cores_fitted
    assert fit.machine == Machine(cores, 4, 1)
    assert min(fit.spread, key=fit.spread.__getitem__) == cores
    # where every message met company, the fastest ones are stretched a little
    assert fit.message_send_s == pytest.approx(SEND, rel=0.05)
    assert fit.message_receive_s == pytest.approx(RECEIVE, rel=0.05)


def test_message_costs_latency_clocks_and_work_are_recovered_exactly() -> None:
    """On 3 cores for 4 ranks some messages cross while a core is free: the fit is exact."""
    trace = synthetic_run("pipedream", 4, 24, 3, OFFSETS)
    fit = machine_fit(trace)
    assert fit is not None
    assert fit.spread[3] == pytest.approx(0.0, abs=1e-9)
    assert fit.message_send_s == pytest.approx(SEND, rel=1e-6)
    assert fit.message_receive_s == pytest.approx(RECEIVE, rel=1e-6)
    for kind, work in WORK.items():
        for stage in range(4):
            assert fit.work_s[(stage, kind)] == pytest.approx(work, rel=1e-6)
    assert fit.latency_s == pytest.approx({0: LATENCY, 1: LATENCY, 2: LATENCY}, rel=1e-6)
    assert fit.clock_offsets == pytest.approx({0: 0.0, **OFFSETS}, abs=1e-9)


def test_the_fitted_model_predicts_the_run_it_was_fitted_on() -> None:
    trace = synthetic_run("pipedream", 4, 24, 3, OFFSETS)
    costs = costs_from_trace(trace)
    assert costs.machine == Machine(3, 4, 1)
    assert (costs.message_send_s, costs.message_receive_s) == pytest.approx((SEND, RECEIVE))
    _, rows = calibrate(trace)
    assert abs(rows[0].relative_error) < 0.01, rows[0]  # time per mini-batch
    lines = fitted_costs(trace)
    assert lines[0] == (
        "core sharing: 4 rank(s) of 1 thread(s) per host on 3 core(s) (fitted from the "
        "trace; tried 1, 2, 3, 4): the busy ranks share the cores (processor sharing)"
    )
    assert "3000 µs at the sender, 2000 µs at the receiver" in lines[1]


def test_a_recorded_machine_is_used_as_it_is() -> None:
    trace = synthetic_run("pipedream", 4, 12, 2, {})
    trace.meta["machine"] = Machine(2, 4, 1).to_dict()
    fit = machine_fit(trace)
    assert fit is not None and not fit.cores_fitted and fit.spread == {}
    assert "2 core(s) (the run's machine record)" in fitted_costs(trace)[0]


def test_a_core_per_rank_charges_the_fitted_messages_and_predicts_the_run() -> None:
    """Each message's work at both ends is charged with a core per rank too: the medians
    of before folded the sends into the passes and left the receives' work out."""
    trace = synthetic_run("pipedream", 2, 12, 2, {})
    trace.meta["machine"] = Machine(2, 2, 1).to_dict()
    costs = costs_from_trace(trace)
    assert costs.machine == Machine(2, 2, 1) and not costs.shares_cores
    assert (costs.message_send_s, costs.message_receive_s) == pytest.approx((SEND, RECEIVE))
    assert costs.forward_s == pytest.approx((WORK["F"], WORK["F"]))
    assert costs.backward_s == pytest.approx((WORK["B"], WORK["B"]))
    _, rows = calibrate(trace)
    assert abs(rows[0].relative_error) < 0.01, rows[0]  # time per mini-batch
    assert "a core per rank" in fitted_costs(trace)[0]
    assert "3000 µs at the sender, 2000 µs at the receiver" in fitted_costs(trace)[1]
    # a trace that recorded no send has no message to fit: the medians of before
    trace.events = [e for e in trace.events if not e.kind.startswith("SEND")]
    medians = costs_from_trace(trace)
    assert medians.machine is None and medians.message_send_s == medians.message_receive_s == 0
    assert "no message recorded to fit" in fitted_costs(trace)[1]


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"cores": 0, "ranks_per_host": 4}, r"cores must be a whole number >= 1.*got 0"),
        ("2 cores", r"machine record must be a mapping"),
    ],
)
def test_a_bad_machine_record_in_a_trace_is_refused(record: object, match: str) -> None:
    trace = synthetic_run("pipedream", 2, 4, 1, {})
    trace.meta["machine"] = record
    with pytest.raises(PipeoptimError, match=match):
        costs_from_trace(trace)


def per_batch(trace: Trace) -> float:
    return float(trace.meta["batch_size"]) / compute_metrics(trace).steady_throughput


def test_actions_first_sharing_is_recognised_and_its_works_recovered() -> None:
    """Where the ranks in actions kept their cores and the woken ones waited, dividing every
    piece by processor sharing halves an action that met company and charges its time to
    the waiting receive: the fit takes the rule whose works of one action are alike."""
    trace = synthetic_run("1f1b", 4, 16, 2, {}, sharing=ACTIONS_FIRST)
    trace.meta["machine"] = Machine(2, 4, 1).to_dict()
    fit = machine_fit(trace)
    assert fit is not None and fit.sharing == ACTIONS_FIRST
    assert fit.sharing_spread[ACTIONS_FIRST] < fit.sharing_spread[PROCESSOR_SHARING]
    # by processor sharing the works of a mini-batch came to 15 % less than the truth (an
    # action 30 % less at most) and a message's cost at each end 56 % and 99 % more
    every = sum(WORK.values()) * 4
    assert sum(fit.work_s.values()) == pytest.approx(every, rel=0.04)
    for kind, work in WORK.items():
        for stage in range(4):  # the fastest messages met company: arrivals move a little
            assert fit.work_s[(stage, kind)] == pytest.approx(work, rel=0.15), (stage, kind)
    assert fit.message_send_s == pytest.approx(SEND, rel=0.15)
    assert fit.message_receive_s == pytest.approx(RECEIVE, rel=0.4)
    assert "(actions first)" in fitted_costs(trace)[0]


def test_a_processor_shared_run_keeps_processor_sharing() -> None:
    trace = synthetic_run("1f1b", 4, 16, 2, {})
    trace.meta["machine"] = Machine(2, 4, 1).to_dict()
    fit = machine_fit(trace)
    assert fit is not None and fit.sharing == PROCESSOR_SHARING
    assert fit.sharing_spread[PROCESSOR_SHARING] < fit.sharing_spread[ACTIONS_FIRST]


@pytest.mark.parametrize("target", ["pipedream", "pipeoptim"])
def test_a_method_with_fewer_messages_is_predicted_from_an_actions_first_run(
    target: str,
) -> None:
    """The 1f1b run's works, taken back to a rank's own speed by the rule its host shared
    by, predict a method of one micro-batch (every rank busy, a quarter of the messages) as
    that method's own run measures it; divided by processor sharing they were too small."""
    measured = synthetic_run("1f1b", 4, 16, 2, {}, sharing=ACTIONS_FIRST)
    # one micro-batch is the 1f1b run's four: its passes take four times the work
    truth = synthetic_run(target, 4, 16, 2, {}, sharing=ACTIONS_FIRST, passes=4.0)
    for trace in (measured, truth):
        trace.meta["machine"] = Machine(2, 4, 1).to_dict()
    got = what_if(measured, target).time_per_mini_batch
    # processor sharing: 11 % (pipedream) and 9 % (pipeoptim) fast; actions first: 2 %, 0 %
    assert got == pytest.approx(per_batch(truth), rel=0.05)
    assert what_if(measured, "1f1b").time_per_mini_batch == pytest.approx(
        per_batch(measured), rel=0.02
    )
