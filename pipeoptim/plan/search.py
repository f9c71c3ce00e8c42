"""Plan search: which method, micro-batch count and partition to run, and why.

For a profile, a device count and a memory cap, every candidate (method, M) gets its
optimal memory-feasible partition (``partition.py``) and is timed by the simulator's fast
evaluator over a run of mini-batches. Candidates are ranked by steady-state throughput;
throughputs within ``tie_tolerance`` of each other count as equal and are ordered by weight
staleness, then peak memory, so a method that is as fast and trains on fresher weights wins.

The profile is taken as measured on one mini-batch of ``profile.batch_size`` samples; a
micro-batch costs ``1/M`` of its time and activations (the linear model the simulator uses).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pipeoptim.errors import PlanError, WorkLimitError
from pipeoptim.plan.limits import estimate_work, fit_budget, max_actions
from pipeoptim.plan.methods import METHODS, get_method
from pipeoptim.plan.partition import Partition, method_memory_factors, optimal_partition
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.units import format_bytes


@dataclass(frozen=True)
class Candidate:
    """One evaluated (method, micro-batch count) with its partition."""

    method: str
    micro_batches: int
    partition: Partition | None
    """None when no partition fits the memory cap (see ``infeasible``)."""
    throughput: float = 0.0
    """Predicted steady-state samples per second."""
    run_throughput: float = 0.0
    """Predicted whole-run samples per second (warm-up and drain included)."""
    bubble_ratio: float = 0.0
    """Idle fraction of all ranks over the simulated run."""
    max_staleness: int = 0
    """Largest weight staleness of an applied gradient (0: fresh weights)."""
    infeasible: str | None = None
    """Why the candidate cannot run (memory cap) or was not simulated (work limit), or None."""
    skipped: bool = False
    """Not simulated: the search's candidates together were over the work limit
    (:data:`pipeoptim.plan.limits.MAX_ACTIONS`); ``infeasible`` says why."""

    @property
    def peak_memory_bytes(self) -> int:
        return self.partition.peak_memory_bytes if self.partition else 0


def micro_batch_options(method: str, num_stages: int) -> list[int]:
    """M values worth trying: 1 for methods that don't micro-batch, else P, 2P, 4P."""
    spec = get_method(method)
    if not spec.micro_batched:
        return [1]
    return [num_stages, 2 * num_stages, 4 * num_stages]


def _per_micro_batch(profile: Profile, micro_batches: int) -> Profile:
    if micro_batches == 1:
        return profile
    m = micro_batches
    layers = tuple(
        replace(
            layer,
            forward_s=layer.forward_s / m,
            backward_s=layer.backward_s / m,
            activation_bytes=math.ceil(layer.activation_bytes / m),
        )
        for layer in profile.layers
    )
    return replace(profile, layers=layers, batch_size=max(1, profile.batch_size // m))


def evaluate_candidate(
    profile: Profile,
    num_stages: int,
    method: str,
    micro_batches: int,
    *,
    memory_cap_bytes: int | None = None,
    bandwidth_bytes_per_s: float = math.inf,
    latency_s: float = 0.0,
    mini_batches: int | None = None,
) -> Candidate:
    """Partition for ``method`` at ``micro_batches`` and simulate it."""
    # The simulator sits above the plan package; import it only where it is needed.
    from pipeoptim.sim.costs import CostModel
    from pipeoptim.sim.evaluate import compile_method, evaluate_program

    spec = get_method(method)
    shape = spec.shape(num_stages, micro_batches if spec.micro_batched else None, mini_batches)
    if spec.interleaved:
        raise PlanError(
            f"plan search places one stage per device; {method} (several stages per "
            f"device) is not searched — pick it by hand with `pipeoptim simulate`"
        )
    try:
        partition = optimal_partition(
            _per_micro_batch(profile, shape.micro_batches),
            num_stages,
            bandwidth_bytes_per_s=bandwidth_bytes_per_s,
            latency_s=latency_s,
            memory_cap_bytes=memory_cap_bytes,
            memory_factors=method_memory_factors(method, num_stages, shape.micro_batches),
        )
    except PlanError as err:
        if isinstance(err, WorkLimitError) or "memory" not in str(err):
            raise
        return Candidate(method, shape.micro_batches, None, infeasible=str(err))
    costs = CostModel.from_profile(
        profile,
        partition.boundaries,
        shape.micro_batches,
        bandwidth=bandwidth_bytes_per_s,
        latency_s=latency_s,
    )
    # one compiled order (cached per method and shape) serves timing and versions
    program = compile_method(method, shape)
    result = evaluate_program(program, costs)
    report = program.versions()
    return Candidate(
        method,
        shape.micro_batches,
        partition,
        throughput=result.steady_throughput,
        run_throughput=result.throughput,
        bubble_ratio=result.overall_bubble,
        max_staleness=max(report.max_staleness(k) for k in report.stages),
    )


def search(
    profile: Profile,
    num_stages: int,
    *,
    memory_cap_bytes: int | None = None,
    bandwidth_bytes_per_s: float = math.inf,
    latency_s: float = 0.0,
    methods: Sequence[str] | None = None,
    mini_batches: int | None = None,
    tie_tolerance: float = 0.01,
    progress: Callable[[str], None] | None = None,
) -> list[Candidate]:
    """Every feasible candidate ranked best first, then the infeasible ones."""
    names = (
        list(methods)
        if methods is not None
        else [n for n, m in METHODS.items() if not m.interleaved]
    )
    if num_stages > profile.num_layers:
        raise PlanError(
            f"cannot split {profile.num_layers} layers into {num_stages} stages; use at "
            f"most {profile.num_layers} stages"
        )
    pairs = [(name, m) for name in names for m in micro_batch_options(name, num_stages)]
    sizes = [_actions(name, num_stages, m, mini_batches) for name, m in pairs]
    keep = fit_budget(sizes)
    found: list[Candidate] = []
    for (name, m), size, kept in zip(pairs, sizes, keep, strict=True):
        if not kept:
            found.append(_skipped(name, m, size))
            continue
        if progress is not None:
            progress(f"{name} M={m}")
        found.append(
            evaluate_candidate(
                profile,
                num_stages,
                name,
                m,
                memory_cap_bytes=memory_cap_bytes,
                bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                latency_s=latency_s,
                mini_batches=mini_batches,
            )
        )
    return rank(found, tie_tolerance)


def _actions(method: str, num_stages: int, micro_batches: int, mini_batches: int | None) -> int:
    """Simulated actions of one candidate (0 where the method's rules refuse the sizes:
    evaluating it raises the rule's own message)."""
    spec = get_method(method)
    try:
        shape = spec.shape(num_stages, micro_batches if spec.micro_batched else None, mini_batches)
    except PlanError:
        return 0
    return estimate_work(spec, shape).cost


def _skipped(method: str, micro_batches: int, size: int) -> Candidate:
    limit = max_actions()
    why = (
        f"not simulated: about {size:,} actions, over the limit of {limit:,}"
        if size > limit
        else f"not simulated: about {size:,} actions, and with the other candidates the search "
        f"is over its limit of {limit:,} actions; plan it alone with --method {method} "
        f"--micro-batches {micro_batches}"
    )
    return Candidate(method, micro_batches, None, infeasible=why, skipped=True)


def rank(candidates: Sequence[Candidate], tie_tolerance: float = 0.01) -> list[Candidate]:
    """Fastest first; near-ties (within ``tie_tolerance``) by staleness, then memory."""
    feasible = [c for c in candidates if c.infeasible is None]
    best = max((c.throughput for c in feasible), default=0.0)

    def key(c: Candidate) -> tuple[int, int, int, float]:
        # bucket throughput on a log scale so near-equal values compare equal
        gap = math.log(best / c.throughput) if c.throughput > 0 and best > 0 else math.inf
        bucket = int(gap / math.log1p(tie_tolerance)) if math.isfinite(gap) else 2**31
        return (bucket, c.max_staleness, c.peak_memory_bytes, -c.throughput)

    return sorted(feasible, key=key) + [c for c in candidates if c.infeasible is not None]


def _rate(samples_per_s: float) -> str:
    return f"{samples_per_s:,.0f}" if samples_per_s >= 100 else f"{samples_per_s:.3g}"


def explain(ranked: Sequence[Candidate], memory_cap_bytes: int | None = None) -> str:
    """One paragraph: what to run and why, against the runner-up and the baselines."""
    feasible = [c for c in ranked if c.infeasible is None]
    if not feasible:
        first = ranked[0].infeasible if ranked else "no candidates"
        raise PlanError(f"no method fits: {first}")
    best = feasible[0]
    cap = f" within the {format_bytes(memory_cap_bytes)} cap" if memory_cap_bytes else ""
    text = (
        f"Run {best.method} with {best.micro_batches} micro-batch(es): predicted "
        f"{_rate(best.throughput)} samples/s, weight staleness {best.max_staleness}, peak stage "
        f"memory {format_bytes(best.peak_memory_bytes)}{cap}."
    )
    slower = [c for c in feasible[1:] if c.method != best.method]
    if slower:
        other = slower[0]
        ratio = best.throughput / other.throughput if other.throughput > 0 else math.inf
        pace = f"{ratio:.3g}x slower" if ratio > 1.001 else "as fast"
        text += (
            f" Next best: {other.method} (M={other.micro_batches}), {_rate(other.throughput)} "
            f"samples/s ({pace}), staleness {other.max_staleness}, peak memory "
            f"{format_bytes(other.peak_memory_bytes)}."
        )
    fits = {c.method for c in feasible}
    out = sorted({c.method for c in ranked if c.infeasible is not None and not c.skipped} - fits)
    if out:
        text += f" Over the memory cap: {', '.join(out)}."
    skipped = [f"{c.method} M={c.micro_batches}" for c in ranked if c.skipped]
    if skipped:
        text += (
            f" Not simulated (over the work limit, pipeoptim.plan.limits): {', '.join(skipped)}."
        )
    return text
