"""Methods built from methods: a delay correction on a base (``base+pipemare``,
``base+nesterov``, ``base+qk-clip``, ``base+extrapolate``), a shrunk prediction
(``pipeoptim+shrink``) and a bounded delay (``base+bounded``). Each keeps what it does not
change from its base."""

from __future__ import annotations

from dataclasses import replace

from pipeoptim.plan import schedules
from pipeoptim.plan.methods.base import Method
from pipeoptim.plan.orders import OrderArrays
from pipeoptim.plan.schedules import Order
from pipeoptim.plan.shape import Shape

__all__ = ["bounded", "corrected", "shrunk"]


def corrected(base: Method, correction: str, suffix: str, what: str, *, buffers: int = 0) -> Method:
    """``base`` with a delay correction: its schedule, weight policy and prediction, and the
    correction's update (a prediction fixes the forward's weights, a correction the update).
    ``buffers``: weight-sized tensors the correction keeps on every stage between updates
    (the extrapolation's previous update), counted as weight copies on top of the base's."""
    return replace(
        base,
        name=f"{base.name}+{suffix}",
        description=f"{base.name} with {what} (delay correction {correction!r})",
        delay_correction=correction,
        corrects=base.name,
        correction_buffers=base.correction_buffers + buffers,
    )


def shrunk(base: Method) -> Method:
    """``base`` (a predicting method) with its prediction over the distance the
    optimizer's update persists instead of the whole stale distance."""
    return replace(
        base,
        name=f"{base.name}+shrink",
        description=f"{base.name} with its prediction over the distance the optimizer's update "
        "persists: Σ lr·(φ + (1-φ)β^i), φ from the measured correlation of successive updates "
        f"(φ = 1 is {base.name}'s Σ lr)",
        prediction_rule="shrunk",
        corrects=base.name,
    )


def bounded(base: Method, max_delay: int) -> Method:
    """``base`` (asynchronous) with its delay bounded by local gradient accumulation: a
    schedule of its own (fewer updates on the early stages) over whole mini-batches (M = 1
    only, whatever micro-batch count the base allows)."""

    def arrays(shape: Shape) -> OrderArrays:
        return schedules.bounded_async_one_f_one_b_arrays(shape, max_delay)

    def order(shape: Shape) -> Order:
        return arrays(shape).to_order()

    return replace(
        base,
        name=f"{base.name}+bounded",
        description=f"{base.name} with its delay bounded to {max_delay} update by local "
        f"gradient accumulation (PACI): stage k updates once per A_k = ⌈(P−1−k)/"
        f"{max_delay}⌉ mini-batches, on their mean gradient",
        generator=order,
        array_generator=arrays,
        max_delay=max_delay,
        # its schedule accumulates whole mini-batches: M = 1 only, whatever the base's dial
        micro_batched=False,
        default_micro_batches=None,
        # a forward meets at most one update, so a stash holds at most one older version;
        # the gradient buffer kept across the accumulation is the +1 every stage is charged
        copies_rule=lambda k, p: 1 if k == p - 1 else 2,
        slots_rule=lambda k, p, m: p - k,
    )
