"""What the runtime costs on a host beyond the layers' compute, as a profile records it.

A layer profile times the layers; a pipeline run also pays, per action, the executor's and
the stage's own work around the layers (the action loop, the weight versions a policy
keeps, the saved-tensor bookkeeping, the loss on the last stage) and, per message between
two rank processes, a fixed work at the sender and at the receiver and a latency between.
On a small model on CPU these are most of a run's time, and a rank's work, done in bursts
between waits for messages, costs more than in the loop the profiler times it in: after
each wait its caches refill and its core wakes, a fixed cost per wait whatever the size of
the work that follows (kept in seconds, :attr:`RuntimeCosts.burst_s`; the ratio the probe's
small step showed is recorded but not charged, since multiplying a model's layer times by
it counted the layers' own time again). ``pipeoptim profile --ranks P``
measures them on the machine it profiles (a message's work from a short run of the model
on two rank processes, :mod:`pipeoptim.workloads.message_probe`, its latency and the
slowdowns from a gloo ping-pong, :mod:`pipeoptim.runtime.profiling.messages`; the actions
from a short run of the model's own stages, :mod:`pipeoptim.workloads.profiling`) and the
profile keeps them as ``runtime_costs``; the offline cost model charges them
(:mod:`pipeoptim.sim.host`). Where the ranks outnumber the host's cores, a short run of the
model on its P rank processes (:mod:`pipeoptim.workloads.layout_probe`) puts its fitted
costs into the layers instead: the slowdowns are then 1, the message costs fitted there,
and each policy's action cost its excess over the synchronous policy's.

A profile without them (older files, synthetic profiles, a profile for one process) costs
nothing beyond its layers: today's model, to the bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeoptim.errors import PlanError
from pipeoptim.plan.orders import KIND_CODES

__all__ = ["ACTION_KINDS", "RuntimeCosts"]

ACTION_KINDS = KIND_CODES
"""The compute actions a fixed cost is kept for: forward, backward, update, and a split
backward's input (I) and weight (W) halves."""

_FIX = "re-profile with `pipeoptim profile --ranks P`, or give 0 for no cost"

_WHAT = {
    "message_send_s": "the fixed seconds a rank works to send one message to another rank",
    "message_receive_s": "the fixed seconds a rank works to take in one message",
    "message_latency_s": "the seconds a message takes between its two ends' work",
    "burst_s": "the seconds a rank's work after a wait for a message costs beyond a loop's",
    "shared_burst_s": "the seconds a rank's work after a wait costs where ranks take turns",
}


def _seconds(where: str, what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        number = math.nan
    else:
        number = float(value)
    if not math.isfinite(number) or number < 0:
        raise PlanError(
            f"{where} is {what} and must be a finite number of seconds >= 0 (got {value!r}); {_FIX}"
        )
    return number


@dataclass(frozen=True)
class RuntimeCosts:
    """The runtime's fixed costs on the host a profile measured (seconds; 0: none)."""

    message_send_s: float = 0.0
    """Work of the sending rank per message to another rank (whatever its size), as a rank
    on cores of its own between waits does it: the runtime's own (the executor's and the
    transport's work with gloo's), or gloo's alone in profiles before the message probe."""
    message_receive_s: float = 0.0
    """Work of the receiving rank per message (woken from its wait, taking it in)."""
    message_latency_s: float = 0.0
    """Seconds a message takes from its sender's work to its receiver's, beyond both."""
    burst_slowdown: float = 1.0
    """How many times slower the message ping-pong's small step ran between two waits than
    in a loop, each rank on cores of its own (a ratio >= 1; 1 where not measured). A
    record of the probe, not charged: the ratio is that of one small step, and the cost of
    a wait is fixed (:attr:`burst_s`); only its ratio to :attr:`shared_burst_slowdown`
    scales a message's work where the ranks take turns on the cores."""
    shared_burst_slowdown: float = 1.0
    """As :attr:`burst_slowdown`, where the ranks take turns on the host's cores (another
    rank ran on the core since, so more of the caches are gone)."""
    action_s: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    """Per weight policy (``flush``, ``stash``, ``double-buffer``, ``predict``: what the
    stage does around its passes differs) the fixed seconds of one action of each kind of
    :data:`ACTION_KINDS` beyond its layers' time."""
    burst_s: float = 0.0
    """Seconds the work after a wait for a message costs beyond the same work in a loop
    (its caches refill, its core wakes), once per wait, each rank on cores of its own;
    charged to the rank per message it takes in (a rank waits only for messages). 0 where
    not measured (profiles before it: their ratio is not converted)."""
    shared_burst_s: float = 0.0
    """As :attr:`burst_s`, where the ranks take turns on the host's cores: charged
    instead where they outnumber the cores."""

    @property
    def shared_over_burst(self) -> float:
        """How many times slower work measured between waits on cores of its own (a
        message's, timed so) runs where the ranks take turns on the cores: the shared
        slowdown over the own-core one, never below 1."""
        return max(1.0, self.shared_burst_slowdown / self.burst_slowdown)

    def __post_init__(self) -> None:
        for name, what in _WHAT.items():
            object.__setattr__(
                self, name, _seconds(f"runtime_costs.{name}", what, getattr(self, name))
            )
        for name in ("burst_slowdown", "shared_burst_slowdown"):
            ratio = getattr(self, name)
            bad = isinstance(ratio, bool) or not isinstance(ratio, (int, float))
            if bad or not math.isfinite(ratio) or ratio < 1:
                raise PlanError(
                    f"runtime_costs.{name} is how many times slower work runs between two "
                    f"waits for messages than in a loop and must be a finite number >= 1 "
                    f"(got {ratio!r}); re-profile with `pipeoptim profile --ranks P`, or "
                    f"give 1 for none"
                )
            object.__setattr__(self, name, float(ratio))
        if not isinstance(self.action_s, Mapping):
            raise PlanError(
                f"runtime_costs.action_s must map a weight policy to seconds per action kind "
                f"(got {self.action_s!r}), e.g. {{'flush': {{'F': 2e-05, 'B': 3e-05}}}}; {_FIX}"
            )
        checked: dict[str, dict[str, float]] = {}
        for policy, kinds in self.action_s.items():
            if not isinstance(policy, str) or not isinstance(kinds, Mapping):
                raise PlanError(
                    f"runtime_costs.action_s maps a weight policy name to seconds per action "
                    f"kind (got {policy!r}: {kinds!r}), e.g. {{'flush': {{'F': 2e-05}}}}; {_FIX}"
                )
            row: dict[str, float] = {}
            for kind, value in kinds.items():
                if kind not in ACTION_KINDS:
                    raise PlanError(
                        f"runtime_costs.action_s[{policy!r}] has action kind {kind!r}; the "
                        f"kinds are {', '.join(ACTION_KINDS)}; {_FIX}"
                    )
                where = f"runtime_costs.action_s[{policy!r}][{kind!r}]"
                what = f"the fixed seconds of one {kind} action beyond its layers"
                row[kind] = _seconds(where, what, value)
            checked[policy] = row
        object.__setattr__(self, "action_s", checked)

    @property
    def charges(self) -> bool:
        """Whether any of the costs is above 0."""
        return (
            self.message_send_s > 0
            or self.message_receive_s > 0
            or self.message_latency_s > 0
            or self.burst_s > 0
            or self.shared_burst_s > 0
            or any(v > 0 for kinds in self.action_s.values() for v in kinds.values())
        )

    def actions(self, policy: str) -> tuple[float, float, float, float, float]:
        """The fixed seconds of an F, B, U, I and W action under weight policy ``policy``:
        its own where measured, else the synchronous (``flush``) one's, else none."""
        kinds = self.action_s.get(policy) or self.action_s.get("flush") or {}
        f, b, u, i, w = (kinds.get(k, 0.0) for k in ACTION_KINDS)
        return f, b, u, i, w

    def to_dict(self) -> dict[str, Any]:
        """The record a profile file keeps as ``runtime_costs``."""
        return {
            "message_send_s": self.message_send_s,
            "message_receive_s": self.message_receive_s,
            "message_latency_s": self.message_latency_s,
            "burst_slowdown": self.burst_slowdown,
            "shared_burst_slowdown": self.shared_burst_slowdown,
            "action_s": {p: dict(k) for p, k in self.action_s.items()},
            "burst_s": self.burst_s,
            "shared_burst_s": self.shared_burst_s,
        }

    @classmethod
    def from_dict(cls, data: object, source: str = "runtime_costs") -> RuntimeCosts:
        """A record written by :meth:`to_dict` (missing entries cost 0); raises
        :class:`PlanError` naming ``source``."""
        if not isinstance(data, Mapping):
            raise PlanError(
                f"{source} must be a mapping of message_send_s, message_receive_s, "
                f"message_latency_s, burst_slowdown, shared_burst_slowdown, action_s, "
                f"burst_s and shared_burst_s "
                f"(got {data!r}); {_FIX}"
            )
        try:
            return cls(
                data.get("message_send_s", 0.0),
                data.get("message_receive_s", 0.0),
                data.get("message_latency_s", 0.0),
                data.get("burst_slowdown", 1.0),
                data.get("shared_burst_slowdown", 1.0),
                data.get("action_s", {}),
                data.get("burst_s", 0.0),
                data.get("shared_burst_s", 0.0),
            )
        except PlanError as err:
            if source == "runtime_costs":  # the messages name the fields already
                raise
            raise PlanError(f"{source}: {err}") from None
