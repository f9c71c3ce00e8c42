"""The one list of methods, the sets derived from it, and the look-up by name.

A new method is a module in this package that builds a :class:`Method` and one line in
``_REGISTRY``; the names are typed by users (CLI, Plan file) and live only here and in the
method modules.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pipeoptim.errors import PlanError
from pipeoptim.plan.actions import Schedule
from pipeoptim.plan.limits import check_work
from pipeoptim.plan.methods.asynchronous import PIPEDREAM, PIPEOPTIM, SPECTRAIN, TWO_BW, XPIPE
from pipeoptim.plan.methods.base import REGISTERED, Method
from pipeoptim.plan.methods.combinators import bounded, corrected, shrunk
from pipeoptim.plan.methods.dualpipe_v import DUALPIPE_V
from pipeoptim.plan.methods.interleaved_zero_bubble import INTERLEAVED_ZB
from pipeoptim.plan.methods.synchronous import GPIPE, INTERLEAVED_1F1B, ONE_F_ONE_B
from pipeoptim.plan.methods.zero_bubble import ZB_H1, ZB_V
from pipeoptim.plan.shape import Shape

__all__ = [
    "CORRECTED",
    "FLUSHING",
    "METHODS",
    "RANKED_BY_DEFAULT",
    "build_schedule",
    "check_schedule_size",
    "get_method",
    "registered",
]

_PIPEMARE = "PipeMare's rescheduling: stage rate lr/τ^(1-min(t/T,1)), T = 1000 updates"
_NESTEROV = (
    "the Nesterov method's delay-dependent momentum β_k = β0 + τ_k(0.99-β0)/P; the paper "
    "pairs it with --optimizer nadam; pipeoptim+nesterov with --optimizer muon is the "
    "study's closest never-micro-batched LM row at 8 stages (+5.9 % over gpipe under Muon)"
)
_QK_CLIP = (
    "Kimi K2's QK-Clip: after each step a head whose max attention logit S exceeds "
    "τ = 100 has its query and key rows scaled by √(τ/S)"
)
_EXTRAPOLATE = (
    "the extrapolation x_(t+1) = x_t − η[(1+λ)u_t − λu_(t−1)] of the optimizer's own update "
    "u (λ: --extrapolation, default 0.5; one more weight-sized buffer): our reading of "
    "Zmushko et al.'s one-step-delay correction, not their published rule"
)

_REGISTRY: list[Method] = [
    GPIPE,
    ONE_F_ONE_B,
    INTERLEAVED_1F1B,
    PIPEDREAM,
    TWO_BW,
    SPECTRAIN,
    XPIPE,
    PIPEOPTIM,
    ZB_H1,
    ZB_V,
    DUALPIPE_V,
    INTERLEAVED_ZB,
    shrunk(PIPEOPTIM),
    corrected(PIPEDREAM, "pipemare-lr", "pipemare", _PIPEMARE),
    corrected(PIPEOPTIM, "pipemare-lr", "pipemare", _PIPEMARE),
    corrected(PIPEDREAM, "delay-momentum", "nesterov", _NESTEROV),
    corrected(PIPEOPTIM, "delay-momentum", "nesterov", _NESTEROV),
    corrected(PIPEDREAM, "qk-clip", "qk-clip", _QK_CLIP),
    corrected(PIPEOPTIM, "qk-clip", "qk-clip", _QK_CLIP),
    corrected(XPIPE, "extrapolate", "extrapolate", _EXTRAPOLATE, buffers=1),
    corrected(TWO_BW, "extrapolate", "extrapolate", _EXTRAPOLATE, buffers=1),
    corrected(PIPEOPTIM, "extrapolate", "extrapolate", _EXTRAPOLATE, buffers=1),
    bounded(PIPEDREAM, 1),
    bounded(PIPEOPTIM, 1),
]

METHODS: dict[str, Method] = REGISTERED
METHODS.update((m.name, m) for m in _REGISTRY)
CORRECTED: frozenset[str] = frozenset(m.name for m in _REGISTRY if m.correction)
"""The registered methods with a delay correction."""
FLUSHING: tuple[str, ...] = tuple(m.name for m in _REGISTRY if m.keeps_one_version)
"""The synchronous methods (every pass of mini-batch t on W^(t), a flush before every
update), in registry order."""
RANKED_BY_DEFAULT: tuple[str, ...] = tuple(
    m.name for m in _REGISTRY if not m.places_several_stages_per_rank and not m.bounds_delay
)
"""The methods the planners rank when not told which: all but the interleaved ones (they
need a virtual-stage count) and the bounded-delay ones, whose cost, 1/A_k of the updates on
the early stages at equal samples, is outside the κ·e risk model, and which the study never
measured as the best row (docs/choosing-a-method.md); name them to rank them."""


@contextmanager
def registered(method: Method) -> Iterator[Method]:
    """Register ``method`` for the length of a ``with`` block (a test's throwaway method),
    then restore the registry; refuses a name already taken."""
    if method.name in METHODS:
        raise PlanError(
            f"a method named {method.name!r} is already registered; give the new method "
            f"a name of its own"
        )
    METHODS[method.name] = method
    try:
        yield method
    finally:
        del METHODS[method.name]


def get_method(name: str) -> Method:
    """Look a method up by name; the error lists the valid names."""
    try:
        return METHODS[name]
    except KeyError:
        raise PlanError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}") from None


def build_schedule(
    method: str,
    num_ranks: int,
    micro_batches: int | None = None,
    mini_batches: int | None = None,
    virtual_stages: int | None = None,
) -> tuple[Schedule, Shape]:
    """Generate and retime ``method``'s schedule; returns the grid and the resolved shape."""
    m = get_method(method)
    shape = m.shape(num_ranks, micro_batches, mini_batches, virtual_stages)
    return m.schedule(shape), shape


def check_schedule_size(
    method: str | Method,
    num_ranks: int,
    micro_batches: int | None = None,
    mini_batches: int | None = None,
    virtual_stages: int | None = None,
    *,
    max_actions: int | None = None,
    what: str = "running",
) -> Shape:
    """Resolve and check the shape (the method's own rules first), then refuse a run of more
    than ``max_actions`` actions (:attr:`~pipeoptim.plan.limits.WorkEstimate.cost`: actions
    plus ``STAGE_COST`` per stage). Returns the resolved :class:`Shape`; builds nothing.

    ``what`` starts the message (``"training"`` gives "training pipeoptim with P=4, ...").
    It lives with the registry, not in :mod:`pipeoptim.plan.limits`, because it looks the
    method up: the limits import nothing from the plan at run time.
    """
    spec = get_method(method) if isinstance(method, str) else method
    shape = spec.shape(num_ranks, micro_batches, mini_batches, virtual_stages)
    check_work(spec.work(shape), max_actions=max_actions, what=what)
    return shape
