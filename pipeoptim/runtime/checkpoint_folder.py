"""A Pipeline's checkpoint folder: held for the fit, loaded from on resume, written to.

Why apart from the fit loop: what a run may resume from, and who writes, are rules of the
folder (one writer: stage 0's rank of replica 0, under a lock; every rank reads; a fresh run
never writes into another run's folder), not of training. The files themselves are
:class:`~pipeoptim.runtime.checkpoint.store.CheckpointStore`'s.

A resume checks everything before it loads anything: the identity when it chooses the
checkpoint, every stage's state against the stage (names and shapes, optimizer class,
prediction rule) on every rank, and, once the first batch is read and before any step runs,
the batch size. A refused resume leaves the Pipeline as it was (weights, optimizer, step).
A checkpoint of another cut (stage count, boundaries) is re-cut by unit before the checks
(``checkpoint/recut.py``), reading only the stage files that hold this process's units.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.assembly import Assembly, RunState
from pipeoptim.runtime.checkpoint.formats import DEFAULT_FORMAT, FORMATS, StageFormat
from pipeoptim.runtime.checkpoint.recut import SavedCut, stage_layout
from pipeoptim.runtime.checkpoint.state_check import refusal
from pipeoptim.runtime.checkpoint.store import CheckpointStore, DirectoryLock
from pipeoptim.runtime.comm.failure_board import FailureBoard

__all__ = ["CheckpointFolder"]


@dataclass
class _Chosen:
    """The checkpoint a resume takes, checked and read, not yet loaded."""

    record: dict[str, Any]
    step: int
    states: dict[int, dict[str, Any]]
    """This process's stage states, on the CPU."""
    notes: list[str]
    """Why it is not the newest (the newest was damaged), that it was re-cut."""


def _on_device(obj: Any, device: torch.device, key: str = "") -> Any:
    """``obj`` with its tensors on ``device``, as ``torch.load(map_location=device)`` reads
    them; RNG states stay CPU byte tensors whatever the device."""
    if isinstance(obj, Tensor):
        return obj if key == "rng" else obj.to(device)
    if isinstance(obj, dict):
        return {k: _on_device(v, device, str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_device(v, device) for v in obj)
    return obj


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
        format: StageFormat = FORMATS[DEFAULT_FORMAT],
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
            format=format,
        )
        self._chosen: _Chosen | None = None
        """The checkpoint a resume chose and checked, until :meth:`restore` loads it."""

    @contextmanager
    def held(self, resume: bool) -> Iterator[None]:
        """Hold the folder for a fit (one writer) and choose and check the checkpoint to
        resume from (:meth:`restore` loads it, once the fit knows the batch size), or refuse
        a fresh run into a folder that holds another run's checkpoints."""
        parts = self.parts
        writer = min(parts.transports) == 0 and parts.replicas.replica == 0
        lock = DirectoryLock(self.store.root) if writer else None
        if lock is not None:
            lock.acquire()
        try:
            if resume:
                self._choose()
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

    def _choose(self) -> None:
        """Choose the newest readable checkpoint (on stage 0's rank, for every rank), read
        this process's stage files and check them against its stages (identity, weights'
        names and shapes, optimizer, predictor), on every rank before any rank goes on.
        Nothing is loaded here, and the step is not moved: :meth:`restore` loads, once the
        batch size is known."""
        parts = self.parts
        record, message = parts.on_first_rank(self.store.newest_readable)
        if record is None:
            return
        step = int(record["step"])
        saved_bounds = record.get("boundaries")
        now_bounds = [list(b) for b in parts.bounds]
        refused: list[tuple[int, str]] = []
        notes = [message] if message else []
        if isinstance(saved_bounds, list) and saved_bounds != now_bounds:
            states = self._recut(step, saved_bounds, refused)
            notes.append(self._recut_note(step, saved_bounds, now_bounds))
        else:
            # On the CPU until loaded, one stage at a time: no second copy on the device.
            states = {
                k: self.store.load(step, k, torch.device("cpu"))["state"] for k in parts.stages
            }
        for k, stage in sorted(parts.stages.items()):
            if k not in states:
                continue  # refused by the re-cut
            try:
                stage.check_state(states[k])
            except RuntimeConfigError as err:
                refused.append((k, str(err)))
        self._refuse(refused, step)
        self._chosen = _Chosen(record, step, states, notes)

    def _recut(
        self, step: int, saved_bounds: list[Any], refused: list[tuple[int, str]]
    ) -> dict[int, dict[str, Any]]:
        """This process's stages' states cut from the checkpoint's stages (``recut.py``),
        reading only the stage files that hold their units; a stage that does not fit goes
        to ``refused``."""
        parts = self.parts
        needed = sorted(
            {
                j
                for k in parts.stages
                for j in SavedCut.stages_holding(saved_bounds, *parts.bounds[k])
            }
        )
        held = [parts.bounds[k] for k in parts.stages]
        units = (min(a for a, _ in held), max(b for _, b in held))
        states: dict[int, dict[str, Any]] = {}
        try:
            saved = SavedCut(
                {j: self.store.load(step, j, torch.device("cpu"), units)["state"] for j in needed},
                saved_bounds,
            )
        except RuntimeConfigError as err:
            refused.extend((k, f"stage {k}: {err}") for k in sorted(parts.stages))
            return states
        beyond = saved.units_beyond(len(parts.units))
        for k, stage in sorted(parts.stages.items()):
            try:
                if beyond:
                    raise RuntimeConfigError(
                        f"the checkpoint holds units {beyond[0]}..{beyond[-1]}, which this "
                        f"model of {len(parts.units)} units does not have; a resume onto "
                        f"another cut needs the same units: resume with the model that "
                        f"wrote it, or start fresh; nothing was loaded"
                    )
                states[k] = saved.cut(stage_layout(stage))
            except RuntimeConfigError as err:
                refused.append((k, str(err)))
        return states

    def _recut_note(self, step: int, saved: list[Any], now: list[list[int]]) -> str:
        method = self.parts.method
        note = (
            f"resumed from step {step} written at {len(saved)} stages (units {saved}) onto "
            f"{len(now)} stages (units {now}): weights and optimizer state re-cut by unit"
        )
        if method.flushes:
            return note
        return note + (
            f"; the asynchronous pipeline ({method.name}) rebuilds what depends on its "
            f"schedule: weight predictions and the delay correction start afresh"
        )

    def _refuse(self, refused: list[tuple[int, str]], step: int) -> None:
        """Raise the refusals of every rank of this pipeline, on every rank (under dist one
        rank's stage may not fit where the others' do)."""
        parts = self.parts
        if not parts.process_model.one_process:
            seen: list[Any] = [None] * parts.shape.num_ranks
            dist.all_gather_object(seen, refused, group=parts.replicas.pipeline_group)
            refused = [r for rank in seen for r in rank]
        message = refusal(refused)
        if message is not None:
            raise RuntimeConfigError(
                f"cannot resume from the checkpoint of step {step} in {self.store.root}: {message}"
            )

    @property
    def start_step(self) -> int:
        """The step the fit starts from: the chosen checkpoint's, else the current one."""
        return self._chosen.step if self._chosen is not None else self.state.step

    def restore(
        self,
        batch_size: int,
        steps_per_epoch: int,
        *,
        checkpoint_every: int | None,
        drains: Sequence[int | None],
    ) -> None:
        """Load the checkpoint :meth:`held` chose, once the first batch told the batch size
        and before any step runs. A checkpoint written at another batch size is refused
        with nothing loaded (the batch size fixes the data position and the micro-batch
        size). ``drains``: the periods this run drains at (checkpoints, evaluations, the
        segment limit); a checkpoint off them, of an asynchronous method, is said in the
        notes: the fit that wrote it drained there and an uninterrupted run does not."""
        chosen, self._chosen = self._chosen, None
        if chosen is None:
            return
        parts, state, step, record = self.parts, self.state, chosen.step, chosen.record
        saved_batch = record.get("batch_size")
        if saved_batch is not None and int(saved_batch) != batch_size:
            raise RuntimeConfigError(self._batch_refusal(record, int(saved_batch), batch_size))
        notes = list(chosen.notes)
        theirs = record.get("hyperparameters") or {}
        changed = {
            k: [theirs[k], v]
            for k, v in self.hyperparameters.items()
            if k in theirs and theirs[k] != v
        }
        if changed:
            shown = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
            notes.append(f"resumed from step {step} with changed hyper-parameters: {shown}")
        notes += self._position_note(record, step, steps_per_epoch)
        notes += self._off_grid_note(step, checkpoint_every, drains)
        try:
            for k, stage in sorted(parts.stages.items()):
                stage.load_state_dict(_on_device(chosen.states.pop(k), parts.device))
        except BaseException as err:  # checked, so unforeseen: the stages are half loaded
            state.failed = f"resuming from step {step} failed part way: {type(err).__name__}: {err}"
            raise
        for note in notes:
            warnings.warn(note, stacklevel=4)  # restore, FitLoop.train, Pipeline.fit, its caller
        state.notes.extend(notes)
        state.resumed_with.update(changed)
        state.step = state.last_checkpoint = step

    def _batch_refusal(self, record: dict[str, Any], saved: int, now: int) -> str:
        step = int(record["step"])
        position = record.get("data_position") or {}
        at = (
            f" (step {step} was epoch {position['epoch']}, batch {position['batch']} there)"
            if {"epoch", "batch"} <= set(position)
            else ""
        )
        return (
            f"the checkpoint in {self.store.root} was written by a run whose batches held "
            f"{saved} samples{at}, and this run's data yields batches of {now}: the batch "
            f"size fixes the data position and each micro-batch's size, so the run would not "
            f"continue; resume with batches of {saved} (the DataLoader's batch_size, "
            f"--batch-size), or use another --checkpoint-dir (checkpoint_dir=) to start "
            f"fresh; nothing was loaded"
        )

    @staticmethod
    def _position_note(record: dict[str, Any], step: int, steps_per_epoch: int) -> list[str]:
        """A note where the data has another epoch length than the run that wrote the
        checkpoint (the same batch size): the data position moves."""
        position = record.get("data_position") or {}
        if not {"epoch", "batch"} <= set(position):
            return []
        epoch, batch = divmod(step, steps_per_epoch)
        if (position["epoch"], position["batch"]) == (epoch, batch):
            return []
        return [
            f"resumed from step {step}, which was epoch {position['epoch']}, batch "
            f"{position['batch']} in the run that wrote the checkpoint; this data has "
            f"{steps_per_epoch} batches per epoch, so the run continues at epoch {epoch}, "
            f"batch {batch}: it is not the data the checkpoint was trained on"
        ]

    def _off_grid_note(
        self, step: int, checkpoint_every: int | None, drains: Sequence[int | None]
    ) -> list[str]:
        """A note where the resumed step is not one this run drains at, for an asynchronous
        method (whose trajectory depends on where it drains; a flushing one does not)."""
        method = self.parts.method
        if method.flushes or any(k and step % k == 0 for k in drains):
            return []
        where = (
            f"which is not a multiple of checkpoint_every={checkpoint_every}"
            if checkpoint_every
            else "where the fit that wrote the checkpoint ended (checkpoint_every is not set)"
        )
        return [
            f"resumed from step {step}, {where}: the asynchronous pipeline ({method.name}) "
            f"drained there when that fit ended, and an uninterrupted run does not, so this "
            f"run differs from an uninterrupted one by that drain; end fits on a multiple of "
            f"checkpoint_every (max_steps, or epochs x steps per epoch) for exact resumes"
        ]

    def write(self, steps_per_epoch: int) -> None:
        """Checkpoint every stage of this process at the current step (replica 0 writes;
        the others hold the same state and only record the step). Where the optimizer state
        is sharded (``optim/sharded.py``) every replica takes part in gathering it whole, so
        the files are those of the unsharded run and resume at any D."""
        parts, state = self.parts, self.state
        sharded = parts.options.stage.shard_optimizer and parts.replicas.replicas > 1
        if parts.replicas.replica != 0 and not sharded:
            state.last_checkpoint = state.step
            return
        states = {k: stage.state_dict() for k, stage in sorted(parts.stages.items())}
        if parts.replicas.replica != 0:
            state.last_checkpoint = state.step
            return
        epoch, pos = divmod(state.step, steps_per_epoch)
        extra = {
            "epoch": epoch,
            "data_position": {"epoch": epoch, "batch": pos},
            # known once the first batch is read; a resume checks it before loading
            "batch_size": parts.plan.batch_size,
            "hyperparameters": self.hyperparameters,
            # the units each stage holds, for pipeoptim export: a run's identity names the
            # plan's boundaries, None where the units were split evenly
            "boundaries": [list(b) for b in parts.bounds],
            # the model's own names and source, for pipeoptim export (only when known)
            **({"model": parts.model_record} if parts.model_record else {}),
        }
        self.store.save(state.step, states, extra)
        state.last_checkpoint = state.step
