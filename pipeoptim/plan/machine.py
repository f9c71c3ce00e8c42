"""The machine a run's ranks share: what decides whether they take turns on its cores.

A pipeline of P ranks on a host of C cores, each rank computing with T threads, has every
rank to itself only when ``C >= ranks_per_host * T``. With fewer cores (more ranks than cores
on a CPU box, or ranks sharing GPUs) the busy ranks of a host share its cores: the
simulator then runs them by processor sharing (:mod:`pipeoptim.sim.sharing`), n busy ranks
each progressing at ``min(1, C / (n * T))`` of their own speed.

Profiles and runtime traces record this as ``meta["machine"]`` (:meth:`Machine.to_dict`),
so calibration and the simulator read the facts of the machine that measured them. A
host's ranks are consecutive: rank r is on host ``r // ranks_per_host``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from pipeoptim.errors import PlanError

__all__ = ["Machine", "this_machine_cores"]

_FIELDS = {
    "cores": (
        "the cores (or shared accelerators) of one host that its ranks run on",
        "give the host's core count, e.g. 2 (os.cpu_count())",
    ),
    "ranks_per_host": (
        "the pipeline ranks placed on each host",
        "give how many ranks run on one machine, e.g. 4 for 4 stages on one host",
    ),
    "threads_per_rank": (
        "the cores each rank computes with (its CPU threads; 1 for a rank on a GPU)",
        "give the rank's thread count, e.g. 1",
    ),
}


def _whole(name: str, value: object) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        what, fix = _FIELDS[name]
        raise PlanError(
            f"the machine's {name} must be a whole number >= 1, {what} (got {value!r}); {fix}"
        )
    return value


@dataclass(frozen=True)
class Machine:
    """The host a run's ranks share (one per host; every host alike)."""

    cores: int
    """Cores (or accelerators) of one host that its ranks run on."""
    ranks_per_host: int
    """Pipeline ranks placed on each host (consecutive ranks)."""
    threads_per_rank: int = 1
    """Cores each rank computes with: its CPU threads (1 for a rank on its own GPU)."""

    def __post_init__(self) -> None:
        for name in _FIELDS:
            object.__setattr__(self, name, _whole(name, getattr(self, name)))

    @property
    def demand(self) -> int:
        """Cores the host's ranks ask for when every one of them is busy."""
        return self.ranks_per_host * self.threads_per_rank

    @property
    def shares_cores(self) -> bool:
        """Whether busy ranks can outnumber the cores (else every rank runs at full speed
        and the simulator's model is the one of a core per rank)."""
        return self.cores < self.demand

    def rate(self, busy: int) -> float:
        """The speed of each of ``busy`` busy ranks of one host, as a fraction of a rank's
        speed on cores of its own."""
        return min(1.0, self.cores / (busy * self.threads_per_rank))

    def host_of(self, rank: int) -> int:
        """The host rank ``rank`` runs on."""
        return rank // self.ranks_per_host

    def to_dict(self) -> dict[str, int]:
        """The record profiles and traces keep as ``meta["machine"]``."""
        return {
            "cores": self.cores,
            "ranks_per_host": self.ranks_per_host,
            "threads_per_rank": self.threads_per_rank,
        }

    @classmethod
    def from_dict(cls, data: object, source: str = "the machine record") -> Machine:
        """A record written by :meth:`to_dict`; raises :class:`PlanError` naming ``source``."""
        if not isinstance(data, Mapping) or "cores" not in data or "ranks_per_host" not in data:
            raise PlanError(
                f"{source} must be a mapping with cores, ranks_per_host and threads_per_rank "
                f"(got {data!r}); rewrite it as Machine.to_dict() does"
            )
        return cls(
            data["cores"], data["ranks_per_host"], data.get("threads_per_rank", 1)
        )  # checked by __post_init__


def this_machine_cores() -> int:
    """The cores this process may run on (its CPU affinity, else the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not every platform has an affinity
        return max(1, os.cpu_count() or 1)
