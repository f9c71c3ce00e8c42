"""One tree of a Pipeline run's options, grouped by concern, and the views built from it.

``PipelineConfig`` (``tree.py``) holds the groups (``groups.py``): ``model``, ``schedule``,
``optim``, ``precision``, ``memory``, ``comm``, ``checkpoint``, ``observe``, each a frozen
dataclass whose fields say type, default and meaning and which checks itself. ``Pipeline``
takes the tree (``options=``) or the same options as keywords (each keyword is a field
name); ``pipeoptim train`` builds it (``PipelineConfig.from_train_config``), and a Plan
file is its ``plan`` (``PipelineConfig.from_plan``). ``resolve.py`` resolves the tree once
against the plan, method and model into the views the parts read (``built.py``:
``StageOptions``, ``PipelineOptions``, ``FitOptions``).
"""

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
