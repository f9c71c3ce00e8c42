"""An action order compiled to flat lists, the common input of both engines.

The SimPy engine and the fast evaluator must agree to the last bit, so they share one
compilation (which action waits for which, over which link), one way to draw durations
(including seeded jitter) and one way to turn start/end times into a :class:`Trace`. Plain
lists of ints and floats indexed by a global action number keep both hot loops cheap: no
:class:`Action` hashing, no object per action.

Dependencies are those of :func:`pipeoptim.plan.schedules.dependencies` (F of stage k after
F of k-1; B of k after B of k+1 and its own F; U after its mini-batch's backwards). A split
backward's input half I waits like a B (for the I or B of stage k+1, whose gradient crosses
the edge, and its own F), its weight half W for its own I (same rank, no message), and U
for the W's of its mini-batch where its backwards are split. A
dependency on the same rank earlier in its order is implied by the rank running actions one
after the other, so only cross-rank dependencies are kept; one on the same rank *later* in
the order can never be met and is reported at compile time.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple, cast

import numpy as np
import numpy.typing as npt

from pipeoptim.errors import ScheduleError
from pipeoptim.plan.actions import Action
from pipeoptim.plan.methods import WeightPolicy
from pipeoptim.plan.orders import (
    KIND_B,
    KIND_CODES,
    KIND_F,
    KIND_I,
    KIND_U,
    KIND_W,
    IntArray,
    KeyIndex,
    OrderArrays,
)
from pipeoptim.plan.versions import VersionReport, analyze_order
from pipeoptim.sim.costs import CostModel
from pipeoptim.trace import TraceEvent

__all__ = ["KIND_B", "KIND_CODES", "KIND_F", "KIND_I", "KIND_U", "KIND_W", "Program", "Timing"]

_KINDS = len(KIND_CODES)
"""Kinds with a duration of their own: the cost table has one block of stages per kind,
then the predicted forwards."""


FloatArray = npt.NDArray[np.float64]


class Steps(NamedTuple):
    """A topological order of a program's actions (see :meth:`Program.steps`)."""

    order_array: IntArray
    """The action run at each step."""
    position_array: IntArray
    """The step of each action (the inverse of ``order_array``)."""
    previous: list[int]
    """The step of the same rank's previous action; -1 for a rank's first action."""
    input: list[int]
    """The step of the action's cross-rank input; -1 for none."""
    cost_code: list[int]
    """The action's :meth:`Program.cost_code_array` entry (index into a duration table)."""
    link: list[int]
    """The link its input crosses: ``edge + 1`` (0 for none; index into a transfer table)."""


@dataclass
class Timing:
    """What an engine computed: start and end of every compiled action, and the transfers."""

    starts: list[float]
    ends: list[float]
    transfers: list[tuple[int, float, float]] = field(default_factory=list)
    """``(consumer action index, start, end)`` of every transfer over a costly link."""

    @property
    def makespan(self) -> float:
        return max(self.ends, default=0.0)


class Program:
    """Per-rank action orders compiled to flat lists (index = global action number).

    Actions are numbered rank by rank in execution order, so ``rank_bounds[p]`` is the
    half-open index range of the ``p``-th rank in ``ranks``. Communication actions in the
    order are dropped: the engines model transfers themselves. The order may be given as
    Actions or in array form (:class:`~pipeoptim.plan.orders.OrderArrays`, what long runs
    are generated in); compiling is vectorised, so a million actions take a fraction of a
    second.
    """

    def __init__(
        self,
        order: Mapping[int, Sequence[Action | None]] | OrderArrays,
        micro_batches: int = 1,
        policy: WeightPolicy | None = None,
    ) -> None:
        self.micro_batches = micro_batches
        self.policy = policy
        self.arrays = order if isinstance(order, OrderArrays) else OrderArrays.from_order(order)
        self._order = None if isinstance(order, OrderArrays) else order
        a = self.arrays
        self.ranks: list[int] = list(a.ranks)
        bounds = a.bounds.tolist()
        self.rank_bounds: list[tuple[int, int]] = list(itertools.pairwise(bounds))
        self.size = a.size
        self.rank_array = a.rank_of()
        self.stage_rank: dict[int, int] = self._stage_ranks()
        self.num_stages = max(self.stage_rank, default=-1) + 1
        self.dep_array: IntArray = np.full(self.size, -1, dtype=np.int64)
        """Index of the one cross-rank action each action waits for, or -1."""
        self.edge_array: IntArray = np.full(self.size, -1, dtype=np.int64)
        """Link of that wait: ``2*k`` forward over edge k, ``2*k+1`` backward, -1 none."""
        self._compile_dependencies()
        self._versions: VersionReport | None = None
        self._flat_versions: tuple[list[int], list[int], list[bool]] | None = None
        self._steps: Steps | None = None
        self._codes: dict[bool, IntArray] = {}  # cost codes, with or without predictions
        self._predicted_step_codes: list[int] | None = None
        self._code_counts: dict[bool, IntArray] = {}
        self._first_stage_micro_batches: int | None = None
        self._last_updates: list[int] | None = None

    # Plain lists for the engines' per-action Python loops (indexing numpy arrays one
    # element at a time is several times slower), built on first use.
    @cached_property
    def stage(self) -> list[int]:
        return cast(list[int], self.arrays.stage.tolist())

    @cached_property
    def kind(self) -> list[int]:
        return cast(list[int], self.arrays.kind.tolist())

    @cached_property
    def mb(self) -> list[int]:
        return cast(list[int], self.arrays.mb.tolist())

    @cached_property
    def rank_of(self) -> list[int]:
        return cast(list[int], self.rank_array.tolist())

    @cached_property
    def dep(self) -> list[int]:
        return cast(list[int], self.dep_array.tolist())

    @cached_property
    def edge(self) -> list[int]:
        return cast(list[int], self.edge_array.tolist())

    @property
    def order(self) -> Mapping[int, Sequence[Action | None]]:
        """The order in Action form (built from the arrays when it was given that way)."""
        if self._order is None:
            self._order = self.arrays.to_order()
        return self._order

    # ------------------------------------------------------------------ compile
    def _stage_ranks(self) -> dict[int, int]:
        stage, rank = self.arrays.stage, self.rank_array
        if self.size == 0:
            return {}
        owner = np.full(int(stage.max()) + 1, -1, dtype=np.int64)
        owner[stage] = rank  # some rank of each stage; a second one shows below
        elsewhere = rank != owner[stage]
        if elsewhere.any():  # name the first action on a rank other than its stage's first
            stages, first = np.unique(stage, return_index=True)
            owner[stages] = rank[first]
            i = int(np.argmax(rank != owner[stage]))
            k = int(stage[i])
            raise ScheduleError(
                f"stage {k} has actions on rank {int(owner[k])} and rank {int(rank[i])}; "
                f"every stage must run on one rank (action {self._name(i)})"
            )
        stages = np.flatnonzero(owner >= 0)
        return dict(zip(stages.tolist(), owner[stages].tolist(), strict=True))

    def _compile_dependencies(self) -> None:
        """Vectorised :func:`~pipeoptim.plan.schedules.dependencies`: a dependency on
        another rank becomes the action's ``dep``; one on the same rank must come earlier
        in its order, or the rank would wait forever."""
        s, m = max(self.num_stages, 1), self.micro_batches
        stage, kind, mb = self.arrays.stage, self.arrays.kind, self.arrays.mb
        rank = self.rank_array
        passes = np.flatnonzero(kind != KIND_U)
        index = KeyIndex(((mb[passes] * s + stage[passes]) << 3) | kind[passes])
        twice = index.duplicate()
        if twice is not None:
            i, first = int(passes[twice[0]]), int(passes[twice[1]])
            raise ScheduleError(
                f"{self._name(i)} appears twice in the order (also as action {first}); "
                f"every F, B, I and W runs once per stage and micro-batch"
            )

        def find(at: IntArray, j: IntArray, k: IntArray, code: int, *other: int) -> IntArray:
            """The action of kind ``code`` (else of the first ``other`` kind found)."""
            found = index.find(((j * s + k) << 3) | code)
            for alt in other:
                found = np.where(found >= 0, found, index.find(((j * s + k) << 3) | alt))
            return np.where(found >= 0, passes[np.maximum(found, 0)], -1)

        late: list[tuple[int, int]] = []  # (action, a same-rank input it runs before)

        def link(at: IntArray, d: IntArray, edge: IntArray | None) -> None:
            has = d >= 0
            at, d = at[has], d[has]
            cross = rank[d] != rank[at]
            if edge is not None:
                self.dep_array[at[cross]] = d[cross]
                self.edge_array[at[cross]] = edge[has][cross]
            wrong = ~cross & (d > at)
            if wrong.any():
                q = int(np.argmax(wrong))
                late.append((int(at[q]), int(d[q])))

        f = np.flatnonzero((kind == KIND_F) & (stage > 0))
        link(f, find(f, mb[f], stage[f] - 1, KIND_F), 2 * (stage[f] - 1))
        b = np.flatnonzero((kind == KIND_B) | (kind == KIND_I))  # a backward's input gradient
        link(b, find(b, mb[b], stage[b], KIND_F), None)
        b = b[stage[b] < s - 1]
        link(b, find(b, mb[b], stage[b] + 1, KIND_B, KIND_I), 2 * stage[b] + 1)
        w = np.flatnonzero(kind == KIND_W)
        link(w, find(w, mb[w], stage[w], KIND_I), None)
        u = np.flatnonzero(kind == KIND_U)
        for q in range(m):
            link(u, find(u, mb[u] * m + q, stage[u], KIND_B, KIND_W), None)
        if late:
            i, d = min(late)
            r = int(rank[i])
            raise ScheduleError(
                f"rank {r} runs {self._name(i)} before {self._name(d)}, which it needs; "
                f"the rank would wait forever. Put {self._name(d)} first in rank {r}'s order"
            )

    def steps(self) -> Steps:
        """A topological order of the actions, with each step's inputs as earlier steps.

        The order depends only on the schedule, not on costs, so it is computed once; a
        schedule whose ranks wait for each other in a cycle raises :class:`ScheduleError`
        here. Actions are ordered by their step on a unit-time clock (:meth:`_levels`), so
        an engine walking the steps reads and writes its times nearly in sequence.
        """
        if self._steps is None:
            n = self.size
            inputs = np.where(self.dep_array >= 0, self.dep_array, n)  # n: the sentinel
            levels = self._levels(inputs)
            at = self._worklist() if levels is None else np.argsort(levels, kind="stable")
            position = np.empty(n + 1, dtype=np.int64)
            position[at] = np.arange(n, dtype=np.int64)
            position[n] = -1
            previous = np.arange(-1, n - 1, dtype=np.int64)
            previous[[lo for lo, hi in self.rank_bounds if hi > lo]] = n
            self._steps = Steps(
                at, position[:n], position[previous[at]].tolist(),
                position[inputs[at]].tolist(), self.cost_code_array()[at].tolist(),
                (self.edge_array[at] + 1).tolist(),
            )  # fmt: skip
        return self._steps

    def _levels(self, inputs: IntArray, max_sweeps: int = 32) -> IntArray | None:
        """Each action's step on a clock where every action takes one step: one more than
        the later of its rank's previous action and its cross-rank input.

        Sorting by it is a topological order. Computed by sweeping the ranks, down then up
        (forwards flow down, backwards up), each rank in one vectorised pass:
        ``level[i] = i + max over j <= i of (input level[j] + 1 - j)``. None when the
        sweeps do not settle (a cycle, or an unusual order): the worklist decides then.
        ``inputs`` is each action's cross-rank input, ``size`` where it has none.
        """
        n = self.size
        level = np.zeros(n + 1, dtype=np.int64)
        level[n] = -1  # the sentinel input: level -1 + 1 = 0 imposes nothing
        spans = [(lo, hi, np.arange(hi - lo, dtype=np.int64)) for lo, hi in self.rank_bounds]
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

    def _worklist(self) -> IntArray:
        """A topological order by running each rank until it blocks; raises on a deadlock."""
        n = self.size
        done = [False] * n
        dep = self.dep
        pos = [lo for lo, _ in self.rank_bounds]
        stop = [hi for _, hi in self.rank_bounds]
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
            raise self._deadlock(pos, stop)
        return np.asarray(steps, dtype=np.int64)

    def _deadlock(self, pos: list[int], stop: list[int]) -> ScheduleError:
        lines = [
            f"rank {r} waits at {self._name(pos[p])} for {self._name(self.dep[pos[p]])}"
            for p, r in enumerate(self.ranks)
            if pos[p] < stop[p]
        ]
        return ScheduleError(
            "schedule deadlocks: every rank waits for an action another rank has not run.\n"
            + "\n".join(lines)
            + "\nReorder the ranks' actions so each one's inputs run first."
        )

    def _name(self, i: int) -> str:
        return self.arrays.name(i)

    def describe(self, i: int) -> str:
        """The action's text form, e.g. ``"2F13"``."""
        return self._name(i)

    # ------------------------------------------------------------------ costs
    def durations(self, costs: CostModel, jitter: float = 0.0, seed: int = 0) -> list[float]:
        """Seconds of every action; with ``jitter`` > 0 each is multiplied by a seeded
        lognormal factor ``exp(jitter * z - jitter**2 / 2)`` (mean 1), drawn in index order,
        so a seed gives the same run in either engine."""
        if jitter < 0 or math.isnan(jitter):
            raise ScheduleError(f"jitter must be >= 0 (got {jitter}); pass e.g. --jitter 0.1")
        out: list[float] = self.duration_array(costs).tolist()
        if jitter > 0:
            rng = random.Random(seed)
            mu = -jitter * jitter / 2.0
            draw = rng.lognormvariate
            out = [d * draw(mu, jitter) for d in out]
        return out

    def duration_array(self, costs: CostModel) -> FloatArray:
        """:meth:`durations` without jitter, as an array."""
        table = np.array(self.duration_table(costs))
        return cast(FloatArray, table[self.duration_codes(any(costs.predict_s))])

    def transfer_times(self, costs: CostModel) -> list[float]:
        """Seconds each action's cross-rank input spends on its link (0.0 when none)."""
        table = np.array(self.transfer_table(costs))
        return cast(list[float], table[self.edge_array + 1].tolist())

    def cost_code_array(self) -> IntArray:
        """Per action ``kind * num_stages + stage``: its index in a [F..., B..., U..., I...,
        W...] table."""
        return self.arrays.kind * self.num_stages + self.arrays.stage

    def duration_codes(self, predicting: bool) -> IntArray:
        """Per action its index into :meth:`duration_table`: the cost code, moved to the
        predicted-forward entries (``5 * num_stages + stage``) for forwards the version
        analysis predicts when ``predicting`` (the costs have a prediction time)."""
        if predicting not in self._codes:
            codes = self.cost_code_array()
            if predicting:
                codes[self.versions().actions.predicted] += _KINDS * self.num_stages
            self._codes[predicting] = codes
        return self._codes[predicting]

    def duration_table(self, costs: CostModel) -> list[float]:
        """Seconds per cost code: ``[F..., B..., U..., I..., W..., predicted F...]`` of
        every stage (an update with its stage's all-reduce, :attr:`CostModel.update_total_s`;
        I and W the halves of the backward, :attr:`CostModel.backward_input_s` and
        :attr:`CostModel.backward_weight_s`; a recomputing stage's B and I also run the
        recomputed forward, :attr:`CostModel.recompute_s`).

        A predicted forward (code ``5 * num_stages + stage``, see :meth:`duration_codes`)
        costs its forward plus the prediction."""
        if costs.num_stages < self.num_stages:
            raise ScheduleError(
                f"the cost model has {costs.num_stages} stages but the schedule has "
                f"{self.num_stages}; build the costs for {self.num_stages} stages"
            )
        s = self.num_stages
        extra = [f + p for f, p in zip(costs.forward_s[:s], costs.predict_s[:s], strict=True)]
        backward, backward_input = costs.backward_s[:s], costs.backward_input_s[:s]
        if costs.recomputes:  # the backward (a split one's I) runs the forward again first
            again = costs.recompute_s[:s]
            backward = tuple(b + r for b, r in zip(backward, again, strict=True))
            backward_input = tuple(b + r for b, r in zip(backward_input, again, strict=True))
        return [
            *costs.forward_s[:s],
            *backward,
            *costs.update_total_s[:s],
            *backward_input,
            *costs.backward_weight_s[:s],
            *extra,
        ]

    def busy_seconds(self, costs: CostModel) -> tuple[dict[int, float], dict[int, float]]:
        """Compute seconds per stage and per rank without jitter, from how often each rank
        runs each cost code (counted once per program)."""
        s = self.num_stages
        predicting = any(costs.predict_s)
        if predicting not in self._code_counts:
            codes = self.duration_codes(predicting)
            self._code_counts[predicting] = np.stack(
                [np.bincount(codes[lo:hi], minlength=(_KINDS + 1) * s)
                 for lo, hi in self.rank_bounds]
            ) if self.rank_bounds else np.zeros((0, (_KINDS + 1) * s), dtype=np.int64)  # fmt: skip
        counts = self._code_counts[predicting]
        table = np.array(self.duration_table(costs))
        per_code = counts * table  # seconds per (rank, code)
        per_stage = per_code.sum(axis=0).reshape(_KINDS + 1, s).sum(axis=0)
        stage = {k: float(per_stage[k]) for k in sorted(self.stage_rank)}
        rank = {
            r: float(per_code[p].sum())
            for p, (r, (lo, hi)) in enumerate(zip(self.ranks, self.rank_bounds, strict=True))
            if hi > lo
        }
        return stage, rank

    def step_cost_codes(self, costs: CostModel) -> list[int]:
        """:meth:`duration_codes` in step order (:meth:`steps`)."""
        if not any(costs.predict_s):
            return self.steps().cost_code
        if self._predicted_step_codes is None:
            order = self.steps().order_array
            self._predicted_step_codes = self.duration_codes(True)[order].tolist()
        return self._predicted_step_codes

    def transfer_table(self, costs: CostModel) -> list[float]:
        """Seconds per link code of :attr:`Steps.link`: 0.0 for none, then for every edge
        its forward and its backward transfer."""
        table = [0.0]
        for e in range(max(self.num_stages - 1, 0)):
            table += [costs.transfer_s(e, False), costs.transfer_s(e, True)]
        return table

    def first_stage_micro_batches(self) -> int:
        """Forwards on the first stage: the micro-batches the run trains."""
        if self._first_stage_micro_batches is None:
            first = min(self.stage_rank, default=0)
            a = self.arrays
            self._first_stage_micro_batches = int(
                np.count_nonzero((a.kind == KIND_F) & (a.stage == first))
            )
        return self._first_stage_micro_batches

    # ------------------------------------------------------------------ versions
    def versions(self) -> VersionReport:
        """The version analysis of the order under the program's weight policy."""
        if self._versions is None:
            self._versions = analyze_order(
                self.arrays, self.policy or WeightPolicy.FLUSH, self.micro_batches
            )
        return self._versions

    def flat_versions(self) -> tuple[list[int], list[int], list[bool]]:
        """Per action: weight version used, prediction distance (F only), predicted flag.

        The version of a forward is the version its weights stand for (for a predicted
        forward the target it predicts), of a backward the weights it uses, of an update
        the version it is applied to.
        """
        if self._flat_versions is None:
            actions = self.versions().actions
            self._flat_versions = (
                actions.version.tolist(),
                actions.distance.tolist(),
                actions.predicted.tolist(),
            )
        return self._flat_versions

    # ------------------------------------------------------------------ output
    def last_stage_updates(self) -> list[int]:
        """Indices of the last stage's updates, in order."""
        if self._last_updates is None:
            last, a = self.num_stages - 1, self.arrays
            self._last_updates = np.flatnonzero((a.kind == KIND_U) & (a.stage == last)).tolist()
        return self._last_updates

    def events(
        self, timing: Timing, costs: CostModel, *, versions: bool = True
    ) -> list[TraceEvent]:
        """Trace events: one per compute action (rank order), then one per transfer.

        A transfer is a ``SEND_F``/``SEND_B`` event of the sending rank and stage, from the
        moment it takes the link to its arrival, with the bytes it carries.
        """
        if versions:
            version, distance, _ = self.flat_versions()
        else:
            version = distance = [0] * self.size
        starts, ends = timing.starts, timing.ends
        stage, kind, mb, rank_of = self.stage, self.kind, self.mb, self.rank_of
        act = costs.activation_bytes
        out = [
            TraceEvent(
                rank_of[i],
                stage[i],
                KIND_CODES[kind[i]],
                mb[i],
                starts[i],
                ends[i],
                version[i],
                act[stage[i]] if kind[i] == KIND_F else 0,
                distance[i],
            )
            for i in range(self.size)
        ]
        for i, t0, t1 in timing.transfers:
            d = self.dep[i]
            back = self.kind[i] in (KIND_B, KIND_I)  # a gradient travels back
            e = self.edge[i] >> 1
            size = (costs.send_backward_bytes if back else costs.send_forward_bytes)[e]
            out.append(
                TraceEvent(
                    rank_of[d],
                    stage[d],
                    "SEND_B" if back else "SEND_F",
                    mb[d],
                    t0,
                    t1,
                    version[d],
                    size,
                    0,
                )
            )
        return out
