"""The executor: interprets each rank's lowered action list, whatever the transport.

A run is a sequence of segments (see ``checkpoint.py``); each is one continuous, never
flushed pipeline laid out by the method's own schedule generator, analysed by
``plan.versions`` (which weight version every pass uses) and lowered by
``plan.passes.add_communication`` (explicit SEND/RECV actions). A :class:`RankExecutor`
walks one rank's list: compute actions go to its stages, communication actions to its
transport. With ``LocalTransport``, :func:`drive_local` interleaves all ranks in one process,
always running a rank that can progress (a receive is ready once its message was sent), so
every dependency is respected; with ``DistTransport`` each process runs its own rank and
blocks on receives. The code that touches stages and tensors is the same in both cases, so
a multi-process run computes bit for bit what the single-process one does.

Every action becomes a :class:`~pipeoptim.trace.TraceEvent`, every compute action a memory
sample. :class:`PipelineRun` is one process's share of a whole run.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch._C._distributed_c10d import Store
from tqdm import tqdm

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.actions import Action, Kind
from pipeoptim.plan.methods import Method, get_method
from pipeoptim.plan.passes import add_communication
from pipeoptim.plan.schedules import Shape, stage_ranks
from pipeoptim.plan.versions import MicroBatchVersions, VersionReport, analyze_versions
from pipeoptim.runtime.checkpoint import CheckpointStore, Segment, plan_segments
from pipeoptim.runtime.data import BatchOrder, MicroBatches
from pipeoptim.runtime.models import build_model, probe_outputs, stage_boundaries
from pipeoptim.runtime.stage import Stage
from pipeoptim.runtime.transport import MessageKey, Transport
from pipeoptim.trace import MemorySample, TraceEvent

if TYPE_CHECKING:
    from pipeoptim.runtime.launch import TrainConfig

__all__ = [
    "Boundary",
    "NonFiniteLossError",
    "PipelineRun",
    "RankExecutor",
    "RankResult",
    "Recorder",
    "SegmentPlan",
    "drive_local",
    "segment_plan",
]

LOOKAHEAD = 8
"""How many upcoming actions a rank scans to post its receives early."""


class NonFiniteLossError(RuntimeConfigError):
    """The loss became NaN or infinite; training stops at that step."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


@dataclass(frozen=True)
class Boundary:
    """One sample of a stage's output: what the next stage's rank allocates to receive."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.dtype if self.dtype.is_floating_point else torch.float32


@dataclass(frozen=True)
class SegmentPlan:
    """A segment's schedule: version analysis, lowered per-rank actions, stage placement."""

    shape: Shape
    versions: VersionReport
    actions: dict[int, list[Action]]
    rank_of: dict[int, int]

    def passes(self, stage: int) -> dict[int, MicroBatchVersions]:
        return {mb: v for (k, mb), v in self.versions.passes.items() if k == stage}


@lru_cache(maxsize=8)
def segment_plan(method: Method, shape: Shape) -> SegmentPlan:
    """Schedule, analyse and lower one segment length (a run's segments mostly share one)."""
    order = method.order(shape)
    return SegmentPlan(
        shape,
        analyze_versions(order, method.weight_policy, shape.micro_batches),
        add_communication(order),
        stage_ranks(order),
    )


Mark = float | torch.cuda.Event


class Recorder:
    """Trace events and memory samples of the ranks one process runs.

    Times are seconds since ``origin``, a ``perf_counter`` value taken after all ranks met
    (ranks of one machine share the clock). On CUDA actions are timed with events, resolved
    at segment ends, so timing never stalls the device mid-segment.
    """

    def __init__(self, device: torch.device, origin: float) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.origin = origin
        self.events: list[TraceEvent] = []
        self.memory: list[MemorySample] = []
        self._pending: list[tuple[TraceEvent | MemorySample, Any, Any]] = []
        self._base = torch.cuda.Event(enable_timing=True) if self.cuda else None  # type: ignore[no-untyped-call]
        if self._base is not None:
            self._base.record()
        self._base_time = time.perf_counter() - origin

    def mark(self) -> Mark:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            ev.record()
            return ev
        return time.perf_counter() - self.origin

    def add(self, item: TraceEvent | MemorySample, start: Mark, end: Mark) -> None:
        if isinstance(start, float) and isinstance(end, float):
            self._store(item, start, end)
        else:
            self._pending.append((item, start, end))

    def _store(self, item: TraceEvent | MemorySample, start: float, end: float) -> None:
        if isinstance(item, TraceEvent):
            self.events.append(replace(item, start=start, end=end))
        else:
            self.memory.append(MemorySample(item.rank, end, item.bytes, item.detail))

    def resolve(self) -> None:
        """Turn pending CUDA events into times (one device synchronisation)."""
        if not self._pending or self._base is None:
            return
        torch.cuda.synchronize(self.device)
        base = self._base
        for item, start, end in self._pending:
            t0 = self._base_time + base.elapsed_time(start) / 1e3
            self._store(item, t0, self._base_time + base.elapsed_time(end) / 1e3)
        self._pending = []


StepCallback = Callable[[int, float, int], None]
"""Called on the rank of the last stage with (global step, loss, correct samples)."""


class RankExecutor:
    """Runs one rank's action list, one segment at a time."""

    def __init__(
        self,
        rank: int,
        stages: Mapping[int, Stage],
        transport: Transport,
        *,
        boundaries: Sequence[Boundary],
        batches: MicroBatches,
        recorder: Recorder,
        on_step: StepCallback | None = None,
    ) -> None:
        self.rank = rank
        self.stages = dict(stages)
        self.transport = transport
        self.boundaries = list(boundaries)
        self.batches = batches
        self.recorder = recorder
        self.on_step = on_step
        self._actions: list[Action] = []
        self._pos = 0
        self._first = 0  # global step of the segment's first mini-batch
        self._m = 1
        self._rank_of: dict[int, int] = {}
        self._inputs: dict[tuple[int, int], Tensor] = {}  # (consuming stage, mb) -> tensor
        self._grads: dict[tuple[int, int], Tensor] = {}  # (consuming stage, mb) -> tensor
        self._loss: dict[int, tuple[float, int, int]] = {}  # step -> (loss, correct, parts)

    def begin(self, segment: Segment, plan: SegmentPlan) -> None:
        self._first, self._m, self._rank_of = (
            segment.first_step,
            plan.shape.micro_batches,
            plan.rank_of,
        )
        self._actions, self._pos = plan.actions.get(self.rank, []), 0
        for k, stage in self.stages.items():
            stage.begin_segment(plan.passes(k))
        self._post_ahead()

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
            return self.transport.ready(self._recv_spec(a)[0])
        return True

    def run(self) -> None:
        """Run to the end of the segment, blocking on receives (one rank per process)."""
        while not self.done:
            self.step()

    def step(self) -> None:
        a = self._actions[self._pos]
        self._pos += 1
        rec = self.recorder
        start = rec.mark()
        version, nbytes, distance = self._execute(a)
        end = rec.mark()
        mb = self._first + a.mb if a.kind is Kind.UPDATE else self._global(a.mb)
        event = TraceEvent(
            self.rank, a.stage, a.kind.value, mb, 0.0, 0.0, version, nbytes, distance
        )
        rec.add(event, start, end)
        if a.kind.is_compute:
            detail: dict[str, int] = {}
            for stage in self.stages.values():
                for key, value in stage.memory().items():
                    detail[key] = detail.get(key, 0) + value
            total = (
                int(torch.cuda.memory_allocated(rec.device)) if rec.cuda else sum(detail.values())
            )
            rec.add(MemorySample(self.rank, 0.0, total, detail), start, end)
        self._post_ahead()

    def _execute(self, a: Action) -> tuple[int, int, int]:
        """Run one action; returns (global weight version, bytes, prediction distance)."""
        k, mb = a.stage, a.mb
        stage = self.stages.get(k)
        if stage is None or not a.kind.is_compute:
            return self._communicate(a)
        if a.kind is Kind.FORWARD:
            step, j = divmod(mb, self._m)
            g = self._first + step
            x = self.batches.inputs(g, j) if k == 0 else self._inputs.pop((k, mb))
            out = stage.forward(mb, x, self.batches.labels(g, j) if stage.is_last else None)
            if stage.is_last:
                self._record_loss(g, out, stage.correct)
            else:
                self._inputs[(k + 1, mb)] = out
            v = stage.versions(mb)
            return self._first + v.forward_version, stage.activation_bytes(mb), stage.distance(mb)
        if a.kind is Kind.BACKWARD:
            g_in = stage.backward(mb, None if stage.is_last else self._grads.pop((k, mb)))
            if k > 0:
                if g_in is None:  # the input took no gradient; the sender still expects one
                    b = self.boundaries[k - 1]
                    shape = (self.batches.size, *b.shape)
                    g_in = torch.zeros(shape, dtype=b.grad_dtype, device=stage.device)
                self._grads[(k - 1, mb)] = g_in
            return self._first + stage.versions(mb).backward_version, 0, 0
        version = self._first + stage.version
        stage.update()
        return version, 0, 0

    def _communicate(self, a: Action) -> tuple[int, int, int]:
        k, mb = a.stage, a.mb
        if a.kind is Kind.SEND_F:
            t = self._inputs.pop((k + 1, mb))
            self.transport.send(t, self._rank_of[k + 1], ("act", k + 1, self._global(mb)))
        elif a.kind is Kind.SEND_B:
            t = self._grads.pop((k - 1, mb))
            self.transport.send(t, self._rank_of[k - 1], ("grad", k - 1, self._global(mb)))
        elif a.kind in (Kind.RECV_F, Kind.RECV_B):
            key, peer, shape, dtype = self._recv_spec(a)
            t = self.transport.recv(key, peer, shape, dtype)
            (self._inputs if a.kind is Kind.RECV_F else self._grads)[(k, mb)] = t
        else:
            raise RuntimeError(f"rank {self.rank}: action {a} is for a stage it does not hold")
        return 0, t.numel() * t.element_size(), 0

    def _recv_spec(self, a: Action) -> tuple[MessageKey, int, tuple[int, ...], torch.dtype]:
        n, k, mb = self.batches.size, a.stage, self._global(a.mb)
        if a.kind is Kind.RECV_F:
            b = self.boundaries[k - 1]
            return ("act", k, mb), self._rank_of[k - 1], (n, *b.shape), b.dtype
        b = self.boundaries[k]
        return ("grad", k, mb), self._rank_of[k + 1], (n, *b.shape), b.grad_dtype

    def _global(self, mb: int) -> int:
        """A segment's micro-batch id as the run counts it (messages and the trace)."""
        return self._first * self._m + mb

    def _post_ahead(self) -> None:
        for a in self._actions[self._pos : self._pos + LOOKAHEAD]:
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                self.transport.post_recv(*self._recv_spec(a))

    def _record_loss(self, step: int, loss: Tensor, correct: Tensor) -> None:
        value = float(loss)
        if value != value or abs(value) == float("inf"):
            raise NonFiniteLossError(
                f"non-finite loss ({value}) at step {step} (mini-batches count from 0); "
                f"training stopped and the last good checkpoint was kept. Lower --lr, then "
                f"resume from the checkpoint",
                step,
            )
        total, right, parts = self._loss.pop(step, (0.0, 0, 0))
        total, right, parts = total + value, right + int(correct), parts + 1
        if parts < self._m:
            self._loss[step] = (total, right, parts)
        elif self.on_step is not None:
            self.on_step(step, total, right)


def drive_local(executors: Sequence[RankExecutor]) -> None:
    """Run every rank of this process to the end of the segment: each rank runs until it
    waits for a message, then the next; deterministic, and any valid schedule finishes."""
    pending = [e for e in executors if not e.done]
    while pending:
        progressed = False
        for ex in pending:
            while ex.ready():
                ex.step()
                progressed = True
        pending = [e for e in pending if not e.done]
        if pending and not progressed:
            waiting = ", ".join(f"rank {e.rank} at {e.next_action()}" for e in pending)
            raise RuntimeError(f"pipeline deadlock: every rank waits for a message ({waiting})")


@dataclass
class RankResult:
    """What one process measured; plain data, so it travels as JSON between processes."""

    ranks: list[int]
    steps_per_epoch: int = 0
    start_step: int = 0
    end_step: int = 0
    losses: dict[int, float] = field(default_factory=dict)
    correct: dict[int, int] = field(default_factory=dict)
    test_correct: int = 0
    test_total: int = 0
    weight_copies: dict[int, int] = field(default_factory=dict)
    train_seconds: float = 0.0
    events: list[TraceEvent] = field(default_factory=list)
    memory: list[MemorySample] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> RankResult:
        d = json.loads(text)
        for key in ("losses", "correct", "weight_copies"):
            d[key] = {int(k): v for k, v in d[key].items()}
        d["events"] = [TraceEvent(**e) for e in d["events"]]
        d["memory"] = [MemorySample(**m) for m in d["memory"]]
        return cls(**d)


class PipelineRun:
    """One process's share of a training run: builds the stages of its ranks (every rank
    builds the whole model from the seed and keeps its slices), runs the segments,
    checkpoints between them and evaluates on the test set at the end."""

    def __init__(
        self,
        config: TrainConfig,
        transports: Mapping[int, Transport],
        device: torch.device,
        *,
        origin: float,
        store: Store | None = None,
        world_size: int = 1,
        abort_check: Callable[[], None] = lambda: None,
    ) -> None:
        plan, self.config, self.device = config.plan, config, device
        self.method = get_method(plan.method)
        self.transports = dict(transports)
        layers, self.data = build_model(config.model, config.seed)
        self.shape = plan.shape(1)
        self.num_stages, m = self.shape.num_stages, self.shape.micro_batches
        check_batch_size(config.batch_size, m)
        bounds = stage_boundaries(len(layers), self.num_stages, plan.boundaries, config.model)
        probe = probe_outputs(layers, bounds, self.data.train_x[:2])
        self.boundaries = [Boundary(shape, dtype) for shape, dtype in probe]
        self.rank_of = stage_ranks(self.method.order(self.shape))
        self.order = BatchOrder(len(self.data.train_x), config.batch_size, config.seed)
        self.recorder = Recorder(device, origin)
        self.stages: dict[int, Stage] = {}
        self.executors: list[RankExecutor] = []
        for rank in sorted(self.transports):
            mine = {
                k: Stage(
                    k,
                    nn.Sequential(*layers[bounds[k][0] : bounds[k][1]]),
                    num_stages=self.num_stages,
                    method=self.method,
                    optimizer=plan.optimizer,
                    micro_batches=m,
                    prediction_offset=plan.prediction_offset,
                    device=device,
                    seed=config.seed * 1000 + k + 1,
                )
                for k, r in sorted(self.rank_of.items())
                if r == rank
            }
            self.stages.update(mine)
            order = BatchOrder(len(self.data.train_x), config.batch_size, config.seed)
            self.executors.append(
                RankExecutor(
                    rank,
                    mine,
                    self.transports[rank],
                    boundaries=self.boundaries,
                    batches=MicroBatches(self.data, order, m, device),
                    recorder=self.recorder,
                    on_step=self._on_step if self.num_stages - 1 in mine else None,
                )
            )
        self.result = RankResult(sorted(self.transports), self.order.steps_per_epoch)
        self.checkpoints: CheckpointStore | None = None
        if config.checkpoint_dir:
            self.checkpoints = CheckpointStore(
                config.checkpoint_dir,
                config.identity(),
                num_stages=self.num_stages,
                store=store,
                rank=min(self.transports),
                world_size=world_size,
                timeout=config.timeout,
                abort_check=abort_check,
            )
        self._bar: Any = None

    @property
    def owns_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stages

    def total_steps(self) -> int:
        """Mini-batches of the whole run: epochs, capped by max_steps."""
        cfg, per_epoch = self.config, self.order.steps_per_epoch
        total = cfg.epochs * per_epoch if cfg.epochs is not None else cfg.max_steps or 0
        return min(total, cfg.max_steps) if cfg.max_steps is not None else total

    def restore(self) -> int:
        """Load the latest checkpoint when resuming; returns the step to start from."""
        record = self.checkpoints.latest() if self.config.resume and self.checkpoints else None
        if record is None or self.checkpoints is None:
            return 0
        step = int(record["step"])
        for k, stage in self.stages.items():
            stage.load_state_dict(self.checkpoints.load(step, k, self.device)["state"])
        return step

    def run(self) -> RankResult:
        res = self.result
        res.start_step = res.end_step = start = self.restore()
        total = self.total_steps()
        if self.owns_last_stage and not self.config.quiet and sys.stderr.isatty():
            samples = max(total - start, 0) * self.config.batch_size
            desc = self.config.plan.method
            self._bar = tqdm(total=samples, unit="sample", unit_scale=True, desc=desc, leave=False)
        t0 = time.perf_counter()
        every = self.config.checkpoint_every
        try:
            for seg in plan_segments(start, total, self.order.steps_per_epoch, every):
                self._run_segment(seg)
                res.end_step = seg.first_step + seg.num_steps
                res.train_seconds = time.perf_counter() - t0
                if self.checkpoints is not None:
                    self._checkpoint(res.end_step)
        finally:
            res.train_seconds = time.perf_counter() - t0
            if self._bar is not None:
                self._bar.close()
            self.collect()
        res.test_correct, res.test_total = self.evaluate()
        return res

    def collect(self) -> RankResult:
        """The result so far (after a failure too: the trace of what ran)."""
        self.recorder.resolve()
        self.result.events, self.result.memory = self.recorder.events, self.recorder.memory
        self.result.weight_copies = {k: s.peak_weight_copies for k, s in self.stages.items()}
        return self.result

    def _run_segment(self, seg: Segment) -> None:
        s = self.shape
        shape = Shape(s.num_ranks, s.micro_batches, seg.num_steps, s.virtual_stages)
        plan = segment_plan(self.method, shape)
        for ex in self.executors:
            ex.begin(seg, plan)
        if len(self.executors) == 1:
            self.executors[0].run()
        else:
            drive_local(self.executors)
        for t in self.transports.values():
            t.flush()
        self.recorder.resolve()

    def _checkpoint(self, step: int) -> None:
        assert self.checkpoints is not None
        for k, stage in self.stages.items():
            if not all(bool(torch.isfinite(p).all()) for p in stage.module.parameters()):
                raise NonFiniteLossError(
                    f"the weights of stage {k} became non-finite by step {step}; training "
                    f"stopped and the last good checkpoint was kept. Lower --lr",
                    step,
                )
        epoch, pos = divmod(step, self.order.steps_per_epoch)
        states = {k: stage.state_dict() for k, stage in self.stages.items()}
        extra = {"epoch": epoch, "data_position": {"epoch": epoch, "batch": pos}}
        self.checkpoints.save(step, states, extra)

    def _on_step(self, step: int, loss: float, correct: int) -> None:
        self.result.losses[step] = loss
        self.result.correct[step] = correct
        if self._bar is not None:  # the rate tqdm shows is samples/s
            self._bar.update(self.config.batch_size)
            acc = correct / self.config.batch_size
            self._bar.set_postfix(step=step, loss=f"{loss:.4f}", acc=f"{acc:.3f}")

    def evaluate(self) -> tuple[int, int]:
        """Test accuracy of the live weights: a forward-only pipeline, one batch at a time;
        returns (correct, total) on the process of the last stage, else (0, 0)."""
        x_all, y_all, bs = self.data.test_x, self.data.test_y, self.config.batch_size
        transport = next(iter(self.transports.values()))
        correct = 0
        modes = {k: stage.module.training for k, stage in self.stages.items()}
        for stage in self.stages.values():
            stage.module.eval()  # dropout off, batch-norm statistics frozen
        with torch.no_grad():
            for i, lo in enumerate(range(0, len(x_all), bs)):
                x = x_all[lo : lo + bs].to(self.device)
                n = len(x)
                for k, stage in sorted(self.stages.items()):
                    if k > 0 and k - 1 not in self.stages:
                        b, peer = self.boundaries[k - 1], self.rank_of[k - 1]
                        x = transport.recv(("eval", k, i), peer, (n, *b.shape), b.dtype)
                    x = stage.module(x)
                    if k + 1 < self.num_stages and k + 1 not in self.stages:
                        transport.send(x, self.rank_of[k + 1], ("eval", k + 1, i))
                if self.owns_last_stage:
                    y = y_all[lo : lo + bs].to(self.device)
                    correct += int((x.argmax(dim=-1) == y).sum())
        transport.flush()
        for k, stage in self.stages.items():
            stage.module.train(modes[k])
        return (correct, len(x_all)) if self.owns_last_stage else (0, 0)


def check_batch_size(batch_size: int, micro_batches: int) -> None:
    if batch_size % micro_batches:
        m = micro_batches
        raise RuntimeConfigError(
            f"batch size {batch_size} is not divisible by {m} micro-batches; use --batch-size "
            f"{max(m, batch_size // m * m)}, or a micro-batch count that divides {batch_size}"
        )
