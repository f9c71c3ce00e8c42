"""A rank's side of clipping by the pipeline's norm (``optim/global_clip.py``), for the
executor: apart from the norm's arithmetic because it drives the rank's stages and their
shared-weight exchange, which sit above the stage's parts."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from pipeoptim.runtime.model.ties import TieExchange
from pipeoptim.runtime.optim.global_clip import NormBoard, clip_factor
from pipeoptim.runtime.stage.stage import Stage

__all__ = ["PipelineClip"]


class PipelineClip:
    """One rank's side of clipping by the pipeline's norm, for the executor: at the rank's
    first update of a step, its stages' gradients are made final (shared weights summed,
    replicas averaged, unscaled) and their squared norms added to the board; each of its
    stages then scales by the factor of the total. Every synchronous schedule puts a rank's
    updates of a step after all of its backwards of that step, so all of its stages'
    gradients are whole then."""

    def __init__(self, board: NormBoard, max_norm: float, rank: int) -> None:
        self.board, self.max_norm, self.rank = board, max_norm, rank
        self._added = -1  # the step this rank last added its norm for
        self._factor: tuple[int, Tensor] | None = None  # (step, its factor)

    def begin(self) -> None:
        """A segment starts: no step spans two, and the next may go back (a resume)."""
        self._added, self._factor = -1, None

    def added(self, step: int) -> bool:
        """Whether this rank has added its norm of ``step`` (its latest: a rank's updates of
        one step come together, and a later fit may go back to an earlier step)."""
        return step == self._added

    def add(self, step: int, stages: Mapping[int, Stage], ties: TieExchange | None) -> None:
        """Add this rank's squared norm of ``step`` (once; the first call does it)."""
        if self.added(step):
            return
        self._added, self._factor = step, None
        total: Tensor | None = None
        for k in sorted(stages):
            if ties is not None and ties.holds(k):
                ties.exchange(k, step)
            squared = stages[k].clip_norm_squared()
            total = squared if total is None else total + squared.to(total.device)
        assert total is not None  # a rank holds a stage
        self.board.add(step, self.rank, total)

    def ready(self, step: int) -> bool:
        """Whether the factor of ``step`` is known (every rank has added)."""
        return (self._factor is not None and self._factor[0] == step) or self.board.ready(step)

    def factor(self, step: int) -> Tensor:
        """The factor every gradient of ``step`` is scaled by (``clip_factor``)."""
        if self._factor is None or self._factor[0] != step:
            self._factor = (step, clip_factor(self.board.take(step, self.rank), self.max_norm))
        return self._factor[1]
