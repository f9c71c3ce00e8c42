"""The SimPy engine: one process per rank, links as resources, a Trace out.

Each rank is one SimPy process that walks its compiled action order: it waits for the one
cross-rank input an action needs, holds the rank for the action's duration, then hands the
result to its consumer. Producer and consumer meet in a per-action slot: whichever gets
there first leaves a marker (the consumer an event to wake it, the producer "done" or the
arrival event of a transfer), so events exist only where somebody actually waits and no
process is made per action. A transfer over a costly link is a short process that queues on
that link's :class:`simpy.Resource` (one per direction of each stage edge, or one per edge
when links are half-duplex) and holds it for ``latency + bytes / bandwidth``; with
``contention=False`` a transfer is a plain delay, and links with no cost, or between stages
on one rank, are skipped altogether. Jitter (a seeded lognormal factor per action) makes
what-if runs; without jitter and contention the result equals the fast evaluator's
(:mod:`pipeoptim.sim.evaluate`) to the bit.

Everything lives on an explicit :class:`simpy.Environment` made per run: no module state.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from functools import partial
from typing import Any

import simpy

from pipeoptim.errors import ScheduleError, WorkLimitError
from pipeoptim.plan.actions import Action
from pipeoptim.plan.limits import check_work, max_actions
from pipeoptim.plan.machine import Machine
from pipeoptim.plan.methods import Method, WeightPolicy, get_method
from pipeoptim.plan.orders import KIND_CODES
from pipeoptim.plan.shape import Shape
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.memory import memory_report
from pipeoptim.sim.program import Program, Timing
from pipeoptim.sim.sharing import HostCores
from pipeoptim.trace import Trace

__all__ = ["build_trace", "run_simpy", "simulate", "simulate_order"]

_DONE = object()
"""Slot marker: the input arrived before its consumer looked for it."""


def _arrive(arrival: simpy.Event, _: simpy.Event) -> None:
    arrival.succeed()


class _SharedHost:
    """A host whose busy ranks share its cores: the SimPy face of
    :class:`~pipeoptim.sim.sharing.HostCores` (the same arithmetic as the fast evaluator).

    A rank asks for ``work`` seconds and gets an event that fires when it is done; after
    every change the host schedules one timeout for its next finish (an earlier one that
    another start made stale finds nothing due and changes nothing)."""

    def __init__(self, env: simpy.Environment, machine: Machine) -> None:
        self.env = env
        self.cores = HostCores(machine)
        self.waiting: dict[int, simpy.Event] = {}

    def run(self, rank: int, work: float) -> simpy.Event:
        done = self.waiting[rank] = self.env.event()
        self._release(self.cores.start(rank, work, self.env.now))
        self._wake()
        return done

    def _wake(self) -> None:
        if self.cores.tags:  # the host's clock is env.now: its delay lands on the finish
            self.env.timeout(self.cores.delay()).callbacks.append(self._tick)

    def _tick(self, _: simpy.Event) -> None:
        done = self.cores.finish(self.env.now)
        if done:
            self._release(done)
            self._wake()

    def _release(self, done: list[tuple[int, float]]) -> None:
        for rank, _end in done:
            self.waiting.pop(rank).succeed()


def _transfer(
    env: simpy.Environment,
    link: simpy.Resource,
    delay: float,
    slots: list[Any],
    consumer: int,
    log: list[tuple[int, float, float]],
) -> Generator[simpy.Event, Any, None]:
    with link.request() as req:
        yield req
        began = env.now
        yield env.timeout(delay)
    log.append((consumer, began, env.now))
    waiting = slots[consumer]
    if waiting is None:
        slots[consumer] = _DONE
    else:
        waiting.succeed()


class _Run:
    """One run's shared state; ranks are processes over its lists."""

    def __init__(
        self,
        program: Program,
        durations: Sequence[float],
        transfers: Sequence[float],
        contention: bool,
        full_duplex: bool,
        machine: Machine | None = None,
    ) -> None:
        self.env = simpy.Environment()
        # the hosts whose ranks share cores (none: every rank holds its own for d seconds)
        self.hosts: dict[int, _SharedHost] = {}
        if machine is not None and machine.shares_cores:
            for r in program.ranks:
                self.hosts.setdefault(machine.host_of(r), _SharedHost(self.env, machine))
        self.machine = machine
        n = program.size
        self.program = program
        self.durations = durations
        self.starts = [0.0] * n
        self.ends = [-1.0] * n
        self.log: list[tuple[int, float, float]] = []
        # slots[i]: for an action i with a cross-rank input, None until either side gets
        # there: the consumer parks a waiting event, or the producer leaves _DONE (free link)
        # or the arrival event (costly link).
        self.slots: list[Any] = [None] * n
        # feeds[d]: the consumer action d's completion feeds, -1 if none.
        self.feeds = [-1] * n
        self.delay = [0.0] * n
        self.links: list[simpy.Resource | None] = [None] * n
        links: dict[int, simpy.Resource] = {}
        for i, d in enumerate(program.dep):
            if d < 0:
                continue
            if self.feeds[d] >= 0:
                raise ScheduleError(
                    f"{program.describe(d)} feeds two actions on other ranks; the engine "
                    f"supports one consumer per action (adjacent stages)"
                )
            self.feeds[d] = i
            if transfers[i] > 0.0:
                self.delay[d] = transfers[i]
                if contention:
                    e = program.edge[i]
                    key = e if full_duplex else e >> 1
                    link = links.get(key)
                    if link is None:
                        link = links[key] = simpy.Resource(self.env, capacity=1)
                    self.links[d] = link

    def rank(self, rank: int, lo: int, hi: int) -> Generator[simpy.Event, Any, None]:
        env = self.env
        host = self.hosts.get(self.machine.host_of(rank)) if self.machine else None
        timeout, event = env.timeout, env.event
        dep, durations, starts, ends = self.program.dep, self.durations, self.starts, self.ends
        slots, feeds, delays, links, log = self.slots, self.feeds, self.delay, self.links, self.log
        for i in range(lo, hi):
            if dep[i] >= 0:
                got = slots[i]
                if got is None:
                    got = slots[i] = event()
                    yield got
                elif got is not _DONE and got.callbacks is not None:
                    yield got
            now = env.now
            starts[i] = now
            d = durations[i]
            if d > 0.0:
                yield timeout(d) if host is None else host.run(rank, d)
                now = env.now
            ends[i] = now
            c = feeds[i]
            if c < 0:
                continue
            waiting = slots[c]
            delay = delays[i]
            if delay == 0.0:
                if waiting is None:
                    slots[c] = _DONE
                else:
                    waiting.succeed()
                continue
            link = links[i]
            if link is None:
                arrival = timeout(delay)
                log.append((c, now, now + delay))
                if waiting is None:
                    slots[c] = arrival
                else:
                    arrival.callbacks.append(partial(_arrive, waiting))
            else:
                env.process(_transfer(env, link, delay, slots, c, log))


def run_simpy(
    program: Program,
    durations: Sequence[float],
    transfers: Sequence[float],
    *,
    contention: bool = True,
    full_duplex: bool = True,
    machine: Machine | None = None,
) -> Timing:
    """Run the compiled order on a fresh :class:`simpy.Environment`; raises
    :class:`ScheduleError` when the ranks deadlock. ``machine``: the host the ranks share,
    whose busy ranks share its cores where they outnumber them (:mod:`pipeoptim.sim.sharing`)."""
    run = _Run(program, durations, transfers, contention, full_duplex, machine)
    for r, (lo, hi) in zip(program.ranks, program.rank_bounds, strict=True):
        if hi > lo:
            run.env.process(run.rank(r, lo, hi))
    run.env.run()
    if min(run.ends, default=0.0) < 0.0:
        raise program.stuck_error(run.ends)
    run.log.sort()
    return Timing(run.starts, run.ends, run.log)


def build_trace(
    program: Program,
    timing: Timing,
    costs: CostModel,
    *,
    method: str | None = None,
    shape: Shape | None = None,
    engine: str = "simpy",
    memory: bool = True,
    jitter: float = 0.0,
    seed: int = 0,
    meta: Mapping[str, Any] | None = None,
) -> Trace:
    """Events with weight versions, memory samples and run metadata from a timing."""
    report = program.versions()
    mem = memory_report(program, timing, costs, samples=memory)
    m = program.micro_batches
    info: dict[str, Any] = {
        "method": method,
        "policy": (program.policy or WeightPolicy.FLUSH).value,
        "num_ranks": len(program.ranks),
        "num_stages": program.num_stages,
        "micro_batches": m,
        "mini_batches": shape.mini_batches if shape is not None else None,
        "virtual_stages": shape.virtual_stages if shape is not None else 1,
        # global: what all replicas train (the events are one replica's, all run alike)
        "batch_size": m * costs.global_samples_per_micro_batch,
        "samples_per_micro_batch": costs.global_samples_per_micro_batch,
        "data_parallel": costs.data_parallel,
        "source": "sim",
        "engine": engine,
        "time_unit": "s",
        "jitter": jitter,
        "seed": seed,
        "optimizer": costs.optimizer,
        "weight_copies": {str(k): v for k, v in sorted(report.weight_copies.items())},
        "max_in_flight": {str(k): v for k, v in sorted(report.max_in_flight.items())},
        "peak_memory": {str(k): p.bytes for k, p in sorted(mem.peaks.items())},
        "stage_ranks": {str(k): r for k, r in sorted(program.stage_rank.items())},
        "makespan": timing.makespan,
    }
    if costs.machine is not None:  # the machine the ranks shared, as a runtime trace has it
        info["machine"] = costs.machine.to_dict()
    if costs.charges_messages:
        info["message_send_s"] = costs.message_send_s
        info["message_receive_s"] = costs.message_receive_s
    if costs.action_s:
        info["action_s"] = dict(zip(KIND_CODES, costs.action_s, strict=True))
    if costs.data_parallel > 1:
        info["replica_batch_size"] = m * costs.samples_per_micro_batch
        info["allreduce_s"] = {str(k): v for k, v in enumerate(costs.allreduce_s)}
    info.update(meta or {})
    return Trace(events=program.events(timing, costs), memory=mem.samples, meta=info)


def simulate_order(
    order: Mapping[int, Sequence[Action | None]],
    costs: CostModel,
    *,
    micro_batches: int = 1,
    policy: WeightPolicy = WeightPolicy.FLUSH,
    jitter: float = 0.0,
    seed: int = 0,
    contention: bool = True,
    full_duplex: bool = True,
    memory: bool = True,
    meta: Mapping[str, Any] | None = None,
) -> Trace:
    """Simulate any per-rank action order (idle slots are ignored) under ``costs``."""
    size, limit = sum(len(acts) for acts in order.values()), max_actions()
    if size > limit:
        raise WorkLimitError(
            f"the order has {size:,} steps; the simulator's limit is {limit:,} actions "
            f"(about 1.1 kB of memory each, pipeoptim.plan.limits); simulate fewer mini-batches"
        )
    program = Program(order, micro_batches, policy)
    return _simulate(
        program, costs, jitter, seed, contention, full_duplex, memory, None, None, meta
    )


def simulate(
    method: str | Method,
    shape: Shape,
    costs: CostModel,
    *,
    jitter: float = 0.0,
    seed: int = 0,
    contention: bool = True,
    full_duplex: bool = True,
    memory: bool = True,
    program: Program | None = None,
) -> Trace:
    """Simulate ``method`` at ``shape`` (use ``method.shape(...)`` to validate sizes).

    ``program`` reuses a compiled order (:func:`pipeoptim.sim.evaluate.compile_method`).
    """
    spec = get_method(method) if isinstance(method, str) else method
    if program is None:
        check_work(spec.work(shape))
        program = Program(spec.order_arrays(shape), shape.micro_batches, spec.version_rule)
    return _simulate(
        program, costs, jitter, seed, contention, full_duplex, memory, spec.name, shape, None
    )


def _simulate(
    program: Program,
    costs: CostModel,
    jitter: float,
    seed: int,
    contention: bool,
    full_duplex: bool,
    memory: bool,
    method: str | None,
    shape: Shape | None,
    meta: Mapping[str, Any] | None,
) -> Trace:
    durations = program.durations(costs, jitter, seed)
    timing = run_simpy(
        program,
        durations,
        program.transfer_times(costs),
        contention=contention,
        full_duplex=full_duplex,
        machine=costs.machine,
    )
    return build_trace(
        program,
        timing,
        costs,
        method=method,
        shape=shape,
        engine="simpy",
        memory=memory,
        jitter=jitter,
        seed=seed,
        meta=meta,
    )
