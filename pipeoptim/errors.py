"""Error types raised on bad input.

Every library error is a ``ValueError`` subclass so callers can catch one type; the CLI
prints the message (which states the rule, the values and the fix) and exits non-zero
without a traceback.
"""

from __future__ import annotations

from typing import Any


class PipeoptimError(ValueError):
    """Base class of every error pipeoptim raises on bad input."""


class ScheduleError(PipeoptimError):
    """A schedule breaks a rule (dependency, count, duplicate, deadlock, malformed action)."""


class PlanError(PipeoptimError):
    """A plan, method option or partition request cannot be satisfied."""


class RuntimeConfigError(PipeoptimError):
    """A training run was configured inconsistently (world size, batch size, optimizer...)."""


class StageError(RuntimeConfigError):
    """User code (a layer, the loss, the optimizer or scheduler factory) failed in a stage;
    the message names the stage, the unit and the values."""


class WorkLimitError(PlanError):
    """The requested work (actions, memory, file size) is over a documented limit.

    Raised before anything is built, by :mod:`pipeoptim.plan.limits` (work and memory) and
    :mod:`pipeoptim.jsonfile` (input files); the message gives the estimate, the limit and the
    fix.
    """


class OutputPathError(PipeoptimError):
    """An output path (``--out``, ``--html``, ``--trace``...) cannot be written."""


class TrainingFailedError(PipeoptimError):
    """A run that was configured right failed while it trained: the loss diverged, or a rank
    stopped. Not a configuration error: the message says what happened, at which step or
    rank, and what was kept (the last good checkpoint, the trace)."""


class NonFiniteLossError(TrainingFailedError):
    """The loss became NaN or infinite; training stops at that step. ``partial`` holds the
    run's result up to the stop, where it could be gathered (a ``FitResult``)."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step
        self.partial: Any = None


class RankFailedError(TrainingFailedError):
    """A rank of a multi-process run failed; the message names it."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class PeerLostError(TrainingFailedError):
    """A peer rank stopped answering: it crashed, was killed, or stopped on an error."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer
