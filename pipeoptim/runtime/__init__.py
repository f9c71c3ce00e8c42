"""Torch runtime: the Pipeline library, stages, weight prediction, transports, the executor.

The built-in models a ``pipeoptim train`` run trains are not here but in
:mod:`pipeoptim.workloads` (``pipeoptim.workloads.train.train`` runs a ``TrainConfig``),
which imports the runtime; the runtime never imports it."""

from typing import Any

__all__ = ["EvalResult", "FitResult", "Pipeline", "TrainConfig"]

_HOMES = {
    "Pipeline": "pipeline",
    "FitResult": "result",
    "EvalResult": "result",
    "TrainConfig": "config",
}


def __getattr__(name: str) -> Any:
    # Lazy: importing one runtime module (e.g. predict) need not load the whole executor.
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"pipeoptim.runtime.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'pipeoptim.runtime' has no attribute {name!r}")
