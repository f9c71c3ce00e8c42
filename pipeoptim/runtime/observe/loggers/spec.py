"""``--log SCHEME:TARGET``: a logger from its command-line text."""

from __future__ import annotations

from collections.abc import Callable

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.observe.loggers.base import Logger
from pipeoptim.runtime.observe.loggers.jsonl import JsonlLogger
from pipeoptim.runtime.observe.loggers.tensorboard import TensorBoardLogger
from pipeoptim.runtime.observe.loggers.wandb import WandbLogger

__all__ = ["LOGGERS", "check_logger_spec", "logger_from_spec"]

LOGGERS: dict[str, tuple[str, Callable[[str], Logger]]] = {
    "tensorboard": ("DIR", TensorBoardLogger),
    "wandb": ("PROJECT", WandbLogger),
    "jsonl": ("FILE", JsonlLogger),
}
"""Scheme -> (what its target is, the logger it builds)."""


def _forms() -> str:
    return ", ".join(f"{scheme}:{target}" for scheme, (target, _) in LOGGERS.items())


def check_logger_spec(spec: str) -> tuple[str, str]:
    """(scheme, target) of ``spec``, refused where it names no logger or no target."""
    scheme, sep, target = spec.partition(":")
    if not sep or scheme not in LOGGERS:
        raise RuntimeConfigError(
            f"unknown logger {spec!r}; use one of {_forms()} (--log is repeatable)"
        )
    what = LOGGERS[scheme][0]
    if not target.strip():
        raise RuntimeConfigError(
            f"--log {scheme}: needs a {what} after the colon ({scheme}:{what})"
        )
    return scheme, target


def logger_from_spec(spec: str) -> Logger:
    """The logger ``spec`` names; its package and target are checked now, before training."""
    scheme, target = check_logger_spec(spec)
    return LOGGERS[scheme][1](target)
