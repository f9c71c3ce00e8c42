"""The Trace: what a run did, emitted alike by the simulator and the runtime.

One schema for both producers means one metrics function and one plot compare a
prediction with a measurement. Traces save as JSON and export to chrome-trace JSON,
which Perfetto and chrome://tracing open.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, StrictStr, with_config
from typing_extensions import Required, TypedDict

from pipeoptim.filecheck import (
    IntKey,
    NonNegativeNumber,
    NonNegativeWhole,
    Number,
    PositiveWhole,
    Whole,
    WholeNumber,
    check,
)
from pipeoptim.jsonfile import read_json

TRACE_FORMAT = "pipeoptim-trace"
TRACE_VERSION = 1
_REMEDY = "write one with --trace FILE from `pipeoptim simulate` or `pipeoptim train`"


@with_config(ConfigDict(extra="forbid"))
@dataclass(frozen=True)
class TraceEvent:
    """One executed action (its field types are also what a trace file's events must hold)."""

    rank: NonNegativeWhole
    """Process (device) that ran it."""
    stage: NonNegativeWhole
    """Pipeline stage the action belongs to."""
    kind: StrictStr
    """Action kind code: F, B, U, the halves of a split backward (I, W), or a communication
    kind (SEND_F, RECV_F, SEND_B, RECV_B)."""
    mb: WholeNumber
    """Global micro-batch id; for U the mini-batch index."""
    start: Number
    """Start time in seconds from the run's start."""
    end: Number
    """End time in seconds from the run's start."""
    weight_version: WholeNumber = 0
    """Weight version the action used (for a predicted forward: the version it predicts)."""
    bytes: NonNegativeWhole = 0
    """Bytes moved (communication) or allocated (compute) by the action; 0 if unknown."""
    distance: WholeNumber = 0
    """For a forward: updates between it and its backward (prediction distance s)."""

    @property
    def duration(self) -> float:
        return self.end - self.start


@with_config(ConfigDict(extra="forbid"))
@dataclass(frozen=True)
class MemorySample:
    """Memory held by one rank at one time."""

    rank: NonNegativeWhole
    time: Number
    bytes: NonNegativeWhole
    detail: dict[str, WholeNumber] = field(default_factory=dict)
    """Breakdown (weights, stash, gradients, optimizer, activations), where known."""


@with_config(ConfigDict(extra="allow"))
class TraceMeta(TypedDict, total=False):
    """The run metadata keys a trace file's ``meta`` types; it may hold further keys."""

    method: StrictStr | None
    source: StrictStr | None
    transport: StrictStr | None
    num_ranks: NonNegativeWhole | None
    num_stages: NonNegativeWhole | None
    micro_batches: PositiveWhole | None
    mini_batches: NonNegativeWhole | None
    virtual_stages: PositiveWhole | None
    batch_size: NonNegativeNumber | None
    samples_per_micro_batch: NonNegativeNumber | None
    weight_copies: dict[IntKey, WholeNumber] | None
    predict_s: dict[IntKey, NonNegativeNumber] | None
    plan: dict[str, Any] | None


@with_config(ConfigDict(title="pipeoptim trace", extra="allow"))
class TraceFile(TypedDict, total=False):
    """A trace file: what :meth:`Trace.from_dict` checks before it builds the trace."""

    format: Required[Literal["pipeoptim-trace"]]
    version: Annotated[int, Whole(one_of=(TRACE_VERSION,))]
    meta: TraceMeta
    events: Required[list[TraceEvent]]
    memory: list[MemorySample]


@dataclass
class Trace:
    """Events, memory samples and run metadata."""

    events: list[TraceEvent] = field(default_factory=list)
    memory: list[MemorySample] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    """Run metadata: ``method``, ``num_stages``, ``micro_batches``, ``mini_batches``,
    ``batch_size`` (samples per mini-batch), ``source`` (``sim`` or ``runtime``), ``plan``."""

    @property
    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events} | {m.rank for m in self.memory})

    def events_of(
        self, rank: int | None = None, kinds: Iterable[str] | None = None
    ) -> list[TraceEvent]:
        wanted = set(kinds) if kinds is not None else None
        return [
            e
            for e in self.events
            if (rank is None or e.rank == rank) and (wanted is None or e.kind in wanted)
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "meta": self.meta,
            "events": [asdict(e) for e in self.events],
            "memory": [asdict(m) for m in self.memory],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<trace>") -> Trace:
        """Check ``data`` as a :class:`TraceFile` (pydantic builds the events and memory
        samples), then build the trace."""
        checked = check(TraceFile, data, source=source, remedy=_REMEDY)
        meta: dict[str, Any] = dict(checked.get("meta", {}))
        return cls(
            events=checked["events"],
            memory=checked.get("memory", []),
            meta={key: meta[key] for key in data.get("meta", {})},  # in the file's order
        )

    def save(self, path: str | Path) -> None:
        """Write JSON atomically, so a crash never leaves half a trace."""
        p = Path(path)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict()))
        tmp.replace(p)

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        data = read_json(path, what="trace", remedy=_REMEDY)
        return cls.from_dict(data, source=str(path))

    def to_chrome_trace(self) -> dict[str, Any]:
        """Chrome trace-event JSON: one thread per rank, microsecond timestamps."""
        events: list[dict[str, Any]] = []
        for rank in self.ranks:
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": 0,
                    "tid": rank,
                    "args": {"name": f"rank {rank}"},
                }
            )
        for e in self.events:
            events.append(
                {
                    "name": f"{e.stage}{e.kind}{e.mb}",
                    "cat": e.kind,
                    "ph": "X",
                    "pid": 0,
                    "tid": e.rank,
                    "ts": e.start * 1e6,
                    "dur": max(e.duration, 0.0) * 1e6,
                    "args": {
                        "stage": e.stage,
                        "mb": e.mb,
                        "weight_version": e.weight_version,
                        "bytes": e.bytes,
                        "distance": e.distance,
                    },
                }
            )
        for m in self.memory:
            events.append(
                {
                    "ph": "C",
                    "name": f"memory rank {m.rank}",
                    "pid": 0,
                    "tid": m.rank,
                    "ts": m.time * 1e6,
                    "args": {"bytes": m.bytes},
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": self.meta}

    def save_chrome_trace(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_chrome_trace()))
