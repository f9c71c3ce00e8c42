"""Weight predictors whose Δ is read off element-wise optimizer state: SGD's and RMSprop's
momentum buffer, Adam's (AdamW's, NAdam's) bias-corrected moments, XPipe's Adam form and
SpecTrain's smoothed gradient.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim import AdamW, Optimizer

from pipeoptim.runtime.optim.predictors.base import Tensor, WeightPredictor, param_state

__all__ = [
    "AdamPredictor",
    "DecoupledDecayOption",
    "NAdamPredictor",
    "RMSpropPredictor",
    "SGDPredictor",
    "SpecTrainPredictor",
    "XPipePredictor",
]


class SGDPredictor(WeightPredictor):
    """SGD: Δ = momentum buffer (dampening and L2 decay are inside it).

    With μ = 0 or Nesterov the applied direction (g, or g + μ·buf) is not in the state, so
    those groups use the exact last displacement instead of reading a stale ``p.grad``.
    """

    name = "sgd"

    def _uses_displacement(self, group: dict[str, Any]) -> bool:
        return float(group["momentum"]) == 0.0 or bool(group.get("nesterov", False))

    def _state_deltas(self, group: dict[str, Any]) -> list[Tensor | None]:
        return [param_state(self.optimizer, p).get("momentum_buffer") for p in group["params"]]


class DecoupledDecayOption(WeightPredictor):
    """A rule whose Δ leaves the optimizer's decoupled weight decay λ·W out unless
    ``include_decoupled_decay`` asks for it."""

    options = frozenset({"auto_hooks", "include_decoupled_decay"})

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        include_decoupled_decay: bool = False,
        auto_hooks: bool = True,
    ) -> None:
        super().__init__(optimizer, auto_hooks=auto_hooks)
        self.include_decoupled_decay = include_decoupled_decay


class AdamPredictor(DecoupledDecayOption):
    """Adam / AdamW: Δ = m̂ / (sqrt(v̂) + ε), bias-corrected with the optimizer's own step.

    amsgrad uses max_exp_avg_sq; Adam's L2 decay is already inside the moments. With
    ``include_decoupled_decay`` the decoupled term λ·W of AdamW is added.
    """

    name = "adam"

    def _moments(
        self, group: dict[str, Any]
    ) -> tuple[list[int], list[Tensor], list[Tensor], list[float], list[float]]:
        """Of the group's trainable parameters with moments: their indices, m, v (or its
        running max under amsgrad), the divisor of m (Adam: its bias correction 1 − β1^t)
        and √(1 − β2^t)."""
        beta1, beta2 = (float(b) for b in group["betas"])
        amsgrad = bool(group.get("amsgrad", False))
        idx, ms, vs, bc1, bc2 = [], [], [], [], []
        for i, p in enumerate(group["params"]):
            st = param_state(self.optimizer, p)
            step = float(st.get("step", 0.0))
            if not p.requires_grad or step <= 0 or "exp_avg" not in st or "exp_avg_sq" not in st:
                continue
            idx.append(i)
            ms.append(st["exp_avg"])
            vs.append(st.get("max_exp_avg_sq", st["exp_avg_sq"]) if amsgrad else st["exp_avg_sq"])
            bc1.append(1.0 - beta1**step)
            bc2.append(math.sqrt(1.0 - beta2**step))
        return idx, ms, vs, bc1, bc2

    def _denominators(self, vs: list[Tensor], bc2: list[float], eps: float) -> list[Tensor]:
        """√v̂ + ε, i.e. √v / √(1 − β2^t) + ε, one temporary per parameter."""
        d = torch._foreach_sqrt(vs)
        torch._foreach_div_(d, bc2)
        torch._foreach_add_(d, eps)
        return list(d)

    def _write_fused(self, group: dict[str, Any], eta: float, dest: list[Tensor]) -> bool:
        # Ŵ = W − (η / (1 − β1^t)) · m / (√v̂ + ε) in one addcdiv per parameter, with no Δ
        # tensor: about a third fewer passes over memory than forming Δ first.
        params: list[Tensor] = group["params"]
        if self.include_decoupled_decay:
            return False
        if any(out.data_ptr() == p.data_ptr() for out, p in zip(dest, params, strict=True)):
            return False
        idx, ms, vs, bc1, bc2 = self._moments(group)
        denominators = self._denominators(vs, bc2, float(group["eps"])) if idx else []
        moving = set(idx)
        rest = [i for i in range(len(params)) if i not in moving]
        if rest:
            torch._foreach_copy_([dest[i] for i in rest], [params[i].detach() for i in rest])
        for j, i in enumerate(idx):
            torch.addcdiv(
                params[i].detach(), ms[j], denominators[j], value=-eta / bc1[j], out=dest[i]
            )
        return True

    def _state_deltas(self, group: dict[str, Any]) -> list[Tensor | None]:
        params: list[Tensor] = group["params"]
        idx, ms, vs, bc1, bc2 = self._moments(group)
        out: list[Tensor | None] = [None] * len(params)
        if not idx:
            return out
        # d = m / (bc1 · (sqrt(v)/sqrt(bc2) + ε)) with one temporary per parameter.
        d = self._denominators(vs, bc2, float(group["eps"]))
        torch._foreach_mul_(d, bc1)
        torch._foreach_reciprocal_(d)
        torch._foreach_mul_(d, ms)
        wd = float(group.get("weight_decay", 0.0))
        decoupled = group.get("decoupled_weight_decay", isinstance(self.optimizer, AdamW))
        if self.include_decoupled_decay and decoupled and wd != 0.0:
            torch._foreach_add_(d, [params[i] for i in idx], alpha=wd)
        for i, t in zip(idx, d, strict=True):
            out[i] = t
        return out


class NAdamPredictor(AdamPredictor):
    """NAdam: Δ = c·m / (√v̂ + ε), its next update with the future gradient taken to be m.

    torch's step t+1, with μ_k = β1·(1 − ½·0.96^(k·ψ)) (ψ: momentum_decay) and the state's
    Π_t = μ_1⋯μ_t (``mu_product``), is m' = β1·m + (1 − β1)·g and
    ``W ← W − lr·[(1 − μ_{t+1})/(1 − Π_t·μ_{t+1})·g + μ_{t+2}/(1 − Π_t·μ_{t+1}·μ_{t+2})·m']
    / (√v̂ + ε)``. With g = m (Adam's rule assumes the moments stay), m' = m and
    ``c = (1 − μ_{t+1})/(1 − Π_t·μ_{t+1}) + μ_{t+2}/(1 − Π_t·μ_{t+1}·μ_{t+2})``; c → 1 as
    Π_t → 0, Adam's direction. v̂ = v_t/(1 − β2^t) as for Adam (v stays too). One Δ serves
    all s steps, with the next step's μ values (c moves by O(0.96^(t·ψ)) per step). L2 decay
    is inside the moments; decoupled decay λ·W is added only with ``include_decoupled_decay``.
    """

    name = "nadam"

    def _moments(
        self, group: dict[str, Any]
    ) -> tuple[list[int], list[Tensor], list[Tensor], list[float], list[float]]:
        idx, ms, vs, _, bc2 = super()._moments(group)
        beta1, psi = float(group["betas"][0]), float(group["momentum_decay"])
        divisors = []
        for i in idx:
            st = param_state(self.optimizer, group["params"][i])
            t, prod = float(st["step"]), float(st.get("mu_product", 1.0))
            mu1 = beta1 * (1.0 - 0.5 * 0.96 ** ((t + 1.0) * psi))
            mu2 = beta1 * (1.0 - 0.5 * 0.96 ** ((t + 2.0) * psi))
            c = (1.0 - mu1) / (1.0 - prod * mu1) + mu2 / (1.0 - prod * mu1 * mu2)
            divisors.append(1.0 / c)
        return idx, ms, vs, divisors, bc2


class XPipePredictor(AdamPredictor):
    """XPipe: the Adam-form Δ, also applied to Adam-like optimizers (NAdam, RAdam).

    Every micro-batch of a mini-batch predicts from the same Δ. The first prediction after
    a step writes Ŵ in one ``addcdiv`` per weight and forms no Δ; a second one before the
    next step (micro-batches of one mini-batch at another distance, as with M < P) forms
    Δ once and keeps it (one weight-sized buffer) for the rest, instead of once per
    micro-batch.
    """

    name = "xpipe"
    keeps_deltas = True
    fuses_first_write = True


class RMSpropPredictor(SGDPredictor):
    """RMSprop: Δ = momentum buffer where momentum > 0, else g/(sqrt(v)+ε).

    g_t is not kept in the state, so momentum-free groups use the last displacement, which
    is exactly g_t / (sqrt(v_t) + ε) (centered: v_t − grad_avg²).
    """

    name = "rmsprop"

    def _uses_displacement(self, group: dict[str, Any]) -> bool:
        return float(group["momentum"]) == 0.0


class SpecTrainPredictor(WeightPredictor):
    """SpecTrain: Δ = smoothed gradient (SGD momentum buffer or Adam's raw exp_avg)."""

    name = "spectrain"

    def _state_deltas(self, group: dict[str, Any]) -> list[Tensor | None]:
        out: list[Tensor | None] = []
        for p in group["params"]:
            st = param_state(self.optimizer, p)
            v = st.get("momentum_buffer")
            out.append(v if v is not None else st.get("exp_avg"))
        return out
