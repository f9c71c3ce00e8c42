"""The delay corrections by the name a method gives in ``StagePolicy.correction``.

A new correction is its own file beside this one and one line in :data:`CORRECTIONS`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.optim import Optimizer

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.optim.corrections.delay_momentum import DelayMomentum
from pipeoptim.runtime.optim.corrections.extrapolate import EXTRAPOLATE, Extrapolate
from pipeoptim.runtime.optim.corrections.pipemare_lr import PipeMareLr
from pipeoptim.runtime.optim.corrections.protocol import DelayCorrection, StageContext
from pipeoptim.runtime.optim.corrections.qk_clip import QKClip

__all__ = ["CORRECTIONS", "CorrectionFactory", "build_correction"]

CorrectionFactory = Callable[[StageContext, Optimizer], DelayCorrection]
"""Called once per stage with the stage's :class:`StageContext` and optimizer."""

CORRECTIONS: dict[str, CorrectionFactory] = {
    "pipemare-lr": lambda context, optimizer: PipeMareLr(context),
    "delay-momentum": DelayMomentum,
    "qk-clip": QKClip,
    EXTRAPOLATE: Extrapolate,
}
"""Delay corrections by name: a factory called once per stage with its context and
optimizer."""


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
            f"not know (known: {known}); register it in "
            f"pipeoptim.runtime.optim.corrections.registry.CORRECTIONS"
        )
    return factory(context, optimizer)
