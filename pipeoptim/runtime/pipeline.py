"""The library entry point: ``Pipeline`` trains *your* model in *your* training script.

    pipe = Pipeline(layers, method="pipeoptim", stages=4,
                    optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4),
                    scheduler=lambda opt: CosineAnnealingLR(opt, T_max=1000),
                    loss_fn=F.cross_entropy, amp="bf16")
    result = pipe.fit(train_loader, epochs=3, eval_data=test_loader)

The same script runs in one process (``transport="local"``: every stage here, the way to
emulate P stages on one device) or as one rank per stage under ``torchrun``
(``transport="dist"``). Every stage builds its own optimizer (and scheduler) from the
factories over its own parameters and steps it once per update.

This module is the front: it checks the arguments once, hands them on as typed options
(:mod:`~pipeoptim.runtime.options`), builds the parts (:mod:`~pipeoptim.runtime.assembly`),
and hands ``fit`` and ``evaluate`` to the fit loop
(:mod:`~pipeoptim.runtime.fit_loop`) and the checkpoint folder
(:mod:`~pipeoptim.runtime.checkpoint_folder`). A Pipeline that failed with passes in flight
refuses further work, with the way to resume.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._C._distributed_c10d import Store

from pipeoptim.errors import NonFiniteLossError, RuntimeConfigError
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.plan.recompute import (
    UnitLabels,
    check_shard_optimizer,
    recompute_units,
    resolve_recompute,
)
from pipeoptim.plan.risk import depth_advice
from pipeoptim.runtime.assembly import Assembly, RunState
from pipeoptim.runtime.checkpoint.export import (
    check_export_target,
    export_checkpoint,
    merge_stages,
    write_export,
)
from pipeoptim.runtime.checkpoint.state_check import refusal
from pipeoptim.runtime.checkpoint.store import DEFAULT_KEEP, latest_step
from pipeoptim.runtime.checkpoint_folder import CheckpointFolder
from pipeoptim.runtime.comm.process_model import ProcessModel
from pipeoptim.runtime.config import (
    check_fit_arguments,
    check_fit_options,
    check_offset,
    check_options,
    check_replicas,
    check_whole,
    is_whole,
    resolve_plan,
)
from pipeoptim.runtime.executor import Boundary, RankResult, Recorder
from pipeoptim.runtime.fit_loop import FitLoop, FitOptions
from pipeoptim.runtime.host_allocator import keep_freed_memory
from pipeoptim.runtime.model.layout import stage_boundaries
from pipeoptim.runtime.model.units import InitWeights, ModelUnits
from pipeoptim.runtime.observe.callbacks import Callbacks, check_callbacks
from pipeoptim.runtime.optim.prediction_closure import PredictionClosure
from pipeoptim.runtime.optim.update import OptimizerFactory, SchedulerFactory
from pipeoptim.runtime.options import PipelineOptions, StageOptions
from pipeoptim.runtime.result import EvalResult, FitResult
from pipeoptim.runtime.segments import segment_limit
from pipeoptim.runtime.stage.loss import LossFn
from pipeoptim.runtime.stage.stage import Stage
from pipeoptim.trace import Trace

__all__ = ["Pipeline"]


def unit_labels(layers: object) -> UnitLabels:
    """What ``recompute`` may name each unit by: its key in an ``nn.Sequential`` (else its
    index) and its class."""
    if isinstance(layers, ModelUnits):
        units: list[Any] = list(layers.units)
        names = [str(i) for i in range(len(units))]
    elif isinstance(layers, nn.Sequential):
        units, names = list(layers), list(layers._modules)
    elif isinstance(layers, (list, tuple)):
        units, names = list(layers), [str(i) for i in range(len(layers))]
    else:
        units, names = [], []
    return UnitLabels(tuple(names), tuple(type(u).__name__ for u in units))


def _units(layers: nn.Module | Sequence[nn.Module] | ModelUnits) -> ModelUnits:
    if isinstance(layers, ModelUnits):
        return layers
    units = list(layers) if isinstance(layers, (nn.Sequential, list, tuple)) else None
    if not units or not all(isinstance(u, nn.Module) for u in units):
        raise RuntimeConfigError(
            f"Pipeline takes an nn.Sequential, a non-empty list of nn.Module units or a "
            f"ModelUnits (got {type(layers).__name__}); a unit takes the previous unit's "
            f"output (a tensor, or a tuple of tensors as its arguments)"
        )
    return ModelUnits(units)


class Pipeline:
    """A model split into pipeline stages, trained with one of pipeoptim's methods.

    ``layers``: an ``nn.Sequential`` or list of units (a stage holds consecutive units), or a
    :class:`~pipeoptim.runtime.model.units.ModelUnits` (units with their names in the user's
    model, for :meth:`export`, and a loss and initialiser: ``pipeoptim.hf.cut_causal_lm``
    makes one). Units built on the meta device are materialised stage by stage on the
    process that trains them and initialised by ``init_weights(index, unit)``. A Parameter
    used by units on two stages is kept one weight under synchronous methods and refused
    by asynchronous ones (``ties.py``).
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
    ``loggers`` and ``callbacks``: objects with some of the hooks ``on_fit_start``,
    ``on_step_end``, ``on_eval_end``, ``on_checkpoint``, ``on_fit_end``
    (:class:`~pipeoptim.runtime.observe.callbacks.Callback`), called in that order, loggers
    first, at the points where the fit already reads the losses (every ``log_every``), so
    they add no host synchronisation; ``TensorBoardLogger``, ``WandbLogger`` and
    ``JsonlLogger`` are in :mod:`pipeoptim.runtime.observe`. A callback may end the fit
    (``info.request_stop()``): it drains, checkpoints and evaluates as an end does.
    ``tune_allocator`` (CPU): raise glibc's mmap and trim thresholds in this process, so
    each step reuses the memory the last one freed instead of fresh pages
    (:mod:`~pipeoptim.runtime.host_allocator`; up to 256 MiB of freed memory stays in the
    process); False, or either of glibc's ``MALLOC_MMAP_THRESHOLD_`` and
    ``MALLOC_TRIM_THRESHOLD_`` set, leaves the allocator as it is.
    ``forwards_first`` (``transport="local"``): each rank runs its forwards between two of
    its updates back to back, then its backwards, as gpipe does, instead of the schedule's
    alternation (``plan.passes.forwards_first``). The same weights, losses and gradients
    bit for bit: nothing a forward reads changes between two updates, and the backwards
    keep their order. One thread runs every stage here, and 1F1B's alternation costs it
    more than the forwards in a row (xpipe's step at 16 stages, ``benchmarks/README.md``);
    the price is a rank's activations of up to one more mini-batch. A segment that a
    callback may cut short (``request_stop``) keeps the schedule's order, so the run stops
    where a ``dist`` run of it would.
    """

    def __init__(
        self,
        layers: nn.Module | Sequence[nn.Module] | ModelUnits,
        method: str | None = None,
        *,
        stages: int | None = None,
        plan: Plan | None = None,
        optimizer: OptimizerFactory | OptimizerSpec | None = None,
        scheduler: SchedulerFactory | None = None,
        loss_fn: LossFn | None = None,
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
        init_weights: InitWeights | None = None,
        recompute: object = None,
        shard_optimizer: bool | None = None,
        loggers: Sequence[Any] | None = None,
        callbacks: Sequence[Any] | None = None,
        tune_allocator: bool = True,
        forwards_first: bool = False,
    ) -> None:
        watchers = [
            *check_callbacks(loggers, "loggers"),
            *check_callbacks(callbacks, "callbacks"),
        ]
        labels = unit_labels(layers)
        self.model_units = _units(layers)
        """The units and what the model says of them (names for export, initialiser)."""
        units = self.model_units.units
        if loss_fn is None:
            loss_fn = self.model_units.loss_fn or F.cross_entropy
        if init_weights is None:
            init_weights = self.model_units.init_weights
        elif not callable(init_weights):
            raise RuntimeConfigError(
                f"init_weights must be a callable (index, unit) -> None that fills a unit's "
                f"tensors in place (got {type(init_weights).__name__})"
            )
        run_plan = resolve_plan(plan, method, stages, micro_batches, virtual_stages)
        if data_parallel is None:
            data_parallel = plan.data_parallel if isinstance(plan, Plan) else 1
        run_plan.data_parallel = check_replicas(data_parallel, transport)
        if prediction_offset is not None:
            run_plan.prediction_offset = prediction_offset
        check_options(optimizer, loss_fn, transport, amp, grad_clip, log_every, timeout)
        check_fit_options(
            scheduler=scheduler,
            device=device,
            seed=seed,
            memory_every=memory_every,
            keep_checkpoints=keep_checkpoints,
            checkpoint_dir=checkpoint_dir,
            predicted_backward=predicted_backward,
            run_identity=run_identity,
            hyperparameters=hyperparameters,
        )
        if checkpoint_every is not None and not is_whole(checkpoint_every, 1):
            raise RuntimeConfigError(
                f"checkpoint_every must be a positive number of mini-batches (got "
                f"{checkpoint_every!r})"
            )
        if checkpoint_every is not None and not checkpoint_dir:
            raise RuntimeConfigError(
                "checkpoint_every needs checkpoint_dir (where the checkpoints go)"
            )
        method_ = get_method(run_plan.method)
        if predicted_backward and not method_.predicts:
            raise RuntimeConfigError(
                f"predicted_backward keeps the predicted weights of a forward for its backward, "
                f"and {method_.name} does not predict; use pipeoptim, spectrain or xpipe, "
                f"or leave predicted_backward off"
            )
        if not isinstance(tune_allocator, bool):
            raise RuntimeConfigError(
                f"tune_allocator must be True or False (got {tune_allocator!r})"
            )
        if not isinstance(forwards_first, bool):
            raise RuntimeConfigError(
                f"forwards_first must be True or False (got {forwards_first!r})"
            )
        if forwards_first and transport != "local":
            raise RuntimeConfigError(
                f"forwards_first orders the ranks that one process runs together "
                f"(transport='local'); under transport={transport!r} each rank runs in a "
                f"process of its own, where it would only hold more activations: leave "
                f"forwards_first off there"
            )
        if targets not in ("send", "read"):
            raise RuntimeConfigError(f"unknown targets {targets!r}; use 'send' or 'read'")
        shape = run_plan.shape(1)
        check_offset(
            run_plan.prediction_offset,
            run_plan.method,
            shape.num_stages,
            given=prediction_offset is not None,
        )
        limit = segment_limit(method_, shape)
        bounds = stage_boundaries(
            len(units),
            shape.num_stages,
            run_plan.boundaries,
            run_plan.model,
            virtual_stages=shape.virtual_stages,
            method=run_plan.method,
        )
        if recompute is None and isinstance(plan, Plan):
            recompute = plan.recompute
        run_plan.recompute = resolve_recompute(recompute, bounds, labels, error=RuntimeConfigError)
        if shard_optimizer is None:
            shard_optimizer = plan.shard_optimizer if isinstance(plan, Plan) else False
        run_plan.shard_optimizer = check_shard_optimizer(
            shard_optimizer, run_plan.data_parallel, error=RuntimeConfigError
        )
        stage_options = StageOptions(
            optimizer=optimizer if optimizer is not None else run_plan.optimizer,
            scheduler=scheduler,
            loss_fn=loss_fn,
            amp=amp,
            grad_clip=grad_clip,
            prediction_offset=run_plan.prediction_offset,
            predicted_backward=predicted_backward,
            seed=seed,
            recompute={
                k: units_of
                for k, entry in enumerate(run_plan.recompute or [])
                if (units_of := recompute_units(entry, *bounds[k], labels))
            },
            shard_optimizer=run_plan.shard_optimizer,
        )
        options = PipelineOptions(
            stage_options, ProcessModel.parse(transport), device, timeout, store, init_weights
        )
        self.parts = Assembly(units, run_plan, method_, bounds, options)
        if tune_allocator and self.parts.device.type == "cpu":
            keep_freed_memory()
        cut = self.model_units
        if cut.names is not None or cut.source:
            self.parts.model_record = {"names": cut.names, "source": cut.source}
        self.identity = run_identity or self.parts.identity()
        self.keep_checkpoints = keep_checkpoints
        self.hyperparameters = hyperparameters or {"lr": run_plan.optimizer.lr, "amp": amp}
        """What a resume may change (recorded in checkpoints and the trace)."""
        self.options = FitOptions(
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            progress=progress,
            log_every=log_every,
            memory_every=memory_every,
            # how training targets reach the last stage's rank under dist (see the class)
            targets="send" if self.parts.process_model.one_process else targets,
            segment_limit=limit,
            forwards_first=forwards_first,
        )
        self.state = RunState()
        advice = depth_advice(method_.name, shape.num_stages, self.plan.optimizer.family)
        if advice is not None:  # the study found this method to stall at this depth
            self.state.notes.append(advice)
        self.closed = False
        """close() left the process group: a dist Pipeline cannot train or evaluate again."""
        if not self.parts.process_model.one_process:
            dist.barrier()  # every rank was built (a dead one is a lost peer here)
            self.parts.open_stop_channel()
            dist.barrier()  # a shared time origin for the trace
        self.loop = FitLoop(self.parts, self.state, self.options, self.hyperparameters)
        self.loop.callbacks = Callbacks(watchers, self)

    # -- what the parts hold ---------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The run's plan (method, sizes, boundaries, the optimizer the stages built)."""
        return self.parts.plan

    @property
    def units(self) -> list[nn.Module]:
        return self.parts.units

    @property
    def stages(self) -> dict[int, Stage]:
        """This process's stages, by index."""
        return self.parts.stages

    @property
    def rank_of(self) -> dict[int, int]:
        """The pipeline rank of every stage."""
        return self.parts.rank_of

    @property
    def segment_limit(self) -> int:
        """Mini-batches per never-flushed segment at most (see ``segments.SEGMENT_PASSES``)."""
        return self.options.segment_limit

    @property
    def memory_every(self) -> int:
        """Actions between memory samples of each stage (read when the executors are built
        at the first fit or evaluation)."""
        return self.options.memory_every

    @memory_every.setter
    def memory_every(self, every: int) -> None:
        self.options.memory_every = check_whole("memory_every", every, example="memory_every=4")

    @property
    def result(self) -> RankResult:
        """This process's share of the run so far."""
        return self.loop.result

    @property
    def recorder(self) -> Recorder:
        """The trace events and memory samples of this process's ranks."""
        return self.loop.recorder

    @property
    def _boundaries(self) -> list[Boundary] | None:
        """What crosses each stage boundary (known after the first batch's dry run)."""
        return self.loop.boundaries

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
        self._check_open()
        check_fit_arguments(
            data,
            epochs=epochs,
            max_steps=max_steps,
            eval_data=eval_data,
            eval_every=eval_every,
            steps_per_epoch=steps_per_epoch,
            resume=resume,
            checkpoint_dir=self.options.checkpoint_dir,
        )
        if epochs is None and max_steps is None:
            epochs = 1
        try:
            root = self.options.checkpoint_dir
            folder = (
                CheckpointFolder(
                    self.parts,
                    self.state,
                    root,
                    identity=self.identity,
                    hyperparameters=self.hyperparameters,
                    keep=self.keep_checkpoints,
                )
                if root
                else None
            )
            if folder is None:
                return self.loop.train(
                    None, data, epochs, max_steps, eval_data, eval_every, steps_per_epoch
                )
            with folder.held(resume):
                return self.loop.train(
                    folder, data, epochs, max_steps, eval_data, eval_every, steps_per_epoch
                )
        except BaseException as err:
            if self.state.busy or isinstance(err, NonFiniteLossError):
                self.state.failed = f"{type(err).__name__}: {err}"
            self.loop.close_bar()
            if isinstance(err, NonFiniteLossError) and self.parts.process_model.one_process:
                err.partial = self.loop.partial()
            raise

    def _check_open(self) -> None:
        """A dist Pipeline needs its process group: refuse once it is gone (close())."""
        if self.parts.process_model.one_process:
            return
        if self.closed or not dist.is_initialized():
            how = "pipe.close() left it" if self.closed else "it was destroyed"
            raise RuntimeConfigError(
                f"this Pipeline's process group is closed ({how}), and a dist Pipeline "
                f"trains and evaluates through it; call fit and evaluate before close(), or "
                f"build a new Pipeline (it joins or starts a process group) and resume from "
                f"its checkpoint"
            )

    def _check_usable(self) -> None:
        if self.state.failed is None:
            return
        root = self.options.checkpoint_dir
        where = (
            f"resume from {root} with fit(..., resume=True)"
            if root
            else "train again from the start (set checkpoint_dir to be able to resume)"
        )
        raise RuntimeConfigError(
            f"this Pipeline stopped on an error ({self.state.failed}) and its stages may hold "
            f"passes in flight, so it cannot train or evaluate again; build a new Pipeline "
            f"and {where}"
        )

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, data: Iterable[Any]) -> EvalResult:
        """Loss (and accuracy) of the live weights on ``data``: a forward-only schedule
        through the stages, any batch sizes. The same result on every rank."""
        self._check_usable()
        self._check_open()
        try:
            return self.loop.evaluate(data)
        except BaseException as err:
            if self.state.busy:
                self.state.failed = f"{type(err).__name__}: {err}"
            raise

    # -- results, state --------------------------------------------------------------------
    def rank_result(self) -> RankResult:
        """This process's share so far (after a failure too: the trace of what ran)."""
        return self.loop.rank_result()

    def trace(self) -> Trace:
        """The trace of the last ``fit`` (every rank's events), or of what ran so far."""
        if self.loop.trace is not None and self.state.failed is None:
            return self.loop.trace
        return self.loop.trace_so_far()

    def measure_prediction_closure(self) -> PredictionClosure:
        """Measure, from now on, how much of the stale weight distance every predicted
        forward of this process's stages removes (``runtime/optim/prediction_closure.py``).
        Costs two flat weight copies per predicted forward in flight: for studies on small
        models."""
        probe = PredictionClosure()
        for stage in self.stages.values():
            stage.closure = probe
        return probe

    @property
    def replica(self) -> int:
        """This process's data-parallel replica (0 without data parallelism): the replicas
        return the same result, so a script reports from replica 0's first stage."""
        return self.parts.replicas.replica

    @property
    def step(self) -> int:
        """Mini-batches trained so far (the global step)."""
        return self.state.step

    def state_dict(self) -> dict[str, Any]:
        """This process's stages (weights, optimizer, scheduler, predictor, RNG) and the step."""
        self._check_usable()
        return {
            "format": "pipeoptim-pipeline",
            "step": self.state.step,
            # what load_state_dict checks before it loads anything
            "method": self.plan.method,
            "num_stages": self.plan.num_stages,
            "stages": {k: s.state_dict() for k, s in self.stages.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned. Everything is checked before anything is
        loaded: the method and the stage count (where the state names them), the stages
        this process holds, and each stage's weights (names and shapes), optimizer class
        and prediction rule; a state that does not fit is refused with one error naming
        what differs, and this Pipeline stays as it was. To move only the weights into
        another kind of Pipeline, load ``state["stages"][k]["module"]`` into
        ``pipe.stages[k].module``."""
        self._check_state(state)
        try:
            for k, s in sorted(self.stages.items()):
                s.load_state_dict(state["stages"][k])
        except BaseException as err:  # checked, so unforeseen: the stages are half loaded
            self.state.failed = f"load_state_dict failed part way: {type(err).__name__}: {err}"
            raise
        self.state.step = int(state["step"])

    def _check_state(self, state: Any) -> None:
        """Refuse, before loading, a state :meth:`load_state_dict` cannot take."""
        if not isinstance(state, dict) or state.get("format") != "pipeoptim-pipeline":
            raise RuntimeConfigError(
                "load_state_dict takes what Pipeline.state_dict() returned (no "
                "'format': 'pipeoptim-pipeline' in it)"
            )
        held = state.get("stages")
        step = state.get("step")
        if not isinstance(held, dict) or not is_whole(step, None):
            raise RuntimeConfigError(
                "load_state_dict takes what Pipeline.state_dict() returned ('stages' a dict "
                f"and 'step' an integer; got {type(held).__name__} and {type(step).__name__})"
            )
        now = {"method": self.plan.method, "num_stages": self.plan.num_stages}
        # a state saved before these were recorded lacks them: its stages are still checked
        differ = [
            f"{k}: saved {state[k]!r}, here {v!r}"
            for k, v in now.items()
            if k in state and state[k] != v
        ]
        if differ:
            raise RuntimeConfigError(
                f"the state was saved by another kind of Pipeline ({'; '.join(differ)}); "
                f"build this Pipeline with the saved method and stages to load it, or load "
                f"only the weights: pipe.stages[k].module.load_state_dict("
                f"state['stages'][k]['module']); nothing was loaded"
            )
        missing = sorted(set(self.stages) - set(held))
        if missing:
            raise RuntimeConfigError(
                f"the state holds stages {sorted(held)} but this process runs "
                f"{sorted(self.stages)} (missing {missing}); load the state saved by the same "
                f"rank of a Pipeline of the same shape; nothing was loaded"
            )
        refused: list[tuple[int, str]] = []
        for k, s in sorted(self.stages.items()):
            try:
                s.check_state(held[k])
            except RuntimeConfigError as err:
                refused.append((k, str(err)))
        message = refusal(refused)
        if message is not None:
            raise RuntimeConfigError(f"load_state_dict: {message}")

    def export(self, out: str | Path, fmt: str | None = None) -> Path:
        """Write the trained model as one state dict in the model's own names (``.pt``,
        ``.safetensors``, or ``fmt="hf"``: a folder ``from_pretrained`` loads), see
        :mod:`~pipeoptim.runtime.checkpoint.export`. In one process, from the live stages; under
        ``dist``, every rank calls it and stage 0's rank writes from the latest checkpoint,
        which must be of this step (set ``checkpoint_dir``: a fit writes one at its end)."""
        self._check_usable()
        root = self.options.checkpoint_dir
        check_export_target(out, fmt, root)  # before any work, on every rank
        if self.parts.process_model.one_process:
            states = {k: s.module.state_dict() for k, s in self.stages.items()}
            merged = merge_stages(states, self.parts.bounds, self.model_units.names)
            return write_export(merged, out, fmt, self.model_units.source, checkpoint_dir=root)
        # The fit's last checkpoint is published by rank 0 once every stage file is written;
        # other ranks (another replica's, which write none) get here sooner (issue 33 item 8).
        dist.barrier()
        record = latest_step(root) if root else None
        if record is None or int(record["step"]) != self.state.step:
            have = f"its latest is step {record['step']}" if record else "there is none"
            raise RuntimeConfigError(
                f"under dist, export writes the latest checkpoint, which must be of this "
                f"Pipeline's step {self.state.step} ({have}); set checkpoint_dir (a fit writes "
                f"a checkpoint at its end) or export with transport='local'"
            )
        written: Path | None = None
        failure: str | None = None
        if 0 in self.stages and self.replica == 0:
            assert root is not None  # a record was found in it
            try:
                written = export_checkpoint(root, out, fmt=fmt, step=self.state.step)
            except RuntimeConfigError as err:
                failure = str(err)
        outcomes: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, failure)  # every rank ends as the writer did
        refused = next((o for o in outcomes if o is not None), None)
        if refused is not None:
            raise RuntimeConfigError(refused)
        return written or Path(out)

    def close(self) -> None:
        """Leave the process group this Pipeline started (dist under torchrun)."""
        if self.parts.owns_group and dist.is_initialized():
            if self.state.failed is None:
                # No rank tears its connections down while a peer is still using them.
                dist.barrier()
            dist.destroy_process_group()
            self.parts.owns_group = False
            self.closed = True

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
