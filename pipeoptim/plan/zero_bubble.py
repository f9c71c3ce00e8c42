"""Zero-bubble schedules (Qi et al., ICLR 2024, "Zero Bubble Pipeline Parallelism").

Each backward is split into its input half ``I`` (the gradient the previous stage waits
for) and its weight half ``W`` (needed only by the update), so ``W`` passes can wait and
fill the bubbles a full backward leaves. Both generators are synchronous: every mini-batch
is flushed, each stage updates once (``U``, numbered by the mini-batch ``t``) after its last
``W``, and mini-batch ``t``'s micro-batch ``j`` has the global id ``t*M + j``. They return a
clock grid placed by :func:`~pipeoptim.plan.schedules.retime`: one action per step, each
at the first step after its dependencies, i.e. the timing of uniform costs F = I = W = 1.

The simulator runs them as they are (I and W take the cost model's ``backward_input_s``
and ``backward_weight_s``, the backward split by its per-stage ``weight_grad_fraction``,
which a profile measures); the
runtime runs only full backwards: merge a zero-bubble schedule with
:func:`~pipeoptim.plan.passes.merge_backward` to train it.
"""

from __future__ import annotations

from pipeoptim.errors import PlanError
from pipeoptim.plan.actions import Action, F, Kind, Schedule, U
from pipeoptim.plan.schedules import Order, retime

I = Kind.BACKWARD_INPUT  # noqa: E741 - the paper's and PyTorch's name for the input half
W = Kind.BACKWARD_WEIGHT


def _check_sizes(name: str, num_ranks: int, micro_batches: int, mini_batches: int) -> None:
    if num_ranks < 1:
        raise PlanError(f"{name} needs at least 1 rank (got {num_ranks}); pass 1 or more")
    if micro_batches < 1:
        raise PlanError(
            f"{name} needs at least 1 micro-batch per mini-batch (got {micro_batches}); "
            f"pass 1 or more"
        )
    if mini_batches < 1:
        raise PlanError(f"{name} needs at least 1 mini-batch (got {mini_batches}); pass 1 or more")


def zb_h1_order(num_stages: int, micro_batches: int, mini_batches: int) -> Order:
    """The per-rank orders of :func:`zb_h1`, without idle steps."""
    _check_sizes("ZB-H1", num_stages, micro_batches, mini_batches)
    p, m = num_stages, micro_batches
    if m < p:
        raise PlanError(
            f"ZB-H1 needs at least as many micro-batches as stages, M >= P (got M={m} "
            f"micro-batches for P={p} stages): with fewer, stage k cannot hold back k weight "
            f"passes and the schedule is not ZB-H1; raise the micro-batches to {p} or more"
        )
    order: Order = {}
    for k in range(p):
        warmup = p - 1 - k
        acts: list[Action] = []
        for t in range(mini_batches):
            base = t * m
            fwd = [Action(k, F, base + j) for j in range(m)]
            inp = [Action(k, I, base + j) for j in range(m)]
            wgt = [Action(k, W, base + j) for j in range(m)]
            acts += fwd[:warmup]
            next_w = 0
            for i in range(m - warmup):  # steady: F, I and, k pairs late, the oldest W
                acts += [fwd[warmup + i], inp[i]]
                if i >= k:
                    acts.append(wgt[next_w])
                    next_w += 1
            for i in range(m - warmup, m):  # cool-down: I, W pairs
                acts += [inp[i], wgt[next_w]]
                next_w += 1
            acts += wgt[next_w:]  # the k held-back W's fill the tail
            acts.append(Action(k, U, t))
        order[k] = acts
    return order


def zb_h1(num_stages: int, micro_batches: int, mini_batches: int = 1) -> Schedule:
    """ZB-H1: 1F1B with split backwards, its ``W`` passes held back to fill the bubbles.

    One stage per rank, P = ``num_stages``. Stage k's order for each mini-batch follows the
    paper's handcrafted schedule (section 2.1, Figure 3 top):

    * warm-up: ``P-1-k`` forwards, as in 1F1B;
    * steady state, one round per remaining forward ``i = 0 .. M-P+k``: ``F``, then ``I`` of
      the oldest micro-batch, then, from round ``k`` on, ``W`` of the oldest micro-batch
      still waiting (stage k starts its ``W``'s k rounds late: the later the stage, the
      fewer warm-up forwards, so every stage holds the same P micro-batches between ``F``
      and ``W``, the first stage's 1F1B count);
    * cool-down: the remaining ``I``'s, each followed by one waiting ``W``;
    * the k ``W``'s still waiting, which fill what 1F1B leaves as the tail bubble;
    * ``U`` after the last ``W``.

    Between ``F`` and ``I`` stage k holds at most ``P-k`` micro-batches, exactly 1F1B's
    count, so the activation peak (which the paper counts from ``F`` to ``I``; a micro-batch
    waiting for ``W`` keeps less) is 1F1B's. With F = I = W = 1 the ``I``'s travel back up
    the pipeline one step per stage instead of two, and the bubble of each rank per
    mini-batch is ``(P-1)(T_F + T_I - T_W) = P-1`` steps against 1F1B's
    ``(P-1)(T_F + T_I + T_W) = 3(P-1)``: a third (the paper's Table 2).

    Requires ``M >= P``; raises :class:`~pipeoptim.errors.PlanError` otherwise.
    """
    return retime(zb_h1_order(num_stages, micro_batches, mini_batches), micro_batches)


def zb_v_order(num_stages: int, micro_batches: int, mini_batches: int) -> Order:
    """The per-rank orders of :func:`zb_v`, without idle steps."""
    if num_stages < 2 or num_stages % 2:
        raise PlanError(
            f"ZB-V places two model stages on every rank in a V, so the stage count must be "
            f"even and at least 2 (got {num_stages}); pass 2*P stages for P ranks"
        )
    p = num_stages // 2
    _check_sizes("ZB-V", p, micro_batches, mini_batches)
    order: Order = {}
    for r in range(p):
        one = _zbv_rank(p, micro_batches, r)
        acts: list[Action] = []
        for t in range(mini_batches):
            acts += [Action(a.stage, a.kind, t * micro_batches + a.mb) for a in one]
            acts += [Action(r, U, t), Action(num_stages - 1 - r, U, t)]
        order[r] = acts
    return order


def _zbv_rank(p: int, m: int, rank: int) -> list[Action]:
    """One mini-batch of rank ``rank``, PyTorch's ``ScheduleZBVZeroBubble`` order exactly.

    As PyTorch does, the order is built for ``max(2P-1, M)`` micro-batches (enough to fill
    the V) and the actions of micro-batches ``>= M`` are dropped.
    """
    n = max(2 * p - 1, m)
    s0, s1 = rank, 2 * p - 1 - rank
    acts: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - rank) - 1):  # warm-up 1: forwards down the first leg
        acts.append(Action(s0, F, f0))
        f0 += 1
    for _ in range(rank):  # warm-up 2: the second leg's forwards start, alternating
        acts += [Action(s1, F, f1), Action(s0, F, f0)]
        f1 += 1
        f0 += 1
    for _ in range(p - rank):  # warm-up 3: second leg F, I, W
        acts += [Action(s1, F, f1), Action(s1, I, b1), Action(s1, W, b1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n:  # steady: F I W on the first leg, F I W on the second
        if f0 < n:
            acts.append(Action(s0, F, f0))
            f0 += 1
        acts += [Action(s0, I, b0), Action(s0, W, b0)]
        b0 += 1
        acts += [Action(s1, F, f1), Action(s1, I, b1), Action(s1, W, b1)]
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):  # cool-down 1: input halves only, W's wait
        acts += [Action(s0, I, b0), Action(s1, I, b1)]
        b0 += 1
        b1 += 1
    for _ in range(p - rank):  # cool-down 2: first leg I, then a waiting W
        acts += [Action(s0, I, b0), Action(s0, W, w0)]
        b0 += 1
        w0 += 1
    acts += [Action(s1, W, j) for j in range(w1, b1)]
    acts += [Action(s0, W, j) for j in range(w0, b0)]
    return [a for a in acts if a.mb < m]


def zb_v(num_stages: int, micro_batches: int, mini_batches: int = 1) -> Schedule:
    """ZB-V: ``num_stages = 2P`` model stages on P ranks in a V (paper section 6).

    Rank r holds stages r and 2P-1-r, so the forward runs down the ranks and back up, and
    the last stage sits on rank 0 beside the first. Each rank's order per mini-batch is
    PyTorch's ``ScheduleZBVZeroBubble`` order exactly (``torch.distributed.pipelining``, the
    reference users compare against; a test checks it action for action), which is:

    * warm-up: ``2(P-r)-1`` forwards of the first stage r; then r pairs (second-stage F,
      first-stage F); then ``P-r`` rounds of second-stage F, I, W;
    * steady: rounds of first-stage F (while any is left), I, W, then second-stage F, I, W;
    * cool-down: r rounds of first-stage I, second-stage I (their W's wait); ``P-r`` rounds
      of first-stage I and one waiting first-stage W; then the waiting second-stage W's,
      then the waiting first-stage W's.

    Like PyTorch, the order is laid out for ``max(2P-1, M)`` micro-batches and the actions
    of micro-batches ``>= M`` are left out, so any ``M >= 1`` works (PyTorch's constructor
    accepts any count); the bubble is near zero only from ``M >= 2P-1`` on. Each rank then
    runs ``U`` for stage r and for stage 2P-1-r after their last ``W``.
    """
    return retime(zb_v_order(num_stages, micro_batches, mini_batches), micro_batches)
