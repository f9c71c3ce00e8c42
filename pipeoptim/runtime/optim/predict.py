"""Weight predictors: the weights a mini-batch will meet at backward time, read off the optimizer.

Why: in asynchronous 1F1B (no flush) stage k runs mini-batch t's forward while s updates are
still to come before t's backward; PipeOptim runs that forward on ``Ŵ = W − lr·s·Δ`` so both
passes see (nearly) one version. SpecTrain and XPipe differ only in Δ (DESIGN.md,
"Weight-version semantics", "Δ per optimizer"). Δ is *read* from the user's ``torch.optim``
state (or computed by torch's own functions from it, as Muon's orthogonalisation), never
re-implemented. Where the state lacks the applied direction (SGD with μ = 0 or
Nesterov, RMSprop without momentum, other optimizers) the last applied displacement
``(W^(j-1) − W^(j)) / lr`` is recorded around ``step()``: exact, for one extra copy.
Prediction uses ``torch._foreach_*`` ops, so it costs about one optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch.optim import SGD, Adam, AdamW, Muon, NAdam, Optimizer, RAdam, RMSprop
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
from torch.utils.hooks import RemovableHandle

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.config import is_whole
from pipeoptim.runtime.optim.basis_rotation import BasisRotation, rotated_direction
from pipeoptim.runtime.optim.optimizers import MuonWithAdamW
from pipeoptim.runtime.optim.update_persistence import UpdatePersistence

#: Valid values of ``predictor_for(..., rule=...)``.
RULES: tuple[str, ...] = ("optimizer", "spectrain", "xpipe", "displacement", "shrunk")

Tensor = torch.Tensor
Deltas = list[list[Tensor | None]]


def check_distance(s: int) -> int:
    """``s`` checked: a count of future updates, 0 or more."""
    if not is_whole(s, 0):
        raise RuntimeConfigError(
            f"the prediction distance s is a count of future optimizer updates and must be an "
            f"integer >= 0 (got {s!r}); pass s = number of updates between the forward and "
            f"the backward of the mini-batch (0 runs the forward on the current weights)"
        )
    return int(s)


def _state(optimizer: Optimizer, p: Tensor) -> dict[str, Any]:
    # .get: optimizer.state is a defaultdict and indexing would create empty entries.
    st = optimizer.state.get(p)
    return st if st else {}


class WeightPredictor:
    """Base class: predicts ``Ŵ = W − Σ lr·Δ`` per parameter from optimizer state.

    Subclasses choose Δ per param group: either from the optimizer state
    (``_state_deltas``) or from the recorded last displacement (``_uses_displacement``).
    """

    name: ClassVar[str] = "base"
    options: ClassVar[frozenset[str]] = frozenset({"auto_hooks"})
    keeps_deltas: ClassVar[bool] = False
    """Keep a computed Δ until the next step: for rules that predict several times per
    update (micro-batches of one mini-batch), at the cost of one weight-sized buffer."""
    fuses_first_write: ClassVar[bool] = False
    """A rule that keeps Δ but can write Ŵ without forming it (:meth:`_write_fused`) does
    so for a group's first prediction after a step and keeps nothing; only a second
    prediction before the next step forms Δ and keeps it. Where every update is followed
    by one prediction (XPipe with M >= P: one distance per mini-batch), no Δ is formed."""

    def __init__(self, optimizer: Optimizer, *, auto_hooks: bool = True) -> None:
        if not isinstance(optimizer, Optimizer):
            raise RuntimeConfigError(
                f"a weight predictor reads a torch.optim.Optimizer's state (got "
                f"{type(optimizer).__name__}); pass the stage's optimizer"
            )
        self.optimizer = optimizer
        # Displacement record, one buffer per tracked parameter: holds W^(j-1) between
        # before_step and after_step, then Δ = (W^(j-1) − W^(j)) / lr (the buffer is reused).
        self._buf: dict[Tensor, Tensor] = {}
        self._has_delta: set[Tensor] = set()
        self._pending: list[tuple[list[Tensor], list[Tensor], float]] | None = None
        self._kept: dict[int, list[Tensor | None]] = {}  # Δ per group index, until a step
        self._written: set[int] = set()  # groups written fused since the last step
        self.kept_computations = 0
        """How many times a Δ was computed and kept (a caller's memory count goes stale)."""
        # Hooks on the optimizer make the record impossible to forget and skip steps that
        # never happen (e.g. GradScaler skipping an inf step); explicit calls stay harmless.
        self.persistence: UpdatePersistence | None = None
        """Set by the ``shrunk`` rule: the next s updates are weighted by the measured
        persistence of the optimizer's update (``optim/update_persistence.py``) instead of 1."""
        self._hooks: list[RemovableHandle] = []
        if auto_hooks:
            self._hooks = [
                optimizer.register_step_pre_hook(lambda *_: self.before_step()),
                optimizer.register_step_post_hook(lambda *_: self.after_step()),
                optimizer.register_load_state_dict_post_hook(lambda *_: self._drop_kept()),
            ]

    # -- what subclasses decide ------------------------------------------------------------
    def _uses_displacement(self, group: dict[str, Any]) -> bool:
        return False

    def _state_deltas(self, group: dict[str, Any]) -> list[Tensor | None]:
        raise NotImplementedError

    # -- Δ ---------------------------------------------------------------------------------
    def _group_deltas(self, group: dict[str, Any], index: int) -> list[Tensor | None]:
        # May alias optimizer state or the displacement buffer: internal use only.
        params: list[Tensor] = group["params"]
        if self._uses_displacement(group):
            ds: list[Tensor | None] = [
                self._buf[p] if p in self._has_delta else None for p in params
            ]
        elif self.keeps_deltas and self._hooks:  # the step hook drops what is kept
            kept = self._kept.get(index)
            if kept is None:
                kept = self._kept[index] = self._state_deltas(group)
                self.kept_computations += 1
            ds = kept
        else:
            ds = self._state_deltas(group)
        # Frozen parameters are never updated by torch.optim: forward uses W as it is.
        return [d if p.requires_grad else None for p, d in zip(params, ds, strict=True)]

    def _drop_kept(self) -> None:
        """Forget what was kept or written since the last step (the state moves on)."""
        self._kept.clear()
        self._written.clear()

    def _may_fuse(self, index: int) -> bool:
        """Whether group ``index``'s Ŵ may be written without forming Δ now: always for a
        rule that keeps none, or where no step hook could drop a kept Δ (nothing is kept
        then); for one that keeps Δ, only for its first prediction after a step, where it
        fuses that (:attr:`fuses_first_write`)."""
        if not self.keeps_deltas or not self._hooks:
            return True
        return self.fuses_first_write and index not in self._kept and index not in self._written

    def delta(self) -> Deltas:
        """Δ per param group, per parameter (fresh tensors); None: no state yet, Δ = 0."""
        with torch.no_grad():
            return [
                [None if d is None else d.detach().clone() for d in self._group_deltas(g, i)]
                for i, g in enumerate(self.optimizer.param_groups)
            ]

    # -- prediction ------------------------------------------------------------------------
    def _params(self) -> list[Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _etas(self, s: int, lrs: Sequence[Sequence[float]] | None) -> list[float]:
        groups = self.optimizer.param_groups
        weights = self.persistence.weights(s) if self.persistence is not None else [1.0] * s
        if lrs is None:
            return [float(g["lr"]) * math.fsum(weights) for g in groups]
        if len(lrs) != len(groups) or any(len(row) < s for row in lrs):
            raise RuntimeConfigError(
                f"lrs must hold, for each of the optimizer's {len(groups)} param groups, the "
                f"learning rates of the next s={s} updates (got {len(lrs)} groups with "
                f"{[len(row) for row in lrs]} rates); build it with future_lrs(scheduler, "
                f"optimizer, s) or pass lrs=None to use the current lr"
            )
        return [
            math.fsum(float(x) * w for x, w in zip(row[:s], weights, strict=False)) for row in lrs
        ]

    def predict_into(
        self, dest: list[Tensor], s: int, lrs: Sequence[Sequence[float]] | None = None
    ) -> None:
        """Write Ŵ for every parameter (flattened group order) into the preallocated ``dest``.

        ``lrs[g]`` lists the learning rates of group g's next updates (at least s of them,
        the first s are used): Σ lr replaces lr·s under a schedule.
        """
        s = check_distance(s)
        self._check_dest(dest)
        etas = self._etas(s, lrs)
        with torch.no_grad():
            # Ŵ = W − η·Δ written once per element where dest is not W itself and Δ exists
            # (read W, read Δ, write Ŵ); the rest is copied, or updated in place.
            copies: list[tuple[Tensor, Tensor]] = []
            in_place: list[tuple[Tensor, Tensor, float]] = []
            offset = 0
            for index, (group, eta) in enumerate(
                zip(self.optimizer.param_groups, etas, strict=True)
            ):
                ps: list[Tensor] = group["params"]
                moving = s > 0 and eta != 0.0
                fused = moving and self._may_fuse(index)
                if fused and self._write_fused(group, eta, dest[offset : offset + len(ps)]):
                    self._written.add(index)
                    offset += len(ps)
                    continue
                deltas = self._group_deltas(group, index) if moving else [None] * len(ps)
                for i, (p, d) in enumerate(zip(ps, deltas, strict=True)):
                    out = dest[offset + i]
                    same = out.data_ptr() == p.data_ptr()
                    if d is None:
                        if not same:
                            copies.append((out, p))
                    elif same:
                        in_place.append((out, d, eta))
                    else:
                        torch.add(p.detach(), d, alpha=-eta, out=out)
                offset += len(ps)
            if copies:
                torch._foreach_copy_([d for d, _ in copies], [p for _, p in copies])
            for out, d, eta in in_place:
                out.add_(d, alpha=-eta)

    def _check_dest(self, dest: list[Tensor]) -> None:
        n = len(self._params())
        if len(dest) != n:
            raise RuntimeConfigError(
                f"predict_into needs one destination tensor per optimizer parameter (got "
                f"{len(dest)} for {n} parameters); allocate dest in the order "
                f"'for group in param_groups for p in group[\"params\"]'"
            )

    def _write_fused(self, group: dict[str, Any], eta: float, dest: list[Tensor]) -> bool:
        """Write the group's Ŵ into ``dest`` without forming Δ, where the rule can; False
        leaves it to the general path."""
        return False

    def predicted(self, s: int, lrs: Sequence[Sequence[float]] | None = None) -> list[Tensor]:
        """Convenience form of :meth:`predict_into` that allocates the predicted copy."""
        dest = [torch.empty_like(p) for p in self._params()]
        self.predict_into(dest, s, lrs)
        return dest

    # -- displacement record ---------------------------------------------------------------
    def before_step(self) -> None:
        """Record W^(j-1) of displacement-tracked parameters (call right before step())."""
        self._drop_kept()  # the moments and the weights are about to change
        if self._pending is not None:  # already recorded for this step (hook + explicit call)
            return
        pending: list[tuple[list[Tensor], list[Tensor], float]] = []
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                if not self._uses_displacement(group):
                    continue
                lr = float(group["lr"])
                live = [p for p in group["params"] if p.grad is not None and lr != 0.0]
                # Parameters step() will not touch have no last displacement to repeat.
                self._has_delta.difference_update(group["params"])
                if not live:
                    continue
                bufs = [self._buf.get(p) for p in live]
                for i, p in enumerate(live):
                    if bufs[i] is None:
                        self._buf[p] = bufs[i] = torch.empty_like(p)
                ready = [b for b in bufs if b is not None]
                torch._foreach_copy_(ready, live)
                pending.append((live, ready, lr))
        self._pending = pending

    def after_step(self) -> None:
        """Turn the record into Δ = (W^(j-1) − W^(j)) / lr (call right after step())."""
        self._drop_kept()
        if self._pending is None:
            return
        with torch.no_grad():
            for live, bufs, lr in self._pending:
                torch._foreach_sub_(bufs, live)
                torch._foreach_div_(bufs, lr)
                self._has_delta.update(live)
        self._pending = None

    def close(self) -> None:
        """Remove the hooks this predictor put on the optimizer."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._drop_kept()
        if self.persistence is not None:
            self.persistence.close()

    def held_tensors(self) -> list[Tensor]:
        """Tensors this predictor keeps between steps (for memory accounting): recorded
        displacements and a kept Δ."""
        params = self._params()
        held = [self._buf[p] for p in params if p in self._buf]
        held += [d for ds in self._kept.values() for d in ds if d is not None]
        return held

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Rule name and the recorded displacements (by flat parameter index; tensors are
        references, as in ``Optimizer.state_dict``)."""
        state: dict[str, Any] = {"rule": self.name, "displacement": self._displacements()}
        if self.persistence is not None:
            state["persistence"] = self.persistence.state_dict()
        return state

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d.get("rule") != self.name:
            raise RuntimeConfigError(
                f"checkpoint holds the state of a {d.get('rule')!r} weight predictor but this "
                f"stage uses {self.name!r}; build the predictor with the same rule and optimizer"
            )
        n = len(self._params())
        disp: dict[int, Tensor] = d.get("displacement", {})
        bad = [i for i in disp if not 0 <= int(i) < n]
        if bad:
            raise RuntimeConfigError(
                f"checkpoint has displacements for parameter indices {bad} but the optimizer "
                f"has {n} parameters; load it into the stage it was saved from"
            )
        if self.persistence is not None and d.get("persistence") is not None:
            self.persistence.load_state_dict(d["persistence"])
        self._load_displacements({int(i): t for i, t in disp.items()})

    def _displacements(self) -> dict[int, Tensor]:
        """The recorded displacements by flat parameter index."""
        params = self._params()
        return {i: self._buf[p] for i, p in enumerate(params) if p in self._has_delta}

    def _load_displacements(self, disp: dict[int, Tensor]) -> None:
        params = self._params()
        self._buf, self._has_delta, self._pending = {}, set(), None
        self._drop_kept()
        for i, t in disp.items():
            p = params[i]
            self._buf[p] = t.detach().to(device=p.device, dtype=p.dtype, copy=True)
            self._has_delta.add(p)


class DisplacementPredictor(WeightPredictor):
    """Any optimizer: Δ = last applied displacement (W^(j-1) − W^(j)) / lr."""

    name = "displacement"

    def _uses_displacement(self, group: dict[str, Any]) -> bool:
        return True


class SGDPredictor(WeightPredictor):
    """SGD: Δ = momentum buffer (dampening and L2 decay are inside it).

    With μ = 0 or Nesterov the applied direction (g, or g + μ·buf) is not in the state, so
    those groups use the exact last displacement instead of reading a stale ``p.grad``.
    """

    name = "sgd"

    def _uses_displacement(self, group: dict[str, Any]) -> bool:
        return float(group["momentum"]) == 0.0 or bool(group.get("nesterov", False))

    def _state_deltas(self, group: dict[str, Any]) -> list[Tensor | None]:
        return [_state(self.optimizer, p).get("momentum_buffer") for p in group["params"]]


class _DecoupledDecayOption(WeightPredictor):
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


class AdamPredictor(_DecoupledDecayOption):
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
            st = _state(self.optimizer, p)
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
            st = _state(self.optimizer, group["params"][i])
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
            st = _state(self.optimizer, p)
            v = st.get("momentum_buffer")
            out.append(v if v is not None else st.get("exp_avg"))
        return out


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
            buf = _state(self.optimizer, p).get("momentum_buffer")
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


class BasisRotationPredictor(_DecoupledDecayOption):
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
            st = _state(self.optimizer, p)
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


# Exact types: a subclass may change the update rule, and then only displacement is exact.
_FAMILY: dict[type[Optimizer], type[WeightPredictor]] = {
    SGD: SGDPredictor,
    Adam: AdamPredictor,
    AdamW: AdamPredictor,
    NAdam: NAdamPredictor,
    RMSprop: RMSpropPredictor,
    Muon: MuonPredictor,
    MuonWithAdamW: MuonWithAdamWPredictor,
    BasisRotation: BasisRotationPredictor,
}
_ADAM_LIKE: tuple[type[Optimizer], ...] = (Adam, AdamW, NAdam, RAdam)


def predictor_for(optimizer: Optimizer, rule: str = "optimizer", **options: Any) -> WeightPredictor:
    """The predictor of a method's prediction rule for this optimizer.

    "optimizer": by ``type(optimizer)`` (SGD, Adam, AdamW, NAdam, RMSprop, Muon,
    MuonWithAdamW, BasisRotation, else displacement);
    "spectrain": smoothed gradient; "xpipe": Adam-form Δ for Adam-like optimizers, the
    optimizer's own rule otherwise; "displacement": last applied displacement; "shrunk":
    the optimizer's own rule with the next s updates weighted by how much of the update
    persists (``runtime/optim/update_persistence.py``).
    """
    if rule not in RULES:
        raise RuntimeConfigError(
            f"unknown weight-prediction rule {rule!r}; valid rules are {', '.join(RULES)}"
        )
    cls: type[WeightPredictor]
    if rule == "spectrain":
        cls = SpecTrainPredictor
    elif rule == "displacement":
        cls = DisplacementPredictor
    elif rule == "xpipe" and type(optimizer) in _ADAM_LIKE:
        cls = XPipePredictor
    else:
        cls = _FAMILY.get(type(optimizer), DisplacementPredictor)
    unknown = sorted(set(options) - cls.options)
    if unknown:
        raise RuntimeConfigError(
            f"option(s) {unknown} do not apply to the {cls.name!r} predictor chosen for rule "
            f"{rule!r} and {type(optimizer).__name__}; valid options: {sorted(cls.options)}"
        )
    predictor = cls(optimizer, **options)
    if rule == "shrunk":  # the optimizer's own rule, over the distance its updates persist
        predictor.persistence = UpdatePersistence(optimizer)
        for part in getattr(predictor, "parts", []):
            part.persistence = predictor.persistence
    return predictor
