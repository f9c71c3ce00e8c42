"""Memory factors: how many weight copies and activation slots each stage of a method holds.

The partitioner's memory model (:mod:`pipeoptim.plan.partition_cost`) charges a stage
``(weight_copies + 1)`` times its parameters and ``activation_slots`` times its activations;
the two numbers depend on the training method (stashed versions, double buffers, prediction
buffers, micro-batches in flight), and only on the method, the stage's position and the
micro-batch count. This module holds the rule of every method and the check of a
caller's own rule, apart from the cost model and the search that use them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pipeoptim.errors import PlanError
from pipeoptim.plan.methods import METHODS

__all__ = [
    "MEMORY_METHODS",
    "MemoryFactors",
    "method_holds_weights",
    "method_memory_factors",
    "resolve_factors",
]

MemoryFactors = Callable[[int, int], tuple[int, int]]
"""``(stage_index, num_stages) -> (weight_copies, activation_slots)`` of one stage."""


MEMORY_METHODS = tuple(METHODS)
"""Methods :func:`method_memory_factors` knows (the registry's; a method carries its own
rules: :meth:`~pipeoptim.plan.methods.Method.weight_copies` and ``activation_slots``)."""


def method_memory_factors(method: str, num_stages: int, micro_batches: int) -> MemoryFactors:
    """The ``(weight_copies, activation_slots)`` of each stage under ``method``.

    ``P`` stages, ``M`` micro-batches, stage ``k`` (0-based); an activation slot holds the
    activations of one pipeline unit of ``Profile.batch_size`` samples:

    ==================  =========================  ===================
    method              weight copies              activation slots
    ==================  =========================  ===================
    gpipe               1                          M
    1f1b                1                          min(P-k, M)
    interleaved-1f1b    1 (treated as 1f1b)        min(P-k, M)
    pipedream           P-k (stashed versions)     P-k
    2bw                 2                          min(P-k, M)
    base+correction     as base                    as base
    base+extrapolate    base's + 1 (kept update)   as base
    spectrain           2, last stage 1            P-k
    xpipe               2, last stage 1            P-k (async: no flush)
    pipeoptim           2, last stage 1            P-k
    base+bounded        2, last stage 1            P-k
    zb-h1               1                          min(P, M) (held until W)
    zb-v                1                          min(P-k, M), P = 2 x ranks
    ==================  =========================  ===================

    The returned function computes from the ``num_stages`` it is called with (so a search
    over stage counts can reuse it); ``num_stages`` here is only validated.
    """
    key = method.strip().lower()
    if key not in METHODS:
        raise PlanError(f"unknown method {method!r}; valid methods are {', '.join(METHODS)}")
    for name, value in (("num_stages", num_stages), ("micro_batches", micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name} must be a whole number >= 1, got {value!r}")
    # a corrected method keeps its base's weights and activations, plus the weight-sized
    # buffers its correction keeps (the extrapolation's): the method object carries its rules
    method_ = METHODS[key]

    def factors(stage_index: int, num_stages: int) -> tuple[int, int]:
        if not 0 <= stage_index < num_stages:
            raise PlanError(
                f"stage index {stage_index} is outside 0..{num_stages - 1} for {num_stages} stages"
            )
        return (
            method_.weight_copies(stage_index, num_stages),
            method_.activation_slots(stage_index, num_stages, micro_batches),
        )

    factors.__name__ = f"{key}_memory_factors"
    return factors


def _unit_factors(stage_index: int, num_stages: int) -> tuple[int, int]:
    return (1, 1)


def resolve_factors(
    memory_factors: MemoryFactors | None, num_stages: int
) -> tuple[list[int], list[int]]:
    rule = _unit_factors if memory_factors is None else memory_factors
    copies: list[int] = []
    slots: list[int] = []
    for k in range(num_stages):
        pair = rule(k, num_stages)
        try:
            wc, sl = pair
        except (TypeError, ValueError):
            raise PlanError(
                f"memory_factors({k}, {num_stages}) returned {pair!r}; it must return a pair "
                "(weight_copies, activation_slots) of whole numbers"
            ) from None
        for name, value, low in (("weight_copies", wc, 1), ("activation_slots", sl, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise PlanError(
                    f"memory_factors({k}, {num_stages}) gave {name}={value!r}; it must be a "
                    f"whole number >= {low}"
                )
        copies.append(int(wc))
        slots.append(int(sl))
    return copies, slots


def method_holds_weights(method: str, num_stages: int) -> list[bool]:
    """Per stage whether a recomputation under ``method`` holds the recomputed units'
    weights per activation slot: where the method runs forwards on predicted weights
    (PREDICT policy, every stage but the last, whose prediction distance is 0); stashing
    and flushing methods keep the version their backward needs anyway."""
    key = method.strip().lower()
    if key not in METHODS:
        raise PlanError(f"unknown method {method!r}; valid methods are {', '.join(METHODS)}")
    predicts = METHODS[key].predicts
    return [predicts and k < num_stages - 1 for k in range(num_stages)]
