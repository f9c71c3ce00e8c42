"""Prediction closure: how much of the stale weight distance a prediction removes.

For a forward that runs on predicted weights Ŵ (pipeoptim, spectrain, xpipe with s > 0),
the stale distance is ‖W_forward − W_backward‖: how far the live weights at the forward are
from the weights the same mini-batch meets at its backward. The prediction leaves
‖Ŵ − W_backward‖ of it. Their ratio (the *closure ratio*) is 0 for a perfect prediction and
1 for none; ``1 − ratio`` is the share of the gap the prediction closed.

The probe keeps two flat copies of a stage's weights per predicted forward in flight, so it
is for studies on small models (``Pipeline.measure_prediction_closure``), not production runs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ClosureSample", "PredictionClosure", "StageClosure"]


@dataclass(frozen=True)
class ClosureSample:
    """One predicted forward, measured at its backward."""

    stage: int
    distance: int
    """s: the updates between the forward and the backward the predictor used."""
    predicted_gap: float
    """‖Ŵ − W_backward‖."""
    stale_gap: float
    """‖W_forward − W_backward‖."""

    @property
    def ratio(self) -> float:
        """‖Ŵ − W_b‖ / ‖W_f − W_b‖ (nan where the weights did not move)."""
        return self.predicted_gap / self.stale_gap if self.stale_gap > 0 else math.nan


@dataclass(frozen=True)
class StageClosure:
    """The closure of one stage over a run."""

    stage: int
    samples: int
    max_distance: int
    median_ratio: float
    """Median of the per-forward ratios ‖Ŵ − W_b‖ / ‖W_f − W_b‖."""
    mean_ratio: float

    @property
    def closed(self) -> float:
        """Share of the stale distance the prediction removed (1 − median ratio)."""
        return 1.0 - self.median_ratio


def _flat(tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


class PredictionClosure:
    """Collects :class:`ClosureSample` s from the stages it is attached to.

    A stage calls :meth:`forward` right after it wrote Ŵ (with the live weights set aside)
    and :meth:`backward` before the backward of the same micro-batch.
    """

    def __init__(self) -> None:
        self.samples: list[ClosureSample] = []
        self._open: dict[tuple[int, int], tuple[int, Tensor, Tensor]] = {}

    def forward(
        self,
        stage: int,
        mb: int,
        distance: int,
        predicted: Sequence[Tensor],
        live: Sequence[Tensor],
    ) -> None:
        self._open[(stage, mb)] = (distance, _flat(predicted), _flat(live))

    def backward(self, stage: int, mb: int, live: Sequence[Tensor]) -> None:
        opened = self._open.pop((stage, mb), None)
        if opened is None:
            return
        distance, predicted, at_forward = opened
        at_backward = _flat(live)
        self.samples.append(
            ClosureSample(
                stage,
                distance,
                float(torch.linalg.vector_norm(predicted - at_backward)),
                float(torch.linalg.vector_norm(at_forward - at_backward)),
            )
        )

    def summary(self) -> list[StageClosure]:
        """Per stage, over every predicted forward whose weights moved before its backward."""
        by_stage: dict[int, list[ClosureSample]] = {}
        for sample in self.samples:
            if sample.stale_gap > 0:
                by_stage.setdefault(sample.stage, []).append(sample)
        out = []
        for stage, rows in sorted(by_stage.items()):
            ratios = [r.ratio for r in rows]
            out.append(
                StageClosure(
                    stage,
                    len(rows),
                    max(r.distance for r in rows),
                    statistics.median(ratios),
                    statistics.fmean(ratios),
                )
            )
        return out
