"""Error types raised on bad input.

Every library error is a ``ValueError`` subclass so callers can catch one type; the CLI
prints the message (which states the rule, the values and the fix) and exits non-zero
without a traceback.
"""

from __future__ import annotations


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
