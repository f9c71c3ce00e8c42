"""The fit loop's watching: the losses read back every ``log_every`` mini-batches (the only
host syncs of training), the non-finite checks, and the callbacks' log points and stop
decisions.

Why apart from the loop: what a fit reports and when it may stop is one concern, which the
training loop (``fit_loop.py``) and the evaluation (``fit_evaluation.py``) both build on.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pipeoptim.errors import NonFiniteLossError
from pipeoptim.runtime.assembly import Assembly, RunState
from pipeoptim.runtime.comm.replicas import collective
from pipeoptim.runtime.divergence import nonfinite_message
from pipeoptim.runtime.executor import (
    Boundary,
    RankExecutor,
    RankResult,
    Recorder,
    TensorSpec,
)
from pipeoptim.runtime.feed import (
    BatchSpec,
)
from pipeoptim.runtime.observe.callbacks import (
    Callbacks,
    FitEnd,
    FitStart,
    StepEnd,
    Stop,
)
from pipeoptim.runtime.observe.signals import StageSignals, read_learning_rate
from pipeoptim.runtime.options.built import FitOptions
from pipeoptim.runtime.result import FitResult
from pipeoptim.trace import Trace

__all__ = ["HISTORY", "FitWatching"]

HISTORY = 100_000
"""Per-step losses kept in memory (the newest); a run of 10^9 steps keeps no more."""


class FitWatching:
    """The state of one process's fit loop, its loss reads and its callbacks' log points."""

    def __init__(
        self, parts: Assembly, state: RunState, options: FitOptions, hyperparameters: dict[str, Any]
    ) -> None:
        self.parts, self.state, self.options = parts, state, options
        self.hyperparameters = hyperparameters
        self.recorder = Recorder(parts.device, time.perf_counter())
        self.result = RankResult(parts.ranks)
        self.spec: BatchSpec | None = None
        self.boundaries: list[Boundary] | None = None
        self._target: TensorSpec | None = None
        self._executors: list[RankExecutor] = []
        self._pending: list[tuple[int, Tensor, Tensor | None, int]] = []
        self._bar: Any = None
        self.trace: Trace | None = None
        """The trace of the last completed fit (None: none yet)."""
        self.probed_training = False
        """The dry run checked that the loss trains (a fit's probe; evaluate's does not)."""
        self.callbacks = Callbacks([], None)
        """The user's callbacks and loggers (``observe/``), set by the Pipeline."""
        self._stop = Stop()
        self._control = False  # a callback may stop: log points carry stop decisions
        self._horizons: dict[int, int] = {}  # this segment's log points -> horizon (global)
        self._segment_last = 0  # the current segment's last mini-batch
        self._stop_sent = False
        self._last_log: tuple[float, int] = (0.0, 0)  # (time, mini-batches) at the last log
        self._segment_first = 0

    def _on_step(self, step: int, loss: Tensor, correct: Tensor | None, targets: int) -> None:
        self._pending.append((step, loss, correct, targets))
        if len(self._pending) >= self.options.log_every:
            self._flush_metrics(mid_segment=True)

    def _on_update(self, step: int) -> None:
        """A log point of a process without the last stage (its stages' signals only)."""
        if self.callbacks:
            self._log_point(step, {}, mid_segment=False)

    def _flush_metrics(self, mid_segment: bool = False) -> None:
        """Read the pending losses from the device (one sync) and check them; then the
        callbacks' log point."""
        if not self._pending:
            if not mid_segment and self.callbacks and self.parts.last not in self.parts.stages:
                self._on_update(self.state.step - 1)  # a segment's end, off the last stage
            return
        pending, self._pending = self._pending, []
        losses = torch.stack([p[1].float() for p in pending])
        has_correct = all(p[2] is not None for p in pending)
        right = torch.stack([p[2] for p in pending]) if has_correct else None  # type: ignore[misc]
        losses, right = self._over_replicas(losses, right)
        values, counts = losses.tolist(), right.tolist() if right is not None else []
        res = self.result
        replicas = self.parts.replicas.replicas
        for i, (step, _, _, targets) in enumerate(pending):
            value = values[i]
            if value != value or abs(value) == float("inf"):
                raise NonFiniteLossError(self.nonfinite_message(value, step), step)
            res.losses[step] = value
            res.targets[step] = targets * replicas  # every replica's share
            if has_correct:
                res.correct[step] = int(counts[i])
        for record in (res.losses, res.targets, res.correct):
            while len(record) > HISTORY:  # oldest first: dicts keep insertion order
                del record[next(iter(record))]
        if self._bar is not None:
            self._bar.update(len(pending) * (self.spec.batch_size if self.spec else 1))
            self._bar.set_postfix(step=pending[-1][0], loss=f"{values[-1]:.4f}")
        if self.callbacks or (mid_segment and self._control):
            read = {step: values[i] for i, (step, *_) in enumerate(pending)}
            self._log_point(pending[-1][0], read, mid_segment)

    def _over_replicas(self, losses: Tensor, right: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The whole batch's mean losses and correct counts from every replica's share
        (each replica's last stage saw 1/D of the batch). Every replica then checks the
        same values, so a non-finite loss stops all of them at the same step."""
        replicas = self.parts.replicas
        group = replicas.data_group
        if group is None:
            return losses, right
        n = len(losses)
        parts = [losses.double()] + ([right.double()] if right is not None else [])
        sums = torch.cat(parts)
        with collective(group, "averaging the losses"):
            dist.all_reduce(sums, group=group)
        mean = (sums[:n] / replicas.replicas).float()
        return mean, sums[n:].round().long() if right is not None else None

    def _check_finite_weights(self) -> None:
        """Refuse to checkpoint weights that became non-finite (the last good one stays)."""
        for k, stage in self.parts.stages.items():
            params = list(stage.module.parameters())
            if not params:  # a stage of parameter-free units (a lone ReLU)
                continue
            finite = torch.stack([torch.isfinite(p).all() for p in params])
            if not bool(finite.all()):
                raise NonFiniteLossError(
                    self.nonfinite_message(float("nan"), self.state.step)
                    + f" (the weights of stage {k} became non-finite)",
                    self.state.step,
                )

    def nonfinite_message(self, value: float, step: int) -> str:
        """What stopped, what was kept, and the remedies for this method and depth."""
        p = self.parts
        return nonfinite_message(
            value,
            step,
            last_checkpoint=self.state.last_checkpoint,
            checkpoint_dir=self.options.checkpoint_dir,
            method=p.method,
            shape=p.shape,
            options=p.options.stage,
        )

    def close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _begin_watching(self, start: int, total: int, batch: int) -> None:
        """A fit starts: whether stops travel at log points, and on_fit_start."""
        p = self.parts
        self._stop = Stop()
        self._stop_sent = False
        logs_updates = bool(self.callbacks) and p.last not in p.stages
        for ex in self._executors:
            ex.stopped_after = None
            ex.on_log_update = self._on_update if logs_updates else None
            ex.log_every = self.options.log_every
        wanted = bool(self.callbacks) and self.callbacks.may_stop
        channel = p.stop_channel
        self._control = (
            channel.any(wanted, "agreeing whether a callback may stop") if channel else wanted
        )
        self._last_log = (time.perf_counter(), start)
        if not self.callbacks:
            return
        world = dist.get_world_size() if channel is not None else 1
        rank = dist.get_rank() if channel is not None else 0
        info = FitStart(start, total, batch, self.run_config(), rank, world, tuple(p.stages))
        self.callbacks.call("on_fit_start", info)

    def _end_watching(self, result: FitResult | None, error: BaseException | None) -> None:
        if not self.callbacks:
            return
        said = None if error is None else f"{type(error).__name__}: {error}"
        info = FitEnd(self.state.step, self._stop.reason, said, result)
        try:
            self.callbacks.call("on_fit_end", info)
        except Exception:
            if error is None:
                raise
            # the fit's own error is the one to raise; the callback's is chained to it
            error.__context__ = error.__context__ or sys.exc_info()[1]

    @property
    def decides(self) -> bool:
        """Whether this process's callbacks' stop counts (it reads the losses, replica 0)."""
        channel = self.parts.stop_channel
        if channel is not None:
            return channel.decides
        return True

    def _stopping(self) -> bool:
        """At a segment's end: whether a callback asked to stop (every process agrees)."""
        channel = self.parts.stop_channel
        stopped = self._stop.requested or any(
            ex.stopped_after is not None for ex in self._executors
        )
        if channel is not None and self._control:
            stopped = channel.agree(stopped if channel.decides else False)
            if stopped and not self._stop.requested:
                self._stop.request("a callback on the process that reads the losses")
        return stopped

    def run_config(self) -> dict[str, Any]:
        """The run's configuration, as a logger records its hyper-parameters."""
        p = self.parts
        plan = p.plan
        return {
            "method": plan.method,
            "num_stages": p.shape.num_stages,
            "num_ranks": p.shape.num_ranks,
            "micro_batches": p.shape.micro_batches,
            "batch_size": plan.batch_size,
            "optimizer": plan.optimizer.family,
            "lr": plan.optimizer.lr,
            "seed": p.seed,
            "data_parallel": p.replicas.replicas,
            "boundaries": [list(b) for b in p.bounds],
            "transport": p.process_model.value,
            "hyperparameters": self.hyperparameters,
        }

    def stage_signals(self) -> dict[int, StageSignals]:
        """This process's stages at a log point (host numbers; waits reset)."""
        p = self.parts
        out: dict[int, StageSignals] = {}
        cuda = p.device.type == "cuda"
        # the measurement's own per-stage summary (one probe serves every stage it is on)
        probes = {id(st.closure): st.closure for st in p.stages.values() if st.closure}
        closures = {c.stage: c.median_ratio for pr in probes.values() for c in pr.summary()}
        for ex in self._executors:
            waited, ex.wait_s = ex.wait_s, 0.0
            for k, stage in sorted(ex.stages.items()):
                held = sum(stage.memory().values())
                if cuda and len(ex.stages) == 1:
                    held = int(torch.cuda.memory_allocated(p.device))
                out[k] = StageSignals(
                    stage=k,
                    rank=ex.rank,
                    lr=read_learning_rate(stage.optimizer),
                    memory_bytes=held,
                    wait_s=waited,
                    distance=ex.last_distance.get(k, 0),
                    closure=closures.get(k),
                    weight_copies=stage.weight_copies(),
                    updates=stage.version_base(self._segment_first) + stage.version,
                )
        return out

    def _log_point(self, step: int, losses: dict[int, float], mid_segment: bool) -> None:
        """on_step_end at a log point; inside a segment, the stop decision goes out."""
        res, now = self.result, time.perf_counter()
        then, done = self._last_log
        steps = step + 1 - done
        seconds = now - then
        batch = self.spec.batch_size if self.spec is not None else 0
        samples = steps * batch / seconds if seconds > 0 and steps > 0 else None
        tokens = None
        if losses and samples is not None:
            counted = sum(res.targets.get(s, 0) for s in losses)
            if counted > batch * len(losses):  # more than one target per sample: tokens
                tokens = counted / seconds * steps / len(losses)
        self._last_log = (now, step + 1)
        info = StepEnd(
            step=step,
            losses=losses,
            all_losses=res.losses,
            samples_per_s=samples,
            tokens_per_s=tokens,
            stages=self.stage_signals(),
            decides=self.decides,
            stop=self._stop,
        )
        self.callbacks.call("on_step_end", info)
        if mid_segment and self._control and self.decides and not self._stop_sent:
            self._send_stop(step)

    def _send_stop(self, step: int) -> None:
        """The decision at a log point inside a segment: cut the segment where asked."""
        stop = self._stop.requested
        channel = self.parts.stop_channel
        if channel is not None:
            channel.send(step, stop)
        if stop:
            self._stop_sent = True
            horizon = min(self._horizons.get(step, self._segment_last), self._segment_last)
            for ex in self._executors:
                ex.truncate(horizon)
