"""The checkpoint format slot: the store writes and reads stage files through a format, so a
new format plugs in without touching the store, and files written before the slot existed
(one ``torch.save`` per stage) still load."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path
from typing import Any, BinaryIO

import torch

from pipeoptim.runtime.checkpoint.formats import DEFAULT_FORMAT, FORMATS, TorchSave
from pipeoptim.runtime.checkpoint.store import CheckpointStore

CONFIG = {"method": "pipeoptim", "stages": 2}


def state(k: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(k)
    return {"weights": torch.randn(3, 4, generator=g), "rng": torch.ByteTensor([k, 1, 2])}


class GzipTorchSave:
    """A format of the test's own: torch.save, compressed."""

    name = "gzip-torch-save"
    suffix = ".pt.gz"

    def __init__(self) -> None:
        self.reads = 0

    def write(self, payload: dict[str, Any], file: BinaryIO) -> None:
        with gzip.GzipFile(fileobj=file, mode="wb") as out:
            torch.save(payload, out)

    def read(self, path: Path, device: torch.device) -> dict[str, Any]:
        self.reads += 1
        raw = gzip.decompress(path.read_bytes())
        payload: dict[str, Any] = torch.load(
            io.BytesIO(raw), map_location=device, weights_only=True
        )
        return payload


def test_the_default_format_is_one_torch_save_file_per_stage(tmp_path: Path) -> None:
    assert DEFAULT_FORMAT == "torch-save" and isinstance(FORMATS[DEFAULT_FORMAT], TorchSave)
    store = CheckpointStore(tmp_path, CONFIG, num_stages=2)
    store.save(4, {0: state(0), 1: state(1)}, {})
    assert sorted(p.name for p in (tmp_path / "step-00000004").iterdir()) == [
        "stage-0.pt",
        "stage-1.pt",
    ]
    loaded = store.load(4, 1, torch.device("cpu"))
    assert torch.equal(loaded["state"]["weights"], state(1)["weights"])


def test_another_format_plugs_into_the_store_unchanged(tmp_path: Path) -> None:
    fmt = GzipTorchSave()
    store = CheckpointStore(tmp_path, CONFIG, num_stages=2, format=fmt)
    store.save(8, {0: state(0), 1: state(1)}, {"epoch": 1})
    files = sorted(p.name for p in (tmp_path / "step-00000008").iterdir())
    assert files == ["stage-0.pt.gz", "stage-1.pt.gz"]
    record, note = store.newest_readable()
    assert record is not None and record["step"] == 8 and record["epoch"] == 1 and note is None
    for k in (0, 1):
        loaded = store.load(8, k, torch.device("cpu"))
        assert torch.equal(loaded["state"]["weights"], state(k)["weights"])
        assert torch.equal(loaded["state"]["rng"], state(k)["rng"])
    assert fmt.reads == 4  # newest_readable read both stages, then the two loads


def test_a_checkpoint_written_before_the_format_slot_still_loads(tmp_path: Path) -> None:
    """Every checkpoint so far: stage-k.pt, a torch.save of the payload, and latest.json."""
    folder = tmp_path / "step-00000012"
    folder.mkdir()
    for k in (0, 1):
        payload = {
            "format": "pipeoptim-checkpoint",
            "version": 1,
            "stage": k,
            "step": 12,
            "config": CONFIG,
            "state": state(k),
        }
        torch.save(payload, folder / f"stage-{k}.pt")
    record = {"step": 12, "num_stages": 2, "config": CONFIG}
    (tmp_path / "latest.json").write_text(json.dumps(record))
    store = CheckpointStore(tmp_path, CONFIG, num_stages=2)
    found, note = store.newest_readable()
    assert found is not None and found["step"] == 12 and note is None
    assert torch.equal(
        store.load(12, 0, torch.device("cpu"))["state"]["weights"], state(0)["weights"]
    )
