"""The published delay corrections, registered in ``update.CORRECTIONS`` by name.

A delay correction changes how a stage updates as a function of its delay τ (DESIGN.md,
"Delay corrections"; the slot is :class:`~pipeoptim.runtime.optim.update.DelayCorrection`). Each
here is the rule of one paper, written from the paper's formula and its public code, with
the defaults they use; ``plan/methods.py`` registers the methods that name them.

* ``pipemare-lr`` — PipeMare's learning-rate rescheduling (Yang et al., MLSys 2021,
  arXiv 1910.05124, "T1"): stage k's rate is divided by ``τ^p(t)`` with
  ``p(t) = 1 − min((t+1)/T, 1)``, so a delayed stage starts at ``lr/τ`` and reaches the full
  rate after T updates. PipeMare's second technique, the discrepancy correction of the
  backward's weights, approximates the forward's weights without a stash; the methods that
  use this correction stash them (PipeDream's policy) or predict them, so the backward
  already reads what the correction would estimate.
* ``delay-momentum`` — the delay-dependent momentum of the Nesterov method for asynchronous
  pipelines (Ajanthan et al., ICML 2025, arXiv 2505.01099; PluralisResearch/AsyncPP's
  ``--adaptive_momentum``): ``β_k = β0 + τ_k(0.99 − β0)/P``, set once from the stage's
  steady-state delay, on the optimizer's own momentum (Adam-family ``betas[0]``, SGD's
  ``momentum``). The paper's optimizer is NAdam with decoupled weight decay and
  momentum decay 0.004 (``--optimizer nadam``), whose μ_{t+1}·m term is the look-ahead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.optim.update import CORRECTIONS, DelayCorrection, StageContext

__all__ = [
    "PIPEMARE_ANNEAL_UPDATES",
    "DelayMomentum",
    "PipeMareLr",
    "build_correction",
    "delay_momentum",
]

PIPEMARE_ANNEAL_UPDATES = 1000
"""T of PipeMare's rescheduling: the updates over which a delayed stage's rate rises from
``lr/τ`` to ``lr``. PipeMare anneals over its first epochs; AsyncPP's implementation uses 7
epochs of 1,000 updates in a 50,000-update run. Register a ``PipeMareLr(context, T)`` of
your own for another T."""

MOMENTUM_CEILING = 0.99
"""The momentum of the most delayed stage under the delay-dependent rule (AsyncPP)."""


class PipeMareLr:
    """PipeMare's rescheduling: ``lr_k(t) = lr(t) / τ^(1 − min((t+1)/T, 1))`` for the update
    of delay τ ≥ 2 (τ ≤ 1 keeps the rate), t counting this stage's updates from 0. The rate
    is divided just for the step and put back after it, so the user's scheduler keeps
    driving ``lr(t)``."""

    def __init__(
        self, context: StageContext, anneal_updates: int = PIPEMARE_ANNEAL_UPDATES
    ) -> None:
        if anneal_updates < 1:
            raise RuntimeConfigError(
                f"PipeMare's annealing length T must be at least 1 update (got "
                f"{anneal_updates}); pass anneal_updates=1000 or so"
            )
        self.anneal_updates = anneal_updates
        self.updates = 0
        self._saved: list[float] = []

    def factor(self, delay: int) -> float:
        """The divisor ``τ^p(t)`` of the next update."""
        if delay <= 1:
            return 1.0
        p = 1.0 - min((self.updates + 1) / self.anneal_updates, 1.0)
        return math.pow(delay, p)

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


def delay_momentum(base: float, delay: int, num_stages: int) -> float:
    """``β_k = β0 + τ_k(0.99 − β0)/P`` (AsyncPP's adaptive momentum)."""
    return base + delay * (MOMENTUM_CEILING - base) / num_stages


class DelayMomentum:
    """Sets each param group's momentum to :func:`delay_momentum` of the stage's steady
    delay, once, at construction (as AsyncPP does). The optimizer checkpoints the values
    with its param groups, so nothing is kept here."""

    def __init__(self, context: StageContext, optimizer: Optimizer) -> None:
        for group in optimizer.param_groups:
            if "betas" in group:
                beta1, beta2 = group["betas"]
                group["betas"] = (
                    delay_momentum(float(beta1), context.delay, context.num_stages),
                    beta2,
                )
            elif float(group.get("momentum", 0.0)) > 0.0:
                group["momentum"] = delay_momentum(
                    float(group["momentum"]), context.delay, context.num_stages
                )
            else:
                raise RuntimeConfigError(
                    f"stage {context.index}: {context.method} sets the momentum from the "
                    f"stage's delay, but {type(optimizer).__name__} has no momentum to set "
                    f"(no betas, momentum 0); use NAdam (the paper's, --optimizer nadam), "
                    f"Adam, AdamW or SGD with momentum"
                )

    def before_step(self, optimizer: Optimizer, params: Sequence[Tensor], delay: int) -> None:
        return None

    def after_step(self, optimizer: Optimizer, params: Sequence[Tensor], delay: int) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def build_correction(
    name: str | None, method: str, context: StageContext, optimizer: Optimizer
) -> DelayCorrection | None:
    """The correction a method names, built for one stage (None: the plain update)."""
    if name is None:
        return None
    factory = CORRECTIONS.get(name)
    if factory is None:
        known = ", ".join(sorted(CORRECTIONS)) or "none are registered"
        raise RuntimeConfigError(
            f"method {method!r} names the delay correction {name!r}, which the runtime does "
            f"not know (known: {known}); register it in pipeoptim.runtime.optim.update.CORRECTIONS"
        )
    return factory(context, optimizer)


CORRECTIONS["pipemare-lr"] = lambda context, optimizer: PipeMareLr(context)
CORRECTIONS["delay-momentum"] = DelayMomentum
