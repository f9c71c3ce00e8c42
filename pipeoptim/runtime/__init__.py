"""Torch runtime: the Pipeline library, stages, weight prediction, transports, the executor."""

from typing import Any

__all__ = ["EvalResult", "FitResult", "Pipeline", "TrainConfig", "train"]

_HOMES = {
    "Pipeline": "pipeline",
    "FitResult": "result",
    "EvalResult": "result",
    "TrainConfig": "config",
    "train": "launch",
}


def __getattr__(name: str) -> Any:
    # Lazy: importing one runtime module (e.g. predict) need not load the whole executor.
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"pipeoptim.runtime.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'pipeoptim.runtime' has no attribute {name!r}")
