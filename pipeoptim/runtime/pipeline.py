"""The library entry point: ``Pipeline`` trains *your* model in *your* training script.

    pipe = Pipeline(layers, method="pipeoptim", stages=4,
                    optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4),
                    scheduler=lambda opt: CosineAnnealingLR(opt, T_max=1000),
                    loss_fn=F.cross_entropy, amp="bf16")
    result = pipe.fit(train_loader, epochs=3, eval_data=test_loader)

The same script runs in one process (``transport="local"``: every stage here, the way to
emulate P stages on one device) or as one rank per stage under ``torchrun``
(``transport="dist"``). Every stage builds its own optimizer (and scheduler) from the
factories over its own parameters and steps it once per update. Training runs as one
never-flushed pipeline over the whole ``fit``; it drains only where a checkpoint or an
evaluation is due (``checkpoint_every``, ``eval_every``) and at the end.

Only stage 0's rank reads the data (``feed.py``); shapes, batch counts and evaluation chunk
sizes reach the other ranks through ``torch.distributed.broadcast_object_list``. A dry run of
two samples through every stage (the *probe*) before any work finds the receive shapes and
catches layers that do not chain, wrong feature counts, bad targets and non-scalar losses,
naming the stage and the unit.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch._C._distributed_c10d import Store
from tqdm import tqdm

from pipeoptim.errors import PipeoptimError, RuntimeConfigError
from pipeoptim.plan.limits import estimate_work
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.plan.schedules import Shape
from pipeoptim.runtime.checkpoint import (
    DEFAULT_KEEP,
    CheckpointStore,
    DirectoryLock,
    Segment,
    plan_segments,
)
from pipeoptim.runtime.closure import PredictionClosure
from pipeoptim.runtime.config import (
    MAX_SEED,
    check_options,
    check_replicas,
    resolve_plan,
    run_length,
)
from pipeoptim.runtime.executor import (
    Boundary,
    NonFiniteLossError,
    RankExecutor,
    RankResult,
    Recorder,
    drive_local,
    eval_plan,
    segment_plan,
)
from pipeoptim.runtime.feed import BatchSpec, EvalReader, TrainFeed, steps_per_epoch
from pipeoptim.runtime.models import stage_boundaries
from pipeoptim.runtime.placement import join_group, local_device
from pipeoptim.runtime.probe import probe_stages
from pipeoptim.runtime.replicas import GradientAverager, ReplicaGroups, collective
from pipeoptim.runtime.result import EvalResult, FitResult, build_trace, merge
from pipeoptim.runtime.stage import (
    LossFn,
    OptimizerFactory,
    SchedulerFactory,
    Stage,
)
from pipeoptim.runtime.transport import DistTransport, FailureBoard, LocalTransport, Transport
from pipeoptim.trace import Trace

__all__ = ["Pipeline"]

_FAMILIES = {"SGD": "sgd", "Adam": "adam", "AdamW": "adamw", "RMSprop": "rmsprop"}

SEGMENT_PASSES = 2**16
"""At most this many forward passes (mini-batches x stages x micro-batches) in one
never-flushed segment. A segment's schedule is laid out in advance, so this bounds the
memory of a long run: at 4 stages a drain (P-1 idle steps) every 16,384 mini-batches."""

SEGMENT_ACTIONS = 4_000_000
"""The most compute actions one segment may hold (about 140 B each in the executor); only
absurd shapes reach it (a segment is at most SEGMENT_PASSES passes, or 4P mini-batches)."""

HISTORY = 100_000
"""Per-step losses kept in memory (the newest); a run of 10^9 steps keeps no more."""


def _units(layers: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    units = list(layers) if isinstance(layers, (nn.Sequential, list, tuple)) else None
    if not units or not all(isinstance(u, nn.Module) for u in units):
        raise RuntimeConfigError(
            f"Pipeline takes an nn.Sequential or a non-empty list of nn.Module units (got "
            f"{type(layers).__name__}); each unit takes one tensor and returns one tensor"
        )
    return units


class Pipeline:
    """A model split into pipeline stages, trained with one of pipeoptim's methods.

    ``layers``: an ``nn.Sequential`` or list of units (a stage holds consecutive units).
    ``method``/``stages`` or ``plan`` (a Plan from ``pipeoptim plan``: its method, sizes and
    boundaries; explicit arguments override it). ``optimizer(params)`` and
    ``scheduler(optimizer)`` are called once per stage. ``loss_fn(output, target)`` returns
    the mean loss. ``amp``: None, ``"bf16"`` (CPU and CUDA) or ``"fp16"`` (CUDA, loss
    scaling per stage). ``grad_clip`` clips each stage's own gradient norm (stages update
    independently, so there is no global norm). ``checkpoint_dir``/``checkpoint_every``
    write per-stage checkpoints; ``fit(..., resume=True)`` continues from the latest.
    ``log_every``: mini-batches between reads of the loss (the only host syncs of the
    training loop); ``progress`` shows a progress bar. ``targets`` (``dist`` only):
    ``"send"`` (default) has stage 0's rank send each micro-batch's targets to the last
    stage's rank, one small message each; ``"read"`` has the last stage's rank iterate the
    data itself, no message, at the cost of loading every batch there too, and only right
    for data that yields the same batches on every rank (a DataLoader, shuffled or not,
    does under pipeoptim's per-epoch seeding; a stream from a shared queue does not).
    ``predicted_backward`` (predicting methods; beyond the paper): each predicted forward
    keeps its Ŵ for its backward, so the input gradients also go through Ŵ (consistent, as
    PipeDream's stash) at one weight copy per mini-batch in flight instead of PipeOptim's
    one extra copy; measured in ``examples/convergence``. ``data_parallel`` (``dist`` only):
    D replicas of the pipeline in D x P processes (``torchrun --nproc-per-node`` times
    ``--nnodes`` = D x P; global rank = replica x P + pipeline rank); each replica trains on
    its own 1/D of every batch the data yields (so the batch divides into D x M), and the
    replicas of a stage average their gradients before each update (``replicas.py``).
    Replica 0's weights are broadcast at start; only replica 0 writes checkpoints (every
    replica reads them on resume, so put ``checkpoint_dir`` on a shared file system across
    nodes); evaluation runs the whole data on every replica; the replicas draw the same
    dropout masks (one RNG stream per stage, as a resume restores it).
    """

    def __init__(
        self,
        layers: nn.Module | Sequence[nn.Module],
        method: str | None = None,
        *,
        stages: int | None = None,
        plan: Plan | None = None,
        optimizer: OptimizerFactory | OptimizerSpec | None = None,
        scheduler: SchedulerFactory | None = None,
        loss_fn: LossFn = F.cross_entropy,
        micro_batches: int | None = None,
        virtual_stages: int | None = None,
        prediction_offset: int | None = None,
        transport: str = "local",
        device: str = "auto",
        amp: str | None = None,
        grad_clip: float | None = None,
        checkpoint_dir: str | None = None,
        checkpoint_every: int | None = None,
        seed: int = 0,
        timeout: float = 300.0,
        progress: bool = False,
        log_every: int = 50,
        memory_every: int = 4,
        keep_checkpoints: int = DEFAULT_KEEP,
        targets: str = "send",
        store: Store | None = None,
        run_identity: dict[str, Any] | None = None,
        hyperparameters: dict[str, Any] | None = None,
        predicted_backward: bool = False,
        data_parallel: int | None = None,
    ) -> None:
        self.units = _units(layers)
        self.plan = resolve_plan(plan, method, stages, micro_batches, virtual_stages)
        if data_parallel is None:
            data_parallel = plan.data_parallel if isinstance(plan, Plan) else 1
        self.plan.data_parallel = check_replicas(data_parallel, transport)
        if prediction_offset is not None:
            self.plan.prediction_offset = prediction_offset
        check_options(optimizer, loss_fn, transport, amp, grad_clip, log_every, timeout)
        if not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise RuntimeConfigError(f"seed must be an integer in 0..{MAX_SEED} (got {seed!r})")
        if checkpoint_every is not None and (
            not isinstance(checkpoint_every, int) or checkpoint_every < 1
        ):
            raise RuntimeConfigError(
                f"checkpoint_every must be a positive number of mini-batches (got "
                f"{checkpoint_every!r})"
            )
        if checkpoint_every is not None and not checkpoint_dir:
            raise RuntimeConfigError(
                "checkpoint_every needs checkpoint_dir (where the checkpoints go)"
            )
        self.method = get_method(self.plan.method)
        if predicted_backward and self.method.prediction_rule is None:
            raise RuntimeConfigError(
                f"predicted_backward keeps the predicted weights of a forward for its backward, "
                f"and {self.method.name} does not predict; use pipeoptim, spectrain or xpipe, "
                f"or leave predicted_backward off"
            )
        self.predicted_backward = predicted_backward
        self.shape = self.plan.shape(1)
        per_step = self.shape.num_stages * self.shape.micro_batches
        self.segment_limit = max(4 * self.shape.num_ranks, SEGMENT_PASSES // per_step)
        """Mini-batches per segment at most (see SEGMENT_PASSES)."""
        work = estimate_work(self.method, replace(self.shape, mini_batches=self.segment_limit))
        if work.actions > SEGMENT_ACTIONS:
            raise RuntimeConfigError(
                f"one never-flushed segment ({self.segment_limit} mini-batches of "
                f"{self.shape.num_stages} stages x {self.shape.micro_batches} micro-batches) "
                f"is about {work.actions:,} actions, over the limit of {SEGMENT_ACTIONS:,}; "
                f"use fewer micro-batches (each carries B/M samples) or fewer stages"
            )
        self.loss_fn, self.amp, self.seed = loss_fn, amp, seed
        self.transport_name, self.timeout = transport, timeout
        self.checkpoint_dir, self.checkpoint_every = checkpoint_dir, checkpoint_every
        self.progress, self.log_every, self.memory_every = progress, log_every, memory_every
        n_stages = self.shape.num_stages
        self.bounds = stage_boundaries(
            len(self.units), n_stages, self.plan.boundaries, self.plan.model or "the model"
        )
        self.rank_of = segment_plan(self.method, self.shape).rank_of
        self.last = n_stages - 1
        self._owns_group = False
        self.store = store
        self.replicas = ReplicaGroups.single(self.shape.num_ranks)
        """This process's replica and its process groups (``replicas.py``)."""
        self.device, ranks = self._place(device)
        self.transports: dict[int, Transport] = (
            dict(enumerate(LocalTransport.group(self.shape.num_ranks)))
            if transport == "local"
            else {
                ranks[0]: DistTransport(
                    ranks[0],
                    self.shape.num_ranks,
                    self.device,
                    first_rank=self.replicas.global_rank(0),
                )
            }
        )
        spec = optimizer if optimizer is not None else self.plan.optimizer
        self.stages: dict[int, Stage] = {}
        for k, r in sorted(self.rank_of.items()):
            if r not in ranks:
                continue
            a, b = self.bounds[k]
            self.stages[k] = Stage(
                k,
                nn.Sequential(*self.units[a:b]),
                num_stages=n_stages,
                method=self.method,
                optimizer=spec,
                micro_batches=self.shape.micro_batches,
                prediction_offset=self.plan.prediction_offset,
                device=self.device,
                seed=seed * 1000 + k + 1,
                loss_fn=loss_fn,
                scheduler=scheduler,
                amp=amp,
                grad_clip=grad_clip,
                first_unit=a,
                predicted_backward=predicted_backward,
            )
        self._join_replicas()
        self._record_optimizer()
        self.identity = run_identity or self._identity()
        self.keep_checkpoints = keep_checkpoints
        if targets not in ("send", "read"):
            raise RuntimeConfigError(f"unknown targets {targets!r}; use 'send' or 'read'")
        self.targets = targets if transport == "dist" else "send"
        """How training targets reach the last stage's rank under dist (see the class)."""
        self.hyperparameters = hyperparameters or {"lr": self.plan.optimizer.lr}
        """What a resume may change (recorded in checkpoints and the trace)."""
        self._resumed_with: dict[str, Any] = {}
        self._notes: list[str] = []
        if transport == "dist":
            dist.barrier()  # a shared time origin for the trace
        self.recorder = Recorder(self.device, time.perf_counter())
        self.result = RankResult(ranks)
        self._spec: BatchSpec | None = None
        self._boundaries: list[Boundary] | None = None
        self._target: Boundary | None = None
        self._executors: list[RankExecutor] = []
        self._step = 0
        self._failed: str | None = None
        self._busy = False  # a schedule is running: an error now leaves passes in flight
        self._pending: list[tuple[int, Tensor, Tensor | None, int]] = []
        self._bar: Any = None
        self._last_checkpoint: int | None = None
        self._trace: Trace | None = None

    # -- construction ----------------------------------------------------------------------
    def _place(self, requested: str) -> tuple[torch.device, list[int]]:
        """This process's device and ranks; joins (or starts) the process group for dist."""
        if self.transport_name == "local":
            device = local_device(requested, self.plan.devices)
            return device, sorted(set(self.rank_of.values()))
        p, d = self.shape.num_ranks, self.plan.data_parallel
        device, rank, self._owns_group = join_group(
            p, requested, self.plan.devices, self.timeout, replicas=d
        )
        if self.store is None:
            self.store = dist.distributed_c10d._get_default_store()
        self.replicas = ReplicaGroups.build(d, p, device)
        return device, [rank % p]

    def _join_replicas(self) -> None:
        """Start every replica from replica 0's weights; average gradients before updates."""
        group = self.replicas.data_group
        if group is None:
            return
        self.replicas.broadcast_weights([s.module for s in self.stages.values()])
        for stage in self.stages.values():
            stage.grad_sync = GradientAverager(group, self.replicas.replicas)

    def _record_optimizer(self) -> None:
        """The plan (and trace) name the optimizer the stages actually built."""
        opt = next((s.optimizer for s in self.stages.values() if s.optimizer is not None), None)
        if opt is None:
            return
        family = _FAMILIES.get(type(opt).__name__, self.plan.optimizer.family)
        lr = float(opt.param_groups[0]["lr"])
        self.plan.optimizer = OptimizerSpec(family, lr if lr > 0 else self.plan.optimizer.lr)

    def _identity(self) -> dict[str, Any]:
        """What a checkpoint must agree on to be resumed (the same on every rank)."""
        p, shape = self.plan, self.shape
        units = [[type(u).__name__, [list(t.shape) for t in u.parameters()]] for u in self.units]
        return {
            "method": p.method,
            "num_stages": p.num_stages,
            "micro_batches": shape.micro_batches,
            "virtual_stages": shape.virtual_stages,
            "prediction_offset": p.prediction_offset,
            "boundaries": [list(b) for b in self.bounds],
            "units": units,
            "seed": self.seed,
            "amp": self.amp,
            # only when set, so checkpoints written before the option resume unchanged
            **({"predicted_backward": True} if self.predicted_backward else {}),
        }

    # -- sharing between ranks -------------------------------------------------------------
    def _share(self, obj: Any, stage: int) -> Any:
        """``obj`` as computed on the rank of ``stage``, on every rank."""
        if self.transport_name == "local":
            return obj
        box = [obj]
        cuda = self.device.type == "cuda"
        dist.broadcast_object_list(
            box,
            src=self.replicas.global_rank(self.rank_of[stage]),
            group=self.replicas.pipeline_group,
            device=self.device if cuda else None,
        )
        return box[0]

    def _on_first_rank(self, work: Any) -> Any:
        """Run ``work`` on stage 0's rank and share its result; an error there is raised on
        every rank (the original on stage 0's, its message elsewhere)."""
        out: Any = None
        error: BaseException | None = None
        if 0 in self.stages:
            try:
                out = work()
            except BaseException as err:
                error = err
                out = ("error", str(err) if isinstance(err, PipeoptimError) else repr(err))
        out = self._share(out, 0)
        if error is not None:
            raise error
        if isinstance(out, tuple) and len(out) == 2 and out[0] == "error":
            raise RuntimeConfigError(f"stage 0's rank failed: {out[1]}")
        return out

    # -- the dry run -----------------------------------------------------------------------
    def _probe(self, x: Tensor, y: Tensor) -> dict[str, Any]:
        """Two samples through every stage: receive shapes, and user errors found early."""
        boundaries = probe_stages(
            self.units, self.bounds, x[:2], y[:2], self.loss_fn, self.amp, self.device
        )
        return {"spec": BatchSpec.of(x, y), "boundaries": boundaries}

    def _adopt(self, info: dict[str, Any]) -> None:
        """Take the run's shapes (from the probe) and build the executors once."""
        spec: BatchSpec = info["spec"]
        if self._spec is None:
            self._boundaries = info["boundaries"]
            self._target = Boundary(spec.target_shape, spec.target_dtype)
            self._spec = spec
            self._build_executors()
        self._spec = replace(self._spec, batch_size=spec.batch_size)

    def _build_executors(self) -> None:
        assert self._boundaries is not None and self._target is not None
        for rank in sorted(self.transports):
            mine = {k: s for k, s in self.stages.items() if self.rank_of[k] == rank}
            self._executors.append(
                RankExecutor(
                    rank,
                    mine,
                    self.transports[rank],
                    boundaries=self._boundaries,
                    target=self._target,
                    micro_size=1,
                    rank_of=self.rank_of,
                    recorder=self.recorder,
                    on_step=self._on_step if self.last in mine else None,
                    memory_every=self.memory_every,
                )
            )

    # -- training --------------------------------------------------------------------------
    def fit(
        self,
        data: Iterable[Any],
        *,
        epochs: int | None = None,
        max_steps: int | None = None,
        eval_data: Iterable[Any] | None = None,
        eval_every: int | None = None,
        steps_per_epoch: int | None = None,
        resume: bool = False,
    ) -> FitResult:
        """Train on ``data`` (an iterable of ``(input, target)`` batches) up to ``epochs``
        epochs or ``max_steps`` mini-batches, both counted from the start of training
        (step 0), so a resumed or repeated ``fit`` continues to the same end. Evaluates on
        ``eval_data`` every ``eval_every`` mini-batches (each one drains the pipeline) and
        at the end. Returns the merged result on every rank."""
        self._check_usable()
        for name, value in (
            ("epochs", epochs),
            ("max_steps", max_steps),
            ("eval_every", eval_every),
        ):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise RuntimeConfigError(f"{name} must be a positive integer (got {value!r})")
        if epochs is None and max_steps is None:
            epochs = 1
        try:
            checkpoints = self._checkpoints()
            with self._folder(checkpoints, resume):
                return self._train(
                    checkpoints, data, epochs, max_steps, eval_data, eval_every, steps_per_epoch
                )
        except BaseException as err:
            if self._busy or isinstance(err, NonFiniteLossError):
                self._failed = f"{type(err).__name__}: {err}"
            self._close_bar()
            if isinstance(err, NonFiniteLossError) and self.transport_name == "local":
                err.partial = merge(self.plan, [self.rank_result()], self._meta())
            raise

    def _check_usable(self) -> None:
        if self._failed is None:
            return
        where = (
            f"resume from {self.checkpoint_dir} with fit(..., resume=True)"
            if self.checkpoint_dir
            else "train again from the start (set checkpoint_dir to be able to resume)"
        )
        raise RuntimeConfigError(
            f"this Pipeline stopped on an error ({self._failed}) and its stages may hold "
            f"passes in flight, so it cannot train or evaluate again; build a new Pipeline "
            f"and {where}"
        )

    def _checkpoints(self) -> CheckpointStore | None:
        if not self.checkpoint_dir:
            return None
        return CheckpointStore(
            self.checkpoint_dir,
            self.identity,
            num_stages=self.shape.num_stages,
            store=self.store,
            rank=min(self.transports),
            world_size=len(self.rank_of) if self.store is None else self.shape.num_ranks,
            timeout=self.timeout,
            abort_check=FailureBoard(self.store).check if self.store is not None else lambda: None,
            keep=self.keep_checkpoints,
        )

    def _restore(self, checkpoints: CheckpointStore) -> None:
        """Load the newest readable checkpoint (chosen on stage 0's rank, for every rank)."""
        record, message = self._on_first_rank(checkpoints.newest_readable)
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
        for k, stage in sorted(self.stages.items()):
            stage.load_state_dict(checkpoints.load(step, k, self.device)["state"])
        for note in notes:
            warnings.warn(note, stacklevel=4)
        self._notes.extend(notes)
        self._resumed_with.update(changed)
        self._step = self._last_checkpoint = step

    @contextmanager
    def _folder(self, checkpoints: CheckpointStore | None, resume: bool) -> Iterator[None]:
        """Hold the checkpoint folder for the fit (one writer) and load from it, or refuse a
        fresh run into a folder that holds another run's checkpoints."""
        if checkpoints is None:
            yield
            return
        writer = min(self.transports) == 0 and self.replicas.replica == 0
        lock = DirectoryLock(checkpoints.root) if writer else None
        if lock is not None:
            lock.acquire()
        try:
            if resume:
                self._restore(checkpoints)
            elif self._last_checkpoint is None and checkpoints.holds_checkpoints():
                raise RuntimeConfigError(
                    f"{checkpoints.root} already holds checkpoints of a run; continue it with "
                    f"--resume (fit(..., resume=True)), or give this run another "
                    f"--checkpoint-dir"
                )
            yield
        finally:
            if lock is not None:
                lock.release()

    def _train(
        self,
        checkpoints: CheckpointStore | None,
        data: Iterable[Any],
        epochs: int | None,
        max_steps: int | None,
        eval_data: Iterable[Any] | None,
        eval_every: int | None,
        given_spe: int | None,
    ) -> FitResult:
        start = self._step
        feed: TrainFeed | None = None

        def make_feed(spe: int) -> TrainFeed:
            return TrainFeed(
                data,
                steps_per_epoch=spe,
                micro_batches=self.shape.micro_batches,
                device=self.device,
                seed=self.seed,
                start_step=start,
                replicas=self.replicas.replicas,
                replica=self.replicas.replica,
            )

        def read_first() -> dict[str, Any]:
            nonlocal feed
            spe, skipped = steps_per_epoch(data, given_spe)
            feed = make_feed(spe)
            x, y = feed.peek()
            if self._spec is not None:
                self._spec.check(x, y, "the first batch", any_size=True)
                info = {"spec": BatchSpec.of(x, y), "boundaries": self._boundaries}
            else:
                info = self._probe(x, y)
            return {**info, "spe": spe, "skipped": skipped}

        info = self._on_first_rank(read_first)
        self._adopt(info)
        assert self._spec is not None
        spe, batch = int(info["spe"]), self._spec.batch_size
        self.plan.batch_size = batch
        res = self.result
        res.steps_per_epoch, res.skipped_samples, res.batch_size = spe, info["skipped"], batch
        total = run_length(epochs, max_steps, spe)
        reads_targets = self.targets == "read" and self.last in self.stages and 0 not in self.stages
        target_feed = make_feed(spe) if reads_targets else None
        for ex in self._executors:
            ex.micro_size = batch // (self.shape.micro_batches * self.replicas.replicas)
            ex.feed = feed if 0 in ex.stages else None
            ex.targets_read = self.targets == "read"
            ex.target_feed = target_feed if self.last in ex.stages else None
        res.start_step = res.end_step = start
        if self.last in self.stages and self.progress and self.replicas.replica == 0:
            samples = max(total - start, 0) * batch
            self._bar = tqdm(total=samples, unit="sample", unit_scale=True, leave=False)
            self._bar.set_description(self.plan.method)
        t0 = time.perf_counter()
        every = [
            self.checkpoint_every,
            eval_every if eval_data is not None else None,
            self.segment_limit,
        ]
        try:
            for seg in plan_segments(start, total, every):
                self._run_segment(seg.first_step, seg.num_steps)
                self._step = res.end_step = seg.first_step + seg.num_steps
                res.train_seconds = time.perf_counter() - t0
                self._flush_metrics()
                at_end = self._step == total
                if checkpoints is not None and (
                    at_end or self._step % (self.checkpoint_every or total) == 0
                ):
                    self._checkpoint(checkpoints, spe)
                due = eval_every is not None and self._step % eval_every == 0
                if eval_data is not None and due and not at_end:
                    self._evaluate(eval_data)
        finally:
            res.train_seconds = time.perf_counter() - t0
            self._close_bar()
        if eval_data is not None:
            self._evaluate(eval_data)
        return self._merged()

    def _run_segment(self, first_step: int, num_steps: int) -> None:
        s = self.shape
        plan = segment_plan(
            self.method, Shape(s.num_ranks, s.micro_batches, num_steps, s.virtual_stages)
        )
        seg = Segment(0, first_step, num_steps)
        self._busy = True  # an error from here on leaves passes in flight
        for ex in self._executors:
            ex.begin(seg, plan)
        self._drive()
        self._busy = False
        self.recorder.resolve()

    def _drive(self) -> None:
        """Run every rank of this process to the end of the current schedule."""
        if len(self._executors) == 1:
            self._executors[0].run()
        else:
            drive_local(self._executors)
        for t in self.transports.values():
            t.flush()

    def _on_step(self, step: int, loss: Tensor, correct: Tensor | None, targets: int) -> None:
        self._pending.append((step, loss, correct, targets))
        if len(self._pending) >= self.log_every:
            self._flush_metrics()

    def _flush_metrics(self) -> None:
        """Read the pending losses from the device (one sync) and check them."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        losses = torch.stack([p[1].float() for p in pending])
        has_correct = all(p[2] is not None for p in pending)
        right = torch.stack([p[2] for p in pending]) if has_correct else None  # type: ignore[misc]
        losses, right = self._over_replicas(losses, right)
        values, counts = losses.tolist(), right.tolist() if right is not None else []
        res = self.result
        for i, (step, _, _, targets) in enumerate(pending):
            value = values[i]
            if value != value or abs(value) == float("inf"):
                raise NonFiniteLossError(self._nonfinite_message(value, step), step)
            res.losses[step] = value
            res.targets[step] = targets * self.replicas.replicas  # every replica's share
            if has_correct:
                res.correct[step] = int(counts[i])
        for record in (res.losses, res.targets, res.correct):
            while len(record) > HISTORY:  # oldest first: dicts keep insertion order
                del record[next(iter(record))]
        if self._bar is not None:
            self._bar.update(len(pending) * (self._spec.batch_size if self._spec else 1))
            self._bar.set_postfix(step=pending[-1][0], loss=f"{values[-1]:.4f}")

    def _over_replicas(self, losses: Tensor, right: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The whole batch's mean losses and correct counts from every replica's share
        (each replica's last stage saw 1/D of the batch). Every replica then checks the
        same values, so a non-finite loss stops all of them at the same step."""
        group = self.replicas.data_group
        if group is None:
            return losses, right
        n = len(losses)
        parts = [losses.double()] + ([right.double()] if right is not None else [])
        sums = torch.cat(parts)
        with collective(group, "averaging the losses"):
            dist.all_reduce(sums, group=group)
        mean = (sums[:n] / self.replicas.replicas).float()
        return mean, sums[n:].round().long() if right is not None else None

    def _nonfinite_message(self, value: float, step: int) -> str:
        if self._last_checkpoint is not None:
            kept = (
                f"the last good checkpoint (step {self._last_checkpoint}) in "
                f"{self.checkpoint_dir} was kept"
            )
        elif self.checkpoint_dir:
            kept = "no checkpoint had been written yet"
        else:
            kept = "nothing was checkpointed (set checkpoint_dir to keep one)"
        resume = (
            " and resume from it (--resume, fit(..., resume=True))"
            if self._last_checkpoint is not None
            else ""
        )
        return (
            f"non-finite loss ({value}) at step {step} (mini-batches count from 0); training "
            f"stopped and {kept}. Lower the learning rate{resume}" + self._divergence_advice()
        )

    def _divergence_advice(self) -> str:
        """The remedies the convergence study measured, for this method and depth."""
        p = self.shape.num_stages
        if not self.method.asynchronous or self.method.micro_batched:
            return "."
        s = p - 1
        text = (
            f"; {self.method.name} runs stage 0's forward {s} update(s) ahead of its backward "
            f"(s = P-1), and in the convergence study (examples/convergence/results) such "
            f"pipelines at 8 stages lost accuracy or diverged under SGD-momentum where gpipe, "
            f"2bw and xpipe (s <= 1) did not: use 2bw or xpipe, or fewer stages"
        )
        if self.method.prediction_rule is not None and not self.predicted_backward:
            text += (
                ", or predicted_backward=True (input gradients through the predicted "
                "weights too, one weight copy per mini-batch in flight)"
            )
        return text + "."

    def _checkpoint(self, checkpoints: CheckpointStore, spe: int) -> None:
        for k, stage in self.stages.items():
            finite = torch.stack([torch.isfinite(p).all() for p in stage.module.parameters()])
            if finite.numel() and not bool(finite.all()):
                raise NonFiniteLossError(
                    self._nonfinite_message(float("nan"), self._step)
                    + f" (the weights of stage {k} became non-finite)",
                    self._step,
                )
        if self.replicas.replica != 0:  # the replicas hold the same state: one writes it
            self._last_checkpoint = self._step
            return
        epoch, pos = divmod(self._step, spe)
        states = {k: stage.state_dict() for k, stage in self.stages.items()}
        extra = {
            "epoch": epoch,
            "data_position": {"epoch": epoch, "batch": pos},
            "hyperparameters": self.hyperparameters,
        }
        checkpoints.save(self._step, states, extra)
        self._last_checkpoint = self._step

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, data: Iterable[Any]) -> EvalResult:
        """Loss (and accuracy) of the live weights on ``data``: a forward-only schedule
        through the stages, any batch sizes. The same result on every rank."""
        self._check_usable()
        try:
            return self._evaluate(data)
        except BaseException as err:
            if self._busy:
                self._failed = f"{type(err).__name__}: {err}"
            raise

    def _evaluate(self, data: Iterable[Any]) -> EvalResult:
        reader = EvalReader(data, self._spec) if 0 in self.stages else None
        modes = {k: s.module.training for k, s in self.stages.items()}
        for s in self.stages.values():
            s.module.eval()  # dropout off, batch-norm statistics frozen
        first = 0
        try:
            while True:
                chunk: list[tuple[Tensor, Tensor]] = []

                def read(
                    first: int = first, chunk: list[tuple[Tensor, Tensor]] = chunk
                ) -> dict[str, Any]:
                    chunk[:] = reader.next_chunk() if reader is not None else []
                    if not chunk and first == 0:
                        raise RuntimeConfigError(
                            "the evaluation data is empty; give it at least one batch"
                        )
                    probe = self._probe(*chunk[0]) if chunk and self._spec is None else None
                    return {"sizes": [len(x) for x, _ in chunk], "probe": probe}

                info = self._on_first_rank(read)
                if info["probe"] is not None:
                    self._adopt(info["probe"])
                sizes: list[int] = info["sizes"]
                if not sizes:
                    break
                placement = tuple(sorted(self.rank_of.items()))
                plan = eval_plan(placement, len(sizes))
                self._busy = True
                for ex in self._executors:
                    ex.begin_eval(plan, sizes, first, chunk if 0 in ex.stages else None)
                self._drive()
                self._busy = False
                first += len(sizes)
        finally:
            for k, s in self.stages.items():
                s.module.train(modes[k])
            for ex in self._executors:
                ex.end_eval()
        return self._eval_result()

    def _eval_result(self) -> EvalResult:
        out: dict[str, Any] | None = None
        for ex in self._executors:
            sums = ex.eval_sums
            if sums is not None:
                loss = float(sums.loss) / max(sums.samples, 1)
                acc = int(sums.correct) / sums.targets if sums.classifier else None
                out = {"loss": loss, "accuracy": acc, "samples": sums.samples, "step": self._step}
                ex.eval_sums = None
        shared = self._share(out, self.last)
        if shared is None:
            raise RuntimeError("the evaluation produced no result on the last stage")
        self.result.evals.append(shared)
        return EvalResult.from_dict(shared)

    # -- results, state --------------------------------------------------------------------
    def rank_result(self) -> RankResult:
        """This process's share so far (after a failure too: the trace of what ran)."""
        self.recorder.resolve()
        res = self.result
        res.events, res.memory = self.recorder.events, self.recorder.memory
        res.weight_copies = {k: s.peak_weight_copies for k, s in self.stages.items()}
        res.meta = self._meta()
        res.predict_s = {
            k: seconds for k, s in self.stages.items() if (seconds := s.prediction_s) is not None
        }
        res.notes = [*self._notes, *sorted({n for s in self.stages.values() for n in s.notes})]
        return res

    def _meta(self) -> dict[str, Any]:
        ranks = self.shape.num_ranks
        device = (
            str(self.device) if self.transport_name == "local" else f"{self.device.type} x{ranks}"
        )
        return {
            "transport": self.transport_name,
            "device": device,
            "hyperparameters": self.hyperparameters,
            "resumed_with_changes": self._resumed_with,
            "trace_truncated": self.recorder.truncated,
            "model": self.plan.model or "custom",
            # the layer ranges the stages ran (the plan may leave them to the even split)
            "boundaries": [list(b) for b in self.bounds],
            "num_layers": len(self.units),
            "threads": torch.get_num_threads(),  # CPU threads each rank computed with
            # replicas of the pipeline; the events are replica 0's (they run alike)
            "data_parallel": self.replicas.replicas,
        }

    def _merged(self) -> FitResult:
        mine = self.rank_result()
        if self.transport_name == "dist":  # this replica's pipeline
            texts: list[Any] = [None] * self.shape.num_ranks
            dist.all_gather_object(texts, mine.to_json(), group=self.replicas.pipeline_group)
            results = [RankResult.from_json(t) for t in texts]
        else:
            results = [mine]
        merged = merge(self.plan, results, self._meta())
        self._trace = merged.trace
        return merged

    def trace(self) -> Trace:
        """The trace of the last ``fit`` (every rank's events), or of what ran so far."""
        if self._trace is not None and self._failed is None:
            return self._trace
        return build_trace(self.plan, [self.rank_result()], self._meta())

    def measure_prediction_closure(self) -> PredictionClosure:
        """Measure, from now on, how much of the stale weight distance every predicted
        forward of this process's stages removes (``runtime/closure.py``). Costs two flat
        weight copies per predicted forward in flight: for studies on small models."""
        probe = PredictionClosure()
        for stage in self.stages.values():
            stage.closure = probe
        return probe

    @property
    def replica(self) -> int:
        """This process's data-parallel replica (0 without data parallelism): the replicas
        return the same result, so a script reports from replica 0's first stage."""
        return self.replicas.replica

    @property
    def step(self) -> int:
        """Mini-batches trained so far (the global step)."""
        return self._step

    def state_dict(self) -> dict[str, Any]:
        """This process's stages (weights, optimizer, scheduler, predictor, RNG) and the step."""
        self._check_usable()
        return {
            "format": "pipeoptim-pipeline",
            "step": self._step,
            "stages": {k: s.state_dict() for k, s in self.stages.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != "pipeoptim-pipeline":
            raise RuntimeConfigError(
                "load_state_dict takes what Pipeline.state_dict() returned (no "
                "'format': 'pipeoptim-pipeline' in it)"
            )
        missing = sorted(set(self.stages) - set(state["stages"]))
        if missing:
            raise RuntimeConfigError(
                f"the state holds stages {sorted(state['stages'])} but this process runs "
                f"{sorted(self.stages)} (missing {missing}); load the state saved by the same "
                f"rank of a Pipeline of the same shape"
            )
        for k, s in self.stages.items():
            s.load_state_dict(state["stages"][k])
        self._step = int(state["step"])

    def close(self) -> None:
        """Leave the process group this Pipeline started (dist under torchrun)."""
        if self._owns_group and dist.is_initialized():
            if self._failed is None:
                # No rank tears its connections down while a peer is still using them.
                dist.barrier()
            dist.destroy_process_group()
            self._owns_group = False

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
