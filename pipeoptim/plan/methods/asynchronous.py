"""The asynchronous methods: asynchronous 1F1B, never a flush; they differ in which
version a forward reads (the latest and stashed, one behind, or predicted)."""

from __future__ import annotations

from pipeoptim.plan import schedules
from pipeoptim.plan.methods.base import Method, WeightPolicy


def _units_in_flight(k: int, p: int, m: int) -> int:
    """Asynchronous 1F1B holds the P - k units in flight at stage k."""
    return p - k


PIPEDREAM = Method(
    "pipedream",
    "PipeDream: asynchronous 1F1B, forward on the latest weights, stashed for backward",
    schedules.async_one_f_one_b,
    WeightPolicy.STASH,
    array_generator=schedules.async_one_f_one_b_arrays,
    micro_batched=False,
    asynchronous=True,
    slots_rule=_units_in_flight,
)

TWO_BW = Method(
    "2bw",
    "PipeDream-2BW: asynchronous 1F1B over micro-batches, weights one version behind",
    schedules.async_one_f_one_b,
    WeightPolicy.DOUBLE_BUFFER,
    array_generator=schedules.async_one_f_one_b_arrays,
    asynchronous=True,
    min_micro_batches_per_stage=True,
)

SPECTRAIN = Method(
    "spectrain",
    "SpecTrain: asynchronous 1F1B, forward on weights predicted along the momentum",
    schedules.async_one_f_one_b,
    WeightPolicy.PREDICT,
    array_generator=schedules.async_one_f_one_b_arrays,
    prediction_rule="spectrain",
    micro_batched=False,
    asynchronous=True,
    slots_rule=_units_in_flight,
)

XPIPE = Method(
    "xpipe",
    "XPipe: micro-batched asynchronous 1F1B, Adam-form prediction of the update target",
    schedules.async_one_f_one_b,
    WeightPolicy.PREDICT,
    array_generator=schedules.async_one_f_one_b_arrays,
    prediction_rule="xpipe",
    asynchronous=True,
    slots_rule=_units_in_flight,
)

PIPEOPTIM = Method(
    "pipeoptim",
    "PipeOptim: asynchronous 1F1B, forward on weights predicted by the optimizer's rule; "
    "whole mini-batches by default, --micro-batches M cuts stage k's delay to ⌈(P−1−k)/M⌉ "
    "updates (one from M = P−1; M = P is XPipe's schedule with this rule)",
    schedules.async_one_f_one_b,
    WeightPolicy.PREDICT,
    array_generator=schedules.async_one_f_one_b_arrays,
    prediction_rule="optimizer",
    default_micro_batches=1,  # the dial: whole mini-batches unless asked for more
    asynchronous=True,
    slots_rule=_units_in_flight,
)
