"""A stage's prediction Ŵ: written into the prediction buffer, or kept for one forward.

Why its own module: a predicting method's forward runs on ``Ŵ = W - lr·s·Δ`` rather than the
live weights (docs/design.md, "Weight-version semantics"). Between two updates Ŵ depends on
the distance s alone, so the forwards that predict the same distance share one write into the
stage's one prediction buffer; a predicted backward keeps its own Ŵ instead. The predictor
(:mod:`~pipeoptim.runtime.optim.predict`) writes in the order of the optimizer's param
groups, with the learning rates of the next updates under the scheduler; here the stage's
weights are put in that order and the writes are timed for calibration.
"""

from __future__ import annotations

import statistics
import time

from torch import Tensor

from pipeoptim.runtime.stage.fields import StageFields

__all__ = ["StagePrediction"]


class StagePrediction(StageFields):
    """The prediction Ŵ a predicted forward of the stage reads."""

    def _lrs(self, s: int) -> list[list[float]] | None:
        """Learning rates of the next s updates under the scheduler (None: use lr·s)."""
        if self.updater is None:
            return None
        # τ of each update the prediction looks ahead to: a correction may rescale its rate
        return self.updater.future_lrs(s, [self._delays.get(self.version + i, 0) for i in range(s)])

    def _write_prediction(self, s: int) -> list[Tensor]:
        """Ŵ in the stage's prediction buffer (the one extra weight copy, reused). Between
        two updates Ŵ depends on s alone (the weights, the optimizer state and the rates of
        the next updates stand still), so the micro-batches that predict the same distance
        (XPipe's, of one mini-batch) share one write."""
        assert self.predictor is not None
        key = (self._updates_before_segment + self.weights.current, s)
        buffer = self.weights.prediction_buffer()
        if key == self._prediction_key:
            return buffer
        timed = self.device.type == "cpu"  # on CUDA reading a clock here would need a sync
        started = time.perf_counter() if timed else 0.0
        kept = self.predictor.kept_computations
        self.predictor.predict_into(self._in_group_order(buffer), s, self._lrs(s))
        if self.predictor.kept_computations != kept:
            self.memory_count.stale()  # a newly kept Δ counts in the predictor's bytes
        if timed:
            self.prediction_seconds.append(time.perf_counter() - started)
        self._prediction_key = key
        return buffer

    def _held_prediction(self, s: int) -> list[Tensor]:
        assert self.predictor is not None
        predicted = self.weights.held_copy()
        self.predictor.predict_into(self._in_group_order(predicted), s, self._lrs(s))
        return predicted

    def _in_group_order(self, tensors: list[Tensor]) -> list[Tensor]:
        """``tensors`` (one per parameter, in the stage's order) in the order of the
        optimizer's param groups, which a predictor writes in: a factory may group the
        parameters in any order (decay and no-decay groups, Muon's matrices first)."""
        if self._group_order is None:
            assert self.optimizer is not None
            position = {id(p): i for i, p in enumerate(self._params)}
            self._group_order = [
                position[id(p)] for g in self.optimizer.param_groups for p in g["params"]
            ]
        return [tensors[i] for i in self._group_order]

    @property
    def prediction_s(self) -> float | None:
        """Median seconds a recent predicted forward spent writing Ŵ (CPU only), or None
        when none was timed."""
        times = self.prediction_seconds
        return statistics.median(times) if times else None
