"""The root of the options tree: one :class:`PipelineConfig` that ``Pipeline``, ``pipeoptim
train`` and a Plan file all build.

Why a tree with flat keywords: a user's script reads best as ``Pipeline(layers, stages=4,
amp="bf16")``, while the code that uses an option should read it from the group it belongs
to. Every option's keyword is its field name in its group, and the names are unique across
the groups, so the keywords map onto the tree without a table to keep in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.plan import Plan
from pipeoptim.runtime.options.groups import (
    CheckpointOptions,
    CommOptions,
    MemoryOptions,
    ModelOptions,
    ObserveOptions,
    OptimizerOptions,
    PrecisionOptions,
    ScheduleOptions,
    check_seed,
)

__all__ = ["GROUPS", "PipelineConfig", "keyword_homes", "option_default"]

GROUPS: dict[str, type] = {
    "model": ModelOptions,
    "schedule": ScheduleOptions,
    "optim": OptimizerOptions,
    "precision": PrecisionOptions,
    "memory": MemoryOptions,
    "comm": CommOptions,
    "checkpoint": CheckpointOptions,
    "observe": ObserveOptions,
}
"""The tree's groups by their attribute on :class:`PipelineConfig`."""

ROOT_KEYWORDS = ("plan", "seed")
"""The options that belong to no one group."""


def keyword_homes() -> dict[str, str]:
    """Every keyword ``Pipeline`` takes -> the group that holds it ('' for the root)."""
    homes = dict.fromkeys(ROOT_KEYWORDS, "")
    for group, kind in GROUPS.items():
        for f in fields(kind):
            assert f.name not in homes, f"option {f.name} is in two groups"
            homes[f.name] = group
    return homes


_HOMES = keyword_homes()


def option_default(name: str) -> Any:
    """The default of the option ``name`` (a ``Pipeline`` keyword), as its group defines it:
    what a front end that holds the option flat (``pipeoptim train``'s ``TrainConfig``)
    defaults it to, so no default is written twice."""
    home = GROUPS[_HOMES[name]] if _HOMES[name] else PipelineConfig
    (default,) = (f.default for f in fields(home) if f.name == name)
    return default


@dataclass(frozen=True)
class PipelineConfig:
    """Every option of a Pipeline run, grouped by concern; checked when built.

    ``Pipeline(layers, options=PipelineConfig(schedule=ScheduleOptions(stages=4)))`` and
    ``Pipeline(layers, stages=4)`` build the same run; :meth:`with_keywords` is the bridge.
    """

    plan: Plan | None = None
    """A Plan (``pipeoptim plan``): its method, sizes, boundaries, optimizer spec, recompute,
    optimizer sharding and replicas; the options set here override it."""
    seed: int = 0
    """The run's seed: initial weights, data order, and stage k's random stream (seeded
    ``seed * 1000 + k + 1``)."""
    model: ModelOptions = field(default_factory=ModelOptions)
    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)
    optim: OptimizerOptions = field(default_factory=OptimizerOptions)
    precision: PrecisionOptions = field(default_factory=PrecisionOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    comm: CommOptions = field(default_factory=CommOptions)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    observe: ObserveOptions = field(default_factory=ObserveOptions)

    def __post_init__(self) -> None:
        for name, kind in GROUPS.items():
            if not isinstance(getattr(self, name), kind):
                raise RuntimeConfigError(
                    f"PipelineConfig.{name} must be a {kind.__name__} (got "
                    f"{type(getattr(self, name)).__name__}); e.g. {name}={kind.__name__}()"
                )
        if self.plan is not None and not isinstance(self.plan, Plan):
            raise RuntimeConfigError(
                f"plan must be a pipeoptim Plan (got {type(self.plan).__name__}); load one "
                f"with Plan.load('plan.json')"
            )
        check_seed(self.seed)
        transport = self.comm.transport
        if self.schedule.forwards_first and transport != "local":
            raise RuntimeConfigError(
                f"forwards_first orders the ranks that one process runs together "
                f"(transport='local'); under transport={transport!r} each rank runs in a "
                f"process of its own, where it would only hold more activations: leave it "
                f"off there (drop forwards_first)"
            )

    @classmethod
    def from_plan(cls, plan: Plan, **keywords: object) -> PipelineConfig:
        """The tree of a Plan file (what ``Pipeline(plan=...)`` runs), with ``keywords``
        over it."""
        return cls(plan=plan).with_keywords(**keywords)

    def with_keywords(self, **keywords: object) -> PipelineConfig:
        """This tree with the options named by ``Pipeline``'s keywords replaced; an unknown
        keyword is refused as Python refuses one, naming the options there are."""
        unknown = sorted(set(keywords) - set(_HOMES))
        if unknown:
            raise TypeError(
                f"Pipeline() got an unexpected keyword argument {unknown[0]!r}; its options "
                f"are: {', '.join(sorted(_HOMES))} (see PipelineConfig)"
            )
        by_group: dict[str, dict[str, object]] = {}
        for name, value in keywords.items():
            by_group.setdefault(_HOMES[name], {})[name] = value
        root: dict[str, Any] = dict(by_group.pop("", {}))
        for group, changed in by_group.items():
            root[group] = replace(getattr(self, group), **changed)
        return replace(self, **root) if root else self

    def keywords(self) -> dict[str, Any]:
        """The tree as ``Pipeline``'s keywords (every option, defaults included)."""
        flat: dict[str, Any] = {name: getattr(self, name) for name in ROOT_KEYWORDS}
        for group in GROUPS:
            held = getattr(self, group)
            flat.update({f.name: getattr(held, f.name) for f in fields(held)})
        return flat
