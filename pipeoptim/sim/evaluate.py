"""The fast deterministic evaluator: list scheduling over the per-rank orders, no SimPy.

Each rank runs its order one action after the other; an action starts at
``max(rank free, end of its cross-rank dependency + link latency + bytes / bandwidth)``
and ends ``duration`` later. That is exactly what the SimPy engine computes when links never
queue (same float operations in the same order), so the two agree to the bit; the planner
calls this one thousands of times. Compile a method's order once (:func:`compile_method`,
cached) and evaluate it under many cost models with :func:`evaluate_program`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING, cast

import numpy as np

from pipeoptim.metrics import steady_state_throughput
from pipeoptim.plan.limits import check_work, estimate_work
from pipeoptim.plan.methods import Method, get_method
from pipeoptim.plan.orders import IntArray
from pipeoptim.plan.schedules import Shape
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.program import FloatArray, Program, Steps, Timing

if TYPE_CHECKING:
    from pipeoptim.trace import Trace

__all__ = [
    "Evaluation",
    "compile_method",
    "evaluate_method",
    "evaluate_program",
    "evaluate_trace",
    "list_schedule",
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
    return Program(method.order_arrays(shape), shape.micro_batches, method.weight_policy)


def compile_method(method: str | Method, shape: Shape) -> Program:
    """The compiled order of ``method`` for ``shape`` (cached by method name and shape);
    refuses a run over :data:`pipeoptim.plan.limits.MAX_ACTIONS` before compiling it."""
    spec = get_method(method) if isinstance(method, str) else method
    check_work(estimate_work(spec, shape))
    return _compile_cached(spec.name, shape)


def list_schedule(program: Program, durations: list[float], transfers: list[float]) -> Timing:
    """Start and end of every action; raises :class:`ScheduleError` on a deadlock.

    Walks the program's cost-independent topological order (:meth:`Program.steps`) once:
    ``start = max(end of the rank's previous action, end of the cross-rank input +
    transfer)``, ``end = start + duration``.
    """
    steps = program.steps()
    starts, ends = _walk(steps, durations, transfers)
    return _in_action_order(steps, starts, ends)


def _walk(
    steps: Steps, durations: Sequence[float] | FloatArray, transfers: Sequence[float]
) -> tuple[list[float], list[float]]:
    """Start and end of every step, from every action's duration and transfer (action order).

    Times are kept in step order, so the loop reads and writes memory nearly in sequence.
    Step -1 (a rank's first action, or no input) reads the sentinel at the end, which
    ended at 0.
    """
    at = steps.order_array
    step_durations = np.asarray(durations, dtype=np.float64)[at].tolist()
    step_transfers = np.asarray(transfers, dtype=np.float64)[at].tolist()
    n = len(step_durations)
    starts = [0.0] * n
    ends = [0.0] * (n + 1)
    j = 0
    for prev, dep, duration, transfer in zip(
        steps.previous, steps.input, step_durations, step_transfers, strict=True
    ):
        t = ends[prev]
        arrive = ends[dep] + transfer
        if arrive > t:
            t = arrive
        starts[j] = t
        ends[j] = t + duration
        j += 1  # noqa: SIM113 (enumerate's tuple costs 20% of this loop)
    ends.pop()
    return starts, ends


def _walk_coded(
    steps: Steps, codes: list[int], durations: list[float], transfers: list[float]
) -> tuple[list[float], list[float]]:
    """:func:`_walk` with durations and transfers looked up in small per-code tables, so
    an evaluation builds no per-action list (the same float operations)."""
    n = len(codes)
    starts = [0.0] * n
    ends = [0.0] * (n + 1)
    j = 0
    for prev, dep, code, link in zip(steps.previous, steps.input, codes, steps.link, strict=True):
        t = ends[prev]
        arrive = ends[dep] + transfers[link]
        if arrive > t:
            t = arrive
        starts[j] = t
        ends[j] = t + durations[code]
        j += 1  # noqa: SIM113 (enumerate's tuple costs 20% of this loop)
    ends.pop()
    return starts, ends


def _in_action_order(steps: Steps, starts: list[float], ends: list[float]) -> Timing:
    where = steps.position_array
    return Timing(
        cast(list[float], np.asarray(starts)[where].tolist()),
        cast(list[float], np.asarray(ends)[where].tolist()),
    )


def summarize(
    program: Program, costs: CostModel, timing: Timing, durations: list[float]
) -> Evaluation:
    """Busy time, bubbles and throughput of a timing."""
    busy, rank_busy = _busy(program, np.asarray(durations, dtype=np.float64))
    return _summary(program, costs, timing.starts, timing.ends, busy, rank_busy, None)


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
    starts: list[float],
    ends: list[float],
    busy: dict[int, float],
    rank_busy: dict[int, float],
    position: IntArray | None,
) -> Evaluation:
    """:func:`summarize` of times held in action order, or in step order (``position``
    gives each action's step)."""

    def step(i: int) -> int:
        return i if position is None else int(position[i])

    firsts = [starts[step(lo)] for lo, hi in program.rank_bounds if hi > lo]
    first = min(firsts, default=0.0)
    # a rank's last action ends last on it (ranks run one action at a time)
    makespan = max((ends[step(hi - 1)] for lo, hi in program.rank_bounds if hi > lo), default=0.0)
    span = makespan - first
    bubble = {r: (1.0 - b / span if span > 0 else 0.0) for r, b in rank_busy.items()}
    overall = 1.0 - sum(rank_busy.values()) / (span * len(rank_busy)) if span > 0 else 0.0
    per_micro = costs.global_samples_per_micro_batch  # all replicas
    samples = program.first_stage_micro_batches() * per_micro
    throughput = samples / span if span > 0 else 0.0
    ups = [ends[step(i)] for i in program.last_stage_updates()]
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
    """Evaluate a compiled order under ``costs`` (``jitter``/``seed`` as in the engine)."""
    steps = program.steps()
    if jitter:
        durations = np.asarray(program.durations(costs, jitter, seed))
        starts, ends = _walk(steps, durations, program.transfer_times(costs))
        busy, rank_busy = _busy(program, durations)
    else:
        starts, ends = _walk_coded(
            steps,
            program.step_cost_codes(costs),
            program.duration_table(costs),
            program.transfer_table(costs),
        )
        busy, rank_busy = program.busy_seconds(costs)
    result = _summary(program, costs, starts, ends, busy, rank_busy, steps.position_array)
    if keep_timing:
        result = replace(result, timing=_in_action_order(steps, starts, ends))
    return result


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
    timing = list_schedule(program, durations, transfers)
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
