"""Learning-rate schedules by name, for ``pipeoptim train --lr-schedule``.

Each name becomes a factory ``optimizer -> scheduler`` that a
:class:`~pipeoptim.runtime.pipeline.Pipeline` calls once per stage; every stage steps its
scheduler once per update, so the schedule is counted in updates (mini-batches). All of
them are schedulers whose next values ``update.future_lrs`` can query, so PipeOptim's
prediction uses the learning rates of the next s updates (Σlr instead of lr·s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.optim import Optimizer
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LRScheduler, StepLR

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.config import LR_SCHEDULES
from pipeoptim.runtime.optim.update import SchedulerFactory

__all__ = ["WarmupCosine", "scheduler_factory"]


@dataclass(frozen=True)
class WarmupCosine:
    """LambdaLR factor: linear warm-up over ``warmup`` updates, then cosine to ``floor`` (a
    share of the base rate) at ``total``. A plain object (not a closure), so the scheduler's
    state dict keeps it."""

    warmup: int
    total: int
    floor: float = 0.0

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def scheduler_factory(
    name: str, total_updates: int, warmup: int | None = None
) -> SchedulerFactory | None:
    """The factory of schedule ``name`` over a run of ``total_updates`` updates (None for
    ``constant``). ``warmup`` defaults to 5 % of the run."""
    if name not in LR_SCHEDULES:
        raise RuntimeConfigError(
            f"unknown lr schedule {name!r}; choose one of: {', '.join(LR_SCHEDULES)}"
        )
    total = max(1, total_updates)
    if name == "constant":
        return None
    if name == "cosine":

        def cosine(opt: Optimizer) -> LRScheduler:
            return CosineAnnealingLR(opt, T_max=total)

        return cosine
    if name == "step":

        def step(opt: Optimizer) -> LRScheduler:
            return StepLR(opt, step_size=max(1, total // 3), gamma=0.1)

        return step
    ramp = warmup if warmup is not None else max(1, total // 20)
    if ramp >= total:
        raise RuntimeConfigError(
            f"--warmup {ramp} is not shorter than the run ({total} updates); lower it"
        )

    def warmup_cosine(opt: Optimizer) -> LRScheduler:
        return LambdaLR(opt, WarmupCosine(max(1, ramp), total))

    return warmup_cosine
