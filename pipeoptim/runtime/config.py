"""The run configuration of ``pipeoptim train``: a plan plus what a plan does not say.

One module, imported alike by the launcher (which ships it to spawned ranks as JSON) and by
the code that turns it into a :class:`~pipeoptim.runtime.pipeline.Pipeline`. A library user
never needs ``TrainConfig``: they hand ``Pipeline`` their own layers, optimizer, loss and
data; this config names the built-in equivalents so a run can be described on a command
line. The options it shares with ``Pipeline`` (seed, transport, precision, checkpoints,
...) are the options tree's (``runtime/options/``): their defaults are the tree's groups'
and their checks are the groups' own, run by building the tree
(``TrainConfig.options``) and worded with the flags of :data:`TREE_FLAGS`;
only what the command alone has (the model and data names, epochs, the learning-rate
schedule, the trace and the loggers) is defined here. The checks ``Pipeline`` and the
command share (:func:`resolve_plan`, :func:`check_offset`, :func:`check_replicas`) live in
``runtime/options/checks.py`` and are re-exported here.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.plan.recompute import parse_recompute_flag
from pipeoptim.runtime.observe.loggers.spec import check_logger_spec
from pipeoptim.runtime.optim.corrections.extrapolate import refuse_extrapolation_without_correction
from pipeoptim.runtime.options.checks import (
    AMP_MODES,
    MAX_SEED,
    MAX_TIMEOUT,
    check_offset,
    check_replicas,
    check_whole,
    is_whole,
    resolve_plan,
)
from pipeoptim.runtime.options.groups import (
    CheckpointOptions,
    CommOptions,
    MemoryOptions,
    ModelOptions,
    OptimizerOptions,
    PrecisionOptions,
    ScheduleOptions,
)
from pipeoptim.runtime.options.tree import PipelineConfig, option_default
from pipeoptim.runtime.stage.compiled import compile_refusal

__all__ = [
    "AMP_MODES",
    "DEFAULT_EPOCHS",
    "LR_SCHEDULES",
    "MAX_SEED",
    "MAX_TIMEOUT",
    "TREE_FLAGS",
    "TrainConfig",
    "check_fit_arguments",
    "check_offset",
    "check_replicas",
    "check_whole",
    "flag_worded",
    "is_whole",
    "resolve_plan",
    "run_length",
]

DEFAULT_EPOCHS = 10
"""Epochs when neither ``epochs`` nor ``max_steps`` is given (the digits MLP of the default
run is past 95 % test accuracy by then)."""

LR_SCHEDULES = ("constant", "cosine", "warmup-cosine", "step")
"""Names ``--lr-schedule`` accepts (``pipeoptim.runtime.optim.lr.scheduler_factory``)."""

TREE_FLAGS = {
    "seed": "--seed",
    "transport": "--transport",
    "device": "--device",
    "timeout": "--timeout",
    "amp": "--amp",
    "grad_clip": "--grad-clip",
    "clip_scope": "--clip-scope",
    "extrapolation": "--extrapolation",
    "checkpoint_dir": "--checkpoint-dir",
    "checkpoint_every": "--checkpoint-every",
    "keep_checkpoints": "--keep-checkpoints",
    "checkpoint_format": "--checkpoint-format",
    "forwards_first": "--forwards-first",
    "compile": "--compile",
}
"""The options of the tree that ``pipeoptim train`` sets from a flag -> that flag: the
tree's errors name the option (``grad_clip``), the command's the flag (``--grad-clip``).
(``--recompute`` is parsed by its own flag parser, whose errors name the flag already.)"""


def flag_worded(message: str) -> str:
    """The tree's error ``message`` with each option of :data:`TREE_FLAGS` named by its flag,
    and ``option=value`` written as on the command line (``--transport dist``)."""
    for name, flag in TREE_FLAGS.items():

        def as_typed(match: re.Match[str], flag: str = flag) -> str:
            quoted, bare = match.groups()
            return f"{flag} {quoted if quoted is not None else bare}"

        message = re.sub(rf"(?<![\w.-]){name}=(?:'([^']*)'|([\w.+-]+))", as_typed, message)
        message = re.sub(rf"(?<![\w.-]){name}\b", flag, message)
    return message


def _default_plan() -> Plan:
    return Plan("pipeoptim", 4, optimizer=OptimizerSpec("sgd", 0.02))


@dataclass
class TrainConfig:
    """A training run of a built-in (or ``module:factory``) model.

    ``plan.model`` and ``plan.batch_size`` name the model and the samples per mini-batch
    (defaults ``mlp`` and 32). The options shared with ``Pipeline`` are the options tree's
    (``runtime/options/groups.py``: their meaning, default and check are defined there); the
    rest are the command's own.
    """

    plan: Plan = field(default_factory=_default_plan)
    """Method, stages, micro-batches, optimizer, boundaries."""
    epochs: int | None = None
    """Epochs to train; with ``max_steps`` also None, DEFAULT_EPOCHS."""
    max_steps: int | None = None
    """Stop after this many mini-batches in all (counted from the run's start)."""
    transport: str = option_default("transport")
    """``--transport``: the tree's ``CommOptions.transport``."""
    checkpoint_dir: str | None = option_default("checkpoint_dir")
    """``--checkpoint-dir``: ``CheckpointOptions.checkpoint_dir`` (``resume`` reads it)."""
    checkpoint_every: int | None = option_default("checkpoint_every")
    """``--checkpoint-every``: ``CheckpointOptions.checkpoint_every``."""
    resume: bool = False
    """Continue from the latest checkpoint in ``checkpoint_dir``."""
    trace: str | None = None
    """Write the run's trace (pipeoptim trace JSON) here."""
    seed: int = option_default("seed")
    """``--seed``: the tree's ``PipelineConfig.seed`` (also the data order)."""
    device: str = option_default("device")
    """``--device``: ``CommOptions.device``."""
    quiet: bool = True
    """No progress bar."""
    timeout: float = option_default("timeout")
    """``--timeout``: ``CommOptions.timeout``."""
    lr_schedule: str = "constant"
    """One of LR_SCHEDULES; stepped once per update on every stage."""
    warmup: int | None = None
    """Warm-up updates of ``warmup-cosine`` (default: 5 % of the run)."""
    amp: str | None = option_default("amp")
    """``--amp``: ``PrecisionOptions.amp``."""
    grad_clip: float | None = option_default("grad_clip")
    """``--grad-clip``: ``OptimizerOptions.grad_clip``."""
    clip_scope: str | None = option_default("clip_scope")
    """``--clip-scope``: ``OptimizerOptions.clip_scope``."""
    extrapolation: float | None = option_default("extrapolation")
    """``--extrapolation``: ``OptimizerOptions.extrapolation`` (λ of the extrapolate
    correction; None: 0.5)."""
    keep_checkpoints: int = option_default("keep_checkpoints")
    """``--keep-checkpoints``: ``CheckpointOptions.keep_checkpoints``."""
    checkpoint_format: str = option_default("checkpoint_format")
    """``--checkpoint-format``: ``CheckpointOptions.checkpoint_format``."""
    recompute: str | None = option_default("recompute")
    """``--recompute``: ``none``, ``full``, ``stages:0,1`` or ``units:NAME,...``
    (``plan.recompute.parse_recompute_flag``); None: the plan's ``recompute``."""
    log: tuple[str, ...] = ()
    """``--log`` (repeatable): ``tensorboard:DIR``, ``wandb:PROJECT`` or ``jsonl:FILE``
    (``observe.loggers.spec``), each a logger of the run."""
    forwards_first: bool = option_default("forwards_first")
    """``--forwards-first``: ``ScheduleOptions.forwards_first``."""
    compile: bool | str = option_default("compile")
    """``--compile [MODE|BACKEND]``: ``ModelOptions.compile``."""

    def __post_init__(self) -> None:
        self.plan.model = self.plan.model or "mlp"
        self.plan.batch_size = self.plan.batch_size or 32
        if self.epochs is None and self.max_steps is None:
            self.epochs = DEFAULT_EPOCHS
        counts = {"epochs": self.epochs, "max-steps": self.max_steps}
        counts.update({"batch-size": self.batch_size})
        for flag, value in counts.items():
            if value is not None and value < 1:
                raise RuntimeConfigError(f"--{flag} must be at least 1 (got {value})")
        if self.warmup is not None and self.warmup < 0:
            raise RuntimeConfigError(f"--warmup must be 0 or more updates (got {self.warmup})")
        spec = self.plan.method_spec
        if spec.runs_whole_mini_batches and self.plan.micro_batches != 1:
            spec.shape(self.plan.num_stages, self.plan.micro_batches)  # the registry's error
        self.options()  # the shared options' checks: the tree's, worded with the flags
        refuse_extrapolation_without_correction(
            spec.name, spec.correction, self.extrapolation, flag="--extrapolation"
        )
        refusal = compile_refusal(
            self.compile,
            method=spec.name,
            one_version=spec.keeps_one_version,
            predicts=spec.predicts,
            amp=self.amp,
        )
        if refusal is not None:
            raise RuntimeConfigError(flag_worded(refusal))
        if self.lr_schedule not in LR_SCHEDULES:
            raise RuntimeConfigError(
                f"unknown --lr-schedule {self.lr_schedule!r}; choose one of: "
                f"{', '.join(LR_SCHEDULES)}"
            )
        if self.warmup is not None and self.lr_schedule != "warmup-cosine":
            raise RuntimeConfigError(
                f"--warmup {self.warmup} sets the warm-up of --lr-schedule warmup-cosine, but "
                f"the schedule is {self.lr_schedule}; add --lr-schedule warmup-cosine, or drop "
                f"--warmup"
            )
        for logged in self.log:
            check_logger_spec(logged)
        if self.resume and not self.checkpoint_dir:
            raise RuntimeConfigError("--resume needs --checkpoint-dir D")
        check_replicas(self.plan.data_parallel, self.transport, flag="--data-parallel")

    def options(self) -> PipelineConfig:
        """The tree of this ``pipeoptim train`` run: its plan and every option the command
        line sets (what only the training process can make, the scheduler, the model's loss,
        the loggers, the store, is added with :meth:`PipelineConfig.with_keywords`); the
        tree's errors name the flags (:data:`TREE_FLAGS`)."""
        try:
            return self._tree()
        except RuntimeConfigError as error:
            raise RuntimeConfigError(flag_worded(str(error))) from None

    def _tree(self) -> PipelineConfig:
        recompute = None
        if self.recompute is not None:  # None: the plan's
            recompute = parse_recompute_flag(self.recompute, error=RuntimeConfigError)
        return PipelineConfig(
            plan=self.plan,
            seed=self.seed,
            model=ModelOptions(compile=self.compile),  # the loss: the workload's
            schedule=ScheduleOptions(forwards_first=self.forwards_first),
            optim=OptimizerOptions(
                grad_clip=self.grad_clip,
                clip_scope=self.clip_scope,
                extrapolation=self.extrapolation,
            ),  # the optimizer: the plan's
            precision=PrecisionOptions(amp=self.amp),
            memory=MemoryOptions(recompute=recompute),
            comm=CommOptions(transport=self.transport, device=self.device, timeout=self.timeout),
            checkpoint=CheckpointOptions(
                checkpoint_dir=self.checkpoint_dir,
                checkpoint_every=self.checkpoint_every,
                keep_checkpoints=self.keep_checkpoints,
                checkpoint_format=self.checkpoint_format,
            ),
        )

    @property
    def model(self) -> str:
        return self.plan.model or "mlp"

    @property
    def batch_size(self) -> int:
        return self.plan.batch_size or 32

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must agree on to be resumed by this run: what fixes the shapes
        of the state and the data order. The learning rate, its schedule, clipping and
        precision may change on resume (``hyperparameters``)."""
        p, shape = self.plan, self.plan.shape(1)
        ident = {
            "method": p.method,
            "num_stages": p.num_stages,
            "micro_batches": shape.micro_batches,
            "virtual_stages": shape.virtual_stages,
            "prediction_offset": p.prediction_offset,
            "optimizer": {"family": p.optimizer.family, "options": p.optimizer.options},
            "model": self.model,
            "batch_size": self.batch_size,
            "boundaries": p.boundaries,
            "seed": self.seed,
        }
        normal: dict[str, Any] = json.loads(json.dumps(ident))  # tuples -> lists, as on disk
        return normal

    def hyperparameters(self) -> dict[str, Any]:
        """What a resume may change; recorded in checkpoints and the trace."""
        return {
            "lr": self.plan.optimizer.lr,
            "lr_schedule": self.lr_schedule,
            "warmup": self.warmup,
            "grad_clip": self.grad_clip,
            "amp": self.amp,
        }

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "plan": self.plan.to_dict()})

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        d = json.loads(text)
        return cls(**{**d, "plan": Plan.from_dict(d["plan"]), "log": tuple(d.get("log", ()))})


def run_length(epochs: int | None, max_steps: int | None, steps_per_epoch: int) -> int:
    """Mini-batches of a run, counted from step 0: ``epochs`` epochs, capped by
    ``max_steps`` (either may be None, not both)."""
    total = epochs * steps_per_epoch if epochs is not None else max_steps or 0
    return min(total, max_steps) if max_steps is not None else total


def check_fit_arguments(
    data: object,
    *,
    epochs: object,
    max_steps: object,
    eval_data: object,
    eval_every: object,
    steps_per_epoch: object,
    resume: object,
    checkpoint_dir: object,
) -> None:
    """``Pipeline.fit``'s arguments: types, ranges and what each one needs."""
    for name, value in (
        ("epochs", epochs),
        ("max_steps", max_steps),
        ("eval_every", eval_every),
        ("steps_per_epoch", steps_per_epoch),
    ):
        if value is not None:
            check_whole(name, value)
    for name, batches in (("data", data), ("eval_data", eval_data)):
        if batches is not None and not _iterable(batches):
            raise RuntimeConfigError(
                f"fit's {name} must be an iterable of (input, target) batches, e.g. a "
                f"DataLoader (got {type(batches).__name__})"
            )
    if data is None:
        raise RuntimeConfigError(
            "fit needs the training data: an iterable of (input, target) batches, e.g. a DataLoader"
        )
    if eval_every is not None and eval_data is None:
        raise RuntimeConfigError(
            f"eval_every={eval_every} evaluates on eval_data every {eval_every} mini-batches, "
            f"and no eval_data was given; pass fit(..., eval_data=loader), or leave eval_every "
            f"out"
        )
    if not isinstance(resume, bool):
        raise RuntimeConfigError(f"resume must be True or False (got {resume!r})")
    if resume and not checkpoint_dir:
        raise RuntimeConfigError(
            "fit(..., resume=True) continues from the latest checkpoint in checkpoint_dir, and "
            "this Pipeline has none; build it with checkpoint_dir='the folder of the run to "
            "continue' (pipeoptim train: --resume needs --checkpoint-dir D)"
        )


def _iterable(value: object) -> bool:
    """Iterable as ``for`` sees it (``__iter__`` or the old ``__getitem__`` protocol),
    without calling ``iter``: that would start a DataLoader's workers."""
    kind = type(value)
    return hasattr(kind, "__iter__") or hasattr(kind, "__getitem__")
