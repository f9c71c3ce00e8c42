"""Interleaved zero bubble (the ZB paper's ZB1P on interleaved 1F1B's placement; PyTorch's
``ScheduleInterleavedZeroBubble``).

Rank r holds stages r, r+P, ..., r+(v-1)P (looped, as interleaved-1f1b); each backward is
split into I and W, and each rank's W's wait r steady rounds, so they fill the cool-down
that interleaved 1F1B leaves idle. Synchronous: one weight version, a flush per update.
"""

from __future__ import annotations

from functools import lru_cache

from pipeoptim.plan.actions import Action, F, Kind, U
from pipeoptim.plan.methods.base import Method, WeightPolicy
from pipeoptim.plan.methods.dualpipe_v import held_micro_batches
from pipeoptim.plan.schedules import Order
from pipeoptim.plan.shape import Shape

__all__ = ["INTERLEAVED_ZB", "interleaved_zb_order"]

I = Kind.BACKWARD_INPUT  # noqa: E741 - PyTorch's and the paper's name for the input half
W = Kind.BACKWARD_WEIGHT


def _rank_order(p: int, v: int, m: int, r: int) -> list[Action]:
    """Rank r's order for one mini-batch (``m`` a multiple of ``p``).

    The rank's ``m*v`` forwards visit its stages in groups of ``p`` micro-batches, first
    stage first; its backwards visit them in groups of ``p``, last stage first. Warm-up:
    ``(v-1)p + p-1-r`` forwards. Then one round per backward: the next forward (while any is
    left), the backward's I, and, from round r on, the W of the oldest I still waiting;
    the W's still waiting close the order.
    """
    total = m * v
    warm = min((v - 1) * p + p - 1 - r, total)
    counts: dict[tuple[Kind, int], int] = {}

    def act(kind: Kind, stage: int) -> Action:
        mb = counts.get((kind, stage), 0)
        counts[kind, stage] = mb + 1
        return Action(stage, kind, mb)

    def forward(i: int) -> Action:
        return act(F, (i // p) % v * p + r)

    def backward_stage(j: int) -> int:
        return (v - 1 - (j // p) % v) * p + r

    acts = [forward(i) for i in range(warm)]
    for j in range(total):
        if warm + j < total:
            acts.append(forward(warm + j))
        acts.append(act(I, backward_stage(j)))
        if j >= r:
            acts.append(act(W, backward_stage(j - r)))
    acts += [act(W, backward_stage(j)) for j in range(max(total - r, 0), total)]
    return acts


def interleaved_zb_order(
    num_ranks: int, micro_batches: int, mini_batches: int = 1, virtual_stages: int = 2
) -> Order:
    """The per-rank orders, one mini-batch after another, each ending with the updates of
    the rank's stages."""
    p, v, m = num_ranks, virtual_stages, micro_batches
    order: Order = {}
    for r in range(p):
        one = _rank_order(p, v, m, r)
        acts: list[Action] = []
        for t in range(mini_batches):
            acts += [Action(a.stage, a.kind, t * m + a.mb) for a in one]
            acts += [Action(r + c * p, U, t) for c in range(v)]
        order[r] = acts
    return order


@lru_cache(maxsize=64)
def _slots(num_stages: int, micro_batches: int) -> dict[int, int]:
    # the rule is told the stage count only: counted at the default 2 stages per rank; asked
    # below the size rule's M >= P (a memory table's sweep), it counts at M = P, capped at M
    p = max(num_stages // 2, 1)
    held = held_micro_batches(interleaved_zb_order(p, max(micro_batches, p), 1, num_stages // p))
    return {k: min(n, micro_batches) for k, n in held.items()}


def _order(shape: Shape) -> Order:
    return interleaved_zb_order(
        shape.num_ranks, shape.micro_batches, shape.mini_batches, shape.virtual_stages
    )


INTERLEAVED_ZB = Method(
    "interleaved-zb",
    "interleaved zero bubble (ZB1P, PyTorch's ScheduleInterleavedZeroBubble): v stages "
    "per rank looped, split backward, the W's fill the cool-down, flush; M a multiple of P",
    _order,
    WeightPolicy.FLUSH,
    min_micro_batches_per_stage=True,
    interleaved=True,
    split_backward=True,
    slots_rule=lambda k, p, m: _slots(p, m)[k] if p % 2 == 0 else min(p, m),
)
