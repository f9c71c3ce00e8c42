"""Basis Rotation: Adam run in each weight matrix's gradient eigenbasis, one optimizer per stage.

Why: Jung, Shin and Lee ("Mitigating Staleness in Asynchronous Pipeline Parallelism via Basis
Rotation", ICML 2026) trace much of the harm a stale gradient does to Adam to its
per-coordinate scaling: where the curvature is not aligned with the coordinate axes, a
delayed, coordinate-wise normalised step overshoots along the directions that couple
coordinates. Their remedy (Algorithm 1, bilateral rotation, second-order source) keeps EMAs of
the two gradient covariances ``L = E[G·Gᵀ]`` and ``R = E[Gᵀ·G]`` of every matrix, takes their
eigenvectors ``Q_L``, ``Q_R`` as a basis (refreshed every ``precondition_frequency`` steps by
one warm-started power step with QR), and runs Adam's second moment in that basis:

``m ← β1·m + (1 − β1)·G``, ``v ← β2·v + (1 − β2)·(Q_Lᵀ·G·Q_R)²``,
``W ← W·(1 − lr·λ) − lr·√(1 − β2^t)/(1 − β1^t) · Q_L·((Q_Lᵀ·m·Q_R)/(√v + ε))·Q_Rᵀ``.

The published code leaves non-matrix parameters to another optimizer. A stage must hold ONE
``torch.optim.Optimizer`` (checkpoints, LR schedulers, loss scaling and step hooks see one), so
here every parameter that is not 2-D, and every side of a matrix longer than
``max_precondition_dim`` (SOAP's practice: a 50k-token head keeps that side unrotated instead
of a 50k² basis), runs the same rule with that rotation the identity: plain Adam for vectors.

All state lives in ``self.state[p]`` as plain tensors of the parameter's dtype and device
(``step``, ``exp_avg`` = m in the original basis, ``exp_avg_sq`` = v in the rotated basis, and
per rotated side ``GG_L``/``Q_L`` (rows) and ``GG_R``/``Q_R`` (columns)), so torch's
``state_dict``/``load_state_dict``, which casts state to the parameter's dtype, round-trips it
exactly. Eigendecompositions and QR run in float32 at least; low-precision parameters should
keep fp32 master weights (as autocast does), since the basis is stored in their dtype.
:func:`rotated_direction` is the one formula of the direction, shared by the step and by the
prediction rule (``predict.BasisRotationPredictor``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT

__all__ = ["BasisRotation", "rotated_direction", "state_bytes"]

_SIDES = (("GG_L", "Q_L", 0), ("GG_R", "Q_R", 1))
"""Per side of a matrix: its covariance key, its basis key, the dimension of v it rotates."""


def _rotated_sides(shape: torch.Size | tuple[int, ...], max_dim: int) -> tuple[bool, bool]:
    """Which sides (rows, columns) of a parameter of ``shape`` are rotated."""
    if len(shape) != 2:
        return False, False
    return shape[0] <= max_dim, shape[1] <= max_dim


def state_bytes(shape: tuple[int, ...], element_size: int, max_precondition_dim: int = 4096) -> int:
    """Bytes of the state :class:`BasisRotation` keeps for one parameter of ``shape``: m and v
    (two parameter-sized tensors), the step counter (a float32 scalar) and, per rotated side
    of length n, its covariance and its basis (two n×n tensors)."""
    numel = math.prod(shape)
    rows, cols = _rotated_sides(tuple(shape), max_precondition_dim)
    square = (shape[0] ** 2 if rows else 0) + (shape[1] ** 2 if cols else 0)
    return element_size * (2 * numel + 2 * square) + 4


def _work(t: Tensor) -> Tensor:
    """``t`` in the precision the basis is computed in: float32 at least."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _project(x: Tensor, ql: Tensor | None, qr: Tensor | None) -> Tensor:
    """``Q_Lᵀ·x·Q_R`` (an absent side is the identity)."""
    if ql is not None:
        x = ql.T @ x
    if qr is not None:
        x = x @ qr
    return x


def _project_back(x: Tensor, ql: Tensor | None, qr: Tensor | None) -> Tensor:
    """``Q_L·x·Q_Rᵀ`` (an absent side is the identity)."""
    if qr is not None:
        x = x @ qr.T
    if ql is not None:
        x = ql @ x
    return x


def rotated_direction(state: dict[str, Any], eps: float) -> Tensor:
    """``Q_L·((Q_Lᵀ·m·Q_R)/(√v + ε))·Q_Rᵀ`` from a parameter's state, a new tensor: the update
    before its bias correction and learning rate (Adam's ``m/(√v + ε)`` where no side rotates)."""
    ql, qr = state.get("Q_L"), state.get("Q_R")
    m, v = state["exp_avg"], state["exp_avg_sq"]
    return _project_back(_project(m, ql, qr) / (v.sqrt() + eps), ql, qr)


def _eigenbasis(cov: Tensor) -> Tensor:
    """The eigenvectors of a covariance, columns by descending eigenvalue, in its dtype."""
    work = _work(cov)
    vectors: Tensor
    try:
        _, vectors = torch.linalg.eigh(work)
    except RuntimeError:  # torch.linalg.LinAlgError: no convergence in float32; try float64
        _, vectors = torch.linalg.eigh(work.double())
    return vectors.flip(-1).to(cov.dtype)


class BasisRotation(Optimizer):
    """Adam in the eigenbasis of each matrix's gradient covariances (bilateral rotation,
    covariance source), Adam on the rest; the paper's defaults.

    Args:
        params: the parameters or parameter groups (per-group options as in any torch optimizer).
        lr: learning rate (the step is about Adam's size: an AdamW rate carries over).
        betas: (β1, β2): decay of m (original basis) and of v (rotated basis).
        eps: added to √v in the denominator.
        weight_decay: decoupled decay λ: ``W ← W·(1 − lr·λ)`` before the update, as AdamW.
        precondition_frequency: the basis is refreshed when the step count is a multiple of
            it (one power step warm-started from the current basis, after sorting its columns
            and v by the estimated eigenvalues); the first step takes a full eigendecomposition.
        shampoo_beta: decay of the covariance EMAs ``GG_L``, ``GG_R``; None uses β2.
        max_precondition_dim: a matrix side longer than this is not rotated (its covariance
            and basis would be side² each); both sides longer: the matrix runs plain Adam.
        rotation_geometry: only ``"bi"`` (both sides rotated), the paper's default.
        approx_source: only ``"2nd"`` (covariance EMAs), the paper's default.

    As in the published code, the first step updates too: its basis is the first
    gradient's singular basis, so the rotated gradient is diagonal and its other entries
    are rounding noise, which Adam's normalisation turns into full-size steps (far larger
    where an entry of v rounds to 0). SOAP skips that first update; this rule does not.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        shampoo_beta: float | None = None,
        max_precondition_dim: int = 4096,
        rotation_geometry: str = "bi",
        approx_source: str = "2nd",
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate {lr}: it must be >= 0")
        if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
            raise ValueError(f"invalid betas {betas}: two values in [0, 1), e.g. (0.95, 0.95)")
        if not eps >= 0.0:
            raise ValueError(f"invalid eps {eps}: it must be >= 0, e.g. 1e-8")
        if not weight_decay >= 0.0:
            raise ValueError(f"invalid weight_decay {weight_decay}: it must be >= 0")
        if int(precondition_frequency) != precondition_frequency or precondition_frequency < 1:
            raise ValueError(
                f"invalid precondition_frequency {precondition_frequency}: a whole number of "
                f"steps >= 1 between basis refreshes, e.g. 10"
            )
        if shampoo_beta is not None and not 0.0 <= shampoo_beta < 1.0:
            raise ValueError(
                f"invalid shampoo_beta {shampoo_beta}: a decay in [0, 1), or None for betas[1]"
            )
        if int(max_precondition_dim) != max_precondition_dim or max_precondition_dim < 1:
            raise ValueError(
                f"invalid max_precondition_dim {max_precondition_dim}: a side length >= 1"
            )
        if rotation_geometry != "bi":
            raise ValueError(
                f"rotation_geometry {rotation_geometry!r} is not implemented: only 'bi' (both "
                f"sides of each matrix rotated, the paper's default) is"
            )
        if approx_source != "2nd":
            raise ValueError(
                f"approx_source {approx_source!r} is not implemented: only '2nd' (the basis "
                f"from the gradient covariance EMAs, the paper's default) is"
            )
        defaults = {
            "lr": lr,
            "betas": (float(betas[0]), float(betas[1])),
            "eps": eps,
            "weight_decay": weight_decay,
            "precondition_frequency": int(precondition_frequency),
            "shampoo_beta": shampoo_beta,
            "max_precondition_dim": int(max_precondition_dim),
            "rotation_geometry": rotation_geometry,
            "approx_source": approx_source,
        }
        super().__init__(params, defaults)

    @property
    def cost_period(self) -> int:
        """Steps over which the cost of a step repeats: one basis refresh in every
        ``precondition_frequency`` (the largest over the groups); a profiler times whole
        periods so the refresh is charged at its share."""
        return max((int(g["precondition_frequency"]) for g in self.param_groups), default=1)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("BasisRotation does not support sparse gradients")
                self._update(p, p.grad, group)
        return loss

    def _init_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state: dict[str, Any] = self.state[p]
        state["step"] = torch.tensor(0.0)  # float32 on the CPU, as torch's Adam keeps it
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        rows, cols = _rotated_sides(p.shape, int(group["max_precondition_dim"]))
        if rows:
            state["GG_L"] = p.new_zeros(p.shape[0], p.shape[0])
        if cols:
            state["GG_R"] = p.new_zeros(p.shape[1], p.shape[1])
        return state

    def _update(self, p: Tensor, grad: Tensor, group: dict[str, Any]) -> None:
        state = self.state[p] if self.state.get(p) else self._init_state(p, group)
        beta1, beta2 = (float(b) for b in group["betas"])
        shampoo = group["shampoo_beta"]
        cov_beta = beta2 if shampoo is None else float(shampoo)
        state["step"] += 1
        t = int(state["step"].item())
        sides = [s for s in _SIDES if s[0] in state]
        # 1. the covariance EMAs
        for cov_key, _, dim in sides:
            outer = grad @ grad.T if dim == 0 else grad.T @ grad
            state[cov_key].lerp_(outer, 1.0 - cov_beta)
        # 2. the basis: eigenvectors on the first step, a power step every f steps after
        if any(q_key not in state for _, q_key, _ in sides):
            for cov_key, q_key, _ in sides:
                state[q_key] = _eigenbasis(state[cov_key])
        elif sides and t % int(group["precondition_frequency"]) == 0:
            for cov_key, q_key, dim in sides:
                self._refresh(state, cov_key, q_key, dim)
        # 3. the moments: m in the original basis, v in the rotated one
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1.0 - beta1)
        rotated = _project(grad, state.get("Q_L"), state.get("Q_R"))
        exp_avg_sq.mul_(beta2).addcmul_(rotated, rotated, value=1.0 - beta2)
        # 4.-5. decoupled decay, then the bias-corrected step along the rotated direction
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        direction = rotated_direction(state, float(group["eps"]))
        if wd != 0.0:
            p.mul_(1.0 - lr * wd)
        p.add_(direction, alpha=-lr * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t))

    @staticmethod
    def _refresh(state: dict[str, Any], cov_key: str, q_key: str, dim: int) -> None:
        """One side's basis refresh: columns (and v along ``dim``) sorted by the estimated
        eigenvalues ``diag(QᵀMQ)``, descending, then ``Q ← qr(M·Q)``."""
        basis = state[q_key]
        cov, q = _work(state[cov_key]), _work(basis)
        power = cov @ q
        order = torch.argsort((q * power).sum(0), descending=True, stable=True)
        v = state["exp_avg_sq"]
        v.copy_(v.index_select(dim, order))
        refreshed, _ = torch.linalg.qr(power[:, order])
        basis.copy_(refreshed)
