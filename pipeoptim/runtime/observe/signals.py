"""The pipeline's own signals, per stage, as a log point reads them: plain numbers already on
the host (nothing here synchronises with a device).

What each is for a user of asynchronous methods: the learning rate the stage steps with;
the bytes it holds (by the stage's own count, or the allocator's on CUDA); how long its
rank waited for messages since the last log point (a stage starved by its neighbours);
the prediction distance s of its last forward (how far ahead its weights were guessed);
the measured closure of the prediction, where ``Pipeline.measure_prediction_closure`` is
on (how much of the staleness the guess removed: 1 is all of it); the weight copies it
holds (live, stashed versions, the prediction buffer); and the updates it has made.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["StageSignals", "read_learning_rate", "scalar_items"]


@dataclass(frozen=True)
class StageSignals:
    """One stage at a log point."""

    stage: int
    rank: int
    lr: float | None
    """The learning rate of the stage's first parameter group (None: no optimizer)."""
    memory_bytes: int
    """Bytes the stage holds now (weights, stash, optimizer, activations...)."""
    wait_s: float
    """Seconds this stage's rank waited for messages since the last log point."""
    distance: int
    """The prediction distance s of the stage's last forward (0: it does not predict)."""
    closure: float | None
    """Median measured closure of the stage's predictions so far (None: not measured)."""
    weight_copies: int
    """Weight copies held now (live ones included)."""
    updates: int
    """Updates the stage has made in the run."""

    def scalars(self) -> dict[str, float]:
        """The numbers as ``stage{k}/name`` scalars (the ones that are set)."""
        out: dict[str, float] = {}
        for key, value in asdict(self).items():
            if key in ("stage", "rank") or value is None:
                continue
            out[f"stage{self.stage}/{key}"] = float(value)
        return out


def read_learning_rate(optimizer: Any) -> float | None:
    """The first group's learning rate, where it is a host number (a CUDA tensor lr, of a
    capturable optimizer, would cost a synchronisation: left out)."""
    if optimizer is None or not getattr(optimizer, "param_groups", None):
        return None
    lr = optimizer.param_groups[0].get("lr")
    if isinstance(lr, torch.Tensor):
        return float(lr) if lr.device.type == "cpu" else None
    return float(lr) if isinstance(lr, (int, float)) else None


def scalar_items(values: dict[str, float | None]) -> dict[str, float]:
    """The set values of a flat name -> number mapping."""
    return {k: float(v) for k, v in values.items() if v is not None}
