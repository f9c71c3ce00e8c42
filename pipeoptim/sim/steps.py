"""A topological order of a compiled program: the order the fast evaluator walks.

The order depends only on the schedule, not on costs, so a program computes it once
(:meth:`pipeoptim.sim.program.Program.steps`) and every evaluation walks it. Actions are
ordered by their step on a unit-time clock (:func:`levels`), so the walk reads and writes
its times nearly in sequence; where the level sweeps do not settle (a cycle, or an unusual
order) a worklist decides, and names the waits of a deadlock.

The walk keeps each step's end in a list whose slot 0 is a sentinel that ended at time 0
and slot ``j + 1`` is step ``j``: a rank's first action, or an action without a cross-rank
input, reads the sentinel, and the walk appends each end in turn (an append is cheaper
than an indexed store and a counter in the hot loop).
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from typing import NamedTuple, cast

import numpy as np

from pipeoptim.errors import ScheduleError
from pipeoptim.plan.orders import IntArray

__all__ = ["Steps", "flat_buffer", "levels", "topological_steps", "worklist"]


class Steps(NamedTuple):
    """A topological order of a program's actions, with each step's inputs as slots of the
    walk's list of ends (slot 0: the sentinel, ended at 0; slot ``j + 1``: step ``j``)."""

    order_array: IntArray
    """The action run at each step."""
    position_array: IntArray
    """The step of each action (the inverse of ``order_array``)."""
    previous_slots: IntArray
    """The slot of the same rank's previous action; 0 for a rank's first action."""
    input_slots: IntArray
    """The slot of the action's cross-rank input; 0 for none."""
    link_array: IntArray
    """The link its input crosses: ``edge + 1`` (0 for none; index into a transfer table)."""
    previous: Sequence[int]
    """``previous_slots`` as a flat buffer the walk's loop reads (:func:`flat_buffer`:
    copied in one go, where a list would make a Python int of every slot above 256 up
    front)."""
    input: Sequence[int]
    """``input_slots`` as a flat buffer."""
    cost_code: Sequence[int]
    """The action's :meth:`Program.cost_code_array` entry (index into a duration table),
    as a flat buffer."""
    link: Sequence[int]
    """``link_array`` as a flat buffer."""


def topological_steps(
    dep: IntArray,
    edge: IntArray,
    cost_codes: IntArray,
    rank_bounds: Sequence[tuple[int, int]],
    describe_deadlock: Callable[[list[int], list[int]], ScheduleError],
) -> Steps:
    """The steps of a program whose actions wait for ``dep`` (-1: none) over ``edge``;
    ``describe_deadlock(pos, stop)`` words the error of a schedule that cannot run."""
    n = len(dep)
    inputs = np.where(dep >= 0, dep, n)  # n: the sentinel
    found = levels(inputs, rank_bounds)
    at = (
        worklist(cast(list[int], dep.tolist()), rank_bounds, describe_deadlock)
        if found is None
        else np.argsort(found, kind="stable")
    )
    slot = np.empty(n + 1, dtype=np.int64)
    slot[at] = np.arange(1, n + 1, dtype=np.int64)
    slot[n] = 0
    # a rank's previous action is the one before it in the order (slot[-1] is the
    # sentinel's), except at the rank's first
    previous_slots = slot[at - 1]
    previous_slots[slot[[lo for lo, hi in rank_bounds if hi > lo]] - 1] = 0
    input_slots = slot[inputs[at]]
    link = edge[at] + 1
    return Steps(
        at, slot[:n] - 1, previous_slots, input_slots, link,
        flat_buffer(previous_slots), flat_buffer(input_slots), flat_buffer(cost_codes[at]),
        flat_buffer(link),
    )  # fmt: skip


def flat_buffer(values: IntArray) -> Sequence[int]:
    """``values`` in one copy of their bytes, as ``bytes`` where every value fits in a byte
    (a loop reads those as cached small ints, as fast as from a list), else as an
    ``array`` of shorts or of int64, whichever holds them."""
    low, top = (int(values.min()), int(values.max())) if len(values) else (0, 0)
    if low >= 0 and top < 1 << 8:
        return np.ascontiguousarray(values, dtype=np.uint8).tobytes()
    out = array.array("H" if low >= 0 and top < 1 << 16 else "q")
    dtype = np.dtype(f"{'u' if out.typecode == 'H' else 'i'}{out.itemsize}")
    out.frombytes(np.ascontiguousarray(values, dtype=dtype).data.cast("B"))
    return out


def levels(
    inputs: IntArray, rank_bounds: Sequence[tuple[int, int]], max_sweeps: int = 32
) -> IntArray | None:
    """Each action's step on a clock where every action takes one step: one more than
    the later of its rank's previous action and its cross-rank input.

    Sorting by it is a topological order. Computed by sweeping the ranks, down then up
    (forwards flow down, backwards up), each rank in one vectorised pass:
    ``level[i] = i + max over j <= i of (input level[j] + 1 - j)``. None when the
    sweeps do not settle (a cycle, or an unusual order): the worklist decides then.
    ``inputs`` is each action's cross-rank input, ``len(inputs)`` where it has none.
    """
    n = len(inputs)
    level = np.zeros(n + 1, dtype=np.int64)
    level[n] = -1  # the sentinel input: level -1 + 1 = 0 imposes nothing
    spans = [(lo, hi, np.arange(hi - lo, dtype=np.int64)) for lo, hi in rank_bounds]
    spans = [span for span in spans if span[1] > span[0]]
    for sweep in range(max_sweeps):
        changed = False
        for lo, hi, local in spans if sweep % 2 == 0 else spans[::-1]:
            new = local + np.maximum.accumulate(level[inputs[lo:hi]] + 1 - local)
            if not np.array_equal(new, level[lo:hi]):
                level[lo:hi] = new
                changed = True
        if not changed:
            return level[:n]
    return None


def worklist(
    dep: list[int],
    rank_bounds: Sequence[tuple[int, int]],
    describe_deadlock: Callable[[list[int], list[int]], ScheduleError],
) -> IntArray:
    """A topological order by running each rank until it blocks; raises on a deadlock."""
    n = len(dep)
    done = [False] * n
    pos = [lo for lo, _ in rank_bounds]
    stop = [hi for _, hi in rank_bounds]
    waiter = [-1] * n  # the rank (position) blocked on each action, if any
    more: dict[int, list[int]] = {}
    ready = [p for p in range(len(pos)) if pos[p] < stop[p]]
    steps: list[int] = []
    add = steps.append
    # A rank runs until it blocks, and is woken by the action it waits for. Linear in
    # the actions (sweeping every rank until nothing moves is quadratic in the ranks).
    while ready:
        p = ready.pop()
        i, e = pos[p], stop[p]
        while i < e:
            d = dep[i]
            if d >= 0 and not done[d]:
                if waiter[d] < 0:
                    waiter[d] = p
                else:  # a second rank waits for the same action (rare)
                    more.setdefault(d, []).append(p)
                break
            done[i] = True
            add(i)
            if waiter[i] >= 0:
                ready.append(waiter[i])
                ready.extend(more.pop(i, ()))
            i += 1
        pos[p] = i
    if len(steps) < n:
        raise describe_deadlock(pos, stop)
    return np.asarray(steps, dtype=np.int64)
