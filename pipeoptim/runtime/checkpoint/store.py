"""Per-stage checkpoints, written atomically, from which a run resumes exactly.

A run is cut into segments (:mod:`pipeoptim.runtime.segments`) and checkpointed at segment
boundaries, where nothing is in flight; resuming from step n runs the same segments an
uninterrupted run runs from n.

Layout::

    DIR/step-00000044/stage-0.pt ... stage-{P-1}.pt   one file per stage (formats.py), atomic
                                                       (``stage-k.dcp/`` folders in DCP's format)
    DIR/latest.json                                    {"step": 44, ...}, written last
    DIR/.lock                                          held (flock) by the run writing here

``latest.json`` names a step only once every stage file of that step is complete, so a
crash while writing leaves the previous checkpoint in charge; the ``keep`` newest step
folders stay (default 2), older ones are removed after the pointer moves. A resume takes the
newest step whose every stage file reads back, and says so when that is not the pointer's;
the stage count is the checkpoint's own (its recorded boundaries), so a run of another depth
can re-cut it (``recut.py``).
With one process per stage, ranks count their finished files in the process group's store
and rank 0 moves the pointer. One run at a time: the writer holds an advisory lock on
``.lock`` (released by the kernel if it dies), and a second run is refused with the holder's
pid and host; a fresh run refuses a folder that already holds another run's checkpoints.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch._C._distributed_c10d import Store

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.checkpoint.formats import DEFAULT_FORMAT, FORMATS, StageFormat
from pipeoptim.runtime.checkpoint.recut import RECUT_IDENTITY

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointStore",
    "DirectoryLock",
    "identity_differences",
    "latest_step",
]

CHECKPOINT_FORMAT = "pipeoptim-checkpoint"
CHECKPOINT_VERSION = 1
_LATEST = "latest.json"
_LOCK = ".lock"
DEFAULT_KEEP = 2


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write through a temporary file in the same folder, then rename over ``path``: a
    reader sees the old file or the complete new one, never half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # no half file left behind
        raise


def _atomic_write_folder(path: Path, write: Callable[[Path], object]) -> None:
    """:func:`_atomic_write` for a format whose stage is a folder: written beside ``path``,
    then renamed over it (a folder of the same step written before is removed first)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # no half folder left behind
        raise


COMPARED_WHEN_BOTH_HAVE = frozenset({"optimizer_class"})
"""Identity keys added after checkpoints were first written: a checkpoint (or state) written
before them lacks them, and is compared without them, so it stays resumable."""

NO_LONGER_IDENTITY = frozenset({"amp"})
"""Keys older checkpoints hold in their identity that a resume may now change: precision
(master weights, optimizer state and prediction are fp32 under every ``amp`` mode; an fp16
loss scaler starts afresh where the checkpoint had none)."""


def identity_differences(
    saved: Mapping[str, Any], now: Mapping[str, Any], *, recut: bool = False
) -> list[str]:
    """What differs between a checkpoint's identity and this run's, one ``"key: checkpoint
    X, now Y"`` each (empty: the same run). A key only one side has is a difference (a
    ``predicted_backward`` set on one side only), except the keys of
    :data:`COMPARED_WHEN_BOTH_HAVE` and :data:`NO_LONGER_IDENTITY`; with ``recut`` (the
    checkpoint records its cut, so it can be re-cut) the keys of
    :data:`~pipeoptim.runtime.checkpoint.recut.RECUT_IDENTITY` may differ too."""
    shown = []
    for k in sorted(set(saved) | set(now)):
        if k in NO_LONGER_IDENTITY or (recut and k in RECUT_IDENTITY):
            continue
        if k in COMPARED_WHEN_BOTH_HAVE and (k not in saved or k not in now):
            continue
        if saved.get(k) != now.get(k):
            shown.append(
                _unit_difference(saved.get(k), now.get(k))
                if k == "units"
                else f"{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}"
            )
    return shown


def _unit_difference(saved: Any, now: Any) -> str:
    """The first unit (class and parameter shapes) the checkpoint and this model differ in,
    rather than both lists in full."""
    if not isinstance(saved, list) or not isinstance(now, list):
        return f"units: checkpoint {saved!r}, now {now!r}"
    for i, (a, b) in enumerate(zip(saved, now, strict=False)):
        if a != b:
            return f"unit {i}: checkpoint {a!r}, now {b!r} (class, parameter shapes)"
    return f"units: the checkpoint has {len(saved)}, this model {len(now)}"


def latest_step(root: str | Path) -> dict[str, Any] | None:
    """The ``latest.json`` record of a checkpoint folder, or None if it holds none."""
    path = Path(root) / _LATEST
    if not path.is_file():
        return None
    try:
        record: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise RuntimeConfigError(f"cannot read checkpoint pointer {path}: {err}") from None
    return record


class DirectoryLock:
    """An advisory lock on a checkpoint folder (``flock`` on ``DIR/.lock``): one writer at a
    time. The kernel drops it when the holder exits, however it exits."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._file: Any = None

    def acquire(self) -> None:
        if self._file is not None:
            return
        path = self.root / _LOCK
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            f = open(path, "a+")  # noqa: SIM115 - held open for the lock's lifetime
        except OSError as err:
            raise RuntimeConfigError(
                f"cannot use checkpoint folder {self.root}: {err.strerror}; give a folder "
                f"you can write (--checkpoint-dir)"
            ) from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "an unknown process"
            f.close()
            raise RuntimeConfigError(
                f"checkpoint folder {self.root} is in use by another run ({holder}); wait "
                f"for it to finish, or give this run another --checkpoint-dir"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


class CheckpointStore:
    """Writes and reads one run's checkpoints.

    ``config`` is the run's identity (method, stages, model, optimizer, batch size, seed,
    ...): a resume with a different identity could not continue the same run, so it is
    refused with the fields that differ.
    """

    def __init__(
        self,
        root: str | Path,
        config: Mapping[str, Any],
        *,
        num_stages: int,
        store: Store | None = None,
        rank: int = 0,
        world_size: int = 1,
        timeout: float = 300.0,
        abort_check: Callable[[], None] = lambda: None,
        keep: int = DEFAULT_KEEP,
        format: StageFormat = FORMATS[DEFAULT_FORMAT],
    ) -> None:
        if keep < 1:
            raise RuntimeConfigError(
                f"keep-checkpoints must be at least 1 (got {keep}); the newest is always kept"
            )
        self.root = Path(root)
        self.keep = keep
        self.config = dict(config)
        self.num_stages = num_stages
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.abort_check = abort_check
        self.format = format
        """How each stage file is written and read (``formats.py``)."""

    # -- writing ---------------------------------------------------------------------------
    def save(
        self, step: int, states: Mapping[int, dict[str, Any]], extra: Mapping[str, Any]
    ) -> None:
        """Write this process's stage files for ``step``, then publish the step once every
        stage's file exists."""
        folder = _step_dir(self.root, step)
        folder.mkdir(parents=True, exist_ok=True)
        for k, state in states.items():
            payload = {
                "format": CHECKPOINT_FORMAT,
                "version": CHECKPOINT_VERSION,
                "stage": k,
                "step": step,
                "config": self.config,
                **extra,
                "state": state,
            }
            path = folder / f"stage-{k}{self.format.suffix}"
            try:
                if getattr(self.format, "writes_folder", False):
                    _atomic_write_folder(path, partial(self.format.write_folder, payload))  # type: ignore[attr-defined]
                else:
                    _atomic_write(path, partial(self.format.write, payload))
            except OSError as err:
                previous = latest_step(self.root)
                kept = f"step {previous['step']}" if previous else "none"
                raise RuntimeConfigError(
                    f"cannot write checkpoint {path}: {err.strerror or err}; the latest "
                    f"checkpoint stays the previous one ({kept}). Free space, or point "
                    f"--checkpoint-dir elsewhere and resume from it"
                ) from None
        if self.store is None:
            self._publish(step, extra)
            return
        key = f"pipeoptim/ckpt/{step}"
        self.store.add(key, 1)
        if self.rank != 0:
            return
        deadline = time.monotonic() + self.timeout
        while self.store.add(key, 0) < self.world_size:
            self.abort_check()
            if time.monotonic() > deadline:
                raise RuntimeConfigError(
                    f"checkpoint of step {step}: not every rank wrote its stage file within "
                    f"{self.timeout:.0f} s; the previous checkpoint stays the latest"
                )
            time.sleep(0.01)
        self._publish(step, extra)

    def _publish(self, step: int, extra: Mapping[str, Any]) -> None:
        record = {"step": step, "num_stages": self.num_stages, "config": self.config, **extra}
        text = (json.dumps(record, indent=2) + "\n").encode()
        pointer = self.root / _LATEST
        try:
            _atomic_write(pointer, lambda f: f.write(text))
        except OSError as err:  # the old pointer is untouched (a temporary file, then rename)
            previous = latest_step(self.root)
            still = f"step {previous['step']}" if previous else "none"
            if previous is None or int(previous["step"]) != step:
                # unpublished: removed, so no resume takes it over the pointer's checkpoint
                shutil.rmtree(_step_dir(self.root, step), ignore_errors=True)
            raise RuntimeConfigError(
                f"cannot write checkpoint pointer {pointer}: {err.strerror or err}; the stage "
                f"files of step {step} were written but not published (they are removed), so "
                f"the latest checkpoint stays the previous one ({still}). Free space, or point "
                f"--checkpoint-dir elsewhere and resume from it"
            ) from None
        kept = [s for s in self.steps() if s <= step][: self.keep]
        for old in self.steps():
            if old not in kept:
                shutil.rmtree(_step_dir(self.root, old), ignore_errors=True)

    def steps(self) -> list[int]:
        """Steps that have a folder here, newest first."""
        found = []
        for folder in self.root.glob("step-*"):
            number = folder.name.removeprefix("step-")
            if folder.is_dir() and number.isdigit():
                found.append(int(number))
        return sorted(found, reverse=True)

    # -- reading ---------------------------------------------------------------------------
    def latest(self) -> dict[str, Any] | None:
        """The newest complete checkpoint's record, after checking it belongs to this run."""
        record = latest_step(self.root)
        if record is None:
            return None
        self._check_identity(record)
        return record

    def _check_identity(self, record: Mapping[str, Any]) -> None:
        """A checkpoint that records its cut (``boundaries``) may be resumed at another
        (``recut.py``); the rest of the identity must agree."""
        recut = isinstance(record.get("boundaries"), list)
        shown = identity_differences(record.get("config", {}), self.config, recut=recut)
        if shown:
            raise RuntimeConfigError(
                f"the checkpoint in {self.root} is from a different run ({'; '.join(shown)}); "
                f"resume with the same settings, or use another --checkpoint-dir "
                f"(checkpoint_dir=) to start fresh; nothing was loaded"
            )

    def newest_readable(self) -> tuple[dict[str, Any] | None, str | None]:
        """The newest step whose every stage file reads back, as a record, and a sentence
        when that is not the step ``latest.json`` names (it was damaged)."""
        try:
            pointer = self.latest()
        except RuntimeConfigError as err:
            if "different run" in str(err):
                raise
            pointer = None
        candidates = self.steps()
        if pointer is not None and int(pointer["step"]) not in candidates:
            candidates.insert(0, int(pointer["step"]))
        if pointer is not None:  # nothing newer than the pointer was complete
            candidates = [s for s in candidates if s <= int(pointer["step"])]
        problems: list[str] = []
        for step in candidates:
            try:
                count = self.num_stages
                payloads = [self.load(step, 0, torch.device("cpu"))]
                if isinstance(payloads[0].get("boundaries"), list):  # the cut it was written at
                    count = len(payloads[0]["boundaries"])
                payloads += [self.load(step, k, torch.device("cpu")) for k in range(1, count)]
            except RuntimeConfigError as err:
                problems.append(f"step {step}: {err}")
                continue
            record = {k: v for k, v in payloads[0].items() if k not in ("state", "stage")}
            record["num_stages"] = count
            self._check_identity(record)
            if not problems:
                return record, None
            return record, (
                f"the newest checkpoint could not be read ({'; '.join(problems)}); resumed from "
                f"step {step}, the newest complete one"
            )
        if problems:
            raise RuntimeConfigError(
                f"no checkpoint in {self.root} reads back ({'; '.join(problems)}); point "
                f"--checkpoint-dir at a complete one, or start fresh without --resume"
            )
        return None, None

    def holds_checkpoints(self) -> bool:
        return (self.root / _LATEST).exists() or bool(self.steps())

    def _stage_file(self, step: int, stage: int) -> tuple[Path, StageFormat]:
        """The stage's file (or folder) and its format: this store's, else the format whose
        file is there (a checkpoint written in another format resumes)."""
        folder = _step_dir(self.root, step)
        path = folder / f"stage-{stage}{self.format.suffix}"
        if not path.exists():
            for other in FORMATS.values():
                if (folder / f"stage-{stage}{other.suffix}").exists():
                    return folder / f"stage-{stage}{other.suffix}", other
        return path, self.format

    def load(
        self,
        step: int,
        stage: int,
        device: torch.device,
        units: tuple[int, int] | None = None,
    ) -> dict[str, Any]:
        """The payload of ``stage`` at ``step``; with ``units`` ``[a, b)``, a format that can
        (DCP's) reads only those units' tensors (a re-cut resume needs no more)."""
        path, fmt = self._stage_file(step, stage)
        try:
            read_units = getattr(fmt, "read_units", None)
            if units is not None and read_units is not None:
                payload: dict[str, Any] = read_units(path, device, units)
            else:
                payload = fmt.read(path, device)
        except FileNotFoundError:
            raise RuntimeConfigError(
                f"checkpoint of step {step} has no file for stage {stage} ({path}); the "
                f"folder is damaged, point --checkpoint-dir at a complete one"
            ) from None
        except Exception as err:  # a truncated or foreign file: unpickling fails in many ways
            raise RuntimeConfigError(
                f"cannot read checkpoint {path} ({type(err).__name__}); the folder is damaged, "
                f"point --checkpoint-dir at a complete one"
            ) from None
        if payload.get("format") != CHECKPOINT_FORMAT or payload.get("step") != step:
            raise RuntimeConfigError(f"{path} is not a pipeoptim checkpoint of step {step}")
        state: dict[str, Any] = payload["state"]
        # RNG states are CPU byte tensors whatever the device.
        state["rng"] = state["rng"].cpu()
        return payload
