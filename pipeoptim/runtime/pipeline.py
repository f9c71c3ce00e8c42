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

This module is the front: it builds the options tree from the arguments
(:mod:`~pipeoptim.runtime.options`), resolves it once into the views the parts read
(``options/resolve.py``), builds the parts (:mod:`~pipeoptim.runtime.assembly`),
and hands ``fit`` and ``evaluate`` to the fit loop
(:mod:`~pipeoptim.runtime.fit_loop`) and the checkpoint folder
(:mod:`~pipeoptim.runtime.checkpoint_folder`). A Pipeline that failed with passes in flight
refuses further work, with the way to resume.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from pipeoptim.errors import NonFiniteLossError, RuntimeConfigError
from pipeoptim.plan.plan import Plan
from pipeoptim.plan.risk import depth_advice
from pipeoptim.runtime.assembly import Assembly, RunState
from pipeoptim.runtime.checkpoint.export import (
    check_export_target,
    export_checkpoint,
    merge_stages,
    write_export,
)
from pipeoptim.runtime.checkpoint.formats import FORMATS
from pipeoptim.runtime.checkpoint.state_check import refusal
from pipeoptim.runtime.checkpoint.store import latest_step
from pipeoptim.runtime.checkpoint_folder import CheckpointFolder
from pipeoptim.runtime.config import check_fit_arguments, check_whole, is_whole
from pipeoptim.runtime.executor import Boundary, RankResult, Recorder
from pipeoptim.runtime.fit_loop import FitLoop
from pipeoptim.runtime.host_allocator import keep_freed_memory
from pipeoptim.runtime.model.units import ModelUnits, as_model_units, unit_labels
from pipeoptim.runtime.observe.callbacks import Callbacks
from pipeoptim.runtime.optim.prediction_closure import PredictionClosure
from pipeoptim.runtime.options import FitOptions, PipelineConfig
from pipeoptim.runtime.options.resolve import resolve_run
from pipeoptim.runtime.result import EvalResult, FitResult
from pipeoptim.runtime.segments import segment_limit
from pipeoptim.runtime.stage.stage import Stage
from pipeoptim.trace import Trace

__all__ = ["Pipeline"]


class Pipeline:
    """A model split into pipeline stages, trained with one of pipeoptim's methods.

    ``layers``: an ``nn.Sequential`` or list of units (a stage holds consecutive units), or a
    :class:`~pipeoptim.runtime.model.units.ModelUnits` (units with their names in the user's
    model, for :meth:`export`, and a loss and initialiser: ``pipeoptim.hf.cut_causal_lm``
    makes one). Units built on the meta device are materialised stage by stage on the
    process that trains them and initialised by ``init_weights(index, unit)``. A Parameter
    used by units on two stages is kept one weight under synchronous methods and refused
    by asynchronous ones (``ties.py``).

    The options: ``method`` (also the second positional argument) and the keywords, each a
    field of the options tree :class:`~pipeoptim.runtime.options.PipelineConfig` where it is
    documented and checked (``stages``, ``plan``, ``optimizer``, ``amp``,
    ``checkpoint_dir``, ...), or ``options=`` a whole tree (keywords given too replace its
    options). ``optimizer(params)`` and ``scheduler(optimizer)`` are called once per stage;
    a plan's method, sizes and boundaries are overridden by the options given. Under
    ``data_parallel`` (``dist`` only), D replicas of the pipeline run in D x P processes
    (global rank = replica x P + pipeline rank); each trains on its own 1/D of every batch
    (so the batch divides into D x M), and the replicas of a stage average their gradients
    before each update (``replicas.py``). Replica 0's weights are broadcast at start; only
    replica 0 writes checkpoints (every replica reads them on resume, so put
    ``checkpoint_dir`` on a shared file system across nodes); evaluation runs the whole data
    on every replica; the replicas draw the same dropout masks. Loggers and callbacks are
    called at the points where the fit already reads the losses (every ``log_every``), so
    they add no host synchronisation; a callback may end the fit (``info.request_stop()``):
    it drains, checkpoints and evaluates as an end does. Under ``forwards_first`` a segment
    that a callback may cut short keeps the schedule's order, so the run stops where a
    ``dist`` run of it would.
    """

    def __init__(
        self,
        layers: nn.Module | Sequence[nn.Module] | ModelUnits,
        method: str | None = None,
        *,
        options: PipelineConfig | None = None,
        **keywords: Any,
    ) -> None:
        if options is not None and not isinstance(options, PipelineConfig):
            raise RuntimeConfigError(
                f"options must be a PipelineConfig (got {type(options).__name__}); e.g. "
                f"options=PipelineConfig(schedule=ScheduleOptions(stages=4)), or pass the "
                f"options as keywords"
            )
        if method is not None:
            keywords["method"] = method
        config = (options or PipelineConfig()).with_keywords(**keywords)
        self.config = config
        """The run's options tree, as given (before the plan and the model resolve it)."""
        watchers = config.observe.watchers()
        labels = unit_labels(layers)
        self.model_units = as_model_units(layers)
        """The units and what the model says of them (names for export, initialiser)."""
        run = resolve_run(config, self.model_units, labels)
        # before the parts are built: a refused size must cost nothing (a segment's schedule
        # of millions of actions would be laid out first)
        limit = segment_limit(run.method, run.plan.shape(1))
        self.parts = Assembly(
            self.model_units.units, run.plan, run.method, run.bounds, run.pipeline
        )
        if config.memory.tune_allocator and self.parts.device.type == "cpu":
            keep_freed_memory()
        cut = self.model_units
        if cut.names is not None or cut.source:
            self.parts.model_record = {"names": cut.names, "source": cut.source}
        saved = config.checkpoint
        self.identity = saved.run_identity or self.parts.identity()
        self.keep_checkpoints = saved.keep_checkpoints
        self.checkpoint_format = saved.checkpoint_format
        self.hyperparameters = saved.hyperparameters or {
            "lr": run.plan.optimizer.lr,
            "amp": config.precision.amp,
        }
        """What a resume may change (recorded in checkpoints and the trace)."""
        self.options = FitOptions.of(
            config,
            one_process=self.parts.process_model.one_process,
            segment_limit=limit,
        )
        self.state = RunState()
        stages, family = self.parts.shape.num_stages, self.plan.optimizer.family
        advice = depth_advice(run.method.name, stages, family, run.plan.micro_batches)
        if advice is not None:  # the study found a configuration faster to the target here
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
                    format=FORMATS[self.checkpoint_format],
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


def _signature() -> inspect.Signature:
    """``Pipeline``'s signature as ``help``, editors and ``inspect`` show it: every option of
    the tree as a keyword with its default (``__init__`` takes them as ``**keywords``)."""
    named = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [
        inspect.Parameter("self", named),
        inspect.Parameter("layers", named),
        inspect.Parameter("method", named, default=None),
    ]
    params += [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
        for name, default in PipelineConfig().keywords().items()
        if name != "method"
    ]
    params.append(inspect.Parameter("options", inspect.Parameter.KEYWORD_ONLY, default=None))
    return inspect.Signature(params, return_annotation=None)


Pipeline.__init__.__signature__ = _signature()  # type: ignore[attr-defined]
