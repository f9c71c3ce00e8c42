"""A Pipeline's fit loop: the data, the never-flushed segments, the losses, evaluation, and the
result of every rank.

Why this shape: training runs as one never-flushed pipeline over the whole ``fit``, cut into
segments only where a checkpoint or an evaluation is due (``checkpoint_every``,
``eval_every``), at the segment limit, and at the end. Only stage 0's rank reads the data
(``feed.py``); shapes, batch counts and evaluation chunk sizes reach the other ranks through
:meth:`Assembly.on_first_rank`. A dry run of two samples through every stage (the *probe*)
before any work finds the receive shapes and catches layers that do not chain, wrong feature
counts, bad targets and non-scalar losses, naming the stage and the unit. The executors run
the schedules; this loop only lays them out, reads the losses back every ``log_every``
mini-batches (the only host syncs of training), and stops on a non-finite one.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from tqdm import tqdm

from pipeoptim.errors import NonFiniteLossError, PipeoptimError, RuntimeConfigError
from pipeoptim.plan.schedules import Shape
from pipeoptim.runtime import host_allocator
from pipeoptim.runtime.assembly import Assembly, RunState
from pipeoptim.runtime.checkpoint_folder import CheckpointFolder
from pipeoptim.runtime.comm.replicas import collective, gather_over_replicas
from pipeoptim.runtime.config import run_length
from pipeoptim.runtime.divergence import nonfinite_message
from pipeoptim.runtime.executor import (
    Boundary,
    RankExecutor,
    RankResult,
    Recorder,
    TensorSpec,
    drive_local,
)
from pipeoptim.runtime.feed import (
    BatchSpec,
    DataFingerprint,
    EvalReader,
    TrainFeed,
    readers_disagree,
    steps_per_epoch,
)
from pipeoptim.runtime.observe.callbacks import (
    Callbacks,
    CheckpointWritten,
    EvalEnd,
    FitEnd,
    FitStart,
    StepEnd,
    Stop,
)
from pipeoptim.runtime.observe.signals import StageSignals, read_learning_rate
from pipeoptim.runtime.options.built import FitOptions
from pipeoptim.runtime.payload import Payload, batch_len, head
from pipeoptim.runtime.probe import probe_stage, probe_stages, stand_in
from pipeoptim.runtime.result import EvalResult, FitResult, build_trace, merge
from pipeoptim.runtime.segments import (
    Segment,
    SegmentPlan,
    eval_plan,
    plan_segments,
    segment_plan,
    stop_horizons,
)
from pipeoptim.trace import Trace

__all__ = ["HISTORY", "FitLoop", "FitOptions"]

HISTORY = 100_000
"""Per-step losses kept in memory (the newest); a run of 10^9 steps keeps no more."""


class FitLoop:
    """Trains and evaluates the stages of one process (the executors of its ranks)."""

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

    # -- the dry run -----------------------------------------------------------------------
    def _probe(self, x: Payload, y: Tensor, training: bool = False) -> dict[str, Any]:
        """Two samples through every stage: receive shapes, and user errors found early
        (``training``: also a loss that no trainable parameter reaches, once per loop)."""
        p = self.parts
        if p.chained_probe:  # stage by stage on every rank, once the sample is shared
            sample = (head(x, 2), y[:2])
            return {
                "spec": BatchSpec.of(x, y),
                "boundaries": None,
                "sample": sample,
                "training": training,
            }
        s = p.options.stage
        boundaries = probe_stages(
            p.units, p.bounds, head(x, 2), y[:2], s.loss_fn, s.amp, p.device, training=training
        )
        self.probed_training = self.probed_training or training
        return {"spec": BatchSpec.of(x, y), "boundaries": boundaries}

    def _probe_chain(self, x: Payload, y: Tensor, training: bool) -> list[Boundary]:
        """The dry run of a model no rank holds whole: each rank runs its own stages, on the
        data (stage 0), on the output of its stage before, or on zeros of the shapes the
        previous stage's rank shared; an error is raised on every rank."""
        p = self.parts
        n = batch_len(x)
        specs: list[Boundary] = []
        h: Payload = x
        for k in range(len(p.bounds)):
            kept: list[Payload] = []  # this rank's output of stage k, for its stage k + 1

            def run(k: int = k, h: Payload = h, kept: list[Payload] = kept) -> Boundary:
                given = h if k == 0 or k - 1 in p.stages else stand_in(specs[k - 1], n, p.device)
                spec, out = probe_stage(
                    p.units, p.bounds, k, given, n, y, p.options.stage.loss_fn,
                    p.options.stage.amp, p.device,
                    training=training,
                )  # fmt: skip
                kept.append(out)
                return spec

            specs.append(p.on_stage(k, run))
            if kept:
                h = kept[0]
        self.probed_training = self.probed_training or training
        return specs

    def _adopt(self, info: dict[str, Any]) -> None:
        """Take the run's shapes (from the probe) and build the executors once."""
        spec: BatchSpec = info["spec"]
        if "sample" in info:  # a model no rank holds whole: every rank runs its stages
            sample_x, sample_y = info["sample"]
            chained = self._probe_chain(sample_x, sample_y, bool(info["training"]))
            info = {**info, "boundaries": info["boundaries"] or chained}
        if self.spec is None:
            self.boundaries = info["boundaries"]
            self._target = TensorSpec(spec.target_shape, spec.target_dtype)
            self.spec = spec
            self._build_executors()
        self.spec = replace(self.spec, batch_size=spec.batch_size)

    def _build_executors(self) -> None:
        assert self.boundaries is not None and self._target is not None
        p = self.parts
        for rank in sorted(p.transports):
            mine = {k: s for k, s in p.stages.items() if p.rank_of[k] == rank}
            self._executors.append(
                RankExecutor(
                    rank,
                    mine,
                    p.transports[rank],
                    boundaries=self.boundaries,
                    target=self._target,
                    micro_size=1,
                    rank_of=p.rank_of,
                    recorder=self.recorder,
                    on_step=self._on_step if p.last in mine else None,
                    memory_every=self.options.memory_every,
                )
            )
            self._executors[-1].ties = p.tie_exchange

    # -- training --------------------------------------------------------------------------
    def train(
        self,
        folder: CheckpointFolder | None,
        data: Iterable[Any],
        epochs: int | None,
        max_steps: int | None,
        eval_data: Iterable[Any] | None,
        eval_every: int | None,
        given_spe: int | None,
    ) -> FitResult:
        """Train from the current step to the run's end (see ``Pipeline.fit``)."""
        parts, state, options = self.parts, self.state, self.options
        shape, replicas = parts.shape, parts.replicas
        # a resume's step: the checkpoint is loaded once the first batch is read (restore)
        start = folder.start_step if folder is not None else state.step
        feed: TrainFeed | None = None

        def make_feed(spe: int) -> TrainFeed:
            return TrainFeed(
                data,
                steps_per_epoch=spe,
                micro_batches=shape.micro_batches,
                device=parts.device,
                seed=parts.seed,
                start_step=start,
                replicas=replicas.replicas,
                replica=replicas.replica,
            )

        def read_first() -> dict[str, Any]:
            nonlocal feed
            spe, skipped = steps_per_epoch(data, given_spe)
            feed = make_feed(spe)
            x, y = feed.peek()
            if self.spec is not None:
                self.spec.check(x, y, "the first batch", any_size=True)
                info = {"spec": BatchSpec.of(x, y), "boundaries": self.boundaries}
                if not self.probed_training:  # an evaluate() probed, without the loss check
                    probed = self._probe(x, y, training=True)
                    if "sample" in probed:  # stage by stage, on every rank (_adopt)
                        info = {**probed, "boundaries": self.boundaries}
            else:
                info = self._probe(x, y, training=True)
            fingerprint = DataFingerprint.of(x, y, spe, skipped, data)
            return {**info, "spe": spe, "skipped": skipped, "fingerprint": fingerprint}

        def read_last() -> tuple[TrainFeed, DataFingerprint]:
            spe, skipped = steps_per_epoch(data, given_spe)
            x, y = (last_feed := make_feed(spe)).peek()
            return last_feed, DataFingerprint.of(x, y, spe, skipped, data)

        info = parts.on_first_rank(read_first)
        self._adopt(info)
        assert self.spec is not None
        spe, batch = int(info["spe"]), self.spec.batch_size
        self._check_end(start, epochs, max_steps, spe, folder)  # before a resume loads
        if folder is not None:  # a resume loads now: the batch size is known, no step ran
            drains = (options.checkpoint_every, eval_every if eval_data is not None else None)
            folder.restore(
                batch,
                spe,
                checkpoint_every=options.checkpoint_every,
                drains=(*drains, options.segment_limit),
            )
        parts.plan.batch_size = batch
        res = self.result
        res.steps_per_epoch, res.skipped_samples, res.batch_size = spe, info["skipped"], batch
        total = run_length(epochs, max_steps, spe)
        last = parts.last
        reads_targets = options.targets == "read" and last in parts.stages and 0 not in parts.stages
        target_feed = self._readers_agree(info["fingerprint"], read_last if reads_targets else None)
        for ex in self._executors:
            ex.micro_size = batch // (shape.micro_batches * replicas.replicas)
            ex.feed = feed if 0 in ex.stages else None
            ex.targets_read = options.targets == "read"
            ex.target_feed = target_feed if last in ex.stages else None
        res.start_step = res.end_step = start
        self._begin_watching(start, total, batch)
        if last in parts.stages and options.progress and replicas.replica == 0:
            samples = max(total - start, 0) * batch
            self._bar = tqdm(total=samples, unit="sample", unit_scale=True, leave=False)
            self._bar.set_description(parts.plan.method)
        t0 = time.perf_counter()
        every = [
            options.checkpoint_every,
            eval_every if eval_data is not None else None,
            options.segment_limit,
        ]
        evaluated_at: int | None = None
        try:
            stopped_at_start = self._control and self._stopping()  # asked in on_fit_start
            for seg in [] if stopped_at_start else plan_segments(start, total, every):
                end = self._run_segment(seg.first_step, seg.num_steps)
                state.step = res.end_step = end
                res.train_seconds = time.perf_counter() - t0
                self._flush_metrics()
                at_end = state.step == total
                written = False
                if folder is not None and (
                    at_end or state.step % (options.checkpoint_every or total) == 0
                ):
                    self._write_checkpoint(folder, spe)
                    written = True
                due = eval_every is not None and state.step % eval_every == 0
                if eval_data is not None and due and not at_end:
                    self.evaluate(eval_data)
                    evaluated_at = state.step
                if not at_end and self._stopping():
                    if folder is not None and not written:  # a stop ends as the end does
                        self._write_checkpoint(folder, spe)
                    break
        except BaseException as err:
            res.train_seconds = time.perf_counter() - t0
            self.close_bar()
            self._end_watching(None, err)
            raise
        res.train_seconds = time.perf_counter() - t0
        self.close_bar()
        try:
            if eval_data is not None and evaluated_at != state.step:
                self.evaluate(eval_data, final=True)
            result = self.merged()
        except BaseException as err:
            self._end_watching(None, err)
            raise
        self._end_watching(result, None)
        return result

    # -- callbacks -------------------------------------------------------------------------
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

    def _write_checkpoint(self, folder: CheckpointFolder, spe: int) -> None:
        self._check_finite_weights()
        folder.write(spe)
        if self.callbacks:
            root = str(self.options.checkpoint_dir)
            self.callbacks.call("on_checkpoint", CheckpointWritten(self.state.step, root))

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

    def _readers_agree(
        self,
        first: DataFingerprint,
        read_last: Callable[[], tuple[TrainFeed, DataFingerprint]] | None,
    ) -> TrainFeed | None:
        """Once per fit, before any work: every rank that reads the data read the same first
        batch and epoch length (the last stage's rank under targets="read", whose feed
        ``read_last`` builds and which is returned; each replica's readers against replica
        0's). Every rank sees every fingerprint, so all refuse alike."""
        parts = self.parts
        theirs: Any = None
        error: BaseException | None = None
        feed: TrainFeed | None = None
        if self.options.targets == "read" and parts.rank_of[0] != parts.rank_of[parts.last]:
            if read_last is not None:
                try:
                    feed, theirs = read_last()
                except BaseException as err:  # said on every rank, raised here as it was
                    error, theirs = err, str(err) if isinstance(err, PipeoptimError) else repr(err)
            theirs = parts.share(theirs, parts.last)
        seen = gather_over_replicas(parts.replicas, (first, theirs), "comparing the data read")
        if error is not None:
            raise error
        ranks = (parts.shape.num_ranks, parts.rank_of[0], parts.rank_of[parts.last])
        message = readers_disagree(seen, ranks)
        if message is not None:
            raise RuntimeConfigError(message)
        return feed

    def _check_end(
        self,
        start: int,
        epochs: int | None,
        max_steps: int | None,
        spe: int,
        folder: CheckpointFolder | None,
    ) -> None:
        """Refuse a run that would end before the step it starts from (a resume, or a
        second fit, with a shorter epochs or max_steps): it would train nothing."""
        total = run_length(epochs, max_steps, spe)
        if total >= start:
            return
        resumed = folder is not None and start != self.state.step
        where = (
            f"the checkpoint in {self.options.checkpoint_dir} is at step {start}"
            if resumed
            else f"this Pipeline has trained to step {start}"
        )
        asked = (
            f"max_steps={max_steps}"
            if max_steps is not None and total == max_steps
            else f"epochs={epochs} x {spe} steps per epoch"
        )
        raise RuntimeConfigError(
            f"{where}, past the end of this run ({asked} ends at step {total}); epochs and "
            f"max_steps count from step 0, not from where the run resumes, so nothing would "
            f"train; ask for a run that ends after step {start} (e.g. max_steps={start + 1} "
            f"or more)"
        )

    def _run_segment(self, first_step: int, num_steps: int) -> int:
        """Run one segment; returns the step it ended at (earlier where a callback stopped)."""
        s = self.parts.shape
        # A stop's horizon is where the ranks' own order stands at a log point, so a
        # segment a callback may cut runs in that order (a dist run stops at the same step).
        grouped = self.options.forwards_first and not self._control
        plan = segment_plan(
            self.parts.method,
            Shape(s.num_ranks, s.micro_batches, num_steps, s.virtual_stages),
            grouped,
        )
        seg = Segment(0, first_step, num_steps)
        self._segment_first = first_step
        self._segment_last = first_step + num_steps - 1
        gates: list[tuple[int, int]] = []
        self._horizons = {}
        if self._control and not self._stop.requested:
            every = self.options.log_every
            points = tuple(range(every - 1, num_steps - 1, every))  # inside the segment
            horizons = stop_horizons(plan, points) if points else {}
            self._horizons = {first_step + t: first_step + h for t, h in horizons.items()}
            if not self.decides:
                gates = sorted(self._horizons.items())

        def replan(steps: int) -> SegmentPlan:
            return segment_plan(
                self.parts.method, Shape(s.num_ranks, s.micro_batches, steps, s.virtual_stages)
            )

        self.state.busy = True  # an error from here on leaves passes in flight
        for ex in self._executors:
            ex.begin(seg, plan, gates, self.parts.stop_channel if gates else None)
            ex.replan = replan if self._control else None
        self._drive()
        channel = self.parts.stop_channel
        if channel is not None and self._stop_sent:
            channel.flush()
        self.state.busy = False
        self.recorder.resolve()
        cut = [ex.stopped_after for ex in self._executors if ex.stopped_after is not None]
        return min(cut) + 1 if cut else first_step + num_steps

    def _drive(self) -> None:
        """Run every rank of this process to the end of the current schedule."""
        if len(self._executors) == 1:
            self._executors[0].run()
        else:
            drive_local(self._executors)
        for t in self.parts.transports.values():
            t.flush()

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
            num_stages=p.shape.num_stages,
            predicted_backward=p.options.stage.predicted_backward,
        )

    def close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, data: Iterable[Any], final: bool = False) -> EvalResult:
        """Loss (and accuracy) of the live weights on ``data``: a forward-only schedule."""
        result = self._evaluate(data)
        if self.callbacks:
            info = EvalEnd(
                self.state.step,
                result.loss,
                result.accuracy,
                result.samples,
                final,
                self.decides,
                self._stop,
            )
            self.callbacks.call("on_eval_end", info)
        return result

    def _evaluate(self, data: Iterable[Any]) -> EvalResult:
        parts = self.parts
        reader = EvalReader(data, self.spec) if 0 in parts.stages else None
        modes = {k: s.module.training for k, s in parts.stages.items()}
        for s in parts.stages.values():
            s.module.eval()  # dropout off, batch-norm statistics frozen
        first = 0
        try:
            while True:
                chunk: list[tuple[Payload, Tensor]] = []

                def read(
                    first: int = first, chunk: list[tuple[Payload, Tensor]] = chunk
                ) -> dict[str, Any]:
                    chunk[:] = reader.next_chunk() if reader is not None else []
                    if not chunk and first == 0:
                        raise RuntimeConfigError(
                            "the evaluation data is empty; give it at least one batch"
                        )
                    probe = self._probe(*chunk[0]) if chunk and self.spec is None else None
                    return {"sizes": [batch_len(x) for x, _ in chunk], "probe": probe}

                info = parts.on_first_rank(read)
                if info["probe"] is not None:
                    self._adopt(info["probe"])
                sizes: list[int] = info["sizes"]
                if not sizes:
                    break
                placement = tuple(sorted(parts.rank_of.items()))
                plan = eval_plan(placement, len(sizes))
                self.state.busy = True
                for ex in self._executors:
                    ex.begin_eval(plan, sizes, first, chunk if 0 in ex.stages else None)
                self._drive()
                self.state.busy = False
                first += len(sizes)
        finally:
            for k, s in parts.stages.items():
                s.module.train(modes[k])
            for ex in self._executors:
                ex.end_eval()
        return self._eval_result()

    def _eval_result(self) -> EvalResult:
        out: dict[str, Any] | None = None
        for ex in self._executors:
            sums = ex.eval_sums
            if sums is not None:
                # weighted by tokens where targets are ignored (stage.loss.evaluation_weight)
                weight = float(sums.weight)
                loss = float(sums.loss) / weight if weight > 0 else math.nan
                acc = int(sums.correct) / sums.targets if sums.classifier else None
                out = {
                    "loss": loss,
                    "accuracy": acc,
                    "samples": sums.samples,
                    "step": self.state.step,
                }
                ex.eval_sums = None
        shared = self.parts.share(out, self.parts.last)
        if shared is None:
            raise RuntimeError("the evaluation produced no result on the last stage")
        self.result.evals.append(shared)
        return EvalResult.from_dict(shared)

    # -- results ---------------------------------------------------------------------------
    def rank_result(self) -> RankResult:
        """This process's share so far (after a failure too: the trace of what ran)."""
        self.recorder.resolve()
        res, stages = self.result, self.parts.stages
        res.events, res.memory = self.recorder.events, self.recorder.memory
        res.weight_copies = {k: s.peak_weight_copies for k, s in stages.items()}
        res.meta = self.meta()
        res.predict_s = {
            k: seconds for k, s in stages.items() if (seconds := s.prediction_s) is not None
        }
        res.recompute_held_bytes = {
            k: held for k, s in stages.items() if (held := s.recompute_held_bytes)
        }
        res.notes = [*self.state.notes, *sorted({n for s in stages.values() for n in s.notes})]
        return res

    def meta(self) -> dict[str, Any]:
        """The run's metadata, as the trace records it."""
        p = self.parts
        ranks = p.shape.num_ranks
        device = str(p.device) if p.process_model.one_process else f"{p.device.type} x{ranks}"
        return {
            "transport": p.process_model.value,
            "device": device,
            "hyperparameters": self.hyperparameters,
            "resumed_with_changes": self.state.resumed_with,
            "trace_truncated": self.recorder.truncated,
            "model": p.plan.model or "custom",
            # the layer ranges the stages ran (the plan may leave them to the even split)
            "boundaries": [list(b) for b in p.bounds],
            "num_layers": len(p.units),
            "threads": torch.get_num_threads(),  # CPU threads each rank computed with
            "host_allocator": host_allocator.applied(),  # glibc thresholds set; {}: none
            # replicas of the pipeline; the events are replica 0's (they run alike)
            "data_parallel": p.replicas.replicas,
        }

    def merged(self) -> FitResult:
        """Every rank's result of this replica's pipeline, merged (the same on every rank)."""
        mine = self.rank_result()
        p = self.parts
        if not p.process_model.one_process:  # this replica's pipeline
            texts: list[Any] = [None] * p.shape.num_ranks
            dist.all_gather_object(texts, mine.to_json(), group=p.replicas.pipeline_group)
            results = [RankResult.from_json(t) for t in texts]
        else:
            results = [mine]
        merged = merge(p.plan, results, self.meta())
        self.trace = merged.trace
        return merged

    def partial(self) -> FitResult:
        """What ran so far, merged from this process alone (a failed local run)."""
        return merge(self.parts.plan, [self.rank_result()], self.meta())

    def trace_so_far(self) -> Trace:
        """The trace of what ran so far in this process."""
        return build_trace(self.parts.plan, [self.rank_result()], self.meta())
