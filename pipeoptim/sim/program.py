"""An action order compiled to flat lists, the common input of both engines.

The SimPy engine and the fast evaluator must agree to the last bit, so they share one
compilation (which action waits for which, over which link), one way to draw durations
(including seeded jitter) and one way to turn start/end times into a :class:`Trace`. Plain
lists of ints and floats indexed by a global action number keep both hot loops cheap: no
:class:`Action` hashing, no object per action.

Dependencies are those of :func:`pipeoptim.plan.schedules.dependencies` (F of stage k after
F of k-1; B of k after B of k+1 and its own F; U after its mini-batch's backwards). A
dependency on the same rank earlier in its order is implied by the rank running actions one
after the other, so only cross-rank dependencies are kept; one on the same rank *later* in
the order can never be met and is reported at compile time.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pipeoptim.errors import ScheduleError
from pipeoptim.plan.actions import Action, B, F, U
from pipeoptim.plan.methods import WeightPolicy
from pipeoptim.plan.versions import VersionReport, analyze_versions
from pipeoptim.sim.costs import CostModel
from pipeoptim.trace import TraceEvent

__all__ = ["KIND_B", "KIND_CODES", "KIND_F", "KIND_U", "Program", "Timing"]

KIND_F, KIND_B, KIND_U = 0, 1, 2
KIND_CODES = ("F", "B", "U")
"""Trace kind code of each compiled kind."""


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
    order are dropped: the engines model transfers themselves.
    """

    def __init__(
        self,
        order: Mapping[int, Sequence[Action | None]],
        micro_batches: int = 1,
        policy: WeightPolicy | None = None,
    ) -> None:
        self.micro_batches = micro_batches
        self.policy = policy
        self.order = order
        self.ranks: list[int] = sorted(self.order)
        self.stage: list[int] = []
        self.kind: list[int] = []
        self.mb: list[int] = []
        self.rank_bounds: list[tuple[int, int]] = []
        self.stage_rank: dict[int, int] = {}
        stage, kind, mb = self.stage, self.kind, self.mb
        for r in self.ranks:
            lo = len(stage)
            owned: set[int] = set()
            for a in order[r]:
                if a is None:
                    continue
                c = a.kind
                code = KIND_F if c is F else KIND_B if c is B else KIND_U if c is U else -1
                if code < 0:
                    continue  # communication: the engines model transfers themselves
                k = a.stage
                if k not in owned:
                    owner = self.stage_rank.setdefault(k, r)
                    if owner != r:
                        raise ScheduleError(
                            f"stage {k} has actions on rank {owner} and rank {r}; every "
                            f"stage must run on one rank (action {a})"
                        )
                    owned.add(k)
                stage.append(k)
                kind.append(code)
                mb.append(a.mb)
            self.rank_bounds.append((lo, len(stage)))
        self.num_stages = max(self.stage_rank, default=-1) + 1
        self.size = len(stage)
        self.rank_of: list[int] = [0] * self.size
        for r, (lo, hi) in zip(self.ranks, self.rank_bounds, strict=True):
            self.rank_of[lo:hi] = [r] * (hi - lo)
        self.dep: list[int] = [-1] * self.size
        """Index of the one cross-rank action each action waits for, or -1."""
        self.edge: list[int] = [-1] * self.size
        """Link of that wait: ``2*k`` forward over edge k, ``2*k+1`` backward, -1 none."""
        self._compile_dependencies()
        self._versions: VersionReport | None = None
        self._flat_versions: tuple[list[int], list[int], list[bool]] | None = None
        self._steps: list[tuple[int, int, int]] | None = None
        self._codes: list[int] | None = None
        self._last_updates: list[int] | None = None

    # ------------------------------------------------------------------ compile
    def _compile_dependencies(self) -> None:
        s, m = self.num_stages, self.micro_batches
        index: dict[int, int] = {}  # ((mb * S + stage) * 2 + kind) -> action index
        stage, kind, mb = self.stage, self.kind, self.mb
        for i in range(self.size):
            if kind[i] != KIND_U:
                key = ((mb[i] * s + stage[i]) << 1) | kind[i]
                if key in index:
                    raise ScheduleError(
                        f"{self._name(i)} appears twice in the order (also as action "
                        f"{index[key]}); every F and B runs once per stage and micro-batch"
                    )
                index[key] = i
        dep, edge, rank_of = self.dep, self.edge, self.rank_of
        get = index.get
        last = s - 1
        for i in range(self.size):
            k, c, j, r = stage[i], kind[i], mb[i], rank_of[i]
            if c == KIND_F:
                if k:
                    d = get((j * s + k - 1) << 1)
                    if d is not None:
                        if rank_of[d] != r and dep[i] < 0:
                            dep[i], edge[i] = d, 2 * (k - 1)
                        else:
                            self._link(i, d, 2 * (k - 1))
            elif c == KIND_B:
                d = get((j * s + k) << 1)
                if d is not None and (rank_of[d] != r or d > i):
                    self._link(i, d, -1)
                if k < last:
                    d = get(((j * s + k + 1) << 1) | KIND_B)
                    if d is not None:
                        if rank_of[d] != r and dep[i] < 0:
                            dep[i], edge[i] = d, 2 * k + 1
                        else:
                            self._link(i, d, 2 * k + 1)
            else:
                for q in range(m):
                    d = get((((j * m + q) * s + k) << 1) | KIND_B)
                    if d is not None and (rank_of[d] != r or d > i):
                        self._link(i, d, -1)

    def steps(self) -> list[tuple[int, int, int]]:
        """A topological order of the actions as ``(action, previous on its rank, input)``.

        ``previous`` and ``input`` are ``size`` (a sentinel) where there is none. The order
        depends only on the schedule, not on costs, so it is computed once; a schedule whose
        ranks wait for each other in a cycle raises :class:`ScheduleError` here.
        """
        if self._steps is None:
            n = self.size
            done = [False] * n
            dep = self.dep
            pos = [lo for lo, _ in self.rank_bounds]
            stop = [hi for _, hi in self.rank_bounds]
            waiter = [-1] * n  # the rank (position) blocked on each action, if any
            more: dict[int, list[int]] = {}
            ready = [p for p in range(len(pos)) if pos[p] < stop[p]]
            steps: list[tuple[int, int, int]] = []
            add = steps.append
            # A worklist: a rank runs until it blocks, and is woken by the action it waits
            # for. Linear in the actions (sweeping every rank until nothing moves is
            # quadratic in the ranks: a backward crosses one rank per sweep).
            while ready:
                p = ready.pop()
                i, e = pos[p], stop[p]
                prev = i - 1 if i > self.rank_bounds[p][0] else n
                while i < e:
                    d = dep[i]
                    if d >= 0 and not done[d]:
                        if waiter[d] < 0:
                            waiter[d] = p
                        else:  # a second rank waits for the same action (rare)
                            more.setdefault(d, []).append(p)
                        break
                    done[i] = True
                    add((i, prev, d if d >= 0 else n))
                    if waiter[i] >= 0:
                        ready.append(waiter[i])
                        ready.extend(more.pop(i, ()))
                    prev = i
                    i += 1
                pos[p] = i
            if len(steps) < n:
                raise self._deadlock(pos, stop)
            self._steps = steps
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

    def _link(self, i: int, d: int, e: int) -> None:
        """Record that action ``i`` waits for action ``d`` (slow path: checks)."""
        r = self.rank_of[i]
        if self.rank_of[d] == r:
            if d > i:
                raise ScheduleError(
                    f"rank {r} runs {self._name(i)} before {self._name(d)}, which it needs; "
                    f"the rank would wait forever. Put {self._name(d)} first in rank {r}'s "
                    f"order"
                )
            return
        if self.dep[i] >= 0 or e < 0:
            other = f"{self._name(self.dep[i])} and " if self.dep[i] >= 0 else ""
            raise ScheduleError(
                f"{self._name(i)} waits for {other}{self._name(d)} on another rank; the "
                f"engines support one cross-rank dependency per action, on an adjacent stage, "
                f"and a stage's forward, backward and update on one rank"
            )
        self.dep[i], self.edge[i] = d, e

    def _name(self, i: int) -> str:
        return f"{self.stage[i]}{KIND_CODES[self.kind[i]]}{self.mb[i]}"

    def describe(self, i: int) -> str:
        """The action's text form, e.g. ``"2F13"``."""
        return self._name(i)

    # ------------------------------------------------------------------ costs
    def durations(self, costs: CostModel, jitter: float = 0.0, seed: int = 0) -> list[float]:
        """Seconds of every action; with ``jitter`` > 0 each is multiplied by a seeded
        lognormal factor ``exp(jitter * z - jitter**2 / 2)`` (mean 1), drawn in index order,
        so a seed gives the same run in either engine."""
        if costs.num_stages < self.num_stages:
            raise ScheduleError(
                f"the cost model has {costs.num_stages} stages but the schedule has "
                f"{self.num_stages}; build the costs for {self.num_stages} stages"
            )
        s = self.num_stages
        table = [*costs.forward_s[:s], *costs.backward_s[:s], *costs.update_s[:s]]
        out = list(map(table.__getitem__, self.cost_codes()))
        if any(costs.predict_s):
            _, _, predicted = self.flat_versions()
            extra, stage = costs.predict_s, self.stage
            for i in range(self.size):
                if predicted[i]:
                    out[i] += extra[stage[i]]
        if jitter < 0 or math.isnan(jitter):
            raise ScheduleError(f"jitter must be >= 0 (got {jitter}); pass e.g. --jitter 0.1")
        if jitter > 0:
            rng = random.Random(seed)
            mu = -jitter * jitter / 2.0
            draw = rng.lognormvariate
            out = [d * draw(mu, jitter) for d in out]
        return out

    def transfer_times(self, costs: CostModel) -> list[float]:
        """Seconds each action's cross-rank input spends on its link (0.0 when none)."""
        per_edge: list[float] = []
        for e in range(max(self.num_stages - 1, 0)):
            per_edge += [costs.transfer_s(e, False), costs.transfer_s(e, True)]
        per_edge.append(0.0)  # edge -1 (no cross-rank input) reads this last entry
        return list(map(per_edge.__getitem__, self.edge))

    def cost_codes(self) -> list[int]:
        """Per action ``kind * num_stages + stage``: its index in a [F..., B..., U...] table."""
        if self._codes is None:
            s = self.num_stages
            self._codes = [c * s + k for c, k in zip(self.kind, self.stage, strict=True)]
        return self._codes

    def first_stage_micro_batches(self) -> int:
        """Forwards on the first stage: the micro-batches the run trains."""
        first = min(self.stage_rank, default=0)
        return self.cost_codes().count(first)

    # ------------------------------------------------------------------ versions
    def versions(self) -> VersionReport:
        """The version analysis of the order under the program's weight policy."""
        if self._versions is None:
            self._versions = analyze_versions(
                self.order, self.policy or WeightPolicy.FLUSH, self.micro_batches
            )
        return self._versions

    def flat_versions(self) -> tuple[list[int], list[int], list[bool]]:
        """Per action: weight version used, prediction distance (F only), predicted flag.

        The version of a forward is the version its weights stand for (for a predicted
        forward the target it predicts), of a backward the weights it uses, of an update
        the version it is applied to.
        """
        if self._flat_versions is None:
            report = self.versions()
            version, distance, predicted = [0] * self.size, [0] * self.size, [False] * self.size
            passes, updates = report.passes, report.updates
            for i in range(self.size):
                key = (self.stage[i], self.mb[i])
                c = self.kind[i]
                if c == KIND_F:
                    p = passes[key]
                    version[i], distance[i], predicted[i] = (
                        p.forward_version,
                        p.distance,
                        p.predicted,
                    )
                elif c == KIND_B:
                    version[i] = passes[key].backward_version
                elif key in updates:
                    version[i] = updates[key].applied_to
            self._flat_versions = (version, distance, predicted)
        return self._flat_versions

    # ------------------------------------------------------------------ output
    def last_stage_updates(self) -> list[int]:
        """Indices of the last stage's updates, in order."""
        if self._last_updates is None:
            code = 2 * self.num_stages + self.num_stages - 1
            self._last_updates = [i for i, c in enumerate(self.cost_codes()) if c == code]
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
            back = self.kind[i] == KIND_B
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
