"""Watching a fit: callbacks at the fit loop's own points, the pipeline's signals per stage,
and the loggers built on them."""

from pipeoptim.runtime.observe.callbacks import (
    Callback,
    CallbackError,
    CheckpointWritten,
    EvalEnd,
    FitEnd,
    FitStart,
    StepEnd,
)
from pipeoptim.runtime.observe.loggers import (
    JsonlLogger,
    Logger,
    TensorBoardLogger,
    WandbLogger,
    logger_from_spec,
)
from pipeoptim.runtime.observe.signals import StageSignals

__all__ = [
    "Callback",
    "CallbackError",
    "CheckpointWritten",
    "EvalEnd",
    "FitEnd",
    "FitStart",
    "JsonlLogger",
    "Logger",
    "StageSignals",
    "StepEnd",
    "TensorBoardLogger",
    "WandbLogger",
    "logger_from_spec",
]
