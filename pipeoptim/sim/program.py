"""An action order compiled to flat lists, the common input of both engines.

The SimPy engine and the fast evaluator must agree to the last bit, so they share one
compilation (which action waits for which, over which link), one way to draw durations
(including seeded jitter) and one way to turn start/end times into a :class:`Trace`. Plain
lists of ints and floats indexed by a global action number keep both hot loops cheap: no
:class:`Action` hashing, no object per action.

Dependencies are compiled by :mod:`pipeoptim.sim.dependencies` (only cross-rank ones are
kept: a rank runs its actions one after the other) and the cost-independent topological
order both engines' times are walked in by :mod:`pipeoptim.sim.steps`.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import cast

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
    OrderArrays,
)
from pipeoptim.plan.versions import BoolArray, VersionReport, analyze_order
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.dependencies import compile_dependencies
from pipeoptim.sim.steps import Steps, flat_buffer, topological_steps
from pipeoptim.trace import TraceEvent

__all__ = ["KIND_B", "KIND_CODES", "KIND_F", "KIND_I", "KIND_U", "KIND_W", "Program", "Timing"]

_KINDS = len(KIND_CODES)
"""Kinds with a duration of their own: the cost table has one block of stages per kind,
then the forwards that write a prediction, then the updates that compute the predictor's
kept Δ (:data:`_BLOCKS` in all)."""
_BLOCKS = _KINDS + 2


FloatArray = npt.NDArray[np.float64]


def _code_key(costs: CostModel) -> tuple[bool, bool]:
    """Which cost codes ``costs`` needs: (predicted forwards or the updates before them
    cost more, messages cost)."""
    return any(costs.predict_s) or any(costs.prediction_setup_s), costs.charges_messages


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
        dep, edge = compile_dependencies(
            a.kind, a.mb, a.stage, self.rank_array, self.num_stages, micro_batches, self._name
        )
        self.dep_array: IntArray = dep
        """Index of the one cross-rank action each action waits for, or -1."""
        self.edge_array: IntArray = edge
        """Link of that wait: ``2*k`` forward over edge k, ``2*k+1`` backward, -1 none."""
        self._versions: VersionReport | None = None
        self._prediction_writes: BoolArray | None = None
        self._prediction_setups: BoolArray | None = None
        self._flat_versions: tuple[list[int], list[int], list[bool]] | None = None
        self._steps: Steps | None = None
        # cost codes by (predicting, charging messages): see duration_codes
        self._codes: dict[tuple[bool, bool], IntArray] = {}
        self._step_codes: dict[tuple[bool, bool], Sequence[int]] = {}
        self._code_counts: dict[tuple[bool, bool], IntArray] = {}
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

    def steps(self) -> Steps:
        """A topological order of the actions, with each step's inputs as earlier steps
        (:mod:`pipeoptim.sim.steps`).

        The order depends only on the schedule, not on costs, so it is computed once; a
        schedule whose ranks wait for each other in a cycle raises :class:`ScheduleError`
        here.
        """
        if self._steps is None:
            self._steps = topological_steps(
                self.dep_array, self.edge_array, self.cost_code_array(), self.rank_bounds,
                self._deadlock,
            )  # fmt: skip
        return self._steps

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

    def stuck_error(self, ends: Sequence[float]) -> ScheduleError:
        """The deadlock of a run that left actions unfinished (``ends`` below 0)."""
        lines = []
        for r, (lo, hi) in zip(self.ranks, self.rank_bounds, strict=True):
            stuck = next((i for i in range(lo, hi) if ends[i] < 0.0), None)
            if stuck is not None:
                waits = self.dep[stuck]
                lines.append(f"rank {r} waits at {self._name(stuck)} for {self._name(waits)}")
        return ScheduleError(
            "schedule deadlocks: every rank waits for an action another rank has not run.\n"
            + "\n".join(lines)
            + "\nReorder the ranks' actions so dependencies run first."
        )

    def consumers(self) -> list[int]:
        """The action on another rank each action's output feeds (-1: none)."""
        feeds = [-1] * self.size
        for i, d in enumerate(self.dep):
            if d >= 0:
                feeds[d] = i
        return feeds

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
        return cast(FloatArray, table[self.duration_codes(*_code_key(costs))])

    def transfer_times(self, costs: CostModel) -> list[float]:
        """Seconds each action's cross-rank input spends on its link (0.0 when none)."""
        table = np.array(self.transfer_table(costs))
        return cast(list[float], table[self.edge_array + 1].tolist())

    def cost_code_array(self) -> IntArray:
        """Per action ``kind * num_stages + stage``: its index in a [F..., B..., U..., I...,
        W...] table."""
        return self.arrays.kind * self.num_stages + self.arrays.stage

    def prediction_writes(self) -> BoolArray:
        """Per action whether it writes a prediction Ŵ: a predicted forward whose stage has
        not already written the Ŵ of its distance since the stage's last update. Between two
        updates Ŵ depends on the distance alone, and the runtime writes it once per run of
        forwards that predict the same distance (``Stage._write_prediction``): XPipe's
        micro-batches of one mini-batch share one; PipeOptim's forwards, one per update,
        each write their own."""
        if self._prediction_writes is None:
            a, actions = self.arrays, self.versions().actions
            # each stage's actions in execution order (a rank's are numbered in its order)
            order = np.argsort(a.stage, kind="stable")
            updates = np.cumsum(a.kind[order] == KIND_U)  # differences count a stage's own
            found = np.flatnonzero(actions.predicted[order])
            stage = a.stage[order][found]
            made = updates[found]
            distance = actions.distance[order][found]
            # a predicted forward writes unless the stage's previous one predicted the same
            # distance with no update between
            fresh = np.ones(found.size, dtype=bool)
            fresh[1:] = (
                (stage[1:] != stage[:-1])
                | (made[1:] != made[:-1])
                | (distance[1:] != distance[:-1])
            )
            writes = np.zeros(a.size, dtype=bool)
            writes[order[found[fresh]]] = True
            self._prediction_writes = writes
        return self._prediction_writes

    def prediction_setups(self) -> BoolArray:
        """Per action whether it is an update after which its stage writes a prediction
        before its next update: there the runtime computes the predictor's kept Δ, at the
        end of the update (``Stage._prepare_deltas``), once for every write that follows."""
        if self._prediction_setups is None:
            a = self.arrays
            order = np.argsort(a.stage, kind="stable")
            stage, kind = a.stage[order], a.kind[order]
            updates = np.cumsum(kind == KIND_U)  # a write follows the update of equal count
            writes = np.flatnonzero(self.prediction_writes()[order])
            at = np.flatnonzero(kind == KIND_U)
            span = int(updates[-1]) + 1 if updates.size else 1
            read = stage[writes] * span + updates[writes]
            setups = np.zeros(a.size, dtype=bool)
            # a key of another stage's update (none of its own before the write) never matches
            setups[order[at[np.isin(stage[at] * span + updates[at], read)]]] = True
            self._prediction_setups = setups
        return self._prediction_setups

    def duration_codes(self, predicting: bool, messages: bool = False) -> IntArray:
        """Per action its index into :meth:`duration_table`: the cost code, moved to the
        predicted-forward entries (``5 * num_stages + stage``) for forwards that write a
        prediction (:meth:`prediction_writes`) and updates to the entries with Δ
        (``6 * num_stages + stage``, :meth:`prediction_setups`) when ``predicting`` (the
        costs have a prediction time; a forward on a Ŵ already written costs a forward),
        and when
        ``messages`` (the costs charge each message) into the block of its messages: one
        block of ``7 * num_stages`` codes each for an action that sends a message to another
        rank, receives one, or both (:meth:`message_roles`)."""
        key = (predicting, messages)
        if key not in self._codes:
            codes = self.cost_code_array()
            if predicting:
                codes[self.prediction_writes()] += _KINDS * self.num_stages
                codes[self.prediction_setups()] += (_KINDS + 1 - KIND_U) * self.num_stages
            if messages:
                codes += self.message_roles() * (_BLOCKS * self.num_stages)
            self._codes[key] = codes
        return self._codes[key]

    def message_roles(self) -> IntArray:
        """Per action 1 if its output goes to another rank (it sends a message), plus 2 if
        it waits for an input from another rank (it receives one)."""
        roles = np.where(self.dep_array >= 0, 2, 0)
        roles[self.dep_array[self.dep_array >= 0]] += 1
        return roles

    def duration_table(self, costs: CostModel) -> list[float]:
        """Seconds per cost code: ``[F..., B..., U..., I..., W..., predicted F..., U with
        Δ...]`` of
        every stage (an update with its stage's all-reduce, :attr:`CostModel.update_total_s`;
        I and W the halves of the backward, :attr:`CostModel.backward_input_s` and
        :attr:`CostModel.backward_weight_s`; a recomputing stage's B and I also run the
        recomputed forward, :attr:`CostModel.recompute_s`).

        A forward that writes a prediction (code ``5 * num_stages + stage``, see
        :meth:`duration_codes` and :meth:`prediction_writes`) costs its forward plus the
        prediction (:attr:`CostModel.predict_s`); a predicted forward on the Ŵ its stage
        already wrote, its forward. An update after which its stage writes a prediction
        (code ``6 * num_stages + stage``, :meth:`prediction_setups`) costs the update plus
        the predictor's kept Δ (:attr:`CostModel.prediction_setup_s`). Where the costs have
        a fixed time per action (:attr:`CostModel.action_s`) each block adds its kind's (a
        predicted forward the F's, an update with Δ the U's). Where the costs charge messages
        (:attr:`CostModel.charges_messages`), three more blocks follow: the same seconds
        plus :attr:`CostModel.message_send_s`, plus :attr:`CostModel.message_receive_s`,
        and plus both (the sending and receiving rank's fixed time per message)."""
        if costs.num_stages < self.num_stages:
            raise ScheduleError(
                f"the cost model has {costs.num_stages} stages but the schedule has "
                f"{self.num_stages}; build the costs for {self.num_stages} stages"
            )
        s = self.num_stages
        extra = [f + p for f, p in zip(costs.forward_s[:s], costs.predict_s[:s], strict=True)]
        update = costs.update_total_s[:s]
        setup = [u + d for u, d in zip(update, costs.prediction_setup_s[:s], strict=True)]
        backward, backward_input = costs.backward_s[:s], costs.backward_input_s[:s]
        if costs.recomputes:  # the backward (a split one's I) runs the forward again first
            again = costs.recompute_s[:s]
            backward = tuple(b + r for b, r in zip(backward, again, strict=True))
            backward_input = tuple(b + r for b, r in zip(backward_input, again, strict=True))
        blocks = [
            costs.forward_s[:s],
            backward,
            update,
            backward_input,
            costs.backward_weight_s[:s],
            extra,
            setup,
        ]
        if costs.action_s:  # the runtime's own work around each action, per kind (F for F')
            fixed = (*costs.action_s, costs.action_s[KIND_F], costs.action_s[KIND_U])
            blocks = [tuple(d + a for d in block) for block, a in zip(blocks, fixed, strict=True)]
        table = [d for block in blocks for d in block]
        if not costs.charges_messages:
            return table
        send, receive = costs.message_send_s, costs.message_receive_s
        return [
            *table,
            *(d + send for d in table),
            *(d + receive for d in table),
            *(d + send + receive for d in table),
        ]

    def busy_seconds(self, costs: CostModel) -> tuple[dict[int, float], dict[int, float]]:
        """Compute seconds per stage and per rank without jitter, from how often each rank
        runs each cost code (counted once per program)."""
        s = self.num_stages
        key = _code_key(costs)
        table = np.array(self.duration_table(costs))
        if key not in self._code_counts:
            codes = self.duration_codes(*key)
            self._code_counts[key] = np.stack(
                [np.bincount(codes[lo:hi], minlength=len(table)) for lo, hi in self.rank_bounds]
            ) if self.rank_bounds else np.zeros((0, len(table)), dtype=np.int64)  # fmt: skip
        counts = self._code_counts[key]
        per_code = counts * table  # seconds per (rank, code)
        per_stage = per_code.sum(axis=0).reshape(-1, s).sum(axis=0)
        stage = {k: float(per_stage[k]) for k in sorted(self.stage_rank)}
        rank = {
            r: float(per_code[p].sum())
            for p, (r, (lo, hi)) in enumerate(zip(self.ranks, self.rank_bounds, strict=True))
            if hi > lo
        }
        return stage, rank

    def step_cost_codes(self, costs: CostModel) -> Sequence[int]:
        """:meth:`duration_codes` in step order (:meth:`steps`)."""
        key = _code_key(costs)
        if key == (False, False):
            return self.steps().cost_code
        if key not in self._step_codes:
            order = self.steps().order_array
            self._step_codes[key] = flat_buffer(self.duration_codes(*key)[order])
        return self._step_codes[key]

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
