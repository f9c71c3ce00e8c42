"""pipeoptim: asynchronous pipeline-parallel training with optimizer-dependent weight prediction.

``from pipeoptim import Pipeline`` is the library entry point; torch loads only when it is
first used, so planning and simulating never import torch.
"""

from typing import Any

__version__ = "0.1.0"
_OBSERVE = (
    "Callback",
    "JsonlLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "StepEnd",
    "EvalEnd",
    "FitStart",
    "FitEnd",
)
__all__ = ["FitResult", "Pipeline", "Plan", *_OBSERVE]


def __getattr__(name: str) -> Any:
    if name in ("Pipeline", "FitResult"):
        from pipeoptim.runtime import pipeline, result

        return getattr(pipeline if name == "Pipeline" else result, name)
    if name in _OBSERVE:
        from pipeoptim.runtime import observe

        return getattr(observe, name)
    if name == "Plan":
        from pipeoptim.plan.plan import Plan

        return Plan
    raise AttributeError(f"module 'pipeoptim' has no attribute {name!r}")
