"""What a delay correction is, and what it is told of its stage.

The update is always the user's ``torch.optim`` optimizer; a correction acts on it before
and after its step (:class:`~pipeoptim.runtime.optim.update.StageUpdate` calls it), so a
correction is added without touching the stage's forward or backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = ["DelayCorrection", "FollowsScheduler", "HoldsTensors", "RescalesLr", "StageContext"]


@dataclass(frozen=True)
class StageContext:
    """What a stage's optimizer factory and delay correction may know of the stage."""

    index: int
    """The stage k, from 0 at the input."""
    num_stages: int
    """Stages P of the pipeline."""
    method: str
    """The method's registry name."""
    delay: int
    """τ_k: the steady-state delay of this stage's updates (updates between the weights a
    mini-batch's gradient is computed on and the update that applies it; ``P−1−k`` under
    PipeDream and PipeOptim, 1 under 2BW and XPipe, 0 under a flush), from the schedule
    (``plan.versions.steady_delays``). Warm-up updates have smaller delays."""
    micro_batches: int
    """Micro-batches M per mini-batch."""
    extrapolation: float | None = None
    """λ of the ``extrapolate`` correction (the run's ``extrapolation`` option; None: its
    default, ``extrapolate.DEFAULT_EXTRAPOLATION``); read by no other rule."""
    module: nn.Module | None = field(default=None, compare=False, repr=False)
    """The stage's units (its ``nn.Module``, on the stage's device), for a correction that
    acts on the weights by what they are (QK-Clip rescales attention heads); None where a
    rule is built without a stage."""


class DelayCorrection(Protocol):
    """What a delay correction does around each optimizer step of one stage.

    ``delay`` is τ of the mini-batch whose gradient the step applies: the updates the stage
    made between that mini-batch's forward and its backward, read from the schedule's version
    analysis (``MicroBatchVersions.distance``), so it is right for any schedule, warm-up
    included. ``before_step`` sees the final (synchronised, unscaled, clipped) gradients and
    may change them or the optimizer's hyper-parameters; ``after_step`` may undo such a change
    or move the weights (a look-ahead). Whatever it keeps between steps goes into its state
    dict, which the stage checkpoints.
    """

    def before_step(self, optimizer: Optimizer, params: Sequence[Tensor], delay: int) -> None:
        """Called after the gradient is final, before ``optimizer.step()``."""

    def after_step(self, optimizer: Optimizer, params: Sequence[Tensor], delay: int) -> None:
        """Called after ``optimizer.step()`` (and after a skipped fp16 step too)."""

    def state_dict(self) -> dict[str, Any]:
        """What the correction keeps between steps (checkpointed with the stage)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""


@runtime_checkable
class RescalesLr(Protocol):
    """A correction that changes the learning rate its step uses (PipeMare divides it by
    τ^p(t)). A prediction must sum the rates the update will use, so the stage's
    :meth:`~pipeoptim.runtime.optim.update.StageUpdate.future_lrs` divides the scheduled
    rates of the next updates by these."""

    def lr_divisors(self, delays: Sequence[int]) -> list[float]:
        """The divisor of each of the next ``len(delays)`` updates, ``delays[i]`` being τ of
        the i-th next one (the first: the update the stage makes next)."""


@runtime_checkable
class FollowsScheduler(Protocol):
    """A correction that sets a hyper-parameter an LR scheduler may also write (OneCycleLR
    and CyclicLR cycle the momentum by default): called once the scheduler was built and
    after each of its steps, so the correction applies to what the scheduler set instead of
    being erased by it."""

    def after_scheduler(self, optimizer: Optimizer) -> None:
        """Re-apply the correction to the values the scheduler just wrote (if any)."""


@runtime_checkable
class HoldsTensors(Protocol):
    """A correction that keeps tensors between updates (the extrapolation's previous
    update): the stage's memory count adds them to its optimizer state, as it does a
    predictor's kept Δ."""

    def held_tensors(self) -> list[Tensor]:
        """The tensors kept now."""
