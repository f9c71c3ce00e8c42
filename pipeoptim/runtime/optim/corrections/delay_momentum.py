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
