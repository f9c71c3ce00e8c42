"""The offline cost model's host: what a profile measured of the machine a run will use.

A profile taken for a P-rank run on this machine (``pipeoptim profile --ranks P``) records
the host (``meta["machine"]``: its cores, the P ranks, each rank's threads) and the
runtime's fixed costs there (``runtime_costs``: the work of a message at each end and its
latency, the executor's and the stage's work per action beyond the layers, per weight
policy). :func:`on_profiled_host` puts a cost model built from that profile's layers on
that host, so planning and simulating from the profile alone (before any run) predict what
the run will meet:

* the machine: the planned run's ranks all on the recorded host, each computing with the
  threads the layers were timed with (the profile's threads are those each of the P ranks
  gets, ``cores // P``, and its layer times were taken with the other ranks' stand-ins busy
  on the other cores, so they are one rank's speed on cores of its own); where the ranks
  ask for more cores than the host has, the engines share them (:mod:`pipeoptim.sim.sharing`).
  D replicas on one host are modelled as one whose ranks have ``cores // D`` of it;
* every message between ranks costs its measured work at each end (the runtime's own,
  from a short run of the model on two rank processes; gloo's alone in older profiles),
  and each link at least the measured latency; where the ranks take turns on the cores, a
  message's work takes ``shared_burst_slowdown / burst_slowdown`` times as long (it was
  measured between waits on cores of their own, already ``burst_slowdown`` slow);
* every action costs its method's weight policy's measured fixed work on top of its layers
  (:attr:`~pipeoptim.sim.costs.CostModel.action_s`);
* with several ranks, whose work comes in bursts between waits for messages, every
  message a rank takes in costs it the measured ``burst_s`` more (``shared_burst_s``
  where the ranks take turns on the cores): after each wait its caches refill and its
  core wakes, once per wait whatever the work that follows. The layer and action times
  are charged as measured: they are one rank's speed on cores of its own already, and
  the ping-pong's ratio (``burst_slowdown``), taken on one small step, is no measure of a
  large action's (multiplying the layers by it counted their time about twice: a 2-rank
  run of 8 x Linear(1024) predicted -57 %).

A profile that records none of this (older files, synthetic profiles, one taken without
``--ranks``, for one process) leaves the costs as they are, to the bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pipeoptim.plan.machine import Machine
from pipeoptim.plan.methods import Method, get_method
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.runtime_costs import RuntimeCosts
from pipeoptim.sim.costs import CostModel

__all__ = ["ProfiledHost", "host_notes", "on_profiled_host"]


@dataclass(frozen=True)
class ProfiledHost:
    """What a profile (or a stage graph planned from one) recorded of its host."""

    machine: Machine | None = None
    """The host's record (``meta["machine"]``)."""
    ranks: int | None = None
    """The ranks the profile was taken to share it (``meta["ranks"]``)."""
    runtime: RuntimeCosts | None = None
    """The runtime's fixed costs there."""

    @classmethod
    def of(cls, source: Profile | Mapping[str, Any]) -> ProfiledHost:
        """From a profile, or from a stage graph's attributes (``graph.graph``: the plan's
        stage graph keeps ``machine``, ``ranks`` and ``runtime_costs`` of its profile)."""
        if isinstance(source, Profile):
            return cls(source.machine, source.planned_ranks, source.runtime_costs)
        machine = source.get("machine")
        ranks = source.get("ranks")
        runtime = source.get("runtime_costs")
        return cls(
            None if machine is None else Machine.from_dict(machine, "the stage graph's machine"),
            ranks if isinstance(ranks, int) and not isinstance(ranks, bool) else None,
            None
            if runtime is None
            else RuntimeCosts.from_dict(runtime, "the stage graph's runtime_costs"),
        )

    def machine_for(self, num_ranks: int, data_parallel: int = 1) -> Machine | None:
        """The host ``num_ranks`` pipeline ranks (of each of ``data_parallel`` replicas)
        share, where the record was taken for a multi-rank run on it (else None)."""
        recorded = self.machine
        if recorded is None or self.ranks is None or self.ranks < 2:
            return None
        # The profile's host held all its planned ranks: the planned run's ranks go there.
        per_host = num_ranks if recorded.ranks_per_host >= self.ranks else recorded.ranks_per_host
        cores = max(1, recorded.cores // max(1, data_parallel))
        return Machine(cores, per_host, recorded.threads_per_rank)


def on_profiled_host(
    costs: CostModel,
    source: Profile | Mapping[str, Any] | ProfiledHost,
    method: str | Method,
    num_ranks: int,
    *,
    data_parallel: int = 1,
) -> CostModel:
    """``costs`` (built from ``source``'s layers for ``method`` on ``num_ranks`` ranks) on
    the host ``source`` measured: its machine, message and action costs (module docstring).
    Unchanged where it recorded none."""
    host = source if isinstance(source, ProfiledHost) else ProfiledHost.of(source)
    machine = host.machine_for(num_ranks, data_parallel)
    runtime = host.runtime
    if machine is not None:
        costs = replace(costs, machine=machine)
    if runtime is not None and runtime.charges:
        spec = method if isinstance(method, Method) else get_method(method)
        actions: tuple[float, ...] = runtime.actions(spec.version_rule.value)
        shared = machine is not None and machine.shares_cores
        # a rank waits only for messages: each one it takes in costs it a wait's cold start
        woken = (runtime.shared_burst_s if shared else runtime.burst_s) if num_ranks > 1 else 0.0
        # a message's work was measured between waits on cores of its own: where the ranks
        # take turns on the cores it slows as the ping-pong's step did beyond that
        on_turns = runtime.shared_over_burst if shared and num_ranks > 1 else 1.0
        costs = replace(
            costs,
            message_send_s=runtime.message_send_s * on_turns,
            message_receive_s=runtime.message_receive_s * on_turns + woken,
            latency_s=tuple(max(lat, runtime.message_latency_s) for lat in costs.latency_s),
            action_s=actions if any(actions) else (),
        )
    return costs


def host_notes(source: Profile | Mapping[str, Any], num_ranks: int) -> list[str]:
    """What :func:`on_profiled_host` charges for ``source``, one line each (for reports)."""
    host = ProfiledHost.of(source)
    notes = []
    probe = source.meta.get("layout_probe") if isinstance(source, Profile) else None
    if isinstance(probe, Mapping):
        notes.append(
            f"layer times from the model run on {probe.get('stages')} rank processes of "
            f"this host ({probe.get('method')}, {probe.get('micro_batches')} micro-batches, "
            f"{probe.get('mini_batches')} mini-batches): {float(probe.get('slowdown', 1.0)):.2f}x "
            f"their times in a loop (measured)"
        )
    machine = host.machine_for(num_ranks)
    if machine is not None:
        notes.append(
            f"{machine.ranks_per_host} rank(s) of {machine.threads_per_rank} thread(s) on "
            f"{machine.cores} core(s): "
            + ("the busy ranks share the cores" if machine.shares_cores else "a core per rank")
        )
    runtime = host.runtime
    if runtime is not None and runtime.charges:
        notes.append(
            f"per message {runtime.message_send_s * 1e6:.0f} µs at the sender, "
            f"{runtime.message_receive_s * 1e6:.0f} µs at the receiver, "
            f"{runtime.message_latency_s * 1e6:.0f} µs between (measured)"
        )
        if machine is not None and machine.shares_cores and num_ranks > 1:
            notes.append(
                f"per message {runtime.shared_over_burst:.2f}x that where the ranks take "
                f"turns on the cores (measured)"
            )
        woken = (
            runtime.shared_burst_s
            if machine is not None and machine.shares_cores
            else runtime.burst_s
        )
        if woken > 0 and num_ranks > 1:
            notes.append(
                f"per message taken in {woken * 1e6:.0f} µs more for the work after the "
                f"wait (cold caches and core; measured)"
            )
        for policy, kinds in sorted(runtime.action_s.items()):
            per = ", ".join(f"{k} {v * 1e6:.0f}" for k, v in kinds.items())
            notes.append(f"per action ({policy}): {per} µs beyond the layers (measured)")
    return notes
