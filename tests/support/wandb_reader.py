"""Reads a W&B offline run file (``run-*.wandb``) back, for the logger tests.

The file is W&B's record log: a 7-byte header, then 32 KiB blocks of records, each a
checksum (4 bytes), a length (2) and a type (1: whole, 2/3/4: first, middle, last piece) in
front of its bytes, LevelDB's log layout; every record is a ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, piece, out = HEADER, b"", []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        pos += HEADER
        if length == 0 and kind == 0:
            break
        piece += data[pos : pos + length]
        pos += length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(piece)
            out.append(record)
            piece = b""
    return out


def written(path: Path, seconds: float = 60.0) -> Path:
    """``path`` once W&B's service has written the run's end into it (it writes in the
    background: ``run.finish()`` can return before the file holds the run)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and any(r.WhichOneof("record_type") == "exit" for r in records(path)):
            return path
        time.sleep(0.1)
    raise AssertionError(f"W&B did not finish writing {path} in {seconds:.0f} s")


def history(path: Path) -> list[dict[str, Any]]:
    """Every ``run.log`` row of the run, its values decoded."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        rows.append(row)
    return rows


def config(path: Path) -> dict[str, Any]:
    """The run's configuration as W&B recorded it."""
    out: dict[str, Any] = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        items = record.config.update if kind == "config" else ()
        if kind == "run":
            items = record.run.config.update
        for item in items:
            key = item.key or "/".join(item.nested_key)
            out[key] = json.loads(item.value_json)
    return out
