"""The fast deterministic evaluator: list scheduling over the per-rank orders, no SimPy.

Each rank runs its order one action after the other; an action starts at
``max(rank free, end of its cross-rank dependency + link latency + bytes / bandwidth)``
and ends ``duration`` later. That is exactly what the SimPy engine computes when links never
queue (same float operations in the same order), so the two agree to the bit; the planner
calls this one thousands of times. Compile a method's order once (:func:`compile_method`,
cached) and evaluate it under many cost models with :func:`evaluate_program`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING

from pipeoptim.metrics import steady_state_throughput
from pipeoptim.plan.limits import check_work, estimate_work
from pipeoptim.plan.methods import Method, get_method
from pipeoptim.plan.schedules import Shape
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.program import Program, Timing

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
    """Samples the run trained (micro-batches times samples per micro-batch)."""
    throughput: float
    """Whole-run samples per second (``samples / span``)."""
    steady_throughput: float
    """Steady-state samples per second (see :func:`pipeoptim.metrics.steady_state_throughput`)."""
    timing: Timing | None = None
    """Start and end of every action, when asked for."""


@lru_cache(maxsize=16)
def _compile_cached(name: str, shape: Shape) -> Program:
    method = get_method(name)
    return Program(method.order(shape), shape.micro_batches, method.weight_policy)


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
    transfer)``, ``end = start + duration``. Index ``n`` is a sentinel that ended at 0.
    """
    n = program.size
    starts = [0.0] * n
    ends = [0.0] * (n + 1)
    for i, prev, dep in program.steps():
        t = ends[prev]
        arrive = ends[dep] + transfers[i]
        if arrive > t:
            t = arrive
        starts[i] = t
        ends[i] = t + durations[i]
    del ends[n]
    return Timing(starts, ends)


def summarize(
    program: Program, costs: CostModel, timing: Timing, durations: list[float]
) -> Evaluation:
    """Busy time, bubbles and throughput of a timing."""
    busy: dict[int, float] = {}
    rank_busy: dict[int, float] = {}
    stage = program.stage
    firsts: list[float] = []
    for p, r in enumerate(program.ranks):
        lo, hi = program.rank_bounds[p]
        if hi == lo:
            continue
        firsts.append(timing.starts[lo])
        rank_busy[r] = sum(durations[lo:hi])
        if stage[lo] == stage[hi - 1] and all(
            program.stage_rank[k] != r or k == stage[lo] for k in program.stage_rank
        ):
            busy[stage[lo]] = rank_busy[r]  # the rank runs one stage
            continue
        for i in range(lo, hi):
            busy[stage[i]] = busy.get(stage[i], 0.0) + durations[i]
    first = min(firsts, default=0.0)
    makespan = timing.makespan
    span = makespan - first
    bubble = {r: (1.0 - b / span if span > 0 else 0.0) for r, b in rank_busy.items()}
    overall = 1.0 - sum(rank_busy.values()) / (span * len(rank_busy)) if span > 0 else 0.0
    samples = program.first_stage_micro_batches() * costs.samples_per_micro_batch
    throughput = samples / span if span > 0 else 0.0
    ups = [timing.ends[i] for i in program.last_stage_updates()]
    steady = steady_state_throughput(ups, program.micro_batches * costs.samples_per_micro_batch)
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
    durations = program.durations(costs, jitter, seed)
    timing = list_schedule(program, durations, program.transfer_times(costs))
    result = summarize(program, costs, timing, durations)
    if keep_timing:
        result = replace(result, timing=timing)
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
