"""Per-rank action orders as flat numpy arrays: the form long runs are compiled and analysed in.

An :data:`~pipeoptim.plan.schedules.Order` of :class:`Action` objects is the readable form,
and the one schedules print, parse and save. A run of a million actions costs seconds just
to build those objects, so generators of long asynchronous runs also produce this form, and
the simulator's compiler and the version analysis read it directly. Both forms hold the
same data and convert losslessly (communication actions and idle steps dropped).

The arrays hold every compute kind: F, B and U, and the halves of a split backward, I
(input gradient) and W (weight gradient). The simulator and the version analysis read them
all; the runtime does not run I/W yet and refuses them where it plans a run
(:func:`pipeoptim.runtime.segments.segment_plan`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pipeoptim.plan.actions import Action, B, F, Kind, U

__all__ = [
    "KIND_B",
    "KIND_CODES",
    "KIND_F",
    "KIND_I",
    "KIND_U",
    "KIND_W",
    "IntArray",
    "KeyIndex",
    "OrderArrays",
]

IntArray = npt.NDArray[np.int64]

KIND_F, KIND_B, KIND_U, KIND_I, KIND_W = 0, 1, 2, 3, 4
KIND_CODES = ("F", "B", "U", "I", "W")
"""Text code of each kind number."""
_I, _W = Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT
_KINDS = (F, B, U, _I, _W)
_KIND_NUMBER = {F: KIND_F, B: KIND_B, U: KIND_U, _I: KIND_I, _W: KIND_W}


@dataclass(frozen=True)
class OrderArrays:
    """Compute actions of every rank in execution order, ranks concatenated in rank order.

    Action ``i`` is ``(stage[i], kind[i], mb[i])`` with kind 0 = F, 1 = B, 2 = U, 3 = I
    (input half of a split backward), 4 = W (its weight half); rank
    ``ranks[p]`` owns the half-open index range ``bounds[p]:bounds[p + 1]``.
    """

    ranks: tuple[int, ...]
    bounds: IntArray
    """``len(ranks) + 1`` offsets into the action arrays."""
    stage: IntArray
    kind: IntArray
    mb: IntArray

    @property
    def size(self) -> int:
        return int(self.stage.shape[0])

    @classmethod
    def from_rank_arrays(
        cls, per_rank: Mapping[int, tuple[IntArray, IntArray, IntArray]]
    ) -> OrderArrays:
        """Concatenate ``{rank: (stage, kind, mb)}`` in rank order."""
        ranks = tuple(sorted(per_rank))
        parts = [per_rank[r] for r in ranks]
        sizes = [len(p[0]) for p in parts]
        bounds = np.zeros(len(ranks) + 1, dtype=np.int64)
        np.cumsum(sizes, out=bounds[1:])

        def join(j: int) -> IntArray:
            if not parts:
                return np.zeros(0, dtype=np.int64)
            return np.concatenate([np.asarray(p[j], dtype=np.int64) for p in parts])

        return cls(ranks, bounds, join(0), join(1), join(2))

    @classmethod
    def from_order(cls, order: Mapping[int, Sequence[Action | None]]) -> OrderArrays:
        """The array form of an Action order; idle steps and communication are dropped."""
        per_rank: dict[int, tuple[IntArray, IntArray, IntArray]] = {}
        number = _KIND_NUMBER
        for r, acts in order.items():
            kept = [a for a in acts if a is not None and a.kind.is_compute]
            per_rank[r] = (
                np.fromiter((a.stage for a in kept), np.int64, len(kept)),
                np.fromiter((number[a.kind] for a in kept), np.int64, len(kept)),
                np.fromiter((a.mb for a in kept), np.int64, len(kept)),
            )
        return cls.from_rank_arrays(per_rank)

    def to_order(self) -> dict[int, list[Action]]:
        """The Action form: each rank's actions in execution order."""
        kinds: tuple[Kind, ...] = _KINDS
        stage, kind, mb = self.stage.tolist(), self.kind.tolist(), self.mb.tolist()
        bounds = self.bounds.tolist()
        return {
            r: [Action(stage[i], kinds[kind[i]], mb[i]) for i in range(bounds[p], bounds[p + 1])]
            for p, r in enumerate(self.ranks)
        }

    def rank_of(self) -> IntArray:
        """The rank of every action."""
        counts = np.diff(self.bounds)
        return np.repeat(np.asarray(self.ranks, dtype=np.int64), counts)

    def name(self, i: int) -> str:
        """Action ``i``'s text form, e.g. ``"2F13"``."""
        return f"{int(self.stage[i])}{KIND_CODES[int(self.kind[i])]}{int(self.mb[i])}"


class KeyIndex:
    """Entry number of each integer key, for vectorised lookups of many keys at once.

    Keys that fit a table a few times the entry count are looked up in a dense table, any
    others (micro-batch numbers far apart) by binary search.
    """

    def __init__(self, keys: IntArray) -> None:
        self.keys = keys
        top = int(keys.max()) + 1 if len(keys) else 0
        self.table: IntArray | None = None
        if len(keys) == 0 or (int(keys.min()) >= 0 and top <= 4 * len(keys) + 1024):
            self.table = np.full(top, -1, dtype=np.int64)
            # (a duplicated key holds one of its entries: callers refuse duplicates first)
            self.table[keys] = np.arange(len(keys), dtype=np.int64)
        else:
            self.order = np.argsort(keys, kind="stable")
            self.sorted = keys[self.order]

    def find(self, queries: IntArray) -> IntArray:
        """The entry holding each query key (one of them, if several do), or -1."""
        if self.table is not None:
            if len(self.table) == 0:
                return np.full(len(queries), -1, dtype=np.int64)
            inside = (queries >= 0) & (queries < len(self.table))
            return np.where(inside, self.table[np.where(inside, queries, 0)], -1)
        at = np.searchsorted(self.sorted, queries)
        at_clipped = np.minimum(at, len(self.sorted) - 1)
        hit = (at < len(self.sorted)) & (self.sorted[at_clipped] == queries)
        return np.where(hit, self.order[at_clipped], -1)

    def duplicate(self) -> tuple[int, int] | None:
        """The first entry whose key an earlier entry has, with that earlier entry; or None."""
        if len(self.keys) == 0 or bool((self.find(self.keys) == np.arange(len(self.keys))).all()):
            return None
        order = np.argsort(self.keys, kind="stable")
        repeats = self.keys[order][1:] == self.keys[order][:-1]
        later = int(order[1:][repeats].min())
        earlier = int(np.flatnonzero(self.keys == self.keys[later])[0])
        return later, earlier
