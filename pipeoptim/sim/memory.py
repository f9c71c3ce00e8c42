"""Memory accounting per stage over time, for either engine's timing.

What a stage holds (bytes), following the method's weight policy as
:mod:`pipeoptim.plan.versions` defines it:

* ``weights``: the current weights, one copy, always;
* ``stash``: further weight copies. STASH (PipeDream) and DOUBLE_BUFFER (2BW) keep every
  version a micro-batch in flight ran its forward on, from that forward's start to its
  backward's end (the current version counted once); PREDICT keeps one predicted copy,
  allocated at the stage's first predicted forward and kept from then on (the buffer is
  reused); FLUSH keeps none;
* ``gradients``: one parameter-sized gradient buffer, from the stage's first backward
  after an update to the next update, which frees it (as the runtime's
  ``zero_grad(set_to_none=True)`` does);
* ``optimizer``: the optimizer state, always;
* ``activations``: one micro-batch's activations from its forward's start to its
  backward's end; where the backward is split, to the end of its weight half W (W still
  reads them; the input half I frees nothing), and the W, not the I, then plays the
  backward's part for the gradient buffer and the stash.

With activation recomputation (:mod:`pipeoptim.plan.recompute_costs`) ``activations``
are what a micro-batch keeps (the recomputed units' inputs in place of their
activations), a split backward holds the rebuilt activations from the start of its I to
the end of its W, and under PREDICT every in-flight micro-batch whose forward ran on
predicted weights holds a copy of the recomputed units' weights (counted in ``stash``)
from its forward's start to its backward's end.

Peaks therefore match :class:`~pipeoptim.plan.versions.VersionReport`: weight copies peak at
``weight_copies[stage]`` and activations at ``max_in_flight[stage]`` micro-batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pipeoptim.plan.methods import WeightPolicy
from pipeoptim.sim.costs import CostModel
from pipeoptim.sim.program import KIND_B, KIND_F, KIND_I, KIND_W, Program, Timing
from pipeoptim.trace import MemorySample

__all__ = ["MemoryReport", "StagePeak", "memory_report"]

CATEGORIES = ("weights", "stash", "gradients", "optimizer", "activations")


@dataclass(frozen=True)
class StagePeak:
    """The most one stage held at once."""

    stage: int
    rank: int
    bytes: int
    """Peak total bytes of the stage."""
    weight_copies: int
    """Most weight versions held at once (current, stashed and predicted)."""
    activations: int
    """Most micro-batches whose activations were held at once."""
    detail: dict[str, int] = field(default_factory=dict)
    """Breakdown at the moment of the peak."""


@dataclass
class MemoryReport:
    """Per-rank memory over time and per-stage peaks."""

    samples: list[MemorySample]
    """One sample per rank at every change (rank totals; detail by category and per
    stage as ``"stage:<k>"``)."""
    peaks: dict[int, StagePeak]
    """Keyed by stage."""

    def peak_bytes(self, stage: int | None = None) -> int:
        """Peak of one stage, or of the fullest stage."""
        if stage is not None:
            return self.peaks[stage].bytes
        return max((p.bytes for p in self.peaks.values()), default=0)


class _StageState:
    __slots__ = (
        "act",
        "current",
        "grads",
        "held",
        "holding",
        "inflight",
        "last",
        "opt",
        "param",
        "peak",
        "predicted",
        "rebuilding",
        "rebuilt",
        "stash",
        "total",
    )

    def __init__(self, param: int, opt: int, act: int, held: int = 0, rebuilt: int = 0) -> None:
        self.param, self.opt, self.grads, self.act = param, opt, 0, act
        self.held, self.rebuilt = held, rebuilt
        self.holding: set[int] = set()  # micro-batches holding the recomputed units' Ŵ
        self.rebuilding = 0  # split backwards between their I and their W
        self.inflight = 0
        self.current = 0
        self.stash: dict[int, int] = {}  # version -> micro-batches holding it
        self.predicted = False
        self.peak: tuple[int, int, int, dict[str, int]] = (-1, 1, 0, {})
        self.total = 0
        self.last: dict[str, int] = {}

    def copies(self) -> int:
        versions = len(self.stash) + (0 if self.current in self.stash else 1)
        return versions + (1 if self.predicted else 0)

    def detail(self) -> dict[str, int]:
        return {
            "weights": self.param,
            "stash": (self.copies() - 1) * self.param + len(self.holding) * self.held,
            "gradients": self.grads,
            "optimizer": self.opt,
            "activations": self.inflight * self.act + self.rebuilding * self.rebuilt,
        }

    def refresh(self) -> bool:
        """Recompute the totals and the peak; True when anything changed."""
        d = self.detail()
        if d == self.last:
            return False
        self.last = d
        self.total = sum(d.values())
        copies = self.copies()
        best, best_copies, best_act, _ = self.peak
        if self.total > best:
            self.peak = (self.total, max(best_copies, copies), max(best_act, self.inflight), d)
        else:
            self.peak = (best, max(best_copies, copies), max(best_act, self.inflight), self.peak[3])
        return True


def memory_report(
    program: Program, timing: Timing, costs: CostModel, *, samples: bool = True
) -> MemoryReport:
    """Walk each rank's actions in order with their times and account memory per stage."""
    policy = program.policy or WeightPolicy.FLUSH
    keeps = policy.keeps_past_versions
    holds = policy.reads_predicted  # a recomputation must meet the forward's Ŵ
    mb = program.mb
    version, _, predicted = program.flat_versions()
    starts, ends = timing.starts, timing.ends
    out: list[MemorySample] = []
    peaks: dict[int, StagePeak] = {}
    for r, (lo, hi) in zip(program.ranks, program.rank_bounds, strict=True):
        stages = sorted({program.stage[i] for i in range(lo, hi)})
        state = {
            k: _StageState(
                costs.param_bytes[k],
                costs.optimizer_state_bytes[k],
                costs.activation_bytes[k],
                costs.held_weight_bytes[k] if holds else 0,
                costs.rebuilt_activation_bytes[k],
            )
            for k in stages
        }
        for st in state.values():
            st.refresh()
        pending: list[MemorySample] = []

        def emit(
            time: float,
            rank: int = r,
            state: Mapping[int, _StageState] = state,
            pending: list[MemorySample] = pending,
        ) -> None:
            if not samples:
                return
            if len(state) == 1:
                ((k, st),) = state.items()
                detail = {**st.last, f"stage:{k}": st.total}
                total = st.total
            else:
                detail = dict.fromkeys(CATEGORIES, 0)
                for k, st in state.items():
                    for name, value in st.last.items():
                        detail[name] += value
                    detail[f"stage:{k}"] = st.total
                total = sum(st.total for st in state.values())
            sample = MemorySample(rank, time, total, detail)
            if pending and pending[-1].time == time:
                pending[-1] = sample
            else:
                pending.append(sample)

        emit(starts[lo] if hi > lo else 0.0)
        for i in range(lo, hi):
            st = state[program.stage[i]]
            c = program.kind[i]
            if c == KIND_F:
                st.inflight += 1
                if keeps:
                    st.stash[version[i]] = st.stash.get(version[i], 0) + 1
                if predicted[i]:
                    st.predicted = True
                    if st.held:
                        st.holding.add(mb[i])
                if st.refresh():
                    emit(starts[i])
            elif c == KIND_I:
                if st.rebuilt:  # the I recomputes: the rebuilt activations stay until the W
                    st.rebuilding += 1
                    if st.refresh():
                        emit(starts[i])
                continue  # the activations stay until the W
            elif c in (KIND_B, KIND_W):
                st.inflight -= 1
                if st.holding:
                    st.holding.discard(mb[i])
                if c == KIND_W and st.rebuilt:
                    st.rebuilding -= 1
                st.grads = st.param
                if keeps:
                    # STASH and DOUBLE_BUFFER run the backward on the stashed version.
                    v = version[i]
                    left = st.stash.get(v, 0) - 1
                    if left > 0:
                        st.stash[v] = left
                    else:
                        st.stash.pop(v, None)
                if st.refresh():
                    emit(ends[i])
            else:
                st.current += 1
                st.grads = 0
                if st.refresh():
                    emit(ends[i])
        out += pending
        for k, st in state.items():
            total, copies, act, detail = st.peak
            peaks[k] = StagePeak(k, r, total, copies, act, detail)
    return MemoryReport(out, peaks)
