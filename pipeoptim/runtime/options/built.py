"""The views of the options tree that the parts of a run are built with: what every stage
is built with, what the assembly of one process needs besides, and what the fit loop reads.

Why views: the tree (``options/tree.py``) says what the user asked for; a view says what a
part runs with once the plan, the method and the model resolved it (the model's loss, the
plan's recompute per stage, the transport's targets), built once by ``options/resolve.py``,
so no part repeats the resolution or takes the options as loose arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch.nn.functional as F
from torch._C._distributed_c10d import Store

from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.runtime.comm.process_model import ProcessModel
from pipeoptim.runtime.model.units import InitWeights
from pipeoptim.runtime.optim.update import OptimizerFactory, SchedulerFactory
from pipeoptim.runtime.options.tree import PipelineConfig
from pipeoptim.runtime.stage.loss import LossFn

__all__ = ["FitOptions", "PipelineOptions", "StageOptions"]


@dataclass(frozen=True)
class StageOptions:
    """What every stage of a run is built with (checked by the Pipeline)."""

    optimizer: OptimizerSpec | OptimizerFactory
    """The plan's optimizer spec, or ``optimizer(params)`` / ``optimizer(params, stage)``
    called once per stage."""
    scheduler: SchedulerFactory | None = None
    """``scheduler(optimizer)`` called once per stage; None: constant learning rates."""
    loss_fn: LossFn = F.cross_entropy
    """``loss_fn(output, target)`` -> the mean loss, on the last stage."""
    amp: str | None = None
    """Mixed precision: None, ``"bf16"`` or ``"fp16"`` (CUDA, loss scaling per stage)."""
    grad_clip: float | None = None
    """Largest gradient norm; None: no clipping."""
    clip_scope: str = "stage"
    """Whose norm ``grad_clip`` bounds: ``"pipeline"`` (every stage's gradients of one
    mini-batch) or ``"stage"`` (each its own); resolved (``global_clip.clip_scope_of``)."""
    extrapolation: float | None = None
    """λ of the ``extrapolate`` correction (None: its default)."""
    prediction_offset: int = 0
    """Updates added to the derived prediction distance s (predicting methods)."""
    predicted_backward: bool = False
    """Each predicted forward keeps its Ŵ for its backward (predicting methods)."""
    seed: int = 0
    """The run's seed; stage k's random stream is seeded ``seed * 1000 + k + 1``."""
    recompute: Mapping[int, frozenset[int]] = field(default_factory=dict)
    """Stage -> the stage-local indices of the units whose activations it recomputes in the
    backward instead of keeping them (absent: none; ``plan.recompute``)."""
    shard_optimizer: bool = False
    """Each stage's optimizer state is sharded across its data-parallel replicas (ZeRO-1)."""
    compile: bool | str = False
    """``torch.compile`` each unit once at stage build (``ModelOptions.compile``)."""

    def stage_seed(self, index: int) -> int:
        """The seed of stage ``index``'s own random stream."""
        return self.seed * 1000 + index + 1


@dataclass(frozen=True)
class PipelineOptions:
    """What the assembly of one process's share of a run is built with."""

    stage: StageOptions
    """What every stage is built with."""
    process_model: ProcessModel
    """Every stage in this process, or one process per stage (``transport=``)."""
    device: str = "auto"
    """The requested device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    timeout: float = 300.0
    """Seconds a rank waits on another before it names it lost."""
    store: Store | None = None
    """The process group's store (None: the default group's, under ``dist``)."""
    init_weights: InitWeights | None = None
    """``init_weights(index, unit)`` fills a unit built on the meta device, in place."""
    one_tag: bool = False
    """Every gloo message under one tag (``CommOptions.one_tag``)."""
    varying_shapes: bool = False
    """Each message between stages carries its shape (``CommOptions.varying_shapes``)."""


@dataclass(kw_only=True)
class FitOptions:
    """How the fit loop reports and cuts a run (``memory_every`` may change until the first
    fit builds the executors: ``Pipeline.memory_every``)."""

    checkpoint_dir: str | None
    """Where the checkpoints go (None: none)."""
    checkpoint_every: int | None
    """Mini-batches between checkpoints (None: only at the end)."""
    progress: bool
    """Show a progress bar."""
    log_every: int
    """Mini-batches between reads of the loss."""
    memory_every: int
    """Actions between memory samples of each stage."""
    targets: str
    """How training targets reach the last stage's rank (always ``"send"`` in one process)."""
    segment_limit: int
    """Mini-batches per never-flushed segment at most."""
    forwards_first: bool = False
    """Local transport: each rank's forwards between two updates run first (see
    ``ScheduleOptions.forwards_first``), except in segments a callback may cut short."""

    @classmethod
    def of(cls, config: PipelineConfig, *, one_process: bool, segment_limit: int) -> FitOptions:
        """The fit loop's view of ``config``, for a run in one process or not, whose
        segments the method limits to ``segment_limit`` mini-batches."""
        observe, checkpoint = config.observe, config.checkpoint
        return cls(
            checkpoint_dir=checkpoint.checkpoint_dir,
            checkpoint_every=checkpoint.checkpoint_every,
            progress=observe.progress,
            log_every=observe.log_every,
            memory_every=observe.memory_every,
            # one process has no targets to send (CommOptions.targets: dist only)
            targets="send" if one_process else config.comm.targets,
            segment_limit=segment_limit,
            forwards_first=config.schedule.forwards_first,
        )
