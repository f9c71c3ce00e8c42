"""Callbacks: a user's code at the fit loop's own points, and the stop a callback may ask for.

A callback is any object with some of the five hooks (``on_fit_start``, ``on_step_end``,
``on_eval_end``, ``on_checkpoint``, ``on_fit_end``); subclass :class:`Callback` to get no-op
defaults. Each hook takes one record of plain values (below) and the ``Pipeline`` itself.

Why the hooks sit where they do: ``on_step_end`` runs where the fit loop already reads the
losses (every ``log_every`` mini-batches and at every segment end), so a callback adds no
host synchronisation; the records carry what is already on the host. Under ``torchrun``
every process calls its own callbacks; the process that holds the last stage (of replica 0)
reads the losses and is the one whose stop counts (:attr:`StepEnd.decides`).

A stop (:meth:`Stop.request`) ends the fit as ``max_steps`` would: the pipeline drains
the mini-batches it has already begun, checkpoints, evaluates and ends. In an asynchronous
pipeline a few mini-batches are in flight when the loss of step t is read, so the fit ends
after the last of them (a synchronous method ends at t itself); ``FitResult.end_step`` says
where, and the weights are those of ``max_steps=end_step`` bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.observe.signals import StageSignals

__all__ = [
    "HOOKS",
    "Callback",
    "CallbackError",
    "Callbacks",
    "CheckpointWritten",
    "EvalEnd",
    "FitEnd",
    "FitStart",
    "StepEnd",
    "Stop",
    "check_callbacks",
]

HOOKS = ("on_fit_start", "on_step_end", "on_eval_end", "on_checkpoint", "on_fit_end")


class CallbackError(RuntimeError):
    """A callback raised: the message names it and the hook; the fit's last checkpoint stays."""


@dataclass
class Stop:
    """A stop asked by a callback (shared by every record of one fit)."""

    reason: str | None = None
    by: str | None = None

    def request(self, reason: str = "a callback asked to stop", by: str = "") -> None:
        if self.reason is None:
            self.reason, self.by = reason, by or None

    @property
    def requested(self) -> bool:
        return self.reason is not None


@dataclass(frozen=True)
class FitStart:
    """The start of a fit: where it starts and ends, and the run's configuration."""

    start_step: int
    end_step: int
    """The step the fit ends at if nothing stops it (mini-batches counted from 0)."""
    batch_size: int
    config: dict[str, Any]
    """Method, stages, micro-batches, optimizer, seed and hyper-parameters: what a logger
    records as the run's hyper-parameters."""
    rank: int
    """This process's first pipeline rank."""
    world: int
    """Processes of the run (1: every stage in one process)."""
    stages: tuple[int, ...]
    """The stages this process holds."""


class _Stoppable:
    """A record whose hook may end the fit."""

    stop: Stop

    def request_stop(self, reason: str = "a callback asked to stop") -> None:
        """End the fit (see the module's notes on where it ends)."""
        self.stop.request(reason)


@dataclass(frozen=True)
class StepEnd(_Stoppable):
    """A log point: mini-batches trained so far and what the fit loop read there."""

    step: int
    """The last mini-batch counted (0-based): the losses read go up to it."""
    losses: Mapping[int, float]
    """The losses read at this log point, by mini-batch (empty on a process that does not
    hold the last stage)."""
    all_losses: Mapping[int, float]
    """Every loss read so far in this run (the newest ``HISTORY``)."""
    samples_per_s: float | None
    """Training samples per second since the last log point (None: not measured here)."""
    tokens_per_s: float | None
    """Target tokens per second (language models: targets counted; None for one target per
    sample, where it equals samples_per_s)."""
    stages: Mapping[int, StageSignals]
    """This process's stages: learning rate, memory, waits, s, closure, weight copies."""
    decides: bool
    """Whether this process's stop counts (it reads the losses: the last stage, replica 0)."""
    stop: Stop = field(repr=False, compare=False, default_factory=Stop)


@dataclass(frozen=True)
class EvalEnd(_Stoppable):
    """An evaluation done (the same values on every process)."""

    step: int
    """Mini-batches trained when it ran."""
    loss: float
    accuracy: float | None
    samples: int
    final: bool
    """The fit's last evaluation (after training ended)."""
    decides: bool
    stop: Stop = field(repr=False, compare=False, default_factory=Stop)


@dataclass(frozen=True)
class CheckpointWritten:
    """A checkpoint written (on the process that wrote its stages' files)."""

    step: int
    directory: str


@dataclass(frozen=True)
class FitEnd:
    """The end of a fit, normal or not."""

    step: int
    """Mini-batches trained."""
    stopped_by: str | None
    """The stop's reason when a callback ended the fit."""
    error: str | None
    """The error that ended the fit (None: it ended normally)."""
    result: Any = None
    """The FitResult (None after an error)."""


class Callback:
    """Base class with a no-op for every hook; override the ones you need.

    ``may_stop``: whether this callback may ask to stop. Loggers never do; a fit with no
    callback that may stop exchanges no stop messages between processes.
    """

    may_stop: bool = True

    def on_fit_start(self, info: FitStart, pipeline: Any) -> None:
        """Before the first mini-batch of a fit (after a resume has loaded)."""

    def on_step_end(self, info: StepEnd, pipeline: Any) -> None:
        """At each log point (``log_every`` mini-batches, and every segment end)."""

    def on_eval_end(self, info: EvalEnd, pipeline: Any) -> None:
        """After each evaluation of the fit (``eval_every`` and the last)."""

    def on_checkpoint(self, info: CheckpointWritten, pipeline: Any) -> None:
        """After a checkpoint is written."""

    def on_fit_end(self, info: FitEnd, pipeline: Any) -> None:
        """At the end of a fit, also after an error (``info.error``)."""


def _name(callback: object) -> str:
    return getattr(callback, "name", None) or type(callback).__name__


def check_callbacks(callbacks: object, what: str = "callbacks") -> list[Any]:
    """The callbacks as a list, refused where one has none of the hooks."""
    if callbacks is None:
        return []
    if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Sequence):
        raise RuntimeConfigError(
            f"{what} takes a list of callback objects (got {type(callbacks).__name__}); "
            f"e.g. {what}=[MyCallback()]"
        )
    for i, cb in enumerate(callbacks):
        if not any(callable(getattr(cb, hook, None)) for hook in HOOKS):
            raise RuntimeConfigError(
                f"{what}[{i}] ({type(cb).__name__}) has none of the hooks {', '.join(HOOKS)}; "
                f"subclass pipeoptim.Callback and override the hooks you need"
            )
    return list(callbacks)


class Callbacks:
    """Calls every callback's hook in order; a callback that raises is named."""

    def __init__(self, callbacks: Sequence[Any], pipeline: Any) -> None:
        self.callbacks = list(callbacks)
        self.pipeline = pipeline

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    @property
    def may_stop(self) -> bool:
        return any(getattr(cb, "may_stop", True) for cb in self.callbacks)

    def call(self, hook: str, info: Any) -> None:
        for cb in self.callbacks:
            method = getattr(cb, hook, None)
            if method is None:
                continue
            stop: Stop | None = getattr(info, "stop", None)
            before = stop.requested if stop is not None else True
            try:
                method(info, self.pipeline)
            except Exception as err:
                raise CallbackError(
                    f"callback {_name(cb)} raised in {hook}: {type(err).__name__}: {err}"
                ) from err
            if stop is not None and not before and stop.requested and stop.by is None:
                stop.by = _name(cb)
