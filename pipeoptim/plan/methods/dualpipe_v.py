"""DualPipeV (DeepSeek-V3's DualPipe folded into a V; PyTorch's ``ScheduleDualPipeV``).

P ranks, two stages per rank in a V (rank r holds stages r and 2P-1-r, as zb-v), each
backward either full (B) or split into I and W, and in the steady state each step pairs the
forward of one micro-batch with the backward of another on the rank's other stage: an
overlapped step (``OVERLAP_F_B``, :mod:`pipeoptim.plan.actions`). The runtime and the
simulator run a pair as its two actions back to back (what PyTorch's runtime does), so a
pair costs F + B; the overlap of communication with computation that DualPipe is built for
is not modelled. Synchronous: one weight version, a flush before each update.

Memory: each stage's parameters are held once (a rank holds two different stages, not two
copies of one; DualPipe's non-V form is the one that keeps 2x parameters). Activations:
the micro-batches a stage holds between its forward and its W (or B), counted from the
order itself (:func:`held_micro_batches`).
"""

from __future__ import annotations

from functools import lru_cache

from pipeoptim.errors import PlanError
from pipeoptim.plan.actions import Action, B, F, Kind, U
from pipeoptim.plan.methods.base import Method, WeightPolicy
from pipeoptim.plan.schedules import Order
from pipeoptim.plan.shape import Shape

__all__ = ["DUALPIPE_V", "dualpipe_v_order", "held_micro_batches"]

I = Kind.BACKWARD_INPUT  # noqa: E741 - PyTorch's and the paper's name for the input half
W = Kind.BACKWARD_WEIGHT


class _Rank:
    """One rank's order under construction: the next micro-batch of each stage's forward
    and backward, and the W's waiting for a bubble (oldest first)."""

    def __init__(self) -> None:
        self.acts: list[Action] = []
        self.next_f: dict[int, int] = {}
        self.next_b: dict[int, int] = {}
        self.waiting: list[Action] = []

    def forward(self, stage: int) -> Action:
        mb = self.next_f.get(stage, 0)
        self.next_f[stage] = mb + 1
        return Action(stage, F, mb)

    def backward(self, stage: int, split: bool) -> Action:
        mb = self.next_b.get(stage, 0)
        self.next_b[stage] = mb + 1
        if split:
            self.waiting.append(Action(stage, W, mb))
        return Action(stage, I if split else B, mb)

    def run(self, *acts: Action) -> None:
        self.acts += acts

    def run_waiting_w(self) -> None:
        if self.waiting:
            self.acts.append(self.waiting.pop(0))

    def overlap(self, forward_stage: int, backward_stage: int) -> None:
        """An OVERLAP_F_B step: a forward, then a full backward of the other stage."""
        self.run(self.forward(forward_stage).overlapping(), self.backward(backward_stage, False))


def _rank_order(p: int, n: int, r: int) -> list[Action]:
    """Rank r's order for one mini-batch of ``n >= 2P`` micro-batches.

    The phases, first leg stage ``a = r``, second leg ``z = 2P-1-r``:

    1. ``2(P-1-r)`` forwards of ``a`` (the V's first leg fills);
    2. ``r+1`` pairs of forwards, ``a`` then ``z``;
    3. ``P-1-r`` rounds of ``z``: I, its W, the next F (zero bubble while the second leg's
       backwards arrive);
    4. ``n-2P+r+1`` steady rounds of two overlapped steps, (F ``a``; B ``z``) then
       (F ``z``; B ``a``); the last rank runs the very first pair apart, one after the other;
    5. ``P-1-r`` rounds of B ``z`` then (F ``z``; B ``a``);
    6. ``r+1`` rounds of backwards ``z`` then ``a``; from the middle round on they are
       split into I with the W's left waiting (an odd rank splits from that round's ``z``,
       an even one from its ``a``);
    7. ``P-1-r`` rounds of a waiting W then the next backward of ``a``;
    8. the waiting W's (``r+1`` of them).
    """
    a, z = r, 2 * p - 1 - r
    rank = _Rank()
    for _ in range(2 * (p - 1 - r)):
        rank.run(rank.forward(a))
    for _ in range(r + 1):
        rank.run(rank.forward(a), rank.forward(z))
    for _ in range(p - 1 - r):
        rank.run(rank.backward(z, True))
        rank.run_waiting_w()
        rank.run(rank.forward(z))
    for i in range(n - 2 * p + r + 1):
        if i == 0 and r == p - 1:
            rank.run(rank.forward(a), rank.backward(z, False))
        else:
            rank.overlap(a, z)
        rank.overlap(z, a)
    for _ in range(p - 1 - r):
        rank.run(rank.backward(z, False))
        rank.overlap(z, a)
    split = False
    for i in range(r + 1):
        middle = i == (r + 1) // 2
        split = split or (middle and r % 2 == 1)
        rank.run(rank.backward(z, split))
        split = split or (middle and r % 2 == 0)
        rank.run(rank.backward(a, split))
    for _ in range(p - 1 - r):
        rank.run_waiting_w()
        rank.run(rank.backward(a, split))
    for _ in range(r + 1):
        rank.run_waiting_w()
    return rank.acts


def _keep_first(acts: list[Action], m: int) -> list[Action]:
    """The actions of micro-batches ``< m``; a pair that loses its backward is no pair."""
    return [
        x.overlapping(False) if x.overlapped and acts[i + 1].mb >= m else x
        for i, x in enumerate(acts)
        if x.mb < m
    ]


def dualpipe_v_order(num_ranks: int, micro_batches: int, mini_batches: int = 1) -> Order:
    """DualPipeV's per-rank orders (see :func:`_rank_order` for one mini-batch).

    PyTorch's class needs ``M >= 2P``; here, as for zb-v, the order is laid out for
    ``max(M, 2P)`` micro-batches and those ``>= M`` are left out, so any ``M >= 1`` runs
    (the overlap and the small bubble need ``M >= 2P``). Each mini-batch ends with the
    updates of the rank's two stages.
    """
    p, m = num_ranks, micro_batches
    if p < 1 or m < 1 or mini_batches < 1:
        raise PlanError(
            f"DualPipeV needs at least 1 rank, 1 micro-batch and 1 mini-batch (got P={p}, "
            f"M={m}, N={mini_batches}); pass 1 or more of each"
        )
    order: Order = {}
    for r in range(p):
        one = _keep_first(_rank_order(p, max(m, 2 * p), r), m)
        acts: list[Action] = []
        for t in range(mini_batches):
            acts += [Action(x.stage, x.kind, t * m + x.mb, x.overlapped) for x in one]
            acts += [Action(r, U, t), Action(2 * p - 1 - r, U, t)]
        order[r] = acts
    return order


def held_micro_batches(order: Order) -> dict[int, int]:
    """The most micro-batches each stage holds activations for at once: from its forward
    until its W (split) or B (full), the memory model's activation slots."""
    peak: dict[int, int] = {}
    for acts in order.values():
        held: dict[int, int] = {}
        for x in acts:
            if x.kind is F:
                held[x.stage] = held.get(x.stage, 0) + 1
                peak[x.stage] = max(peak.get(x.stage, 0), held[x.stage])
            elif x.kind in (B, W):
                held[x.stage] -= 1
    return peak


@lru_cache(maxsize=64)
def _dualpipe_v_slots(num_stages: int, micro_batches: int) -> dict[int, int]:
    return held_micro_batches(dualpipe_v_order(num_stages // 2, micro_batches, 1))


def _order(shape: Shape) -> Order:
    return dualpipe_v_order(shape.num_ranks, shape.micro_batches, shape.mini_batches)


DUALPIPE_V = Method(
    "dualpipev",
    "DualPipeV (DeepSeek-V3's DualPipe in a V, PyTorch's ScheduleDualPipeV): 2 stages per "
    "rank, steady steps overlap one forward with another micro-batch's backward "
    "(OVERLAP_F_B), split backward in the tail, flush; overlap from M >= 2P",
    _order,
    WeightPolicy.FLUSH,
    interleaved=True,
    v_shape=True,
    split_backward=True,
    # each stage's parameters once (a rank holds two stages, not two copies)
    copies_rule=lambda k, p: 1,
    # a stage count that is no V (odd) has no order: 1F1B's count for it
    slots_rule=lambda k, p, m: _dualpipe_v_slots(p, m)[k] if p % 2 == 0 else min(p - k, m),
)
