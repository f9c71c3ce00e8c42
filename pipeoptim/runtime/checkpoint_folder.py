"""A Pipeline's checkpoint folder: held for the fit, loaded from on resume, written to.

Why apart from the fit loop: what a run may resume from, and who writes, are rules of the
folder (one writer: stage 0's rank of replica 0, under a lock; every rank reads; a fresh run
never writes into another run's folder), not of training. The files themselves are
:class:`~pipeoptim.runtime.checkpoint.CheckpointStore`'s.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.assembly import Assembly, RunState
from pipeoptim.runtime.checkpoint import CheckpointStore, DirectoryLock
from pipeoptim.runtime.transport import FailureBoard

__all__ = ["CheckpointFolder"]


class CheckpointFolder:
    """The checkpoints of one run in ``root``, as this process sees them."""

    def __init__(
        self,
        parts: Assembly,
        state: RunState,
        root: str,
        *,
        identity: dict[str, Any],
        hyperparameters: dict[str, Any],
        keep: int,
    ) -> None:
        self.parts, self.state, self.root = parts, state, root
        self.hyperparameters = hyperparameters
        shape, store = parts.shape, parts.store
        self.store = CheckpointStore(
            root,
            identity,
            num_stages=shape.num_stages,
            store=store,
            rank=min(parts.transports),
            world_size=len(parts.rank_of) if store is None else shape.num_ranks,
            timeout=parts.timeout,
            abort_check=FailureBoard(store).check if store is not None else lambda: None,
            keep=keep,
        )

    @contextmanager
    def held(self, resume: bool) -> Iterator[None]:
        """Hold the folder for a fit (one writer) and load from it, or refuse a fresh run
        into a folder that holds another run's checkpoints."""
        parts = self.parts
        writer = min(parts.transports) == 0 and parts.replicas.replica == 0
        lock = DirectoryLock(self.store.root) if writer else None
        if lock is not None:
            lock.acquire()
        try:
            if resume:
                self._restore()
            elif self.state.last_checkpoint is None and self.store.holds_checkpoints():
                raise RuntimeConfigError(
                    f"{self.store.root} already holds checkpoints of a run; continue it with "
                    f"--resume (fit(..., resume=True)), or give this run another "
                    f"--checkpoint-dir"
                )
            yield
        finally:
            if lock is not None:
                lock.release()

    def _restore(self) -> None:
        """Load the newest readable checkpoint (chosen on stage 0's rank, for every rank)."""
        parts, state = self.parts, self.state
        record, message = parts.on_first_rank(self.store.newest_readable)
        if record is None:
            return
        step = int(record["step"])
        notes = [message] if message else []
        theirs = record.get("hyperparameters") or {}
        changed = {
            k: [theirs[k], v]
            for k, v in self.hyperparameters.items()
            if k in theirs and theirs[k] != v
        }
        if changed:
            shown = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
            notes.append(f"resumed from step {step} with changed hyper-parameters: {shown}")
        for k, stage in sorted(parts.stages.items()):
            stage.load_state_dict(self.store.load(step, k, parts.device)["state"])
        for note in notes:
            warnings.warn(note, stacklevel=5)  # the caller of Pipeline.fit
        state.notes.extend(notes)
        state.resumed_with.update(changed)
        state.step = state.last_checkpoint = step

    def write(self, steps_per_epoch: int) -> None:
        """Checkpoint every stage of this process at the current step (replica 0 writes;
        the others hold the same state and only record the step)."""
        parts, state = self.parts, self.state
        if parts.replicas.replica != 0:
            state.last_checkpoint = state.step
            return
        epoch, pos = divmod(state.step, steps_per_epoch)
        states = {k: stage.state_dict() for k, stage in parts.stages.items()}
        extra = {
            "epoch": epoch,
            "data_position": {"epoch": epoch, "batch": pos},
            "hyperparameters": self.hyperparameters,
        }
        self.store.save(state.step, states, extra)
        state.last_checkpoint = state.step
