"""What one process measured, as plain data that travels between processes as JSON.

Apart from the executor, which never builds one: the fit loop fills it, ``launch`` carries
it across processes and ``result`` merges the shares of every rank.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

from pipeoptim.trace import MemorySample, TraceEvent

__all__ = ["RankResult"]


def _dataclass_as_dict(value: Any) -> dict[str, Any]:
    """A dataclass met inside a result's plain values (JSON's fallback), as ``asdict``."""
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


@dataclass
class RankResult:
    """What one process measured; plain data, so it travels as JSON between processes."""

    ranks: list[int]
    steps_per_epoch: int = 0
    skipped_samples: int = 0
    batch_size: int = 0
    start_step: int = 0
    end_step: int = 0
    losses: dict[int, float] = field(default_factory=dict)
    correct: dict[int, int] = field(default_factory=dict)
    targets: dict[int, int] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)
    weight_copies: dict[int, int] = field(default_factory=dict)
    predict_s: dict[int, float] = field(default_factory=dict)
    """Median seconds of a prediction per predicting stage (CPU runs)."""
    recompute_held_bytes: dict[int, int] = field(default_factory=dict)
    """Bytes of Ŵ a predicted forward's recomputed units hold until its backward, per
    stage that holds any (``stage/recompute.py``)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """What the rank knows about the run for the trace (boundaries, threads...)."""
    train_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    events: list[TraceEvent] = field(default_factory=list)
    memory: list[MemorySample] = field(default_factory=list)

    def to_json(self) -> str:
        # field by field, the events as their own dicts: ``asdict`` copies every value
        # deeply, about 11 µs an event (seconds at a fit's end for a long trace)
        plain = {f.name: getattr(self, f.name) for f in fields(self)}
        plain["events"] = [vars(e) for e in self.events]
        plain["memory"] = [vars(m) for m in self.memory]
        return json.dumps(plain, default=_dataclass_as_dict)

    @classmethod
    def from_json(cls, text: str | bytes) -> RankResult:
        d = json.loads(text)
        keys = (
            "losses",
            "correct",
            "targets",
            "weight_copies",
            "predict_s",
            "recompute_held_bytes",
        )
        for key in keys:
            d[key] = {int(k): v for k, v in d[key].items()}
        d["events"] = [TraceEvent(**e) for e in d["events"]]
        d["memory"] = [MemorySample(**m) for m in d["memory"]]
        return cls(**d)
