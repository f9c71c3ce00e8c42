"""The groups of the options tree: each option once, with its type, default, meaning and check.

Why groups: a stage needs the optimizer and precision, the fit loop the checkpoint and
observation settings, the assembly the transport; grouped by concern, each part reads the
group it uses, and a new option is one field (with its check) in one group. Every group is a
frozen dataclass that checks itself when built (also by ``dataclasses.replace``), so a tree
that exists is a tree whose options are each valid; the checks that need the model or the
resolved plan (the method, the stage layout) run when the Pipeline is built
(``options/resolve.py``). Every error names the option, the value and a fix.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.runtime.checkpoint.formats import DEFAULT_FORMAT, FORMATS
from pipeoptim.runtime.checkpoint.store import DEFAULT_KEEP
from pipeoptim.runtime.comm.process_model import ProcessModel
from pipeoptim.runtime.optim.corrections.extrapolate import check_extrapolation
from pipeoptim.runtime.optim.global_clip import CLIP_SCOPES
from pipeoptim.runtime.options.checks import (
    AMP_MODES,
    MAX_SEED,
    MAX_TIMEOUT,
    check_whole,
    is_whole,
)
from pipeoptim.runtime.stage.compiled import check_compile

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = [
    "CheckpointOptions",
    "CommOptions",
    "MemoryOptions",
    "ModelOptions",
    "ObserveOptions",
    "OptimizerOptions",
    "PrecisionOptions",
    "ScheduleOptions",
]

TARGETS = ("send", "read")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise RuntimeConfigError(f"{name} must be True or False (got {value!r})")


@dataclass(frozen=True)
class ModelOptions:
    """What the stages compute with besides the units: the loss, the initialiser, and
    whether the units are compiled."""

    loss_fn: Callable[..., Any] | None = None
    """``loss_fn(output, target)`` -> the mean loss, on the last stage; None: the model's
    (a ``ModelUnits``'s), else ``F.cross_entropy``."""
    init_weights: Callable[..., Any] | None = None
    """``init_weights(index, unit)`` fills a unit built on the meta device, in place; None:
    the model's (a ``ModelUnits``'s)."""
    compile: bool | str = False
    """``torch.compile`` each unit once, in place, when its stage is built: True (inductor,
    its default mode), an inductor mode (``"max-autotune-no-cudagraphs"``...) or a registered
    backend's name (``"aot_eager"``, ``"eager"``...); False: eager. Checked against the
    method and ``amp`` when the Pipeline is built (``stage/compiled.py``)."""

    def __post_init__(self) -> None:
        check_compile(self.compile)
        if self.init_weights is not None and not callable(self.init_weights):
            raise RuntimeConfigError(
                f"init_weights must be a callable (index, unit) -> None that fills a unit's "
                f"tensors in place (got {type(self.init_weights).__name__})"
            )
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise RuntimeConfigError(
                f"loss_fn must be a callable (output, target) -> scalar (got "
                f"{type(self.loss_fn).__name__})"
            )


@dataclass(frozen=True)
class ScheduleOptions:
    """The method and the sizes of the pipeline (each over the plan's, when a plan is given).

    The method, stage count, micro-batches and virtual stages are checked against each other
    when the Pipeline resolves them (``options.checks.resolve_plan``)."""

    method: str | None = None
    """A method's name (``pipeoptim methods``); None: the plan's, else ``"pipeoptim"``."""
    stages: int | None = None
    """Pipeline ranks P; None: the plan's (one of the two is needed)."""
    micro_batches: int | None = None
    """Micro-batches per mini-batch; None: the plan's for its method, else the method's
    default: P, or 1 for pipeoptim (its dial: any M >= 1, stage k ⌈(P-1-k)/M⌉ updates
    behind) and for methods that do not split a mini-batch."""
    virtual_stages: int | None = None
    """Stages per rank (interleaved methods); None: the plan's for its method, else 2 for an
    interleaved method and 1 otherwise."""
    prediction_offset: int | None = None
    """Updates added to the derived prediction distance s (predicting methods), in 0..P;
    None: the plan's (0: the paper's rule). Checked against the method and P when the
    Pipeline is built (``options.checks.check_offset``)."""
    predicted_backward: bool = False
    """Predicting methods, beyond the paper: each predicted forward keeps its Ŵ for its
    backward, so the input gradients also go through Ŵ (consistent, as PipeDream's stash),
    at one weight copy per mini-batch in flight instead of PipeOptim's one extra copy."""
    forwards_first: bool = False
    """``transport="local"``: each rank runs its forwards between two of its updates back to
    back, then its backwards, as gpipe does (the same weights bit for bit; a cheaper order
    for the one thread that runs every stage, up to one more mini-batch of activations)."""
    data_parallel: int | None = None
    """Replicas D of the pipeline (``transport="dist"``, D x P processes), each training on
    its own 1/D of every batch; None: the plan's, else 1."""

    def __post_init__(self) -> None:
        _check_flag("predicted_backward", self.predicted_backward)
        _check_flag("forwards_first", self.forwards_first)


@dataclass(frozen=True)
class OptimizerOptions:
    """How each stage updates its own parameters."""

    optimizer: OptimizerSpec | Callable[..., Any] | None = None
    """An ``OptimizerSpec`` or ``optimizer(params)`` / ``optimizer(params, stage)`` called
    once per stage; None: the plan's spec (SGD at lr 0.02 without a plan)."""
    scheduler: Callable[..., Any] | None = None
    """``scheduler(optimizer)`` called once per stage; None: constant learning rates."""
    grad_clip: float | None = None
    """Largest gradient norm, as ``torch.nn.utils.clip_grad_norm_``'s ``max_norm``; whose norm
    is ``clip_scope``'s; None: no clipping."""
    clip_scope: str | None = None
    """Whose gradient norm ``grad_clip`` bounds: ``"pipeline"``, the norm over every stage's
    gradients of one mini-batch (a shared weight once), so that a synchronous method clips
    as ``clip_grad_norm_`` does on the uncut model (one all-reduce of one number per update
    under dist); or ``"stage"``, each stage its own norm at its own update. None: the
    method's default, ``"pipeline"`` for synchronous methods and ``"stage"`` for
    asynchronous ones, whose stages update at their own times (``"pipeline"`` makes each
    stage's t-th update wait for every stage's gradient of mini-batch t; refused under a
    bounded delay). See ``runtime/optim/global_clip.py``."""
    extrapolation: float | None = None
    """λ of the ``extrapolate`` correction (``xpipe+extrapolate``, ``2bw+extrapolate``,
    ``pipeoptim+extrapolate``): each update is ``x_{t+1} = x_t − η[(1+λ)u_t − λu_{t−1}]``,
    u the optimizer's own update direction; a finite number >= 0 (0: the plain step).
    None: 0.5. Refused with a method that does not extrapolate (checked when the Pipeline
    is built). See ``runtime/optim/corrections/extrapolate.py``."""

    def __post_init__(self) -> None:
        if self.extrapolation is not None:
            check_extrapolation(self.extrapolation)
        optimizer = self.optimizer
        if optimizer is not None and not (
            isinstance(optimizer, OptimizerSpec) or callable(optimizer)
        ):
            raise RuntimeConfigError(
                f"optimizer must be a factory params -> torch.optim.Optimizer (got "
                f"{type(optimizer).__name__}), e.g. lambda params: torch.optim.SGD(params, lr=0.1)"
            )
        clip = self.grad_clip
        if clip is not None and (not _is_number(clip) or not clip > 0):
            kind = "positive" if _is_number(clip) else "a positive number"
            raise RuntimeConfigError(
                f"grad_clip must be {kind}, the largest gradient norm of a stage "
                f"(got {clip!r}); e.g. grad_clip=1.0, or None for no clipping"
            )
        if self.clip_scope is not None and self.clip_scope not in CLIP_SCOPES:
            raise RuntimeConfigError(
                f"clip_scope must be one of {', '.join(CLIP_SCOPES)} or None (got "
                f"{self.clip_scope!r}); 'pipeline' clips by the norm over every stage's "
                f"gradients, 'stage' each stage by its own, None the method's default"
            )
        if self.scheduler is not None and not callable(self.scheduler):
            raise RuntimeConfigError(
                f"scheduler must be a factory optimizer -> LR scheduler (got "
                f"{type(self.scheduler).__name__}), e.g. lambda opt: "
                f"torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)"
            )


@dataclass(frozen=True)
class PrecisionOptions:
    """The number format of the forwards and backwards."""

    amp: str | None = None
    """Mixed precision: None (fp32), ``"bf16"`` (CPU and CUDA) or ``"fp16"`` (CUDA, loss
    scaling per stage)."""

    def __post_init__(self) -> None:
        if self.amp is not None and self.amp not in AMP_MODES:
            raise RuntimeConfigError(f"unknown amp {self.amp!r}; use None, 'bf16' or 'fp16' (CUDA)")


@dataclass(frozen=True)
class MemoryOptions:
    """What a run trades for memory."""

    recompute: object = None
    """Units whose activations are recomputed in the backward instead of kept: ``"full"``,
    stage indices, unit names or classes, per stage (``plan.recompute``); None: the plan's,
    else none. Resolved against the model's units when the Pipeline is built."""
    shard_optimizer: bool | None = None
    """Shard each stage's optimizer state across its data-parallel replicas (ZeRO-1); None:
    the plan's, else off."""
    tune_allocator: bool = True
    """CPU: raise glibc's mmap and trim thresholds in this process, so each step reuses the
    memory the last one freed (up to 256 MiB of freed memory stays in the process); False,
    or either of ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` set, leaves the
    allocator as it is."""

    def __post_init__(self) -> None:
        _check_flag("tune_allocator", self.tune_allocator)


@dataclass(frozen=True)
class CommOptions:
    """Where the ranks run and how they reach each other."""

    transport: str = "local"
    """``"local"`` (every stage in this process) or ``"dist"`` (one rank per stage, under
    ``torchrun``)."""
    device: str = "auto"
    """``"auto"`` (CUDA where present, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    timeout: float = 300.0
    """Seconds a rank waits for another before it names it lost."""
    targets: str = "send"
    """``dist`` only: ``"send"`` has stage 0's rank send each micro-batch's targets to the
    last stage's rank; ``"read"`` has the last stage's rank iterate the data itself (right
    only for data that yields the same batches on every rank)."""
    store: Store | None = None
    """The process group's store; None: the default group's, under ``dist``."""
    one_tag: bool = False
    """``dist`` on gloo only: send every message under one tag, so gloo matches a pair of
    ranks' messages in posting order per direction, as NCCL always does (each receiver posts
    its receives in the order the schedule says the sender sends them). The same numbers as
    the default (a tag per message); a check, on CPU, of what runs over NCCL."""
    varying_shapes: bool = False
    """Batches may differ in their per-sample sizes (a collate that pads each batch to its
    own longest sequence): each message between stages carries its shape (under ``dist`` a
    small header of its sizes goes first; in one process tensors just move), and batches
    must keep only their tensors' ranks and dtypes. Off (the default): every tensor that
    crosses a stage boundary keeps the first batch's shape, and a batch that differs is
    refused before it is sent, as receives are sized ahead without a header. Opt-in, since
    one batch cannot tell whether shapes will vary, and a fixed-shape run then keeps its
    messages (one per tensor) and its early refusal."""

    def __post_init__(self) -> None:
        ProcessModel.parse(self.transport)
        timeout = self.timeout
        if not _is_number(timeout) or not 0 < timeout <= MAX_TIMEOUT:
            raise RuntimeConfigError(
                f"timeout must be a number of seconds in (0, {MAX_TIMEOUT:g}] (got "
                f"{timeout!r}): how long a rank waits for another; e.g. timeout=300"
            )
        if not isinstance(self.device, str):
            raise RuntimeConfigError(
                f"device must be a name: 'auto', 'cpu', 'cuda' or 'cuda:N' (got "
                f"{type(self.device).__name__})"
            )
        if self.targets not in TARGETS:
            raise RuntimeConfigError(f"unknown targets {self.targets!r}; use 'send' or 'read'")
        if not isinstance(self.one_tag, bool):
            raise RuntimeConfigError(
                f"one_tag must be True or False (got {self.one_tag!r}): whether every gloo "
                f"message goes under one tag"
            )
        if not isinstance(self.varying_shapes, bool):
            raise RuntimeConfigError(
                f"varying_shapes must be True or False (got {self.varying_shapes!r}): "
                f"whether batches may differ in their per-sample sizes"
            )


@dataclass(frozen=True)
class CheckpointOptions:
    """Where the run's checkpoints go and what they record."""

    checkpoint_dir: str | None = None
    """Write per-stage checkpoints here (``fit(..., resume=True)`` continues from the
    latest); None: no checkpoints."""
    checkpoint_every: int | None = None
    """Drain the pipeline and checkpoint every K mini-batches; None: only at the end."""
    keep_checkpoints: int = DEFAULT_KEEP
    """Checkpoints kept in ``checkpoint_dir`` (a resume falls back past a damaged one)."""
    checkpoint_format: str = DEFAULT_FORMAT
    """How each stage is written: ``torch-save`` (one file) or ``dcp`` (a
    ``torch.distributed.checkpoint`` folder under model-level names); a resume reads
    either."""
    run_identity: dict[str, Any] | None = None
    """What a checkpoint must agree on to be resumed; None: the Pipeline's own."""
    hyperparameters: dict[str, Any] | None = None
    """What a resume may change, recorded in checkpoints and the trace; None: the learning
    rate and ``amp``."""

    def __post_init__(self) -> None:
        check_whole("keep_checkpoints", self.keep_checkpoints, example="keep_checkpoints=2")
        if self.checkpoint_format not in FORMATS:
            raise RuntimeConfigError(
                f"checkpoint_format must be one of {', '.join(FORMATS)} (got "
                f"{self.checkpoint_format!r}), e.g. checkpoint_format='dcp'"
            )
        folder = self.checkpoint_dir
        if folder is not None and not isinstance(folder, (str, os.PathLike)):
            raise RuntimeConfigError(
                f"checkpoint_dir must be a folder path (str or os.PathLike; got "
                f"{type(folder).__name__}), e.g. checkpoint_dir='ckpt'"
            )
        for name, value in (
            ("run_identity", self.run_identity),
            ("hyperparameters", self.hyperparameters),
        ):
            if value is not None and not isinstance(value, dict):
                raise RuntimeConfigError(
                    f"{name} must be a dict or None (got {type(value).__name__})"
                )
        every = self.checkpoint_every
        if every is not None and not is_whole(every, 1):
            raise RuntimeConfigError(
                f"checkpoint_every must be a positive number of mini-batches (got {every!r})"
            )
        if every is not None and not folder:
            raise RuntimeConfigError(
                "checkpoint_every needs checkpoint_dir (where the checkpoints go)"
            )


@dataclass(frozen=True)
class ObserveOptions:
    """What the run reports, and how often it looks."""

    progress: bool = False
    """Show a progress bar."""
    log_every: int = 50
    """Mini-batches between reads of the loss (the only host syncs of the training loop)."""
    memory_every: int = 4
    """Actions between memory samples of each stage."""
    loggers: Sequence[Any] | None = None
    """Objects with some of the hooks ``on_fit_start``, ``on_step_end``, ``on_eval_end``,
    ``on_checkpoint``, ``on_fit_end``, called before the callbacks (``observe/``)."""
    callbacks: Sequence[Any] | None = None
    """Objects with some of the same hooks; one may end the fit (``info.request_stop()``)."""

    def __post_init__(self) -> None:
        check_whole("log_every", self.log_every, example="log_every=50")
        check_whole(
            "memory_every", self.memory_every, example="memory_every=4 (every 4th micro-batch)"
        )
        self.watchers()  # refuses a list entry with none of the hooks

    def watchers(self) -> list[Any]:
        """The loggers, then the callbacks, in the order their hooks are called."""
        from pipeoptim.runtime.observe.callbacks import check_callbacks  # torch: when used

        return [
            *check_callbacks(self.loggers, "loggers"),
            *check_callbacks(self.callbacks, "callbacks"),
        ]


def check_seed(seed: object) -> int:
    """The run's seed, or the error that states its range."""
    if not is_whole(seed, 0, MAX_SEED):
        raise RuntimeConfigError(f"seed must be an integer in 0..{MAX_SEED} (got {seed!r})")
    assert isinstance(seed, int)  # is_whole said so; for the type checker
    return seed
