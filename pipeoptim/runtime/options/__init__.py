"""One tree of a Pipeline run's options, grouped by concern, and the views built from it.

``PipelineConfig`` (``tree.py``) holds the groups (``groups.py``): ``model``, ``schedule``,
``optim``, ``precision``, ``memory``, ``comm``, ``checkpoint``, ``observe``, each a frozen
dataclass whose fields say type, default and meaning and which checks itself. ``Pipeline``
takes the tree (``options=``) or the same options as keywords (each keyword is a field
name); ``pipeoptim train``'s ``TrainConfig`` takes its shared options' defaults and checks
from the groups and builds the tree (``TrainConfig.options``), and a Plan
file is its ``plan`` (``PipelineConfig.from_plan``). ``resolve.py`` resolves the tree once
against the plan, method and model into the views the parts read (``built.py``:
``StageOptions``, ``PipelineOptions``, ``FitOptions``).

The names load when first used: ``runtime/config.py`` imports the tree while the views'
modules (which build stages, and import the config's users) are not loaded yet.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeoptim.runtime.options.built import FitOptions, PipelineOptions, StageOptions
    from pipeoptim.runtime.options.groups import (
        CheckpointOptions,
        CommOptions,
        MemoryOptions,
        ModelOptions,
        ObserveOptions,
        OptimizerOptions,
        PrecisionOptions,
        ScheduleOptions,
    )
    from pipeoptim.runtime.options.tree import GROUPS, PipelineConfig, keyword_homes

__all__ = [
    "GROUPS",
    "CheckpointOptions",
    "CommOptions",
    "FitOptions",
    "MemoryOptions",
    "ModelOptions",
    "ObserveOptions",
    "OptimizerOptions",
    "PipelineConfig",
    "PipelineOptions",
    "PrecisionOptions",
    "ScheduleOptions",
    "StageOptions",
    "keyword_homes",
]

_MODULES = {
    **dict.fromkeys(("FitOptions", "PipelineOptions", "StageOptions"), "built"),
    **dict.fromkeys(("GROUPS", "PipelineConfig", "keyword_homes"), "tree"),
}
"""Each name's module (the rest: ``groups``)."""


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_MODULES.get(name, 'groups')}")
    return getattr(module, name)
