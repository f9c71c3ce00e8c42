"""The executor: interprets each rank's lowered action list, whatever the transport.

A run is a sequence of segments (``segments.py``); each is one continuous, never
flushed pipeline laid out by the method's own schedule generator, analysed by
``plan.versions`` (which weight version every pass uses) and lowered by
``plan.passes.add_communication`` (explicit SEND/RECV actions). A :class:`RankExecutor`
walks one rank's list: compute actions go to its stages, communication actions to its
transport. In one process (``LocalTransport``), :func:`drive_local` interleaves all ranks,
always running a rank that can progress (a receive is ready once its message was sent), so
every dependency is respected; with ``DistTransport`` each process runs its own rank and
blocks on receives. The code that touches stages and tensors is the same in both cases, so
a multi-process run computes bit for bit what the single-process one does.

Data enters at stage 0 from a :class:`~pipeoptim.runtime.feed.TrainFeed`; the targets of
each micro-batch travel from stage 0's rank to the last stage's as a ``target`` message,
with the mini-batch's counted targets as its second tensor (the micro-batch's loss is its
share of the mini-batch's token mean: ``stage.loss.token_share``).
What crosses a stage boundary is one tensor or a tuple of them (:data:`Boundary`); a tuple
travels as one message of several tensors, and its gradient as the tensors of its
floating-point ones (integer masks take no gradient).
Evaluation is the same interpreter on a forward-only schedule
(``plan.schedules.forward_only``). The executor interprets actions and nothing else: the
model is built by :mod:`~pipeoptim.runtime.assembly`, checkpoints are
:mod:`~pipeoptim.runtime.checkpoint_folder`'s, progress, losses and metrics
:mod:`~pipeoptim.runtime.fit_loop`'s, and the segments it runs are laid out by
:mod:`~pipeoptim.runtime.segments`.
Losses stay on the device; nothing here synchronises with the host per micro-batch.

The executor's parts, one concern each: its messages (names, receive specs, receives posted
ahead: :mod:`~pipeoptim.runtime.rank_messages`, its base class), the boundaries it allocates
from (:mod:`~pipeoptim.runtime.boundary`), the trace it records into
(:mod:`~pipeoptim.runtime.recorder`) and what a process returns
(:mod:`~pipeoptim.runtime.rank_result`); their names stay importable from here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pipeoptim.errors import StageError
from pipeoptim.plan.actions import Action, Kind
from pipeoptim.runtime.boundary import VARIES, Boundary, MappingSpec, TensorSpec
from pipeoptim.runtime.comm.stop_channel import StopChannel
from pipeoptim.runtime.comm.transport import Transport
from pipeoptim.runtime.feed import TrainFeed
from pipeoptim.runtime.model.ties import TieExchange
from pipeoptim.runtime.payload import (
    Gradients,
    Payload,
    boundary_mismatch,
    boundary_refusal,
    to_device,
)
from pipeoptim.runtime.pipeline_clip import PipelineClip
from pipeoptim.runtime.rank_messages import RankMessages
from pipeoptim.runtime.rank_result import RankResult
from pipeoptim.runtime.recorder import Recorder
from pipeoptim.runtime.segments import Segment, SegmentPlan, step_of
from pipeoptim.runtime.stage.loss import evaluation_weight
from pipeoptim.runtime.stage.stage import Stage
from pipeoptim.trace import MemorySample, TraceEvent

__all__ = [
    "Boundary",
    "EvalSums",
    "RankExecutor",
    "RankResult",
    "Recorder",
    "TensorSpec",
    "drive_local",
]


@dataclass
class EvalSums:
    """Evaluation totals on the last stage's device: loss x samples, correct, targets."""

    loss: Tensor
    correct: Tensor
    samples: int = 0
    targets: int = 0
    classifier: bool = True
    weight: Tensor | int = 0
    """What the loss sum is divided by: samples, or counted targets per sample position
    where targets are ignored (``stage.loss.evaluation_weight``)."""


StepCallback = Callable[[int, Tensor, Tensor | None, int], None]
"""Called on the rank of the last stage with (global step, loss, correct, targets counted);
loss and correct are device tensors, read by the caller at its log points."""


class RankExecutor(RankMessages):
    """Runs one rank's action list, one segment (or evaluation chunk) at a time."""

    def __init__(
        self,
        rank: int,
        stages: Mapping[int, Stage],
        transport: Transport,
        *,
        boundaries: Sequence[Boundary],
        target: TensorSpec,
        micro_size: int,
        rank_of: Mapping[int, int],
        recorder: Recorder,
        feed: TrainFeed | None = None,
        on_step: StepCallback | None = None,
        memory_every: int = 4,
    ) -> None:
        self.rank = rank
        self.stages = dict(stages)
        self.transport = transport
        self._posts_receives = transport.posts_receives
        self.boundaries = list(boundaries)
        self.target = target
        parts = [p for b in boundaries for p in _spec_parts(b)]
        self._varying = any(VARIES in p.shape for p in parts)
        """Shapes vary (``CommOptions.varying_shapes``): the boundaries hold free sizes."""
        self._input_shapes: dict[tuple[int, int], tuple[int, ...]] = {}
        self.micro_size = micro_size
        self.rank_of = dict(rank_of)
        self.last = max(self.rank_of)
        self.recorder = recorder
        self.feed = feed
        self.target_feed: TrainFeed | None = None
        """The last stage's own reading of the data, where targets are read, not sent."""
        self.on_step = on_step
        self.memory_every = max(1, memory_every)
        self._peak_memory = -1  # the most this rank's stages held at once, so far
        self.targets_read = False
        """Training targets: read by the last stage's rank itself (True) or sent to it by
        stage 0's rank (False). Evaluation targets are always sent."""
        self._actions: list[Action] = []
        self._lists: dict[int, list[Action]] = {}  # every rank's actions of the segment
        self._pos = 0
        self._first = 0  # global step of the segment's first mini-batch
        self._m = 1
        self._inputs: dict[tuple[int, int], Payload] = {}  # (consuming stage, mb) -> input
        self._grads: dict[tuple[int, int], Gradients] = {}  # (consuming stage, mb) -> gradient
        self._targets: dict[int, tuple[Tensor, Tensor | int | None]] = {}  # mb -> targets, the
        # mini-batch's counted targets (None: evaluation), first and last stage local
        self._loss: dict[int, list[Any]] = {}  # step -> [loss, correct, parts, targets]
        self._eval: list[tuple[Payload, Tensor]] | None = None  # the chunk, on stage 0's rank
        self._eval_sizes: list[int] = []
        self._eval_first = 0  # evaluation batches before this chunk (message names)
        self.eval_sums: EvalSums | None = None
        self.ties: TieExchange | None = None
        """Sums the gradients of weights shared across stages before their updates."""
        self.clip: PipelineClip | None = None
        """Clips the gradients by the norm over every stage (``optim/global_clip.py``);
        None: each stage clips its own, where it clips."""
        self.wait_s = 0.0
        """Seconds this rank has waited in receives (read and reset at each log point)."""
        self.last_distance: dict[int, int] = {}
        """The prediction distance of each stage's last forward."""
        self.stopped_after: int | None = None
        """The last mini-batch of the segment when a stop cut it short (``truncate``)."""
        self._gates: list[tuple[int, int]] = []  # (log point, horizon) not yet passed
        self.post_limits: list[tuple[int, int]] = []
        """On the process that decides a stop, where receives are posted in an agreed order:
        (log point, horizon) whose decision is not taken yet; no receive past the horizon is
        posted before it (one posted for a send that a stop cancels would take the next
        message of its channel). Set before :meth:`begin`."""
        self._channel: StopChannel | None = None
        self._steps = 0  # mini-batches in the segment
        self.on_log_update: Callable[[int], None] | None = None
        """Called with the global mini-batch after this rank's first stage updates on a log
        point inside a segment (every ``log_every``): a process without the last stage
        logs its stages' signals there."""
        self.log_every = 1
        self.replan: Callable[[int], SegmentPlan] | None = None
        """The plan of a segment of the same start and the given length (``truncate``)."""

    def begin(
        self,
        segment: Segment,
        plan: SegmentPlan,
        gates: Sequence[tuple[int, int]] = (),
        channel: StopChannel | None = None,
    ) -> None:
        """Start a segment. ``gates`` (under dist, where a callback may stop): for each log
        point inside it, (its mini-batch, its horizon): before any work past a horizon this
        rank waits for the decision at that point over ``channel``."""
        self._first, self._m = segment.first_step, plan.shape.micro_batches
        self._actions, self._pos = plan.actions.get(self.rank, []), 0
        self._eval_sizes = []
        self.stopped_after = None
        self._steps = plan.shape.mini_batches
        self._gates, self._channel = list(gates), channel
        if self._gates and channel is not None:
            channel.post(self._gates[0][0])
        for k, stage in self.stages.items():
            stage.begin_segment(plan.passes(k))
        self._lists = plan.actions
        self._agree(plan.actions, stops=bool(self._gates or self.post_limits))
        if self.clip is not None:
            self.clip.begin()
        self._post_ahead()

    def begin_eval(
        self,
        plan: SegmentPlan,
        sizes: Sequence[int],
        first: int,
        batches: list[tuple[Payload, Tensor]] | None,
    ) -> None:
        """Evaluate one chunk: ``sizes[i]`` samples in batch i, ``batches`` on stage 0's rank."""
        self._actions, self._pos = plan.actions.get(self.rank, []), 0
        self._first, self._m = 0, 1
        self._eval, self._eval_sizes, self._eval_first = batches, list(sizes), first
        self._agree(plan.actions, stops=False)
        self._post_ahead()

    def end_eval(self) -> None:
        self._actions, self._pos = [], 0
        self._eval, self._eval_sizes = None, []
        self._inputs.clear()
        self._targets.clear()

    @property
    def done(self) -> bool:
        return self._pos >= len(self._actions)

    def next_action(self) -> Action | None:
        return None if self.done else self._actions[self._pos]

    def ready(self) -> bool:
        """Whether the next action can run without waiting for another rank."""
        a = self.next_action()
        if a is None:
            return False
        if a.kind in (Kind.RECV_F, Kind.RECV_B):
            return self.transport.ready(self._recv_key(a))
        if self._needs_target_message(a):
            return self.transport.ready(self._target_spec(a.mb)[0])
        if a.kind is Kind.UPDATE and self.clip is not None:
            return self._clip_ready(self._first + a.mb)
        if a.kind is Kind.UPDATE and self.ties is not None and self.ties.holds(a.stage):
            return self.ties.ready(a.stage, self._first + a.mb)
        return True

    def _clip_ready(self, step: int) -> bool:
        """In one process: this rank's updates of ``step`` wait for the pipeline's clipping
        norm, which needs every rank's gradients (its own added here, once its shared
        weights' partners have sent theirs)."""
        assert self.clip is not None
        ties = self.ties
        if not self.clip.added(step):
            if ties is not None and not all(
                ties.ready(k, step) for k in self.stages if ties.holds(k)
            ):
                return False
            self.clip.add(step, self.stages, ties)
        return self.clip.ready(step)

    def run(self) -> None:
        """Run to the end of the segment, blocking on receives (one rank per process)."""
        while not self.done:
            self.step()
        self.drain_gates()

    def truncate(self, last_step: int) -> None:
        """End the segment after mini-batch ``last_step`` (global): drop every action of a
        later one. Nothing of those ran on any rank (``segments.stop_horizons``), and the
        actions left are the schedule of the shorter segment, so the weights are those of
        a run that ended there."""
        first, m = self._first, self._m
        last_step = min(last_step, first + self._steps - 1)
        if self.stopped_after is not None and self.stopped_after <= last_step:
            return
        done = self._actions[: self._pos]
        rest_before = self._actions[self._pos :]
        shorter = self.replan(last_step + 1 - first) if self.replan is not None else None
        mine = shorter.actions.get(self.rank, []) if shorter is not None else None
        if mine is not None and mine[: self._pos] == done:
            # the shorter segment's own schedule: where it differs from the longer one cut
            # short (a bounded delay's last, partial accumulation is applied), it is right
            self._actions = mine
        else:
            rest = [a for a in self._actions[self._pos :] if first + step_of(a, m) <= last_step]
            self._actions = done + rest
        self._agree_after_cut(self._lists, None if shorter is None else shorter.actions, last_step)
        kept = set(self._actions[self._pos :])
        for k, stage in self.stages.items():
            stage.forget_passes(
                [
                    a.mb
                    for a in rest_before
                    if a.kind is Kind.FORWARD and a.stage == k and a not in kept
                ]
            )
        self.stopped_after = last_step
        self._gates = []
        self.post_limits = []

    def _pass_gates(self, a: Action) -> None:
        """Wait for the stop decisions this action must not run ahead of (dist)."""
        assert self._channel is not None
        step = self._first + step_of(a, self._m)
        while self._gates and step > self._gates[0][1]:
            point, horizon = self._gates.pop(0)
            if self._channel.wait(point):
                self.truncate(horizon)
                return
            if self._gates:
                self._channel.post(self._gates[0][0])

    def drain_gates(self) -> None:
        """At the segment's end: take the decisions not yet waited for (each one was sent)."""
        while self._gates and self._channel is not None:
            point, horizon = self._gates.pop(0)
            if self._channel.wait(point):
                self.stopped_after = min(horizon, self._first + self._steps - 1)
                self._gates = []
            elif self._gates:
                self._channel.post(self._gates[0][0])

    def step(self) -> None:
        if self._gates:
            self._pass_gates(self._actions[self._pos])
            if self.done:  # the stop dropped what was left
                return
        a = self._actions[self._pos]
        self._pos += 1
        rec = self.recorder
        if self.evaluating or rec.full:  # not traced
            self._execute(a)
            rec.truncated = rec.truncated or not self.evaluating
            self._post_ahead()
            return
        start = rec.mark()
        version, nbytes, distance = self._execute(a)
        end = rec.mark()
        mb = self._first + a.mb if a.kind is Kind.UPDATE else self._global(a.mb)
        event = TraceEvent(
            self.rank, a.stage, a.kind.value, mb, 0.0, 0.0, version, nbytes, distance
        )
        rec.add(event, start, end)
        # Sampled every few micro-batches (the pattern repeats with each one), and whenever
        # the rank holds more than ever before, so the trace has its exact peak without a
        # sample per action; the stages' counts are kept up to date, so reading them is
        # a few integer sums.
        if a.kind.is_compute:
            counts = {k: stage.memory() for k, stage in self.stages.items()}
            if rec.cuda:
                total = int(torch.cuda.memory_allocated(rec.device))
            else:
                total = sum(sum(c.values()) for c in counts.values())
            if total > self._peak_memory or a.mb % self.memory_every == 0:
                self._peak_memory = max(self._peak_memory, total)
                detail: dict[str, int] = {}
                for k, c in counts.items():
                    for key, value in c.items():
                        detail[key] = detail.get(key, 0) + value
                    if not rec.cuda:  # on CUDA the total is the allocator's, not a sum
                        detail[f"stage:{k}"] = sum(c.values())
                rec.add(MemorySample(self.rank, 0.0, total, detail), start, end)
        self._post_ahead()

    def _execute(self, a: Action) -> tuple[int, int, int]:
        """Run one action; returns (global weight version, bytes, prediction distance)."""
        k, mb = a.stage, a.mb
        stage = self.stages.get(k)
        if stage is None or not a.kind.is_compute:
            return self._communicate(a)
        if a.kind is Kind.FORWARD:
            if self.evaluating:
                self._forward_eval(stage, mb)
                return 0, 0, 0
            step, j = divmod(mb, self._m)
            g = self._first + step
            x = self._stage_input(k, mb, lambda: self._feed().micro_batch(g, j))
            y, counted = self._take_target(mb) if stage.is_last else (None, None)
            out = stage.forward(mb, x, y, counted)
            if y is not None:
                assert isinstance(out, Tensor)  # the last stage returns its loss
                self._record_loss(g, out, stage.correct, y.numel())  # numel: a shape, no sync
            else:
                self._inputs[(k + 1, mb)] = self._fits_boundary(stage, mb, out)
            v = stage.versions(mb)
            distance = self.last_distance[k] = stage.distance(mb)
            return (
                stage.version_base(self._first) + v.forward_version,
                stage.activation_bytes(mb),
                distance,
            )
        if a.kind is Kind.BACKWARD_WEIGHT:  # local: the weight half sends nothing
            stage.backward_weight(mb)
            self._gradient_done(k, mb)
            return stage.version_base(self._first) + stage.versions(mb).backward_version, 0, 0
        if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
            run = stage.backward if a.kind is Kind.BACKWARD else stage.backward_input
            g_in = run(mb, None if stage.is_last else self._grads.pop((k, mb)))
            if a.kind is Kind.BACKWARD:
                self._gradient_done(k, mb)
            if k > 0:
                if g_in is None:  # the input took no gradient; the sender still expects one
                    b = self.boundaries[k - 1]
                    assert isinstance(b, TensorSpec)  # a tuple input's gradient is a tuple
                    shape = self._input_shapes.pop((k, mb), (self.micro_size, *b.shape))
                    g_in = torch.zeros(shape, dtype=b.grad_dtype, device=stage.device)
                else:
                    self._input_shapes.pop((k, mb), None)
                self._grads[(k - 1, mb)] = g_in
            return stage.version_base(self._first) + stage.versions(mb).backward_version, 0, 0
        version = stage.version_base(self._first) + stage.version
        if self.clip is not None:  # clipped by the pipeline's norm (``global_clip.py``)
            self.clip.add(self._first + mb, self.stages, self.ties)
            stage.update(self.clip.factor(self._first + mb))
        else:
            if self.ties is not None and self.ties.holds(k):
                self.ties.exchange(k, self._first + mb)
            stage.update()
        log = self.on_log_update
        due = (mb + 1) % self.log_every == 0 and mb + 1 < self._steps
        if log is not None and due and k == min(self.stages):
            log(self._first + mb)
        return version, 0, 0

    def _fits_boundary(self, stage: Stage, mb: int, out: Payload) -> Payload:
        """``out``, refused where it differs from the boundary the dry run found: the
        receiving rank allocates that shape before the message arrives (issue 33 item 2), so
        the same refusal holds whatever the transport (``payload.boundary_mismatch``)."""
        mismatch = boundary_mismatch(out, self.boundaries[stage.index], self._size(mb))
        if mismatch is not None:
            raise StageError(boundary_refusal(stage, self._where(mb), *mismatch))
        return out

    def _where(self, mb: int) -> str:
        if self.evaluating:
            return f"evaluation batch {self._eval_first + mb}"
        return f"micro-batch {self._global(mb)}"

    def _gradient_done(self, k: int, mb: int) -> None:
        """A micro-batch's weight gradients are in: a stage sharing weights with other
        stages sends its share once the step's last one is (``ties.py``)."""
        if self.ties is not None and self.ties.holds(k):
            self.stages[k].finish_backward()  # the shares sent are whole sums
            step, _ = divmod(mb, self._m)
            self.ties.gradient_done(k, self._first + step, self._m)

    def _feed(self) -> TrainFeed:
        if self.feed is None:
            raise RuntimeError(f"rank {self.rank} holds stage 0 but was given no data")
        return self.feed

    def _stage_input(self, k: int, mb: int, read: Callable[[], tuple[Payload, Tensor]]) -> Payload:
        """Stage 0 reads the data (and passes the targets on); other stages their input."""
        if k > 0:
            x = self._inputs.pop((k, mb))
            if self._varying and isinstance(x, Tensor) and not self.evaluating:
                self._input_shapes[(k, mb)] = tuple(x.shape)  # for a gradient it never took
            return x
        x, y = read()
        # training targets carry the mini-batch's counted targets (``loss.token_share``)
        step = self._first + mb // self._m
        if self.last in self.stages:
            self._targets[mb] = (y, None if self.evaluating else self._feed().counted_here(step))
        elif self.evaluating or not self.targets_read:
            message = y if self.evaluating else (y, self._feed().counted(step))
            self.transport.send(message, self.rank_of[self.last], self._target_spec(mb)[0])
        return x

    def _forward_eval(self, stage: Stage, mb: int) -> None:
        k = stage.index
        x = self._stage_input(k, mb, lambda: self._eval_batch(mb))
        out = stage.forward_eval(x)
        if not stage.is_last:
            self._inputs[(k + 1, mb)] = self._fits_boundary(stage, mb, out)
            return
        y, _ = self._take_target(mb)
        n = self._size(mb)
        loss = stage.loss(out, y, f"evaluation batch {self._eval_first + mb}").detach()
        correct = stage.count_correct(out, y)
        sums = self.eval_sums
        if sums is None:
            zero = torch.zeros((), device=stage.device)
            sums = self.eval_sums = EvalSums(zero, zero.long(), classifier=correct is not None)
        weight = evaluation_weight(y, n)  # tokens where targets are ignored (loss.py)
        sums.loss = sums.loss + loss.float() * weight
        sums.weight = sums.weight + weight
        if correct is not None:
            sums.correct = sums.correct + correct
        sums.classifier = sums.classifier and correct is not None
        sums.samples += n
        sums.targets += y.numel()

    def _eval_batch(self, mb: int) -> tuple[Payload, Tensor]:
        if self._eval is None:
            raise RuntimeError(f"rank {self.rank} holds stage 0 but was given no batches")
        x, y = self._eval[mb]
        device = self.stages[0].device
        return to_device(x, device), y.to(device, non_blocking=True)

    def _record_loss(self, step: int, loss: Tensor, correct: Tensor | None, targets: int) -> None:
        acc = self._loss.get(step)
        if acc is None:
            acc = self._loss[step] = [loss, correct, 0, 0]
        else:
            acc[0] = acc[0] + loss
            acc[1] = None if correct is None or acc[1] is None else acc[1] + correct
        acc[2] += 1
        acc[3] += targets
        if acc[2] == self._m:
            del self._loss[step]
            if self.on_step is not None:
                self.on_step(step, acc[0], acc[1], acc[3])
            while self.post_limits and self.post_limits[0][0] <= step:  # decided
                self.post_limits.pop(0)


_BACKWARD_KINDS = frozenset((Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT))
_FORWARD_KINDS = frozenset((Kind.FORWARD,))


def drive_local(executors: Sequence[RankExecutor]) -> None:
    """Run every rank of this process to the end of the segment, in waves: a forward wave
    runs, rank by rank from the first, every action a rank can run up to its next backward;
    a backward wave, from the last rank, every action up to its next forward. Each rank runs
    its own list in its own order, so what it computes is what a process of its own would
    (the local = dist tests hold it); the waves only choose which rank runs next. Why:
    one thread runs every stage here, and a forward after a forward (or a backward after a
    backward) finds the code and the boundary tensor hot; a 1F1B order rank by rank
    alternates them (issue 34). Deterministic; any valid schedule finishes."""
    pending = [e for e in executors if not e.done]
    backward = False
    idle_waves = 0
    while pending:
        progressed = False
        halt = _FORWARD_KINDS if backward else _BACKWARD_KINDS  # where this wave stops a rank
        for ex in reversed(pending) if backward else pending:
            while ex.ready():
                if ex.next_action().kind in halt:  # type: ignore[union-attr]  # ready: not done
                    break
                ex.step()
                progressed = True
        backward = not backward
        if progressed:
            idle_waves = 0
            pending = [e for e in pending if not e.done]
            continue
        idle_waves += 1
        if idle_waves == 2:
            waiting = ", ".join(f"rank {e.rank} at {e.next_action()}" for e in pending)
            raise RuntimeError(f"pipeline deadlock: every rank waits for a message ({waiting})")


def _spec_parts(b: Boundary) -> tuple[TensorSpec, ...]:
    """The specs of the tensors a boundary's message carries."""
    if isinstance(b, MappingSpec):
        return b.parts
    return b if isinstance(b, tuple) else (b,)
