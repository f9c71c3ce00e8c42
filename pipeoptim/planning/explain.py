"""What to run and why, in words: the recommendation of a search for P stages against its
runner-up and the baselines, what fitting the memory cap cost, and the plan's notes on it."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipeoptim.errors import PlanError
from pipeoptim.plan.units import format_bytes, format_distances
from pipeoptim.planning.candidate import Candidate


def format_rate(samples_per_s: float) -> str:
    """Samples per second for a sentence: whole numbers from 100 on, else 3 digits."""
    return f"{samples_per_s:,.0f}" if samples_per_s >= 100 else f"{samples_per_s:.3g}"


def memory_choice(c: Candidate, memory_cap_bytes: int | None) -> str | None:
    """What the candidate does to fit the cap and what it costs, in one sentence (None:
    nothing)."""
    if not c.fitted or c.partition is None:
        return None
    parts = []
    entries = c.recompute_entries() or []
    stages = [k for k, e in enumerate(entries) if e != "none"]
    if stages:
        what = "; ".join(
            f"stage {k} "
            + ("all its units" if entries[k] == "full" else "units " + ",".join(entries[k]))
            for k in stages
        )
        parts.append(f"recompute activations ({what})")
    if c.shard_optimizer:
        parts.append(f"shard the optimizer state over the {c.data_parallel} replicas (ZeRO-1)")
    cap = f"the {format_bytes(memory_cap_bytes)} cap" if memory_cap_bytes else "the cap"
    return (
        f"Memory: no partition fits {cap} as it is, so {' and '.join(parts)}; peak stage "
        f"memory {format_bytes(c.peak_memory_bytes)} instead of "
        f"{format_bytes(c.unfitted_memory_bytes)}, at {100 * c.slowdown:.1f}% less "
        f"throughput ({format_rate(c.throughput)} against {format_rate(c.unfitted_throughput)} "
        f"samples/s for the same partition without it, which would not fit)."
    )


def explain(ranked: Sequence[Candidate], memory_cap_bytes: int | None = None) -> str:
    """One paragraph: what to run and why, against the runner-up and the baselines."""
    feasible = [c for c in ranked if c.infeasible is None]
    if not feasible:
        first = ranked[0].infeasible if ranked else "no candidates"
        raise PlanError(f"no method fits: {first}")
    best = feasible[0]
    cap = f" within the {format_bytes(memory_cap_bytes)} cap" if memory_cap_bytes else ""
    text = (
        f"Run {best.method} with {best.micro_batches} micro-batch(es){_placement(best)}: "
        f"predicted {format_rate(best.throughput)} samples/s, {describe_staleness(best)}, "
        f"{_peak_words(best)} {format_bytes(best.peak_memory_bytes)}{cap}."
    )
    dial = _dial_choice(best, feasible)
    if dial:
        text += " " + dial
    choice = memory_choice(best, memory_cap_bytes)
    if choice:
        text += " " + choice
    # as fast or faster per sample, ranked lower only because of the convergence risk
    passed = [
        c
        for c in feasible[1:]
        if c.method != best.method
        and c.throughput >= best.throughput * 0.99
        and c.effective_throughput < best.effective_throughput * 0.99
    ]
    if passed:
        text += " " + _passed_over(passed, best)
    slower = [c for c in feasible[1:] if c.method != best.method and c not in passed]
    if slower:
        other = slower[0]
        ratio = best.throughput / other.throughput if other.throughput > 0 else math.inf
        if ratio > 1.001:
            pace = f"{ratio:.3g}x slower"
        elif ratio < 0.999:  # faster per sample, level once its convergence risk counts
            pace = f"{1 / ratio:.3g}x faster per sample, level after its convergence risk"
        else:
            pace = "as fast"
        text += (
            f" Next best: {other.method} (M={other.micro_batches}), "
            f"{format_rate(other.throughput)} samples/s ({pace}), {describe_staleness(other)}, "
            f"peak memory {format_bytes(other.peak_memory_bytes)}."
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


def _stage0_delay(c: Candidate) -> int:
    """Updates stage 0's forwards run ahead of their backwards (its largest distance)."""
    return c.risk.distances[0] if c.risk is not None and c.risk.distances else 0


def _dial_choice(best: Candidate, feasible: Sequence[Candidate]) -> str | None:
    """Where the search tried the best method at counts whose delays differ (PipeOptim's
    dial: stage 0 is ⌈(P−1)/M⌉ updates behind): the chosen M, stage 0's delay at it, and
    the other counts with their delays, rates and risks (None: no such choice was made)."""
    others: dict[int, Candidate] = {}
    for c in feasible:  # ranked: each count's best candidate
        if c.method == best.method and c.micro_batches != best.micro_batches:
            others.setdefault(c.micro_batches, c)
    delay = _stage0_delay(best)
    if all(_stage0_delay(c) == delay for c in others.values()):
        return None
    rates = "; ".join(
        f"M = {m}: {_stage0_delay(c)} behind, {format_rate(c.throughput)} samples/s, risk "
        f"+{100 * (c.risk.risk if c.risk else 0.0):.0f}%"
        for m, c in sorted(others.items())
    )
    return (
        f"M = {best.micro_batches} puts stage 0 {delay} update(s) behind; chosen by "
        f"effective samples/s, throughput / (1 + risk), over the other counts ({rates})."
    )


def _placement(c: Candidate) -> str:
    """Where a rank holds several stages: how many, and that the partition balances
    stages, not ranks (empty for one stage per rank)."""
    if c.virtual_stages <= 1:
        return ""
    return (
        f", {c.virtual_stages} stages on each of {c.stages} ranks as the method places them "
        f"({c.stages * c.virtual_stages} stages balanced one by one)"
    )


def _peak_words(c: Candidate) -> str:
    return "peak rank memory (its stages together)" if c.virtual_stages > 1 else "peak stage memory"


def describe_staleness(c: Candidate) -> str:
    """Staleness and prediction distance together: staleness 0 with s = 7 is not fresh."""
    if c.risk is None or not any(c.risk.distances):
        return f"weight staleness {c.max_staleness}"
    r = c.risk
    text = (
        f"weight staleness {c.max_staleness}, prediction distance s {format_distances(r.distances)}"
    )
    if r.closed is not None:
        text += (
            f" (its prediction removes about {100 * r.closed:.0f}% of the stale distance at "
            f"s = {max(r.distances)})"
        )
    return text + f", convergence risk +{100 * r.risk:.0f}% samples"


def _passed_over(passed: Sequence[Candidate], best: Candidate) -> str:
    """Why candidates as fast or faster per sample are not the recommendation: the risk of
    each method (its best-ranked candidate), with what drives it."""
    first: dict[str, Candidate] = {}
    for c in passed:
        first.setdefault(c.method, c)
    ratio = max(c.throughput for c in passed) / best.throughput
    pace = f"up to {ratio:.3g}x faster" if ratio > 1.01 else "as fast"
    names = list(first)
    who = names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" and {names[-1]}"
    verb = "is" if len(names) == 1 else "are"
    reasons = [_risk_reason(c) for c in first.values()]
    risks = [c.risk for c in first.values() if c.risk is not None]
    closest = max(passed, key=lambda c: c.effective_throughput)
    if risks and risks[0].curve is not None:
        scale = "read off the optimizer's measured curve of extra samples by uncorrected distance, "
    elif risks:
        scale = f"κ = {risks[0].kappa:.3g} per update of uncorrected distance, "
    else:
        scale = ""
    return (
        f"{who} {verb} {pace} per sample but not chosen because of the convergence risk "
        f"({scale}fitted by the convergence study; pipeoptim.plan.risk): "
        + "; ".join(reasons)
        + f". So the time to accuracy is longer ({format_rate(closest.effective_throughput)} "
        f"against {format_rate(best.effective_throughput)} effective samples/s at best)."
    )


def _risk_reason(c: Candidate) -> str:
    r = c.risk
    if r is None:
        return f"{c.method} ranks lower"
    if r.closed is not None and any(r.distances):
        s = max(r.distances)
        return (
            f"{c.method} +{100 * r.risk:.0f}% samples (its forward predicts s = {s} updates "
            f"ahead and the prediction removes only about {100 * r.closed:.0f}% of that stale "
            f"distance: e = {r.uncorrected:.2g})"
        )
    return f"{c.method} +{100 * r.risk:.0f}% samples (staleness {max(r.staleness, default=0)})"


def memory_notes(c: Candidate) -> dict[str, object]:
    """A plan's notes on what was done to fit the memory cap (empty: nothing)."""
    if not c.fitted:
        return {}
    return {
        "memory_fit": {
            "recompute": c.recompute_entries(),
            "shard_optimizer": c.shard_optimizer,
            "samples_per_s_without": c.unfitted_throughput,
            "peak_memory_bytes_without": c.unfitted_memory_bytes,
            "slowdown": c.slowdown,
        }
    }
