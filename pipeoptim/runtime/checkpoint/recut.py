"""Re-cut a checkpoint onto another partition: the same units, other stages.

A checkpoint holds one state per stage, keyed the way the stage holds its units
(``"0.weight"`` of the stage's first unit). Every tensor in it belongs to one unit of the model,
so under the model-level name ``"{unit}.{key}"`` (the name an ``nn.Sequential`` of the units
gives it, and the name :mod:`.export` falls back to) it does not depend on the cut. Re-cutting
reads the old stages' states under those names and builds, for each stage of the new cut, the
state its own ``Stage.state_dict()`` would have: weights, and per parameter the optimizer's
state, looked up by the parameter's model-level name (``param_names`` records the names of
each optimizer group's parameters; a tied weight under each of its names).

What depends on the schedule and not on the weights starts afresh at the new depth, as a
run cut that way from the start would have it: the weight predictor's displacements of the
asynchronous methods (the stashed weight versions are never in a checkpoint), and a stage's
correction state (the delay correction, QK-clip's counts), which is the stage's, not a
unit's. Learning-rate schedule, loss scaler and step counters carry over.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn
from torch.optim import Optimizer

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.optim.optimizers import MuonWithAdamW

if TYPE_CHECKING:  # the stage's state module imports this one
    from pipeoptim.runtime.stage.stage import Stage

__all__ = [
    "RECUT_IDENTITY",
    "SavedCut",
    "StageLayout",
    "optimizer_param_names",
    "stage_layout",
]

RECUT_IDENTITY = frozenset({"num_stages", "micro_batches", "virtual_stages", "boundaries"})
"""Identity keys a resume may change where the checkpoint can be re-cut (it records its
boundaries): the cut and the schedule's shape. The units themselves, the method, the optimizer
and the seed stay fixed."""

_SHOWN = 3


def _few(items: list[str]) -> str:
    more = len(items) - _SHOWN
    return ", ".join(items[:_SHOWN]) + (f" and {more} more" if more > 0 else "")


def model_key(first_unit: int, key: str) -> str:
    """A stage's state key (``"{unit in stage}.{rest}"``) as the model-level name."""
    local, _, rest = key.partition(".")
    return f"{first_unit + int(local)}.{rest}"


def optimizer_param_names(module: nn.Module, optimizer: Optimizer) -> list[list[list[str]]]:
    """For each of the optimizer's parameter groups, for each of its parameters (in the order
    of its state dict's indices), the module's names of that parameter (a tied one has
    several)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [[names.get(id(p), []) for p in g["params"]] for g in optimizer.param_groups]


@dataclass(frozen=True)
class StageLayout:
    """What a stage of the new cut holds: the state it must be given has this shape."""

    index: int
    first_unit: int
    shapes: dict[str, tuple[int, ...]]
    """Module state key -> shape."""
    groups: list[list[list[str]]] | None
    """Per optimizer group, per parameter, its module names (None: no optimizer)."""
    optimizer_extra: dict[str, Any] = field(default_factory=dict)
    """Keys of the optimizer's state dict beside ``state`` and ``param_groups``."""
    predictor: dict[str, Any] | None = None
    """The stage's own (fresh) predictor state: prediction restarts at the new depth."""


def stage_layout(stage: Stage) -> StageLayout:
    """The :class:`StageLayout` of a built (not yet trained) stage."""
    optimizer: Optimizer | None = stage.optimizer if stage.updater is not None else None
    extra: dict[str, Any] = {}
    inner = getattr(optimizer, "optim", optimizer)  # ZeRO-1 wraps the stage's optimizer
    if isinstance(inner, MuonWithAdamW):
        extra["muon_groups"] = 0 if inner.muon is None else len(inner.muon.param_groups)
    return StageLayout(
        index=stage.index,
        first_unit=stage.first_unit,
        shapes={k: tuple(t.shape) for k, t in stage.module.state_dict().items()},
        groups=None if optimizer is None else optimizer_param_names(stage.module, optimizer),
        optimizer_extra=extra,
        predictor=None if stage.predictor is None else stage.predictor.state_dict(),
    )


@dataclass
class _Param:
    stage: int
    group: int
    state: dict[str, Any]


class SavedCut:
    """The states of a checkpoint's stages (those a process needs), read by model-level name.

    ``states``: stage -> its ``Stage.state_dict()`` (only the stages whose units a process
    needs); ``bounds``: every stage's units as the checkpoint was cut."""

    def __init__(
        self, states: Mapping[int, dict[str, Any]], bounds: Sequence[Sequence[int]]
    ) -> None:
        self.states = dict(states)
        self.bounds = [(int(b[0]), int(b[1])) for b in bounds]
        self.tensors: dict[str, Tensor] = {}
        self.params: dict[str, _Param] = {}
        self.groups: dict[tuple[int, int], dict[str, Any]] = {}
        for k, state in sorted(self.states.items()):
            first = self.bounds[k][0]
            for key, value in state["module"].items():
                self.tensors.setdefault(model_key(first, key), value)
            optimizer = state.get("optimizer")
            if optimizer is None:
                continue
            names = state.get("param_names")
            if names is None:
                raise RuntimeConfigError(
                    f"the checkpoint was written before pipeoptim recorded its optimizer's "
                    f"parameter names, so its optimizer state cannot be re-cut: resume it at "
                    f"its own cut ({len(self.bounds)} stages, units {self.bounds}), or start "
                    f"fresh from its weights (pipeoptim export); nothing was loaded"
                )
            for g, (group, group_names) in enumerate(
                zip(optimizer["param_groups"], names, strict=True)
            ):
                self.groups[(k, g)] = {n: v for n, v in group.items() if n != "params"}
                for index, aliases in zip(group["params"], group_names, strict=True):
                    per = optimizer["state"].get(index, optimizer["state"].get(str(index), {}))
                    for alias in aliases:
                        self.params.setdefault(model_key(first, alias), _Param(k, g, per))

    @staticmethod
    def stages_holding(
        bounds: Sequence[Sequence[int]], first_unit: int, end_unit: int
    ) -> list[int]:
        """The stages of ``bounds`` that hold any of the units ``[first_unit, end_unit)``."""
        return [k for k, (a, b) in enumerate(bounds) if a < end_unit and first_unit < b]

    def owner(self, unit: int) -> int:
        return next(k for k, (a, b) in enumerate(self.bounds) if a <= unit < b)

    def units_beyond(self, units: int) -> list[int]:
        """The checkpoint's units this model (of ``units`` units) does not have."""
        return list(range(units, self.bounds[-1][1]))

    def cut(self, layout: StageLayout) -> dict[str, Any]:
        """The state of the new cut's stage ``layout``, as its ``state_dict()`` would be;
        refused (one line naming what differs) where the checkpoint's units do not fit."""
        where = f"stage {layout.index}"
        module: dict[str, Tensor] = {}
        missing: list[str] = []
        shapes: list[str] = []
        for key, shape in layout.shapes.items():
            name = model_key(layout.first_unit, key)
            value = self.tensors.get(name)
            if value is None:
                missing.append(name)
            elif tuple(value.shape) != shape:
                shapes.append(f"{name} saved {list(value.shape)}, here {list(shape)}")
            else:
                module[key] = value
        if missing or shapes:
            found = ([f"other shapes: {_few(shapes)}"] if shapes else []) + (
                [f"not in the checkpoint: {_few(missing)}"] if missing else []
            )
            raise RuntimeConfigError(
                f"{where}: the checkpoint's units do not fit this model's ({'; '.join(found)}); "
                f"a resume onto another cut needs the same units: resume with the model that "
                f"wrote it, or start fresh; nothing was loaded"
            )
        owner = self.states[self.owner(layout.first_unit)]
        state: dict[str, Any] = {
            "module": module,
            "optimizer": None,
            "scheduler": None,
            "scaler": copy.deepcopy(owner.get("scaler")),
            "correction": None,  # the delay correction restarts at the new depth
            "predictor": copy.deepcopy(layout.predictor),
            "rng": owner["rng"].clone(),
        }
        if layout.groups is not None:
            state.update(self._optimizer(layout, owner, where))
        return state

    def _optimizer(self, layout: StageLayout, owner: dict[str, Any], where: str) -> dict[str, Any]:
        per_param: dict[int, dict[str, Any]] = {}
        groups: list[dict[str, Any]] = []
        sources: list[tuple[int, int]] = []
        index = 0
        assert layout.groups is not None
        for group_names in layout.groups:
            params: list[int] = []
            source: tuple[int, int] | None = None
            for aliases in group_names:
                names = [model_key(layout.first_unit, a) for a in aliases]
                found = next((self.params[n] for n in names if n in self.params), None)
                if found is None:
                    raise RuntimeConfigError(
                        f"{where}: the checkpoint holds no optimizer state for "
                        f"{_few(names)}, which this stage trains (it was frozen, or not a "
                        f"parameter, in the run that wrote it); resume with the same weights "
                        f"trainable; nothing was loaded"
                    )
                source = source or (found.stage, found.group)
                if found.state:
                    per_param[index] = copy.deepcopy(found.state)
                params.append(index)
                index += 1
            if source is None:  # an empty group: its settings from the first unit's stage
                source = (self.owner(layout.first_unit), len(sources))
            if source not in self.groups:
                raise RuntimeConfigError(
                    f"{where}: the checkpoint's optimizer has no parameter group {source[1]} "
                    f"on stage {source[0]} to take this stage's group {len(sources)} from; "
                    f"resume with the optimizer that wrote it; nothing was loaded"
                )
            groups.append({**copy.deepcopy(self.groups[source]), "params": params})
            sources.append(source)
        first = self.states[sources[0][0]] if sources else owner
        return {
            "optimizer": {"state": per_param, "param_groups": groups, **layout.optimizer_extra},
            "optimizer_class": first.get("optimizer_class"),
            "scheduler": self._scheduler(sources, first),
            "param_names": layout.groups,
        }

    def _scheduler(
        self, sources: list[tuple[int, int]], first: dict[str, Any]
    ) -> dict[str, Any] | None:
        """The scheduler's state with its per-group lists (``base_lrs``, ``_last_lr``) taken
        group by group from where each group's settings came from."""
        saved = first.get("scheduler")
        if saved is None:
            return None
        out: dict[str, Any] = copy.deepcopy(saved)
        for key, value in saved.items():
            if not isinstance(value, list):
                continue
            lists = []
            for k, g in sources:
                theirs = (self.states[k].get("scheduler") or {}).get(key)
                groups = len((self.states[k].get("optimizer") or {}).get("param_groups", []))
                if not isinstance(theirs, list) or len(theirs) != groups:
                    break
                lists.append(copy.deepcopy(theirs[g]))
            else:
                out[key] = lists
        return out
