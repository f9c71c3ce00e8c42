"""``extrapolate``: an update-level correction for short delays, the optimistic-gradient step
``x_{t+1} = x_t − η_t[(1+λ)u_t − λu_{t−1}]``.

``u_t`` is the optimizer's own update direction at step t, so that its plain step is
``x_{t+1} = x_t − η_t u_t``: the whole displacement of the step (for AdamW its decoupled
weight decay included) divided by that step's rate η_t, measured around the step, so any
optimizer and any learning-rate schedule give the right u. After the plain step the
correction moves the weights by ``−λη_t(u_t − u_{t−1})`` and keeps ``u_t`` for the next one:
one weight-sized buffer per parameter (the memory model's +1 copy, ``corrected(...,
buffers=1)``). While the update direction turns, the step leans towards where it is
turning; a steady direction is left as it is.

Why: Zmushko et al. (ICML 2026, arXiv 2606.30634) describe their correction for
PipeDream-2BW's one-step delay as keeping one extra buffer, the previous update, and
correcting with the difference of consecutive updates; its exact rule was not in anything
we could read. This extrapolation is **our reading** of that description, not their rule.

Edge cases: the first update (no ``u_{t−1}``) is the plain step; an update that did not
move the stage (an fp16 step skipped for an overflow, a zero rate) leaves the weights and
the buffer as they were, decided on the device (no host synchronisation); a parameter
without a gradient at the step (the optimizer skips it) keeps its buffer. Under ZeRO-1
(``sharded.py``) every replica holds the whole updated weights after the step, so each
measures the same displacement and applies the same correction (the buffer is kept whole
on every replica). The correction acts at every update, whatever its delay.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.optim.corrections.protocol import StageContext

__all__ = [
    "DEFAULT_EXTRAPOLATION",
    "EXTRAPOLATE",
    "Extrapolate",
    "check_extrapolation",
    "refuse_extrapolation_without_correction",
]

EXTRAPOLATE = "extrapolate"
"""The correction's registry name (``StagePolicy.correction``)."""

DEFAULT_EXTRAPOLATION = 0.5
"""λ where the run names none (``extrapolation=None``)."""


def check_extrapolation(value: object, flag: str = "extrapolation") -> float:
    """λ as a float: finite and at least 0 (0 is the plain step), or the error naming
    ``flag`` with the fix."""
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < 0
    ):
        example = f"{flag} {DEFAULT_EXTRAPOLATION}" if flag.startswith("--") else f"{flag}=0.5"
        raise RuntimeConfigError(
            f"{flag} must be a finite number >= 0 (got {value!r}): it is λ of the "
            f"extrapolation x_(t+1) = x_t − η[(1+λ)u_t − λu_(t−1)], 0 the plain step; e.g. "
            f"{example}"
        )
    return float(value)


def refuse_extrapolation_without_correction(
    method: str, correction: str | None, value: object, flag: str = "extrapolation"
) -> None:
    """Refuse λ given to a method that does not extrapolate: it would be ignored."""
    if value is None or correction == EXTRAPOLATE:
        return
    raise RuntimeConfigError(
        f"{flag} {value} sets λ of the extrapolate correction, and {method} does not "
        f"extrapolate; use xpipe+extrapolate, 2bw+extrapolate or pipeoptim+extrapolate, or "
        f"leave {flag} out"
    )


class Extrapolate:
    """The extrapolation on one stage: ``W ← W − λη_t(u_t − u_{t−1})`` after each step,
    ``u_t`` the step's displacement over η_t (per parameter group)."""

    def __init__(self, context: StageContext, optimizer: Optimizer) -> None:
        given = context.extrapolation
        self.strength = check_extrapolation(DEFAULT_EXTRAPOLATION if given is None else given)
        """λ."""
        self.optimizer = optimizer
        self.params: list[Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        self.previous: list[Tensor | None] = [None] * len(self.params)
        """u_{t−1} of each parameter (None until its first update)."""
        self.known: list[Tensor | None] = [None] * len(self.params)
        """Whether u_{t−1} was measured (a 0-d bool on the parameter's device): an update
        that did not move the stage leaves it as it was."""
        self._before: list[Tensor | None] = []
        self._rates: list[float] = []

    def before_step(self, optimizer: Optimizer, params: Sequence[Tensor], delay: int) -> None:
        """Keep x_t of each parameter the step will move, and the step's rate η_t."""
        self._before = []
        self._rates = []
        for group in optimizer.param_groups:
            lr = float(group["lr"])
            for p in group["params"]:
                self._rates.append(lr)
                moves = p.grad is not None and lr != 0.0
                self._before.append(p.detach().clone() if moves else None)

    @torch.no_grad()
    def after_step(self, optimizer: Optimizer, params: Sequence[Tensor], delay: int) -> None:
        """Measure u_t, move by −λη_t(u_t − u_{t−1}) where u_{t−1} is known and the stage
        moved, and keep u_t."""
        before, self._before = self._before, []
        if not before:  # after_step without before_step: nothing measured
            return
        taken = [(i, b) for i, b in enumerate(before) if b is not None]
        if not taken:
            return
        steps = [b.sub_(self.params[i].detach()) for i, b in taken]  # η_t u_t = x_t − x_(t+1)
        norms = torch._foreach_norm(steps)
        moved_any = torch.stack([n.to(norms[0].device) for n in norms]).ne(0).any()
        for (i, _), step in zip(taken, steps, strict=True):
            p, lr = self.params[i], self._rates[i]
            moved = moved_any.to(p.device)
            u = step.div_(lr)  # u_t (in place of the step: one temporary per parameter)
            previous, known = self.previous[i], self.known[i]
            if previous is not None and known is not None:
                # W − λη(u_t − u_{t−1}) where it moved and u_{t−1} is known
                gate = (moved & known).to(p.dtype) * (self.strength * lr)
                p.sub_((u - previous).mul_(gate))
                previous.copy_(torch.where(moved, u, previous))
                known.logical_or_(moved)
            else:
                self.previous[i] = torch.where(moved, u, torch.zeros_like(u))
                self.known[i] = moved.clone()

    def held_tensors(self) -> list[Tensor]:
        """The u_{t−1} buffers (counted by the stage's memory as optimizer state)."""
        return [t for t in self.previous if t is not None]

    def state_dict(self) -> dict[str, Any]:
        """λ, and each parameter's u_{t−1} and whether it is known (on the host)."""
        return {
            "strength": self.strength,
            "previous": [None if t is None else t.detach().cpu().clone() for t in self.previous],
            "known": [None if t is None else bool(t) for t in self.known],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the buffers; λ stays this run's (a hyper-parameter a resume may change)."""
        previous = list(state.get("previous", []))
        known = list(state.get("known", [None] * len(previous)))
        if len(previous) != len(self.params) or len(known) != len(self.params):
            raise RuntimeConfigError(
                f"the saved extrapolation state holds {len(previous)} parameters, this "
                f"stage's optimizer {len(self.params)}; load a state saved from the same "
                f"layers, with the same weights trainable"
            )
        for i, (p, saved, flag) in enumerate(zip(self.params, previous, known, strict=True)):
            if saved is not None and tuple(saved.shape) != tuple(p.shape):
                raise RuntimeConfigError(
                    f"the saved extrapolation buffer {i} has shape {tuple(saved.shape)}, its "
                    f"parameter {tuple(p.shape)}; load a state saved from the same layers"
                )
            self.previous[i] = None if saved is None else saved.to(p.device, p.dtype).clone()
            self.known[i] = None if flag is None else torch.tensor(bool(flag), device=p.device)
