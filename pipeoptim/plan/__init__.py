"""Everything about a plan: actions, schedules, methods, versions, validation, partitions.

Pure Python: this package never imports torch, so planning works where torch does not.
"""

from pipeoptim.plan.actions import Action, Kind, Schedule
from pipeoptim.plan.methods import METHODS, Method, WeightPolicy, build_schedule, get_method
from pipeoptim.plan.versions import VersionReport, analyze_versions

__all__ = [
    "METHODS",
    "Action",
    "Kind",
    "Method",
    "Schedule",
    "VersionReport",
    "WeightPolicy",
    "analyze_versions",
    "build_schedule",
    "get_method",
]
