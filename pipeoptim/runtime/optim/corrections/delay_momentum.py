"""``delay-momentum``: the delay-dependent momentum of the Nesterov method for asynchronous
pipelines (Ajanthan et al., ICML 2025, arXiv 2505.01099; PluralisResearch/AsyncPP's
``--adaptive_momentum``): ``β_k = β0 + τ_k(0.99 − β0)/P``, set once from the stage's
steady-state delay, on the optimizer's own momentum (Adam-family ``betas[0]``, SGD's
``momentum``). The paper's optimizer is NAdam with decoupled weight decay and
momentum decay 0.004 (``--optimizer nadam``), whose μ_{t+1}·m term is the look-ahead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.optim.corrections.protocol import StageContext

__all__ = ["MOMENTUM_CEILING", "DelayMomentum", "delay_momentum"]

MOMENTUM_CEILING = 0.99
"""The momentum of the most delayed stage under the delay-dependent rule (AsyncPP)."""


def delay_momentum(base: float, delay: int, num_stages: int) -> float:
    """``β_k = β0 + τ_k(0.99 − β0)/P`` (AsyncPP's adaptive momentum)."""
    return base + delay * (MOMENTUM_CEILING - base) / num_stages


class DelayMomentum:
    """Sets each param group's momentum to :func:`delay_momentum` of the stage's steady
    delay, at construction (as AsyncPP does), and again on whatever base momentum an LR
    scheduler writes later: OneCycleLR and CyclicLR cycle the momentum by default
    (``cycle_momentum=True``), and each of their steps would otherwise put the undelayed
    value back. So under such a scheduler the momentum of step t is
    ``β0(t) + τ_k(0.99 − β0(t))/P`` with β0(t) the scheduler's; under any other it is set
    once. A value is re-corrected only where it differs from the one this rule wrote last
    (kept per group, and checkpointed), so the rule is never applied twice to one value."""

    def __init__(self, context: StageContext, optimizer: Optimizer) -> None:
        self.delay, self.num_stages = context.delay, context.num_stages
        self.optimizer = optimizer
        self.written: list[float] = []
        """The momentum this rule wrote last into each param group."""
        for group in optimizer.param_groups:
            if "betas" not in group and not float(group.get("momentum", 0.0)) > 0.0:
                raise RuntimeConfigError(
                    f"stage {context.index}: {context.method} sets the momentum from the "
                    f"stage's delay, but {type(optimizer).__name__} has no momentum to set "
                    f"(no betas, momentum 0); use NAdam (the paper's, --optimizer nadam), "
                    f"Adam, AdamW or SGD with momentum"
                )
            self.written.append(self._write(group, _momentum(group)))

    def _write(self, group: dict[str, Any], base: float) -> float:
        value = delay_momentum(base, self.delay, self.num_stages)
        if "betas" in group:
            group["betas"] = (value, group["betas"][1])
        else:
            group["momentum"] = value
        return value

    def after_scheduler(self, optimizer: Optimizer) -> None:
        """Correct the momentum of each group the scheduler wrote since this rule did."""
        for i, group in enumerate(optimizer.param_groups):
            now = _momentum(group)
            if now != self.written[i]:
                self.written[i] = self._write(group, now)

    def before_step(self, optimizer: Optimizer, params: Sequence[Tensor], delay: int) -> None:
        self.after_scheduler(optimizer)  # a scheduler stepped outside the stage's update

    def after_step(self, optimizer: Optimizer, params: Sequence[Tensor], delay: int) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"written": list(self.written)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what the rule wrote last; a state saved before it was kept (``{}``)
        leaves the values of the loaded optimizer, which the rule had set."""
        written = state.get("written")
        if written is None:
            self.written = [_momentum(g) for g in self.optimizer.param_groups]
        else:
            self.written = [float(v) for v in written]


def _momentum(group: dict[str, Any]) -> float:
    """The group's momentum: Adam-family ``betas[0]``, else ``momentum``."""
    if "betas" in group:
        return float(group["betas"][0])
    return float(group.get("momentum", 0.0))
