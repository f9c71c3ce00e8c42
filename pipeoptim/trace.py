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
from typing import Any

from pipeoptim.jsonfile import read_json
from pipeoptim.schema import Dict, Int, List, Num, Obj, Opt, Str, check_header, validate

TRACE_FORMAT = "pipeoptim-trace"
TRACE_VERSION = 1
_REMEDY = "write one with --trace FILE from `pipeoptim simulate` or `pipeoptim train`"

_EVENT_SCHEMA = Obj(
    {
        "rank": Int(minimum=0),
        "stage": Int(minimum=0),
        "kind": Str(),
        "mb": Int(),
        "start": Num(),
        "end": Num(),
        "weight_version": Int(),
        "bytes": Int(minimum=0),
        "distance": Int(),
    },
    required=("rank", "stage", "kind", "mb", "start", "end"),
    extra=False,
)
_MEMORY_SCHEMA = Obj(
    {"rank": Int(minimum=0), "time": Num(), "bytes": Int(minimum=0), "detail": Dict(Int())},
    required=("rank", "time", "bytes"),
    extra=False,
)
_META_SCHEMA = Obj(
    {
        "method": Opt(Str()),
        "source": Opt(Str()),
        "transport": Opt(Str()),
        "num_ranks": Opt(Int(minimum=0)),
        "num_stages": Opt(Int(minimum=0)),
        "micro_batches": Opt(Int(minimum=1)),
        "mini_batches": Opt(Int(minimum=0)),
        "virtual_stages": Opt(Int(minimum=1)),
        "batch_size": Opt(Num(minimum=0)),
        "samples_per_micro_batch": Opt(Num(minimum=0)),
        "weight_copies": Opt(Dict(Int(), int_keys=True)),
        "predict_s": Opt(Dict(Num(minimum=0), int_keys=True)),
        "plan": Opt(Dict()),
    }
)
TRACE_SCHEMA = Obj(
    {"meta": _META_SCHEMA, "events": List(_EVENT_SCHEMA), "memory": List(_MEMORY_SCHEMA)},
    required=("events",),
)
"""The trace file's fields and types; ``meta`` may hold further keys of any type."""


@dataclass(frozen=True)
class TraceEvent:
    """One executed action."""

    rank: int
    """Process (device) that ran it."""
    stage: int
    """Pipeline stage the action belongs to."""
    kind: str
    """Action kind code: F, B, U, the halves of a split backward (I, W), or a communication
    kind (SEND_F, RECV_F, SEND_B, RECV_B)."""
    mb: int
    """Global micro-batch id; for U the mini-batch index."""
    start: float
    """Start time in seconds from the run's start."""
    end: float
    """End time in seconds from the run's start."""
    weight_version: int = 0
    """Weight version the action used (for a predicted forward: the version it predicts)."""
    bytes: int = 0
    """Bytes moved (communication) or allocated (compute) by the action; 0 if unknown."""
    distance: int = 0
    """For a forward: updates between it and its backward (prediction distance s)."""

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class MemorySample:
    """Memory held by one rank at one time."""

    rank: int
    time: float
    bytes: int
    detail: dict[str, int] = field(default_factory=dict)
    """Breakdown (weights, stash, gradients, optimizer, activations), where known."""


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
        """Check ``data`` against :data:`TRACE_SCHEMA`, then build the trace."""
        check_header(
            data,
            fmt=TRACE_FORMAT,
            versions=(TRACE_VERSION,),
            source=source,
            what="pipeoptim trace",
            remedy=_REMEDY,
        )
        checked = validate(data, TRACE_SCHEMA, source=source, remedy=_REMEDY)
        return cls(
            events=[TraceEvent(**e) for e in checked["events"]],
            memory=[MemorySample(**m) for m in checked.get("memory", [])],
            meta=dict(checked.get("meta", {})),
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
