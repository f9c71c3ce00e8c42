"""What every logger shares: the records turned into named scalars at steps, and the file
each process writes (under ``torchrun`` each process logs its own stages to a file of its
own, so no two processes write one file).

Scalar names: ``train/loss`` (at each mini-batch whose loss was read), ``train/samples_per_s``
and ``train/tokens_per_s``, ``stage{k}/lr``, ``stage{k}/memory_bytes``, ``stage{k}/wait_s``,
``stage{k}/distance``, ``stage{k}/closure`` (where measured), ``stage{k}/weight_copies``,
``stage{k}/updates`` (at the log point's step), ``eval/loss`` and ``eval/accuracy``. Steps
are the fit's mini-batch numbers (0-based), the keys of ``FitResult``'s losses.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.observe.callbacks import (
    Callback,
    CheckpointWritten,
    EvalEnd,
    FitEnd,
    FitStart,
    StepEnd,
)
from pipeoptim.runtime.observe.signals import scalar_items

__all__ = ["Logger", "check_writable_dir", "flat_config", "per_process_path", "step_scalars"]


def check_writable_dir(directory: Path, what: str) -> Path:
    """Make ``directory`` and check a file can be written there, before training starts."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".pipeoptim-write-check-"):
            pass
    except OSError as err:
        raise RuntimeConfigError(
            f"{what}: cannot write to {directory} ({err.strerror or err}); give a directory "
            f"this process can create and write"
        ) from None
    return directory


def per_process_path(path: Path, rank: int, world: int, *, folder: bool) -> Path:
    """``path`` itself in one process; with several, one per process (``rank{r}``)."""
    if world <= 1:
        return path
    if folder:
        return path / f"rank{rank}"
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def step_scalars(info: StepEnd) -> dict[str, float]:
    """The scalars of a log point at its step (the losses go at their own steps)."""
    values = scalar_items({"train/samples_per_s": info.samples_per_s})
    values.update(scalar_items({"train/tokens_per_s": info.tokens_per_s}))
    for signals in info.stages.values():
        values.update(signals.scalars())
    return values


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """The configuration as hyper-parameters: numbers, strings and booleans; anything else
    as its text (a plan's boundaries, a list of stages)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in flat_config(value).items()})
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[key] = "None" if value is None else value
        else:
            out[key] = str(value)
    return out


class Logger(Callback):
    """A callback that writes the fit's records somewhere; never asks to stop.

    Subclasses implement :meth:`open`, :meth:`write_scalars`, :meth:`close` and may extend
    the other hooks."""

    may_stop = False
    scheme = ""

    def __init__(self) -> None:
        self.is_open = False

    # -- what a subclass writes --------------------------------------------------------------
    def open(self, info: FitStart) -> None:
        raise NotImplementedError

    def write_scalars(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    # -- the hooks -------------------------------------------------------------------------
    def on_fit_start(self, info: FitStart, pipeline: Any) -> None:
        self.open(info)
        self.is_open = True

    def on_step_end(self, info: StepEnd, pipeline: Any) -> None:
        for step, loss in info.losses.items():
            self.write_scalars(step, {"train/loss": loss})
        values = step_scalars(info)
        if values:
            self.write_scalars(info.step, values)

    def on_eval_end(self, info: EvalEnd, pipeline: Any) -> None:
        values = scalar_items({"eval/loss": info.loss, "eval/accuracy": info.accuracy})
        self.write_scalars(info.step, values)

    def on_checkpoint(self, info: CheckpointWritten, pipeline: Any) -> None:
        return None

    def on_fit_end(self, info: FitEnd, pipeline: Any) -> None:
        if self.is_open:
            self.is_open = False
            self.close()
