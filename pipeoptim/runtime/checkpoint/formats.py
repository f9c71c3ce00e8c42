"""How one stage's checkpoint payload becomes a file, and back: the checkpoint format slot.

The store (:mod:`.store`) decides *where* and *when* (step folders, atomic writes, the
``latest.json`` pointer, the lock); a format decides *how* one stage's payload (a dict of
tensors, numbers and strings) is written and read. A new format is a class with the
:class:`StageFormat` methods, here or in a file beside this one, and one entry in
:data:`FORMATS`; ``CheckpointStore(format=...)`` takes it. A format whose stage is a folder
(``writes_folder = True``: DCP's, :mod:`.dcp_format`) has ``write_folder(payload, folder)``
instead of ``write``, and may read only some units (``read_units``) for a re-cut resume.
A store reads whichever format a checkpoint was written in (by the stage file's suffix).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch

from pipeoptim.runtime.checkpoint.dcp_format import DistributedCheckpoint

__all__ = ["DEFAULT_FORMAT", "FORMATS", "StageFormat", "TorchSave"]


class StageFormat(Protocol):
    """Writes and reads one stage's checkpoint payload."""

    name: str
    """The format's name in :data:`FORMATS`."""
    suffix: str
    """The stage file's suffix: ``stage-{k}{suffix}``."""

    def write(self, payload: dict[str, Any], file: BinaryIO) -> None:
        """Write ``payload`` to an open binary file (the store makes the write atomic)."""

    def read(self, path: Path, device: torch.device) -> dict[str, Any]:
        """The payload of ``path`` with its tensors on ``device``; raises on a damaged file
        (the store words the error)."""


class TorchSave:
    """One ``torch.save`` file per stage, read back with ``weights_only=True`` (tensors and
    plain containers only: no code runs on load). Every pipeoptim checkpoint so far is one."""

    name = "torch-save"
    suffix = ".pt"

    def write(self, payload: dict[str, Any], file: BinaryIO) -> None:
        torch.save(payload, file)

    def read(self, path: Path, device: torch.device) -> dict[str, Any]:
        payload: dict[str, Any] = torch.load(path, map_location=device, weights_only=True)
        return payload


FORMATS: dict[str, StageFormat] = {
    TorchSave.name: TorchSave(),
    DistributedCheckpoint.name: DistributedCheckpoint(),
}
"""The checkpoint formats by name."""
DEFAULT_FORMAT = TorchSave.name
