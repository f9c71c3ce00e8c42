"""The run configuration of ``pipeoptim train``: a plan plus what a plan does not say.

One module, imported alike by the launcher (which ships it to spawned ranks as JSON) and by
the code that turns it into a :class:`~pipeoptim.runtime.pipeline.Pipeline`. A library user
never needs ``TrainConfig``: they hand ``Pipeline`` their own layers, optimizer, loss and
data; this config names the built-in equivalents so a run can be described on a command
line. The checks of ``Pipeline``'s own arguments live here too (:func:`resolve_plan`,
:func:`check_options`), torch-free like the rest of the module.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.plan.replicas import check_replicas as plan_replicas

__all__ = [
    "AMP_MODES",
    "DEFAULT_EPOCHS",
    "LR_SCHEDULES",
    "TrainConfig",
    "check_options",
    "check_replicas",
    "resolve_plan",
    "run_length",
]

DEFAULT_EPOCHS = 10
"""Epochs when neither ``epochs`` nor ``max_steps`` is given (the digits MLP of the default
run is past 95 % test accuracy by then)."""

LR_SCHEDULES = ("constant", "cosine", "warmup-cosine", "step")
"""Names ``--lr-schedule`` accepts (``pipeoptim.runtime.lr.scheduler_factory``)."""

AMP_MODES = ("bf16", "fp16")

MAX_SEED = 2**32 - 1
"""Seeds go up to this: per-stage and per-epoch seeds derived from it must fit in 64 bits."""


def _default_plan() -> Plan:
    return Plan("pipeoptim", 4, optimizer=OptimizerSpec("sgd", 0.02))


@dataclass
class TrainConfig:
    """A training run of a built-in (or ``module:factory``) model.

    ``plan.model`` and ``plan.batch_size`` name the model and the samples per mini-batch
    (defaults ``mlp`` and 32).
    """

    plan: Plan = field(default_factory=_default_plan)
    """Method, stages, micro-batches, optimizer, boundaries."""
    epochs: int | None = None
    """Epochs to train; with ``max_steps`` also None, DEFAULT_EPOCHS."""
    max_steps: int | None = None
    """Stop after this many mini-batches in all (counted from the run's start)."""
    transport: str = "local"
    """``local`` (every stage in this process) or ``dist`` (one process per stage)."""
    checkpoint_dir: str | None = None
    """Write per-stage checkpoints here (and resume from here with ``resume``)."""
    checkpoint_every: int | None = None
    """Drain the pipeline and checkpoint every K mini-batches (default: only at the end)."""
    resume: bool = False
    """Continue from the latest checkpoint in ``checkpoint_dir``."""
    trace: str | None = None
    """Write the run's trace (pipeoptim trace JSON) here."""
    seed: int = 0
    """Initial weights, data order and every stage's RNG stream."""
    device: str = "auto"
    """``auto`` (cuda where present, else cpu), ``cpu``, ``cuda`` or ``cuda:N``."""
    quiet: bool = True
    """No progress bar."""
    timeout: float = 300.0
    """Seconds a rank waits for another before giving up (process-group timeout)."""
    lr_schedule: str = "constant"
    """One of LR_SCHEDULES; stepped once per update on every stage."""
    warmup: int | None = None
    """Warm-up updates of ``warmup-cosine`` (default: 5 % of the run)."""
    amp: str | None = None
    """Mixed precision: None (fp32), ``bf16`` (CPU and CUDA) or ``fp16`` (CUDA)."""
    grad_clip: float | None = None
    """Clip each stage's gradient norm to this value before its update."""
    keep_checkpoints: int = 2
    """Checkpoints kept in ``checkpoint_dir`` (a resume falls back past a damaged one)."""

    def __post_init__(self) -> None:
        self.plan.model = self.plan.model or "mlp"
        self.plan.batch_size = self.plan.batch_size or 32
        if self.epochs is None and self.max_steps is None:
            self.epochs = DEFAULT_EPOCHS
        counts = {"epochs": self.epochs, "max-steps": self.max_steps}
        counts.update({"checkpoint-every": self.checkpoint_every, "batch-size": self.batch_size})
        for flag, value in counts.items():
            if value is not None and value < 1:
                raise RuntimeConfigError(f"--{flag} must be at least 1 (got {value})")
        if not 0 <= self.seed <= MAX_SEED:
            raise RuntimeConfigError(f"--seed must be in 0..{MAX_SEED} (got {self.seed})")
        if self.warmup is not None and self.warmup < 0:
            raise RuntimeConfigError(f"--warmup must be 0 or more updates (got {self.warmup})")
        spec = self.plan.method_spec
        if not spec.micro_batched and self.plan.micro_batches != 1:
            spec.shape(self.plan.num_stages, self.plan.micro_batches)  # the registry's error
        if self.transport not in ("local", "dist"):
            raise RuntimeConfigError(f"unknown transport {self.transport!r}; use local or dist")
        if not self.timeout > 0:
            raise RuntimeConfigError(f"--timeout must be positive (got {self.timeout})")
        if self.lr_schedule not in LR_SCHEDULES:
            raise RuntimeConfigError(
                f"unknown --lr-schedule {self.lr_schedule!r}; choose one of: "
                f"{', '.join(LR_SCHEDULES)}"
            )
        if self.amp is not None and self.amp not in AMP_MODES:
            raise RuntimeConfigError(
                f"unknown --amp {self.amp!r}; choose bf16 (CPU and CUDA) or fp16 (CUDA)"
            )
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise RuntimeConfigError(f"--grad-clip must be positive (got {self.grad_clip})")
        if self.checkpoint_every is not None and not self.checkpoint_dir:
            raise RuntimeConfigError(
                "--checkpoint-every needs --checkpoint-dir (where the checkpoints go)"
            )
        if self.resume and not self.checkpoint_dir:
            raise RuntimeConfigError("--resume needs --checkpoint-dir D")
        check_replicas(self.plan.data_parallel, self.transport, flag="--data-parallel")

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
        return cls(**{**d, "plan": Plan.from_dict(d["plan"])})


def run_length(epochs: int | None, max_steps: int | None, steps_per_epoch: int) -> int:
    """Mini-batches of a run, counted from step 0: ``epochs`` epochs, capped by
    ``max_steps`` (either may be None, not both)."""
    total = epochs * steps_per_epoch if epochs is not None else max_steps or 0
    return min(total, max_steps) if max_steps is not None else total


def resolve_plan(
    base: Plan | None,
    method: str | None,
    stages: int | None,
    micro: int | None,
    virtual: int | None,
) -> Plan:
    """The Plan of ``Pipeline``'s arguments: explicit ones over ``base`` over defaults.
    The base's boundaries stay only where its stage layout is kept."""
    if base is not None and not isinstance(base, Plan):
        raise RuntimeConfigError(
            f"plan must be a pipeoptim Plan (got {type(base).__name__}); load one with "
            f"Plan.load('plan.json')"
        )
    name = method or (base.method if base else "pipeoptim")
    spec = get_method(name)
    p = stages if stages is not None else (base.num_stages if base else None)
    if p is None:
        raise RuntimeConfigError(
            "Pipeline needs stages=P (the number of pipeline ranks) or plan=Plan.load(...)"
        )
    if not isinstance(p, int) or isinstance(p, bool) or p < 1:
        raise RuntimeConfigError(f"stages must be a positive integer (got {p!r})")
    same = base is not None and base.method == name
    if micro is None:
        micro = base.micro_batches if base and same else (p if spec.micro_batched else 1)
    if not spec.micro_batched and micro != 1:
        spec.shape(p, micro)  # the registry's error, which names the fix
    v = virtual or (base.virtual_stages if base and same else 2 if spec.interleaved else 1)
    keep = base is not None and base.num_stages == p and base.virtual_stages == v
    return Plan(
        name,
        p,
        micro_batches=micro,
        virtual_stages=v,
        prediction_offset=base.prediction_offset if base else 0,
        optimizer=base.optimizer if base else OptimizerSpec("sgd", 0.02),
        model=base.model if base else None,
        batch_size=base.batch_size if base else None,
        boundaries=base.boundaries if keep and base else None,
        devices=base.devices if base else None,
    )


def check_options(
    optimizer: Any,
    loss_fn: Any,
    transport: str,
    amp: str | None,
    grad_clip: float | None,
    log_every: int,
    timeout: float,
) -> None:
    if optimizer is not None and not (isinstance(optimizer, OptimizerSpec) or callable(optimizer)):
        raise RuntimeConfigError(
            f"optimizer must be a factory params -> torch.optim.Optimizer (got "
            f"{type(optimizer).__name__}), e.g. lambda params: torch.optim.SGD(params, lr=0.1)"
        )
    if not callable(loss_fn):
        raise RuntimeConfigError(
            f"loss_fn must be a callable (output, target) -> scalar (got {type(loss_fn).__name__})"
        )
    if transport not in ("local", "dist"):
        raise RuntimeConfigError(f"unknown transport {transport!r}; use local or dist")
    if amp is not None and amp not in AMP_MODES:
        raise RuntimeConfigError(f"unknown amp {amp!r}; use None, 'bf16' or 'fp16' (CUDA)")
    if grad_clip is not None and not grad_clip > 0:
        raise RuntimeConfigError(f"grad_clip must be positive (got {grad_clip})")
    if not isinstance(log_every, int) or log_every < 1:
        raise RuntimeConfigError(f"log_every must be at least 1 (got {log_every!r})")
    if not timeout > 0:
        raise RuntimeConfigError(f"timeout must be positive (got {timeout})")


def check_replicas(data_parallel: object, transport: str, flag: str = "data_parallel") -> int:
    """``data_parallel`` as a replica count, or the error that says how to fix it (naming
    ``flag``: the library argument or the command-line option)."""
    replicas = plan_replicas(data_parallel, flag, error=RuntimeConfigError)
    if replicas > 1 and transport != "dist":
        option = "--transport dist" if flag.startswith("--") else "transport='dist'"
        raise RuntimeConfigError(
            f"{flag} {replicas} runs {replicas} replicas of the pipeline as separate "
            f"processes, which needs {option}; the local transport runs one pipeline in this "
            f"process"
        )
    return replicas
