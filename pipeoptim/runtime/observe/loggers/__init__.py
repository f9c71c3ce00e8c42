"""Loggers: callbacks that write the fit's records to TensorBoard, W&B or JSON lines (one file
a scheme; a new one is a new file here and a line in ``spec.LOGGERS``)."""

from pipeoptim.runtime.observe.loggers.base import Logger
from pipeoptim.runtime.observe.loggers.jsonl import JsonlLogger
from pipeoptim.runtime.observe.loggers.spec import LOGGERS, logger_from_spec
from pipeoptim.runtime.observe.loggers.tensorboard import TensorBoardLogger
from pipeoptim.runtime.observe.loggers.wandb import WandbLogger

__all__ = [
    "LOGGERS",
    "JsonlLogger",
    "Logger",
    "TensorBoardLogger",
    "WandbLogger",
    "logger_from_spec",
]
