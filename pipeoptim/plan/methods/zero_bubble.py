"""The zero-bubble methods (ZB-H1, ZB-V): each backward split into its input half I and its
weight half W, the W's filling the bubbles; synchronous (one version, a flush)."""

from __future__ import annotations

from pipeoptim.plan import zero_bubble
from pipeoptim.plan.methods.base import Method, WeightPolicy
from pipeoptim.plan.schedules import Order
from pipeoptim.plan.shape import Shape


def _zb_h1(shape: Shape) -> Order:
    return zero_bubble.zb_h1_order(shape.num_ranks, shape.micro_batches, shape.mini_batches)


def _zb_v(shape: Shape) -> Order:
    return zero_bubble.zb_v_order(2 * shape.num_ranks, shape.micro_batches, shape.mini_batches)


ZB_H1 = Method(
    "zb-h1",
    "ZB-H1 zero bubble: backward split into input (I) and weight (W) passes, the W's "
    "fill 1F1B's cool-down; 1F1B's memory, flush; needs M >= P",
    _zb_h1,
    WeightPolicy.FLUSH,
    min_micro_batches_per_stage=True,
    split_backward=True,
    # activations are held from F until the deferred W: P micro-batches on every stage
    slots_rule=lambda k, p, m: min(p, m),
)

ZB_V = Method(
    "zb-v",
    "ZB-V zero bubble: 2 stages per rank in a V, split backward, PyTorch's "
    "ScheduleZBVZeroBubble order, flush; near-zero bubble from M >= 2P-1",
    _zb_v,
    WeightPolicy.FLUSH,
    interleaved=True,
    v_shape=True,
    split_backward=True,
)
