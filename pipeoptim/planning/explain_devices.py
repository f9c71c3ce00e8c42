"""What to run on N devices and why, in words: the chosen P x D factorisation against every
other, with where each one's update period goes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeoptim.plan.profile import Profile
from pipeoptim.plan.units import format_bandwidth, format_bytes
from pipeoptim.planning.candidate import Candidate
from pipeoptim.planning.devices import DeviceSearch
from pipeoptim.planning.explain import describe_staleness, format_rate
from pipeoptim.sim.collectives import Cluster

__all__ = ["Shares", "explain_devices", "shares"]


@dataclass(frozen=True)
class Shares:
    """Where a candidate's update period goes, for comparing factorisations."""

    allreduce: float
    """Largest stage all-reduce / the period."""
    idle: float
    """Steady-state idle fraction of the ranks."""
    device_s_per_sample: float
    """Device-seconds of compute (all-reduce excluded) per sample over all devices."""


def shares(c: Candidate, batch: int) -> Shares:
    """The breakdown of ``c``'s period (see :class:`Shares`)."""
    period = c.update_period_s
    if period <= 0:
        return Shares(0.0, 0.0, 0.0)
    ar = list(c.allreduce_s) or [0.0]
    busy = (1.0 - c.steady_bubble) * period
    compute = max(0.0, busy - math.fsum(ar) / len(ar))
    devices = c.stages * c.data_parallel
    return Shares(max(ar) / period, c.steady_bubble, compute * devices / batch)


def _tier(cluster: Cluster, within: bool) -> str:
    bw, _ = cluster.tier(within)
    where = "within a node" if within or cluster.gpus_per_node is None else "between nodes"
    return f"{where}, {format_bandwidth(bw) if math.isfinite(bw) else 'free links'}"


def _slower(c: Candidate, best: Candidate, batch: int) -> str:
    """Why ``c`` is behind ``best``: the parts of the period that are worse."""
    a, b = shares(c, batch), shares(best, batch)
    reasons = []
    if a.allreduce - b.allreduce > 0.02:
        reasons.append(f"all-reduce {a.allreduce:.0%} of each step against {b.allreduce:.0%}")
    if a.idle - b.idle > 0.02:
        reasons.append(f"ranks idle {a.idle:.0%} of each step against {b.idle:.0%}")
    if b.device_s_per_sample > 0 and a.device_s_per_sample / b.device_s_per_sample > 1.02:
        samples = batch / (c.data_parallel * c.micro_batches)
        reasons.append(
            f"{a.device_s_per_sample / b.device_s_per_sample:.3g}x the device time per "
            f"sample (micro-batches of {_samples(samples)}, links on the way)"
        )
    risk_a = c.risk.risk if c.risk else 0.0
    risk_b = best.risk.risk if best.risk else 0.0
    if risk_a - risk_b > 0.005:
        reasons.append(f"convergence risk +{100 * risk_a:.0f}% against +{100 * risk_b:.0f}%")
    return "; ".join(reasons) or "level within the noise"


def explain_devices(result: DeviceSearch, profile: Profile) -> str:
    """What to run on the devices and why, against every other factorisation."""
    best = result.best
    f = result.factorisation(best)
    p, d, batch = f.stages, f.replicas, result.batch_size
    cluster = result.cluster
    nodes = f", {cluster.gpus_per_node} per node" if cluster.gpus_per_node else ""
    cap = (
        f" within the {format_bytes(result.memory_cap_bytes)} cap"
        if result.memory_cap_bytes
        else ""
    )
    text = (
        f"Run {p} pipeline stage(s) x {d} data-parallel replica(s) on {result.devices:,} "
        f"devices{nodes}: {best.method} with {best.micro_batches} micro-batch(es) of "
        f"{_samples(batch / (d * best.micro_batches))} per replica (global batch {batch:,}): "
        f"predicted {format_rate(best.throughput)} samples/s, {describe_staleness(best)}, peak "
        f"stage memory {format_bytes(best.peak_memory_bytes)}{cap}."
    )
    s = shares(best, batch)
    if d > 1 and best.partition is not None:
        grads = max(
            sum(x.param_bytes for x in profile.layers[a:b]) for a, b in best.partition.boundaries
        )
        text += (
            f" Each update all-reduces up to {format_bytes(grads)} of gradients per stage over "
            f"{d} replicas ({_tier(cluster, f.inter_node_groups == 0)}): "
            f"{max(best.allreduce_s):.3g} s, {s.allreduce:.0%} of the "
            f"{best.update_period_s:.3g} s step; the ranks idle {s.idle:.0%} of it."
        )
    if p > 1 and cluster.gpus_per_node is not None:
        text += (
            f" All {p - 1} pipeline edges stay within a node."
            if f.inter_node_edges == 0
            else f" {f.inter_node_edges} of the {p - 1} pipeline edges cross nodes."
        )
    others = []
    blocked: dict[str, list[str]] = {}  # reason -> labels, so one reason is said once
    for g in result.factorisations:
        if g is f:
            continue
        c = g.best
        if c is None:
            blocked.setdefault(g.excluded or "no candidate", []).append(g.label)
            continue
        ratio = (
            best.effective_throughput / c.effective_throughput
            if c.effective_throughput
            else math.inf
        )
        pace = (
            f"{ratio:.3g}x slower"
            if ratio > 1.001
            else "as fast, ranked lower on freshness or memory"
        )
        others.append(
            f"{g.label} ({c.method}, M={c.micro_batches}) is {pace}: {_slower(c, best, batch)}"
        )
    for why, labels in blocked.items():
        who = labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + f" and {labels[-1]}"
        others.append(f"{who} cannot run: {why}")
    if others:
        text += " Against the other factorisations: " + "; ".join(others) + "."
    return text


def _samples(count: float) -> str:
    return f"{count:g} sample" + ("" if count == 1 else "s")
