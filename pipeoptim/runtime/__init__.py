"""Torch runtime: stages, weight prediction, transport and the executor that runs a plan."""

from typing import Any

__all__ = ["TrainConfig", "TrainResult", "train"]


def __getattr__(name: str) -> Any:
    # Lazy: importing one runtime module (e.g. predict) need not load the whole executor.
    if name in __all__:
        from pipeoptim.runtime import launch

        return getattr(launch, name)
    raise AttributeError(f"module 'pipeoptim.runtime' has no attribute {name!r}")
