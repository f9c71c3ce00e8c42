"""Weight predictors of the optimizers that do matrix work per 2-D weight: Muon's
Newton–Schulz direction, basis rotation's rotated Adam direction, and the Muon-with-AdamW
composite that predicts each part by its own rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.optim.basis_rotation import rotated_direction
from pipeoptim.runtime.optim.optimizers import MuonWithAdamW
from pipeoptim.runtime.optim.predictors.base import (
    Deltas,
    Tensor,
    WeightPredictor,
    check_distance,
    param_state,
)
from pipeoptim.runtime.optim.predictors.moments import AdamPredictor, DecoupledDecayOption

__all__ = ["BasisRotationPredictor", "MuonPredictor", "MuonWithAdamWPredictor"]


class MuonPredictor(WeightPredictor):
    """Muon: Δ = r·NS(buf) + λ·W, its next update with the future gradient taken to be buf.

    torch's step is buf ← μ·buf + (1 − μ)·g (a lerp), u = (1 − μ)·g + μ·buf with Nesterov
    (else u = buf), ``W ← W·(1 − lr·λ) − lr·r·NS(u)`` with r = adjust_lr(lr, shape)/lr (it is
    linear in lr). With g = buf, buf stays and u = buf exactly, Nesterov or not (torch's
    docstring writes buf ← μ·buf + g, so u = (1 + μ)·buf: NS divides by the Frobenius norm
    first, so the same up to its bf16 rounding). Decay is known: for one step Δ is exact
    given g = buf; over s steps (1 − lr·λ)^s is taken to first order, an error of
    O((s·lr·λ)²·‖W‖). NS and r are torch's own functions. One NS per matrix per update: Δ is
    computed once after each step and kept (one weight-sized buffer) for all predictions.
    """

    name = "muon"
    keeps_deltas = True

    def _state_deltas(self, group: dict[str, Any]) -> list[Tensor | None]:
        wd = float(group["weight_decay"])
        coefficients = tuple(float(x) for x in group["ns_coefficients"])
        out: list[Tensor | None] = []
        for p in group["params"]:
            buf = param_state(self.optimizer, p).get("momentum_buffer")
            if buf is None or not p.requires_grad:
                out.append(None)
                continue
            o = _zeropower_via_newtonschulz(
                buf,
                (coefficients[0], coefficients[1], coefficients[2]),
                int(group["ns_steps"]),
                float(group["eps"]),
            )
            d = o.to(p.dtype).mul_(_adjust_lr(1.0, group["adjust_lr_fn"], p.shape))
            if wd != 0.0:
                d.add_(p.detach(), alpha=wd)
            out.append(d)
        return out


class BasisRotationPredictor(DecoupledDecayOption):
    """:class:`~pipeoptim.runtime.optim.basis_rotation.BasisRotation`: Δ = √(1 − β2^t)/(1 − β1^t)
    · Q_L·((Q_Lᵀ·m·Q_R)/(√v + ε))·Q_Rᵀ, its next update with the future gradient taken to be m.

    With g = m, m stays (m ← β1·m + (1 − β1)·m); v, the bias corrections and the basis are
    taken as they are at step t, as Adam's rule takes v̂ to stay (v would take in
    (Q_Lᵀ·m·Q_R)², and the basis moves only on a refresh, every ``precondition_frequency``
    steps: a refresh among the next s updates is not foreseen). Non-matrix parameters and
    unrotated sides use the identity (Adam's Δ). The direction is the optimizer's own function
    (:func:`~pipeoptim.runtime.optim.basis_rotation.rotated_direction`). With
    ``include_decoupled_decay`` the decoupled term λ·W is added. Four matrix products per
    matrix: Δ is computed once after each step and kept (one weight-sized buffer) for every
    prediction until the next.
    """

    name = "basis-rotation"
    keeps_deltas = True

    def _state_deltas(self, group: dict[str, Any]) -> list[Tensor | None]:
        beta1, beta2 = (float(b) for b in group["betas"])
        eps, wd = float(group["eps"]), float(group.get("weight_decay", 0.0))
        out: list[Tensor | None] = []
        for p in group["params"]:
            st = param_state(self.optimizer, p)
            step = float(st.get("step", 0.0))
            if not p.requires_grad or step <= 0 or "exp_avg" not in st:
                out.append(None)
                continue
            d = rotated_direction(st, eps)
            d.mul_(math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step))
            if self.include_decoupled_decay and wd != 0.0:
                d.add_(p.detach(), alpha=wd)
            out.append(d)
        return out


class MuonWithAdamWPredictor(WeightPredictor):
    """:class:`~pipeoptim.runtime.optim.optimizers.MuonWithAdamW`: the Muon rule on its Muon part,
    the Adam rule on its AdamW part; each part's predictor hooks its own inner optimizer
    (the composite's step runs both inner steps)."""

    name = "muon+adamw"
    options = frozenset({"auto_hooks", "include_decoupled_decay"})
    keeps_deltas = True  # the Muon part's Δ

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        include_decoupled_decay: bool = False,
        auto_hooks: bool = True,
    ) -> None:
        if not isinstance(optimizer, MuonWithAdamW):
            raise RuntimeConfigError(
                f"the muon+adamw predictor reads a MuonWithAdamW's parts (got "
                f"{type(optimizer).__name__}); use predictor_for(optimizer)"
            )
        super().__init__(optimizer, auto_hooks=False)
        self.parts: list[WeightPredictor] = []
        if optimizer.muon is not None:
            self.parts.append(MuonPredictor(optimizer.muon, auto_hooks=auto_hooks))
        if optimizer.adamw is not None:
            self.parts.append(
                AdamPredictor(
                    optimizer.adamw,
                    include_decoupled_decay=include_decoupled_decay,
                    auto_hooks=auto_hooks,
                )
            )

    def _count(self) -> None:
        self.kept_computations = sum(p.kept_computations for p in self.parts)

    def delta(self) -> Deltas:
        out = [row for p in self.parts for row in p.delta()]
        self._count()
        return out

    def predict_into(
        self, dest: list[Tensor], s: int, lrs: Sequence[Sequence[float]] | None = None
    ) -> None:
        s = check_distance(s)
        self._check_dest(dest)
        self._etas(s, lrs)  # checks lrs against all groups
        offset, row = 0, 0
        for part in self.parts:
            groups = part.optimizer.param_groups
            k = sum(len(g["params"]) for g in groups)
            rows = None if lrs is None else lrs[row : row + len(groups)]
            part.predict_into(dest[offset : offset + k], s, rows)
            offset, row = offset + k, row + len(groups)
        self._count()

    def prepare_deltas(self) -> None:
        for p in self.parts:
            p.prepare_deltas()
        self._count()

    def before_step(self) -> None:
        for p in self.parts:
            p.before_step()

    def after_step(self) -> None:
        for p in self.parts:
            p.after_step()

    def close(self) -> None:
        for p in self.parts:
            p.close()

    def held_tensors(self) -> list[Tensor]:
        return [t for p in self.parts for t in p.held_tensors()]

    def _displacements(self) -> dict[int, Tensor]:
        """Each part's displacements, indices running on across parts as the composite's
        parameters do (so checkpoint checks read them alike)."""
        disp: dict[int, Tensor] = {}
        offset = 0
        for p in self.parts:
            disp.update({offset + i: t for i, t in p._displacements().items()})
            offset += len(p._params())
        return disp

    def _load_displacements(self, disp: dict[int, Tensor]) -> None:
        offset = 0
        for p in self.parts:
            k = len(p._params())
            p._load_displacements(
                {i - offset: t for i, t in disp.items() if offset <= i < offset + k}
            )
            offset += k
