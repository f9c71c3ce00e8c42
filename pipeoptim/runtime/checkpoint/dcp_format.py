"""``torch.distributed.checkpoint`` (DCP) as a checkpoint format: one DCP folder per stage.

Why DCP: it is the format torchtitan and FSDP users already hold, it reads any subset of a
checkpoint's tensors by name, and it reshards a tensor saved whole into the slices a reader
asks for. Each stage's folder holds its tensors under model-level names that do not depend on
the cut: ``model/{unit}.{key}`` for the weights (the names of an ``nn.Sequential`` of the
units) and ``optim/{unit}.{key}/{state}`` for each parameter's optimizer state; the rest of
the stage's state (RNG, scheduler, predictor, ...) under ``stage/...``. What is not a tensor
(the scheduler's counters, the optimizer's groups) is a small ``skeleton.pt`` beside them,
read with ``weights_only=True``.

No process group is needed: every stage's folder is written and read with ``no_dist=True``
by the one process that holds the stage, on one process (local transport) and under ``dist``
alike (a replica that does not write, or a rank whose stages are elsewhere, takes no part).
A resume onto another cut reads from each old stage's folder only the units its new stages
hold (:meth:`DistributedCheckpoint.read_units`): DCP's load planner picks those tensors.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import Tensor

from pipeoptim.runtime.checkpoint.recut import model_key

__all__ = ["DistributedCheckpoint"]

SKELETON = "skeleton.pt"
"""The payload with each tensor replaced by a reference to its DCP name."""
_REF = "__dcp__"


def _first_unit(payload: dict[str, Any]) -> int:
    bounds = payload.get("boundaries")
    stage = payload.get("stage")
    if isinstance(bounds, list) and isinstance(stage, int) and 0 <= stage < len(bounds):
        return int(bounds[stage][0])
    return 0


def _optimizer_names(state: dict[str, Any], first: int) -> dict[Any, str]:
    """Optimizer state index -> the parameter's model-level name (its first name)."""
    optimizer, names = state.get("optimizer"), state.get("param_names")
    if not isinstance(optimizer, dict) or not isinstance(names, list):
        return {}
    out: dict[Any, str] = {}
    for group, group_names in zip(optimizer.get("param_groups", []), names, strict=False):
        for index, aliases in zip(group["params"], group_names, strict=False):
            if aliases:
                out[index] = model_key(first, aliases[0])
    return out


class _Flattener:
    """Walks a payload: tensors out (under their DCP names), references in."""

    def __init__(self, payload: dict[str, Any]) -> None:
        self.first = _first_unit(payload)
        state = payload.get("state")
        self.optimizer_names = (
            _optimizer_names(state, self.first) if isinstance(state, dict) else {}
        )
        self.tensors: dict[str, Tensor] = {}

    def name(self, path: tuple[Any, ...]) -> str:
        if len(path) == 3 and path[:2] == ("state", "module"):
            return f"model/{model_key(self.first, str(path[2]))}"
        if len(path) == 5 and path[:3] == ("state", "optimizer", "state"):
            param = self.optimizer_names.get(path[3])
            if param is not None:
                return f"optim/{param}/{path[4]}"
        return "stage/" + "/".join(str(p) for p in path)

    def walk(self, obj: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(obj, Tensor):
            key = self.name(path)
            self.tensors[key] = obj.detach()
            return {_REF: key}
        if isinstance(obj, dict):
            return {k: self.walk(v, (*path, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.walk(v, (*path, i)) for i, v in enumerate(obj))
        return obj


def _is_ref(obj: Any) -> bool:
    return isinstance(obj, dict) and set(obj) == {_REF}


def _refs(obj: Any) -> list[str]:
    if _is_ref(obj):
        return [obj[_REF]]
    if isinstance(obj, dict):
        return [r for v in obj.values() for r in _refs(v)]
    if isinstance(obj, (list, tuple)):
        return [r for v in obj for r in _refs(v)]
    return []


_MISSING = object()


def _fill(obj: Any, loaded: dict[str, Tensor]) -> Any:
    """The skeleton with its references replaced by the loaded tensors; a reference not
    loaded (a unit not asked for) leaves its dict entry out."""
    if _is_ref(obj):
        return loaded.get(obj[_REF], _MISSING)
    if isinstance(obj, dict):
        filled = {k: _fill(v, loaded) for k, v in obj.items()}
        return {k: v for k, v in filled.items() if v is not _MISSING}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, loaded) for v in obj)
    return obj


def _unit_of(name: str) -> int | None:
    """The unit a DCP name belongs to (None: the stage's own state)."""
    kind, _, rest = name.partition("/")
    if kind not in ("model", "optim"):
        return None
    return int(rest.partition(".")[0])


class DistributedCheckpoint:
    """One DCP folder per stage (``stage-{k}.dcp/``), written and read without a process
    group."""

    name = "dcp"
    suffix = ".dcp"
    writes_folder = True
    """The store writes a folder (atomically renamed into place), not a file."""

    def write(self, payload: dict[str, Any], file: BinaryIO) -> None:
        raise TypeError("the dcp format writes a folder: the store calls write_folder")

    def write_folder(self, payload: dict[str, Any], folder: Path) -> None:
        # imported here: a rank that writes no DCP starts without torch.distributed.checkpoint
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        flat = _Flattener(payload)
        skeleton = flat.walk(payload, ())
        folder.mkdir(parents=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
            dcp_save(flat.tensors, checkpoint_id=folder, no_dist=True)
        torch.save(skeleton, folder / SKELETON)

    def read(self, path: Path, device: torch.device) -> dict[str, Any]:
        return self.read_units(path, device, None)

    def read_units(
        self, path: Path, device: torch.device, units: tuple[int, int] | None
    ) -> dict[str, Any]:
        """The payload of ``path`` with only the tensors of units ``[a, b)`` (None: all) and
        the stage's own state; DCP reads just those."""
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        if not path.is_dir():
            raise FileNotFoundError(path)
        skeleton = torch.load(path / SKELETON, map_location="cpu", weights_only=True)
        stored = FileSystemReader(path).read_metadata().state_dict_metadata
        template: dict[str, Tensor] = {}
        for name in _refs(skeleton):
            unit = _unit_of(name)
            if units is not None and unit is not None and not units[0] <= unit < units[1]:
                continue
            meta = stored[name]
            if not isinstance(meta, TensorStorageMetadata):
                raise ValueError(f"{name} is not a tensor in {path}")
            template[name] = torch.empty(meta.size, dtype=meta.properties.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
            dcp_load(template, checkpoint_id=path, no_dist=True)
        loaded = {k: v.to(device) for k, v in template.items()}
        payload: dict[str, Any] = _fill(skeleton, loaded)
        return payload
