"""Which action waits for which: the dependencies of an order, compiled in numpy.

The rules are :func:`pipeoptim.plan.schedules.dependencies` (F of stage k after F of k-1; B
of k after B of k+1 and its own F; U after its mini-batch's backwards). A split backward's
input half I waits like a B (for the I or B of stage k+1, whose gradient crosses the edge,
and its own F), its weight half W for its own I, and U for the W's of its mini-batch where
its backwards are split. A dependency on the same rank earlier in its order is implied by
the rank running actions one after the other, so only cross-rank dependencies are kept; one
on the same rank *later* in the order can never be met and is refused.

The passes are looked up in one small table per kind, indexed by ``mb * stages + stage``
(a few MB for a million actions), instead of one table over packed keys of every kind.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pipeoptim.errors import ScheduleError
from pipeoptim.plan.orders import KIND_B, KIND_F, KIND_I, KIND_U, KIND_W, IntArray, KeyIndex

__all__ = ["compile_dependencies"]

_PASS_KINDS = (KIND_F, KIND_B, KIND_I, KIND_W)


class _PassIndex:
    """Where each (kind, micro-batch, stage) pass sits in the order, by ``mb * stages +
    stage``: one dense table per kind when the micro-batches are numbered closely (a
    lookup is then one gather), else a :class:`KeyIndex` per kind."""

    def __init__(self, kind: IntArray, key: IntArray, stages: int) -> None:
        self.stages = stages
        self.positions = {code: np.flatnonzero(kind == code) for code in _PASS_KINDS}
        """Where each kind of pass sits in the order, ascending (the compile reuses them)."""
        found = [(code, at, key[at]) for code, at in self.positions.items() if len(at)]
        count = sum(len(at) for _, at, _ in found)
        # with 0 <= stage < stages, a key is negative exactly where its micro-batch is
        low = min((int(keys.min()) for _, _, keys in found), default=0)
        top = (max((int(keys.max()) // stages for _, _, keys in found), default=-1) + 1) * stages
        self.size = top if low >= 0 and top <= 4 * count + 1024 else -1
        """Length of the dense tables (-1: none, the sparse lookups are used)."""
        self.tables: dict[int, IntArray] = {}
        self.sparse: dict[int, tuple[KeyIndex, IntArray]] = {}
        self.twice: tuple[int, int] | None = None
        repeats = []
        for code, at, keys in found:
            if self.size < 0:
                index = KeyIndex(keys)
                self.sparse[code] = (index, at)
                twice = index.duplicate()
            else:
                table = np.full(self.size, -1, dtype=np.int64)
                table[keys] = at
                self.tables[code] = table
                # a repeated key fills fewer entries than there are passes; name the first
                # repeat as KeyIndex does
                repeated = np.count_nonzero(table >= 0) < len(at)
                twice = KeyIndex(keys).duplicate() if repeated else None
            if twice is not None:
                repeats.append((int(at[twice[0]]), int(at[twice[1]])))
        self.twice = min(repeats, default=None)
        """An action that appears twice (the later one and the first), or None."""

    def find(self, keys: IntArray, code: int, *other: int, checked: bool = True) -> IntArray:
        """The action of kind ``code`` (else of the first ``other`` kind found) at each key
        ``mb * stages + stage``, or -1. ``checked=False``: the caller knows every key is a
        (micro-batch, stage) of some pass, inside the tables."""
        found: IntArray | None = None
        if self.size >= 0 and checked:
            inside = (keys >= 0) & (keys < self.size)
            keys = np.where(inside, keys, 0)
        for kind in (code, *other):
            if self.size >= 0:
                table = self.tables.get(kind)
                hit = table[keys] if table is not None else None
            else:
                entry = self.sparse.get(kind)
                hit = None
                if entry is not None:
                    index, at = entry
                    where = index.find(keys)
                    hit = np.where(where >= 0, at[np.maximum(where, 0)], -1)
            if hit is None:
                continue
            found = hit if found is None else np.where(found >= 0, found, hit)
        if found is None:
            return np.full(len(keys), -1, dtype=np.int64)
        if self.size >= 0 and checked:
            found = np.where(inside, found, -1)
        return found


def compile_dependencies(
    kind: IntArray,
    mb: IntArray,
    stage: IntArray,
    rank: IntArray,
    num_stages: int,
    micro_batches: int,
    name: Callable[[int], str],
) -> tuple[IntArray, IntArray]:
    """Per action the one cross-rank action it waits for (-1: none) and the link of that
    wait (``2*k`` forward over edge k, ``2*k+1`` backward, -1 none); ``name`` gives an
    action's text form for the errors. Every stage runs on one rank (as
    :class:`~pipeoptim.sim.program.Program` checks first)."""
    s, m = max(num_stages, 1), micro_batches
    size = len(kind)
    dep = np.full(size, -1, dtype=np.int64)
    edge_of = np.full(size, -1, dtype=np.int64)
    key = mb * s + stage
    index = _PassIndex(kind, key, s)
    if index.twice is not None:
        i, first = index.twice
        raise ScheduleError(
            f"{name(i)} appears twice in the order (also as action {first}); "
            f"every F, B, I and W runs once per stage and micro-batch"
        )
    late: list[tuple[int, int]] = []  # (action, a same-rank input it runs before)

    def link(at: IntArray, d: IntArray, edge: IntArray | None) -> None:
        if edge is None:  # an input of the same stage, so of the same rank: order only
            wrong = d > at
        else:
            has = d >= 0
            if not has.all():
                at, d, edge = at[has], d[has], edge[has]
            cross = rank[d] != rank[at]
            if cross.all():
                dep[at], edge_of[at] = d, edge
            else:
                dep[at[cross]], edge_of[at[cross]] = d[cross], edge[cross]
            wrong = ~cross & (d > at)
        if wrong.any():
            q = int(np.argmax(wrong))
            late.append((int(at[q]), int(d[q])))

    # a pass's neighbours on the stage before or after hold the keys next to its own
    f = index.positions[KIND_F]
    f = f[stage[f] > 0]
    link(f, index.find(key[f] - 1, KIND_F, checked=False), 2 * (stage[f] - 1))
    b = index.positions[KIND_B]  # a backward's input gradient: a B or an I
    if len(halves := index.positions[KIND_I]):
        b = np.sort(np.concatenate((b, halves))) if len(b) else halves
    link(b, index.find(key[b], KIND_F, checked=False), None)
    b = b[stage[b] < s - 1]
    link(b, index.find(key[b] + 1, KIND_B, KIND_I, checked=False), 2 * stage[b] + 1)
    w = index.positions[KIND_W]
    link(w, index.find(key[w], KIND_I, checked=False), None)
    u = np.flatnonzero(kind == KIND_U)
    for q in range(m):
        link(u, index.find((mb[u] * m + q) * s + stage[u], KIND_B, KIND_W), None)
    if late:
        i, d = min(late)
        r = int(rank[i])
        raise ScheduleError(
            f"rank {r} runs {name(i)} before {name(d)}, which it needs; "
            f"the rank would wait forever. Put {name(d)} first in rank {r}'s order"
        )
    return dep, edge_of
