"""Delayed-gradient emulation: PipeDream's weight semantics in one process, with the delay
chosen per parameter and per step, to find which staleness costs a model its loss.

Why: the pipeline itself ties every stage's delay to its depth (τ_k = P−1−k), so it cannot
say whether the loss is lost in the embedding's staleness or the head's, in attention or in
the MLPs, early or late in training. Under weight stashing the update of mini-batch t on a
stage applies the gradient computed, for every stage at once, on the versions the stages
had when t's forwards ran: stage k's ``W_k^(t − τ_k)`` (the warm-up after a drain sees
``min(τ_k, steps since the drain)``). That is one forward and backward of the whole model
with each parameter read at its own delayed version, which this module runs directly;
``tests/study/test_delays.py`` checks it against the pipeline's pipedream run. Each stage
keeps its own optimizer, scheduler and clipping, as a pipeline stage does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from pipeoptim.errors import RuntimeConfigError

__all__ = ["DelayEmulator", "DelayRule", "pipedream_delays"]

DelayRule = Callable[[str, int, int], int]
"""``(parameter name, stage, step) -> τ``: the delay of one parameter's gradient at a step
(before the warm-up clamp)."""


def pipedream_delays(num_stages: int) -> DelayRule:
    """PipeDream's own delays: τ_k = P−1−k for every parameter of stage k, at every step."""
    return lambda name, stage, step: num_stages - 1 - stage


@dataclass
class _Held:
    """One parameter's past versions, newest last (at most its largest delay + 1)."""

    param: nn.Parameter
    name: str
    stage: int
    versions: deque[Tensor]


class DelayEmulator:
    """Trains ``units`` as ``len(bounds)`` stages whose gradients arrive with the delays of
    ``delay`` (a :data:`DelayRule`); :meth:`step` trains one mini-batch."""

    def __init__(
        self,
        units: Sequence[nn.Module],
        bounds: Sequence[tuple[int, int]],
        *,
        optimizer: Callable[[list[nn.Parameter]], Optimizer],
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        delay: DelayRule,
        max_delay: int,
        scheduler: Callable[[Optimizer], object] | None = None,
        grad_clip: float | None = None,
        drain_every: int | None = None,
    ) -> None:
        if max_delay < 0:
            raise RuntimeConfigError(f"max_delay must be 0 or more (got {max_delay})")
        self.model = nn.Sequential(*units)
        self.loss_fn, self.delay, self.max_delay = loss_fn, delay, max_delay
        self.grad_clip, self.drain_every = grad_clip, drain_every
        self.steps = 0
        self._since_drain = 0
        self.stage_params: list[list[nn.Parameter]] = []
        self._held: list[_Held] = []
        for k, (a, b) in enumerate(bounds):
            params: list[nn.Parameter] = []
            for i in range(a, b):
                for name, p in units[i].named_parameters(prefix=str(i)):
                    if p.requires_grad:
                        params.append(p)
                        self._held.append(_Held(p, name, k, deque(maxlen=max_delay + 1)))
            self.stage_params.append(params)
        self.optimizers = [optimizer(ps) if ps else None for ps in self.stage_params]
        self.schedulers = [
            scheduler(opt) if scheduler is not None and opt is not None else None
            for opt in self.optimizers
        ]
        self._keep()

    def _keep(self) -> None:
        for h in self._held:
            h.versions.append(h.param.detach().clone())

    def delays_now(self) -> list[int]:
        """τ of every parameter for the next step (clamped to the updates since a drain)."""
        out = []
        for h in self._held:
            tau = self.delay(h.name, h.stage, self.steps)
            if not 0 <= tau <= self.max_delay:
                raise RuntimeConfigError(
                    f"the delay rule gave τ={tau} for {h.name} (stage {h.stage}) at step "
                    f"{self.steps}; it must lie in 0..max_delay={self.max_delay}"
                )
            out.append(min(tau, self._since_drain))
        return out

    def step(self, x: Tensor, y: Tensor) -> float:
        """One mini-batch: forward and backward on the delayed versions, then every stage
        updates its current weights with that gradient. Returns the loss."""
        delays = self.delays_now()
        current = [h.param.detach().clone() for h in self._held]
        with torch.no_grad():
            for h, tau in zip(self._held, delays, strict=True):
                if tau:
                    h.param.copy_(h.versions[-1 - tau])
        loss = self.loss_fn(self.model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        with torch.no_grad():
            for h, w in zip(self._held, current, strict=True):
                h.param.copy_(w)
        for params, opt, sched in zip(
            self.stage_params, self.optimizers, self.schedulers, strict=True
        ):
            if opt is None:
                continue
            if self.grad_clip is not None:
                nn.utils.clip_grad_norm_(params, self.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()  # type: ignore[attr-defined]
        self._keep()
        self.steps += 1
        self._since_drain += 1
        if self.drain_every is not None and self.steps % self.drain_every == 0:
            self.drain()
        return float(loss.detach())

    def drain(self) -> None:
        """What a pipeline's flush does to delays: the next steps warm up from 0 again."""
        self._since_drain = 0

    def fit(self, batches: Iterable[tuple[Tensor, Tensor]]) -> list[float]:
        """Train every mini-batch of ``batches``; the losses."""
        self.model.train()
        return [self.step(x, y) for x, y in batches]
