"""A fitted machine model as simulator costs, and carried through a calibrated profile.

Where a run's ranks shared their cores, :func:`shared_costs` replaces the per-stage medians
of :func:`pipeoptim.calibrate.costs_from_trace` by the fitted work of every action (a split
backward's I and W together as the stage's backward, their shares as its weight-gradient
fraction), charges each message its fitted fixed cost at both ends instead of folding the
sends into the passes, takes each link's latency as its fastest message, and hands the
simulator the machine, so it runs the ranks by processor sharing.

A calibrated profile keeps the machine and the message costs in its meta
(:func:`profile_meta`), so what-if predictions built from it (other methods, other stage
counts) run on the same machine (:func:`with_profile_machine`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from pipeoptim.calibrate.fit import MachineFit
from pipeoptim.plan.machine import Machine
from pipeoptim.sim.costs import CostModel

__all__ = ["profile_meta", "shared_costs", "with_profile_machine"]


def shared_costs(costs: CostModel, fit: MachineFit) -> CostModel:
    """``costs`` with the fitted work, message costs, latencies and machine of ``fit``."""
    s = costs.num_stages

    def work(k: int, kind: str) -> float:
        return fit.work_s.get((k, kind), 0.0)

    split = [work(k, "I") + work(k, "W") for k in range(s)]
    shares = tuple(
        work(k, "W") / split[k] if split[k] > 0 else costs.weight_grad_fractions[k]
        for k in range(s)
    )
    return replace(
        costs,
        forward_s=tuple(work(k, "F") for k in range(s)),
        backward_s=tuple(work(k, "B") + split[k] for k in range(s)),
        update_s=tuple(work(k, "U") for k in range(s)),
        weight_grad_fraction=shares,
        latency_s=tuple(fit.latency_s.get(k, 0.0) for k in range(s - 1)),
        message_send_s=fit.message_send_s,
        message_receive_s=fit.message_receive_s,
        machine=fit.machine,
    )


def profile_meta(costs: CostModel) -> dict[str, Any]:
    """What a calibrated profile records of the machine model (nothing without one)."""
    if costs.machine is None:
        return {}
    return {
        "machine": costs.machine.to_dict(),
        "message_send_s": costs.message_send_s,
        "message_receive_s": costs.message_receive_s,
    }


def with_profile_machine(
    costs: CostModel, meta: Mapping[str, Any], run_ranks: int, ranks: int
) -> CostModel:
    """``costs`` (built from a calibrated profile) on the machine its ``meta`` records, for
    ``ranks`` ranks: a run whose ranks all shared one host (``ranks_per_host >= run_ranks``)
    is predicted with all ``ranks`` on that host; a run over several hosts keeps its ranks
    per host."""
    if "machine" not in meta:
        return costs
    recorded = Machine.from_dict(meta["machine"], "the calibrated profile's machine")
    per_host = ranks if recorded.ranks_per_host >= run_ranks else recorded.ranks_per_host
    return replace(
        costs,
        machine=Machine(recorded.cores, per_host, recorded.threads_per_rank),
        message_send_s=float(meta.get("message_send_s", 0.0)),
        message_receive_s=float(meta.get("message_receive_s", 0.0)),
    )
