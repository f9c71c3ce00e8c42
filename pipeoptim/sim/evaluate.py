"""The fast deterministic evaluator: list scheduling over the per-rank orders, no SimPy.

Each rank runs its order one action after the other; an action starts at
``max(rank free, end of its cross-rank dependency + link latency + bytes / bandwidth)``
and ends ``duration`` later. That is exactly what the SimPy engine computes when links never
queue (same float operations in the same order), so the two agree to the bit; the planner
calls this one thousands of times. Compile a method's order once (:func:`compile_method`,
cached) and evaluate it under many cost models with :func:`evaluate_program`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING, cast

import numpy as np

from pipeoptim.metrics import steady_state_throughput
from pipeoptim.plan.limits import check_work
from pipeoptim.plan.methods import Method, get_method
from pipeoptim.plan.orders import IntArray
from pipeoptim.plan.shape import Shape
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.program import FloatArray, Program, Timing
from pipeoptim.sim.sharing import shared_schedule
from pipeoptim.sim.steps import Steps

if TYPE_CHECKING:
    from pipeoptim.trace import Trace

__all__ = [
    "Evaluation",
    "compile_method",
    "evaluate_method",
    "evaluate_program",
    "evaluate_trace",
    "list_schedule",
    "schedule",
    "summarize",
]


@dataclass(frozen=True)
class Evaluation:
    """What one evaluation found. Times in seconds, throughput in samples per second."""

    makespan: float
    """End of the last action (the run starts at 0)."""
    span: float
    """Last end minus first start of any compute action (what bubbles are measured over)."""
    busy_s: dict[int, float]
    """Compute seconds per stage."""
    rank_busy_s: dict[int, float]
    """Compute seconds per rank."""
    bubble_ratio: dict[int, float]
    """Idle fraction of each rank over the span."""
    overall_bubble: float
    """Idle fraction of all ranks together over the span."""
    samples: float
    """Samples the run trained over all data-parallel replicas (micro-batches times samples
    per micro-batch times replicas)."""
    throughput: float
    """Whole-run samples per second (``samples / span``)."""
    steady_throughput: float
    """Steady-state samples per second (see :func:`pipeoptim.metrics.steady_state_throughput`)."""
    timing: Timing | None = None
    """Start and end of every action, when asked for."""


@lru_cache(maxsize=16)
def _compile_cached(name: str, shape: Shape) -> Program:
    method = get_method(name)
    return Program(method.order_arrays(shape), shape.micro_batches, method.version_rule)


def compile_method(method: str | Method, shape: Shape) -> Program:
    """The compiled order of ``method`` for ``shape`` (cached by method name and shape);
    refuses a run over :data:`pipeoptim.plan.limits.MAX_ACTIONS` before compiling it."""
    spec = get_method(method) if isinstance(method, str) else method
    check_work(spec.work(shape))
    return _compile_cached(spec.name, shape)


def list_schedule(program: Program, durations: list[float], transfers: list[float]) -> Timing:
    """Start and end of every action; raises :class:`ScheduleError` on a deadlock.

    Walks the program's cost-independent topological order (:meth:`Program.steps`) once:
    ``start = max(end of the rank's previous action, end of the cross-rank input +
    transfer)``, ``end = start + duration``.
    """
    steps = program.steps()
    at = steps.order_array
    step_transfers = np.asarray(transfers, dtype=np.float64)[at]
    ends = _walk(steps, np.asarray(durations, dtype=np.float64)[at].tolist(), step_transfers)
    return _Walked(steps, ends, step_transfers.__getitem__).timing()


def _walk(steps: Steps, durations: list[float], transfers: FloatArray) -> list[float]:
    """The end of every step (slot ``j + 1``; slot 0 the sentinel, ended at 0) from each
    step's duration and transfer.

    Times are kept in step order, so the loop reads and writes memory nearly in sequence.
    The start is not kept: :class:`_Walked` computes it from the ends, with the same float
    operations.
    """
    ends = [0.0]
    append = ends.append
    for prev, dep, duration, transfer in zip(
        steps.previous, steps.input, durations, transfers.tolist(), strict=True
    ):
        t = ends[prev]
        arrive = ends[dep] + transfer
        if arrive > t:
            t = arrive
        append(t + duration)
    return ends


def _walk_coded(
    steps: Steps, codes: Sequence[int], durations: list[float], transfers: list[float]
) -> list[float]:
    """:func:`_walk` with durations and transfers looked up in small per-code tables, so
    an evaluation builds no per-action list (the same float operations)."""
    ends = [0.0]
    append = ends.append
    for prev, dep, code, link in zip(steps.previous, steps.input, codes, steps.link, strict=True):
        t = ends[prev]
        arrive = ends[dep] + transfers[link]
        if arrive > t:
            t = arrive
        append(t + durations[code])
    return ends


class _Walked:
    """A walk's ends (by slot), read by action; starts where they are asked for.

    A step's start is the later of its rank's previous end and its input's end plus the
    transfer: the walk's own float operations, so recomputing it here gives the walk's
    value to the bit without the walk storing it.
    """

    def __init__(
        self, steps: Steps, ends: list[float], transfer_of: Callable[[IntArray], FloatArray]
    ) -> None:
        self.steps, self.ends, self.transfer_of = steps, ends, transfer_of
        """``transfer_of(steps)``: the transfer seconds of those steps' inputs."""

    def ends_of(self, actions: list[int]) -> list[float]:
        ends, slots = self.ends, (self.steps.position_array[actions] + 1).tolist()
        return [ends[j] for j in slots]

    def first_starts(self, program: Program) -> list[float]:
        """The start of every rank's first action."""
        ends, steps = self.ends, self.steps
        at = steps.position_array[[lo for lo, hi in program.rank_bounds if hi > lo]]
        return [
            max(ends[prev], ends[dep] + transfer)
            for prev, dep, transfer in zip(
                steps.previous_slots[at].tolist(),
                steps.input_slots[at].tolist(),
                self.transfer_of(at).tolist(),
                strict=True,
            )
        ]

    def timing(self) -> Timing:
        """Start and end of every action, in action order."""
        steps = self.steps
        ends = np.asarray(self.ends)
        every = np.arange(len(steps.order_array), dtype=np.int64)
        starts = np.maximum(
            ends[steps.previous_slots], ends[steps.input_slots] + self.transfer_of(every)
        )
        where = steps.position_array
        return Timing(
            cast(list[float], starts[where].tolist()),
            cast(list[float], ends[where + 1].tolist()),
        )


def summarize(
    program: Program, costs: CostModel, timing: Timing, durations: Sequence[float] | FloatArray
) -> Evaluation:
    """Busy time (the sum of ``durations``), bubbles and throughput of a timing."""
    busy, rank_busy = _busy(program, np.asarray(durations, dtype=np.float64))
    firsts = [timing.starts[lo] for lo, hi in program.rank_bounds if hi > lo]
    ends = timing.ends

    def ends_of(actions: list[int]) -> list[float]:
        return [ends[i] for i in actions]

    return _summary(program, costs, firsts, ends_of, busy, rank_busy)


def _busy(program: Program, durations: FloatArray) -> tuple[dict[int, float], dict[int, float]]:
    """Compute seconds per stage and per rank, summed over the actions' durations."""
    per_stage = np.bincount(program.arrays.stage, weights=durations, minlength=program.num_stages)
    busy = {k: float(per_stage[k]) for k in sorted(program.stage_rank)}
    rank_busy = {
        r: float(durations[lo:hi].sum())
        for r, (lo, hi) in zip(program.ranks, program.rank_bounds, strict=True)
        if hi > lo
    }
    return busy, rank_busy


def _summary(
    program: Program,
    costs: CostModel,
    firsts: list[float],
    ends_of: Callable[[list[int]], list[float]],
    busy: dict[int, float],
    rank_busy: dict[int, float],
) -> Evaluation:
    """:func:`summarize` of the start of every rank's first action and ``ends_of``, the
    ends of a list of actions."""
    first = min(firsts, default=0.0)
    # a rank's last action ends last on it (ranks run one action at a time)
    lasts = [hi - 1 for lo, hi in program.rank_bounds if hi > lo]
    makespan = max(ends_of(lasts), default=0.0)
    span = makespan - first
    bubble = {r: (1.0 - b / span if span > 0 else 0.0) for r, b in rank_busy.items()}
    overall = 1.0 - sum(rank_busy.values()) / (span * len(rank_busy)) if span > 0 else 0.0
    per_micro = costs.global_samples_per_micro_batch  # all replicas
    samples = program.first_stage_micro_batches() * per_micro
    throughput = samples / span if span > 0 else 0.0
    ups = ends_of(program.last_stage_updates())
    steady = steady_state_throughput(ups, program.micro_batches * per_micro)
    return Evaluation(
        makespan=makespan,
        span=span,
        busy_s=dict(sorted(busy.items())),
        rank_busy_s=rank_busy,
        bubble_ratio=bubble,
        overall_bubble=overall,
        samples=samples,
        throughput=throughput,
        steady_throughput=throughput if steady is None else steady,
    )


def evaluate_program(
    program: Program,
    costs: CostModel,
    *,
    jitter: float = 0.0,
    seed: int = 0,
    keep_timing: bool = False,
) -> Evaluation:
    """Evaluate a compiled order under ``costs`` (``jitter``/``seed`` as in the engine).

    Where the ranks share their host's cores (:attr:`CostModel.shares_cores`) the walk is
    event-driven (:func:`~pipeoptim.sim.sharing.shared_schedule`) and a rank's busy time is
    the time its actions spanned (what a trace's metrics count), not their work."""
    if costs.shares_cores:
        return _evaluate_shared(program, costs, jitter, seed, keep_timing)
    steps = program.steps()
    if jitter:
        durations = np.asarray(program.durations(costs, jitter, seed))
        transfers = np.asarray(program.transfer_times(costs))[steps.order_array]
        ends = _walk(steps, durations[steps.order_array].tolist(), transfers)
        walked = _Walked(steps, ends, transfers.__getitem__)
        busy, rank_busy = _busy(program, durations)
    else:
        table = program.transfer_table(costs)
        ends = _walk_coded(
            steps, program.step_cost_codes(costs), program.duration_table(costs), table
        )
        links = np.asarray(table)

        def transfer_of(at: IntArray) -> FloatArray:
            return cast(FloatArray, links[steps.link_array[at]])

        walked = _Walked(steps, ends, transfer_of)
        busy, rank_busy = program.busy_seconds(costs)
    result = _summary(program, costs, walked.first_starts(program), walked.ends_of, busy, rank_busy)
    if keep_timing:
        result = replace(result, timing=walked.timing())
    return result


def _evaluate_shared(
    program: Program, costs: CostModel, jitter: float, seed: int, keep_timing: bool
) -> Evaluation:
    assert costs.machine is not None
    timing = shared_schedule(
        program,
        program.durations(costs, jitter, seed),
        program.transfer_times(costs),
        costs.machine,
    )
    spans = np.asarray(timing.ends) - np.asarray(timing.starts)
    result = summarize(program, costs, timing, spans)
    return replace(result, timing=timing) if keep_timing else result


def schedule(
    program: Program, durations: list[float], transfers: list[float], costs: CostModel
) -> Timing:
    """Start and end of every action under ``costs``' machine: :func:`list_schedule`, or
    processor sharing where the ranks share cores (the SimPy engine's times either way,
    without jitter's and links' queueing)."""
    if costs.shares_cores:
        assert costs.machine is not None
        return shared_schedule(program, durations, transfers, costs.machine)
    return list_schedule(program, durations, transfers)


def evaluate_method(
    method: str | Method,
    shape: Shape,
    costs: CostModel,
    *,
    jitter: float = 0.0,
    seed: int = 0,
    keep_timing: bool = False,
) -> Evaluation:
    """Evaluate ``method`` at ``shape`` (compiled once per method and shape)."""
    return evaluate_program(
        compile_method(method, shape), costs, jitter=jitter, seed=seed, keep_timing=keep_timing
    )


def evaluate_trace(
    method: str | Method,
    shape: Shape,
    costs: CostModel,
    *,
    jitter: float = 0.0,
    seed: int = 0,
    memory: bool = True,
) -> Trace:
    """The evaluator's timing as a full :class:`Trace` (versions, transfers, memory)."""
    from pipeoptim.sim.engine import build_trace

    program = compile_method(method, shape)
    durations = program.durations(costs, jitter, seed)
    transfers = program.transfer_times(costs)
    timing = schedule(program, durations, transfers, costs)
    timing.transfers = [
        (i, timing.ends[program.dep[i]], timing.ends[program.dep[i]] + transfers[i])
        for i in range(program.size)
        if program.dep[i] >= 0 and transfers[i] > 0.0
    ]
    name = method if isinstance(method, str) else method.name
    return build_trace(
        program,
        timing,
        costs,
        method=name,
        shape=shape,
        engine="fast",
        memory=memory,
        jitter=jitter,
        seed=seed,
    )
