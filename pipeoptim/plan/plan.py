"""The Plan: the one unit the simulator, the runtime and the planner all consume.

It names the method and its options, the pipeline's size, the optimizer, the stage
boundaries (which layers each stage holds) and, where the planner made it, the stage
graph with costs. It saves to and loads from JSON.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StrictStr, with_config
from typing_extensions import Required, TypedDict

from pipeoptim.errors import PlanError
from pipeoptim.filecheck import (
    NonNegativeWhole,
    Number,
    PositiveWhole,
    Whole,
    WholeNumber,
    check,
    what,
)
from pipeoptim.jsonfile import read_json
from pipeoptim.plan.graph import StageGraphFile
from pipeoptim.plan.methods import Method, get_method
from pipeoptim.plan.optimizer_families import FAMILY_NAMES
from pipeoptim.plan.recompute import (
    RecomputeEntry,
    check_recompute_entries,
    check_shard_optimizer,
)
from pipeoptim.plan.replicas import check_replicas
from pipeoptim.plan.shape import Shape

PLAN_FORMAT = "pipeoptim-plan"
PLAN_VERSION = 1
OPTIMIZER_FAMILIES = FAMILY_NAMES
"""The optimizer family names (``plan.optimizer_families``), in the order the CLI lists them."""
_REMEDY = "make one with `pipeoptim plan ... --out FILE`"


@with_config(ConfigDict(title="pipeoptim plan", extra="allow"))
class PlanHeader(TypedDict, total=False):
    """What makes a JSON object a plan file (checked before its other keys)."""

    format: Required[Literal["pipeoptim-plan"]]
    version: Annotated[int, Whole(one_of=(PLAN_VERSION,))]


@with_config(ConfigDict(extra="forbid"))
class OptimizerFile(TypedDict, total=False):
    """A plan file's ``optimizer`` (the fields of :class:`OptimizerSpec`)."""

    family: StrictStr
    lr: Number
    options: dict[str, Any]


@with_config(ConfigDict(title="pipeoptim plan", extra="forbid"))
class PlanFile(PlanHeader, total=False):
    """A plan file: the fields and types of :class:`Plan` (which documents each field)."""

    method: Required[StrictStr]
    num_stages: Required[PositiveWhole]
    micro_batches: PositiveWhole
    mini_batches: PositiveWhole | None
    virtual_stages: PositiveWhole
    data_parallel: PositiveWhole
    prediction_offset: WholeNumber
    optimizer: OptimizerFile
    model: StrictStr | None
    batch_size: PositiveWhole | None
    boundaries: (
        Annotated[
            list[Annotated[list[NonNegativeWhole], Field(min_length=2, max_length=2)]],
            what("a list of [start, end] layer ranges"),
        ]
        | None
    )
    stage_graph: StageGraphFile | None
    devices: list[StrictStr] | None
    recompute: list[StrictStr | list[StrictStr | NonNegativeWhole]] | None
    shard_optimizer: bool
    notes: dict[str, Any]


@dataclass
class OptimizerSpec:
    """The optimizer every stage builds (the user's torch.optim class and settings)."""

    family: str = "sgd"
    """One of sgd, adam, adamw, rmsprop, nadam, muon (Muon on the 2-D weight matrices, AdamW
    on the rest), basis-rotation (Adam in each matrix's gradient eigenbasis, Adam on the
    rest)."""
    lr: float = 0.02
    """Learning rate (0.02 suits SGD with momentum 0.9; Adam-family runs want ~1e-3)."""
    options: dict[str, float | bool] = field(default_factory=dict)
    """Further keyword arguments to the torch.optim constructor (momentum, weight_decay...);
    ``beta1`` and ``beta2`` set one half each of Adam's kin's ``betas`` pair (AsyncPP's
    NAdam: ``{"beta1": 0.99}``)."""

    def __post_init__(self) -> None:
        if self.family not in OPTIMIZER_FAMILIES:
            raise PlanError(
                f"unknown optimizer {self.family!r}; choose one of: {', '.join(OPTIMIZER_FAMILIES)}"
            )
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise PlanError(
                f"the learning rate must be a positive finite number (got {self.lr}); give "
                f"e.g. lr=0.05 (pipeoptim train: --lr 0.05)"
            )


@dataclass
class Plan:
    """Everything needed to simulate or run one pipeline configuration."""

    method: str
    """Method name from the registry (``pipeoptim methods``)."""
    num_stages: int
    """Pipeline ranks P (one process/device each)."""
    micro_batches: int = 1
    """Micro-batches per mini-batch (1 for methods that do not micro-batch)."""
    mini_batches: int | None = None
    """Mini-batches in the run; None lets the consumer decide (epochs for the runtime)."""
    virtual_stages: int = 1
    """Stages per rank (interleaved-1f1b only)."""
    data_parallel: int = 1
    """Replicas D of the whole pipeline (PP x DP): D x P processes, the D replicas of each
    stage average their gradients (all-reduce) before every update, and each replica trains
    on its own 1/D of every batch. Global rank = replica x P + pipeline rank."""
    prediction_offset: int = 0
    """Added to the derived prediction distance s (1 reproduces the reference code's D-rank)."""
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    """Optimizer family and hyper-parameters."""
    model: str | None = None
    """Built-in model name or ``module:factory`` the plan was made for."""
    batch_size: int | None = None
    """Samples per mini-batch."""
    boundaries: list[tuple[int, int]] | None = None
    """Half-open layer ranges, one per stage; None splits layers evenly."""
    stage_graph: dict[str, Any] | None = None
    """Stage graph with costs (``plan.graph.stage_graph_to_dict``), where a planner made one."""
    devices: list[str] | None = None
    """Device per rank (``cpu``, ``cuda:0``...); None picks cuda where present, else cpu."""
    recompute: list[RecomputeEntry] | None = None
    """Activation recomputation, one entry per stage: ``"none"``, ``"full"`` or a list of
    unit selectors (``plan.recompute``); None recomputes nothing."""
    shard_optimizer: bool = False
    """Shard each stage's optimizer state across its D data-parallel replicas (ZeRO-1);
    needs ``data_parallel`` >= 2."""
    notes: dict[str, Any] = field(default_factory=dict)
    """Free-form provenance (predicted throughput, memory cap, bandwidth...)."""

    def __post_init__(self) -> None:
        self.shape()  # fail at construction, not deep inside a run
        check_replicas(self.data_parallel, "data_parallel")
        if self.boundaries is not None:
            self.boundaries = [(int(a), int(b)) for a, b in self.boundaries]
            check_boundaries(self.boundaries, self.num_stages * self.virtual_stages)
        self.recompute = check_recompute_entries(
            self.recompute, self.num_stages * self.virtual_stages
        )
        check_shard_optimizer(self.shard_optimizer, self.data_parallel)

    @property
    def method_spec(self) -> Method:
        return get_method(self.method)

    def shape(self, mini_batches: int | None = None) -> Shape:
        m = self.method_spec
        return m.shape(
            self.num_stages,
            self.micro_batches,
            mini_batches if mini_batches is not None else self.mini_batches,
            m.virtual_stages_for(self.virtual_stages),
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["format"], data["version"] = PLAN_FORMAT, PLAN_VERSION
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<plan>") -> Plan:
        """Check ``data`` as a :class:`PlanFile`, then build (and check) the plan."""
        check(PlanHeader, data, source=source, remedy=_REMEDY, error=PlanError)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"format", "version"})
        if unknown:
            raise PlanError(f"{source}: unknown plan fields {unknown}; valid: {sorted(known)}")
        checked = check(PlanFile, data, source=source, remedy=_REMEDY, error=PlanError)
        args: dict[str, Any] = {k: v for k, v in checked.items() if k in known}
        if "optimizer" in args:
            args["optimizer"] = OptimizerSpec(**args["optimizer"])
        try:
            return cls(**args)
        except PlanError as err:
            raise PlanError(f"{source}: {err}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        data = read_json(path, what="plan", remedy=_REMEDY, error=PlanError)
        return cls.from_dict(data, source=str(path))


def check_boundaries(boundaries: list[tuple[int, int]], num_stages: int) -> None:
    """Stage ranges must be non-empty, contiguous from layer 0, one per stage."""
    if len(boundaries) != num_stages:
        raise PlanError(
            f"plan has {len(boundaries)} stage ranges for {num_stages} stages; "
            f"give one (start, end) layer range per stage"
        )
    expected = 0
    for k, (start, end) in enumerate(boundaries):
        if start != expected or end <= start:
            raise PlanError(
                f"stage {k} covers layers [{start}, {end}); stages must be non-empty and "
                f"contiguous, so stage {k} must start at layer {expected}"
            )
        expected = end


def even_boundaries(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Split layers into stages of (almost) equal layer count."""
    if num_stages > num_layers:
        raise PlanError(
            f"cannot split {num_layers} layers into {num_stages} stages; use at most "
            f"{num_layers} stages or a model with more layers"
        )
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for k in range(num_stages):
        end = start + base + (1 if k < extra else 0)
        out.append((start, end))
        start = end
    return out
