"""JSON lines: one object per line, no extra dependency; read it back with ``json.loads``.

Lines: ``{"event": "fit_start", "config": {...}, "start_step", "end_step", "stages"}``, then
``{"event": "scalars", "step": s, "values": {"name": value}}`` per step written,
``{"event": "checkpoint", "step", "directory"}``, and ``{"event": "fit_end", "step",
"stopped_by", "error"}``. Lines are flushed at every log point, so a crashed run's file is
readable up to its last log point.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.observe.callbacks import CheckpointWritten, FitEnd, FitStart
from pipeoptim.runtime.observe.loggers.base import Logger, check_writable_dir, per_process_path

__all__ = ["JsonlLogger"]


class JsonlLogger(Logger):
    """Appends the fit's records to ``path`` (``path.rank{r}.jsonl``-style per process when
    several processes train)."""

    scheme = "jsonl"

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)
        if self.path.is_dir():  # open() would fail at the fit's start (IsADirectoryError)
            raise RuntimeConfigError(
                f"jsonl: the target is the file the records are appended to, but {str(path)!r} "
                f"is an existing directory; name a file in it, e.g. "
                f"jsonl:{self.path / 'run.jsonl'}"
            )
        check_writable_dir(self.path.parent if str(self.path.parent) else Path("."), "jsonl")
        self.written: Path | None = None
        """The file this process writes (known once a fit starts)."""
        self._file: IO[str] | None = None

    def _line(self, record: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")

    def open(self, info: FitStart) -> None:
        self.written = per_process_path(self.path, info.rank, info.world, folder=False)
        self._file = self.written.open("a", encoding="utf-8")
        self._line(
            {
                "event": "fit_start",
                "config": info.config,
                "start_step": info.start_step,
                "end_step": info.end_step,
                "rank": info.rank,
                "stages": list(info.stages),
            }
        )
        self._file.flush()

    def write_scalars(self, step: int, values: dict[str, float]) -> None:
        self._line({"event": "scalars", "step": step, "values": values})

    def on_step_end(self, info: Any, pipeline: Any) -> None:
        super().on_step_end(info, pipeline)
        assert self._file is not None
        self._file.flush()

    def on_checkpoint(self, info: CheckpointWritten, pipeline: Any) -> None:
        self._line({"event": "checkpoint", "step": info.step, "directory": info.directory})

    def on_fit_end(self, info: FitEnd, pipeline: Any) -> None:
        if self._file is not None:
            self._line(
                {
                    "event": "fit_end",
                    "step": info.step,
                    "stopped_by": info.stopped_by,
                    "error": info.error,
                }
            )
        super().on_fit_end(info, pipeline)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
