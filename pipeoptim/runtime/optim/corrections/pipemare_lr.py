"""``pipemare-lr``: PipeMare's learning-rate rescheduling (Yang et al., MLSys 2021,
arXiv 1910.05124, "T1"): stage k's rate is divided by ``τ^p(t)`` with
``p(t) = 1 − min((t+1)/T, 1)``, so a delayed stage starts at ``lr/τ`` and reaches the full
rate after T updates. PipeMare's second technique, the discrepancy correction of the
backward's weights, approximates the forward's weights without a stash; the methods that
use this correction stash them (PipeDream's policy) or predict them, so the backward
already reads what the correction would estimate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.optim.corrections.protocol import StageContext

__all__ = ["PIPEMARE_ANNEAL_UPDATES", "PipeMareLr"]

PIPEMARE_ANNEAL_UPDATES = 1000
"""T of PipeMare's rescheduling: the updates over which a delayed stage's rate rises from
``lr/τ`` to ``lr``. PipeMare anneals over its first epochs; AsyncPP's implementation uses 7
epochs of 1,000 updates in a 50,000-update run. Register a ``PipeMareLr(context, T)`` of
your own for another T."""


class PipeMareLr:
    """PipeMare's rescheduling: ``lr_k(t) = lr(t) / τ^(1 − min((t+1)/T, 1))`` for the update
    of delay τ ≥ 2 (τ ≤ 1 keeps the rate), t counting this stage's updates from 0. The rate
    is divided just for the step and put back after it, so the user's scheduler keeps
    driving ``lr(t)``. A prediction sums the same divided rates of the updates it looks
    ahead to (:meth:`lr_divisors`, read by ``StageUpdate.future_lrs``)."""

    def __init__(
        self, context: StageContext, anneal_updates: int = PIPEMARE_ANNEAL_UPDATES
    ) -> None:
        if anneal_updates < 1:
            raise RuntimeConfigError(
                f"PipeMare's annealing length T must be at least 1 update (got "
                f"{anneal_updates}); pass anneal_updates=1000 or so"
            )
        self.anneal_updates = anneal_updates
        self.steady_delay = context.delay
        """τ_k in steady state: the delay assumed for an update whose own is not given."""
        self.updates = 0
        self._saved: list[float] = []

    def factor(self, delay: int) -> float:
        """The divisor ``τ^p(t)`` of the next update."""
        return self._divisor(self.updates, delay)

    def _divisor(self, t: int, delay: int) -> float:
        if delay <= 1:
            return 1.0
        p = 1.0 - min((t + 1) / self.anneal_updates, 1.0)
        return math.pow(delay, p)

    def lr_divisors(self, delays: Sequence[int]) -> list[float]:
        """The divisors of the next ``len(delays)`` updates, ``delays[i]`` the i-th's τ: what
        the prediction divides the scheduled rates by, so it sums the rates the steps use."""
        return [self._divisor(self.updates + i, delay) for i, delay in enumerate(delays)]

    def before_step(self, optimizer: Optimizer, params: Sequence[Tensor], delay: int) -> None:
        divisor = self.factor(delay)
        self._saved = [float(g["lr"]) for g in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = float(group["lr"]) / divisor

    def after_step(self, optimizer: Optimizer, params: Sequence[Tensor], delay: int) -> None:
        for group, lr in zip(optimizer.param_groups, self._saved, strict=True):
            group["lr"] = lr
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates, "anneal_updates": self.anneal_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = int(state["updates"])
