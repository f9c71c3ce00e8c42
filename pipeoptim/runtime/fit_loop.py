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

import time
from collections.abc import Callable, Iterable
from typing import Any

from tqdm import tqdm

from pipeoptim.errors import PipeoptimError, RuntimeConfigError
from pipeoptim.plan.shape import Shape
from pipeoptim.runtime.checkpoint_folder import CheckpointFolder
from pipeoptim.runtime.comm.replicas import gather_over_replicas
from pipeoptim.runtime.config import run_length
from pipeoptim.runtime.feed import (
    BatchSpec,
    DataFingerprint,
    TrainFeed,
    readers_disagree,
    steps_per_epoch,
)
from pipeoptim.runtime.fit_evaluation import FitEvaluation
from pipeoptim.runtime.fit_watch import HISTORY
from pipeoptim.runtime.observe.callbacks import (
    CheckpointWritten,
)
from pipeoptim.runtime.options.built import FitOptions
from pipeoptim.runtime.result import FitResult
from pipeoptim.runtime.segments import (
    Segment,
    SegmentPlan,
    plan_segments,
    segment_plan,
    stop_horizons,
)

__all__ = ["HISTORY", "FitLoop", "FitOptions"]


class FitLoop(FitEvaluation):
    """Trains and evaluates the stages of one process (the executors of its ranks): the
    training loop over the dry run and evaluation (``fit_evaluation.py``) and the watching
    (``fit_watch.py``)."""

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
                varying_shapes=parts.options.varying_shapes,
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

    def _write_checkpoint(self, folder: CheckpointFolder, spe: int) -> None:
        self._check_finite_weights()
        folder.write(spe)
        if self.callbacks:
            root = str(self.options.checkpoint_dir)
            self.callbacks.call("on_checkpoint", CheckpointWritten(self.state.step, root))

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
            if self.decides and ex.transport.needs_order:
                ex.post_limits = sorted(self._horizons.items())
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
