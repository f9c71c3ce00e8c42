"""The demo's resume rule: a step whose result file matches its inputs is not run again.

A demo takes minutes and can be interrupted anywhere. Each step writes its files into
``--out`` atomically (a temporary file, then a rename), then its *result file*
``steps/NAME.json`` last: the step's result as plain JSON, a fingerprint of its inputs (the
options it read and the fingerprints of the steps it builds on) and the SHA-256 of every
file it wrote. On the next run a step is skipped when its result file exists, its
fingerprint equals that of the current inputs and its files are still there unchanged;
anything else runs it again. So a finished step is never lost, a half-written one never
read, and changing an option reruns exactly the steps it reaches.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["StepStore", "fingerprint", "write_atomic"]

RESULT_VERSION = 3
"""Bumped when a step's result changes form, so older result files are recomputed."""


def fingerprint(inputs: Mapping[str, Any]) -> str:
    """A short hash of ``inputs`` (canonical JSON: key order does not matter)."""
    text = json.dumps({"v": RESULT_VERSION, **inputs}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_atomic(path: Path, write: Callable[[Path], object]) -> Path:
    """Have ``write`` fill a temporary file beside ``path``, then rename it over ``path``
    (a rename within one folder is atomic): a reader sees the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


class StepStore:
    """The result files of one demo folder (``out/steps/NAME.json``)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def path(self, name: str) -> Path:
        return self.out / "steps" / f"{name}.json"

    def load(self, name: str, print_: str) -> dict[str, Any] | None:
        """Step ``name``'s stored ``{"result", "files"}`` (files relative to the folder) if
        it was made from inputs with fingerprint ``print_`` and its files are unchanged;
        else None (the step must run)."""
        try:
            record = json.loads(self.path(name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("fingerprint") != print_:
            return None
        files = record.get("files")
        if not isinstance(files, dict):
            return None
        for rel, digest in files.items():
            file = self.out / rel
            if not file.is_file() or _sha256(file) != digest:
                return None
        result = record.get("result")
        return {"result": result, "files": list(files)} if isinstance(result, dict) else None

    def save(
        self,
        name: str,
        print_: str,
        inputs: Mapping[str, Any],
        result: Mapping[str, Any],
        files: Sequence[Path],
        seconds: float,
    ) -> Path:
        """Write the result file of step ``name`` (after the files it lists)."""
        record = {
            "step": name,
            "fingerprint": print_,
            "inputs": dict(inputs),
            "seconds": round(seconds, 3),
            "files": {str(f.relative_to(self.out)): _sha256(f) for f in files},
            "result": dict(result),
        }
        text = json.dumps(record, indent=1, default=str)
        return write_atomic(self.path(name), lambda p: p.write_text(text, encoding="utf-8"))
