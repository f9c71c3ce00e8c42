"""Version analysis: which weight version every forward and backward of a schedule uses.

Derived from the schedule, never hard-coded: the prediction distance ``s(k, t)`` is the
number of updates stage k performs between mini-batch t's forward and its backward, so
the same code gives ``min(t, P-1-k)`` for asynchronous 1F1B and the right value for any
micro-batched or interleaved schedule. ``W^(j)`` is a stage's weights after j updates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pipeoptim.errors import ScheduleError
from pipeoptim.plan.actions import Action, B, F, U
from pipeoptim.plan.methods import WeightPolicy


@dataclass(frozen=True)
class MicroBatchVersions:
    """The versions one micro-batch met on one stage."""

    stage: int
    mb: int
    mini_batch: int
    forward_base: int
    """Updates the stage had made when the forward ran (the weights actually present)."""
    forward_version: int
    """Version the forward's weights stand for: the stash, the buffer, or the prediction target."""
    backward_version: int
    """Version the backward's weights are."""
    distance: int
    """s: updates the stage made between this forward and its backward."""
    predicted: bool
    """The forward ran on predicted weights (PREDICT policy and s > 0)."""

    @property
    def inconsistency(self) -> int:
        """Versions between forward and backward weights that nothing compensates."""
        return self.backward_version - self.forward_version


@dataclass(frozen=True)
class UpdateVersions:
    """One optimizer update of one stage."""

    stage: int
    mini_batch: int
    applied_to: int
    """Version the update is applied to (produces ``applied_to + 1``)."""
    gradient_version: int
    """Oldest weight version the applied gradient was computed on."""

    @property
    def staleness(self) -> int:
        return self.applied_to - self.gradient_version


@dataclass
class VersionReport:
    """Everything about weight versions in one schedule under one weight policy."""

    policy: WeightPolicy
    micro_batches: int
    passes: dict[tuple[int, int], MicroBatchVersions] = field(default_factory=dict)
    """Keyed by (stage, global micro-batch id)."""
    updates: dict[tuple[int, int], UpdateVersions] = field(default_factory=dict)
    """Keyed by (stage, mini-batch)."""
    weight_copies: dict[int, int] = field(default_factory=dict)
    """Most weight versions a stage holds at once (predicted copy included)."""
    max_in_flight: dict[int, int] = field(default_factory=dict)
    """Most micro-batches whose forward ran and backward has not (activations kept)."""

    @property
    def stages(self) -> list[int]:
        return sorted(self.weight_copies)

    def distance(self, stage: int, mini_batch: int) -> int:
        """s(k, t): the largest prediction distance among the micro-batches of t."""
        m = self.micro_batches
        return max(self.passes[(stage, mini_batch * m + j)].distance for j in range(m))

    def max_distance(self, stage: int) -> int:
        return max((v.distance for (k, _), v in self.passes.items() if k == stage), default=0)

    def max_staleness(self, stage: int) -> int:
        return max((u.staleness for (k, _), u in self.updates.items() if k == stage), default=0)

    def max_inconsistency(self, stage: int) -> int:
        return max(
            (abs(v.inconsistency) for (k, _), v in self.passes.items() if k == stage), default=0
        )


def prediction_distance(s: int, offset: int = 0) -> int:
    """The distance a predictor uses: the derived ``s`` shifted by a constant option.

    The public reference code of PipeOptim predicts ``D - rank`` steps, one more than
    the derived steady-state ``s = D - 1 - rank``; ``offset=1`` reproduces it.
    """
    return max(0, s + offset)


def analyze_versions(
    schedule: Mapping[int, Sequence[Action | None]],
    policy: WeightPolicy,
    micro_batches: int = 1,
) -> VersionReport:
    """Walk every stage's actions in execution order and apply ``policy``."""
    per_stage: dict[int, list[Action]] = {}
    for acts in schedule.values():
        for a in acts:
            if a is not None:
                per_stage.setdefault(a.stage, []).append(a)
    report = VersionReport(policy, micro_batches)
    for stage in sorted(per_stage):
        _analyze_stage(stage, per_stage[stage], policy, micro_batches, report)
    return report


def _analyze_stage(
    stage: int,
    actions: list[Action],
    policy: WeightPolicy,
    m: int,
    report: VersionReport,
) -> None:
    # First pass: the update count at each forward and each backward.
    current = 0
    at_forward: dict[int, int] = {}
    at_backward: dict[int, int] = {}
    for a in actions:
        if a.kind is F:
            at_forward[a.mb] = current
        elif a.kind is B:
            at_backward[a.mb] = current
        elif a.kind is U:
            current += 1
    for mb, base in at_forward.items():
        if mb not in at_backward:
            raise ScheduleError(f"stage {stage}: {stage}F{mb} has no backward {stage}B{mb}")
        t = mb // m
        s = at_backward[mb] - base
        if policy is WeightPolicy.PREDICT:
            fwd = bwd = at_backward[mb]
        elif policy is WeightPolicy.DOUBLE_BUFFER:
            fwd = bwd = max(t - 1, 0)
            if not fwd <= base <= fwd + 1 or at_backward[mb] > fwd + 1:
                raise ScheduleError(
                    f"stage {stage}: mini-batch {t} must run on W^({fwd}) (one version "
                    f"behind), but {stage}F{mb} runs after {base} updates and {stage}B{mb} "
                    f"after {at_backward[mb]}, so two buffers cannot hold it; use at least "
                    f"as many micro-batches as stages"
                )
        else:
            fwd = bwd = base
        report.passes[(stage, mb)] = MicroBatchVersions(
            stage, mb, t, base, fwd, bwd, s, policy is WeightPolicy.PREDICT and s > 0
        )
    # Second pass: updates, copies held and activations in flight over time.
    keeps_versions = policy in (WeightPolicy.STASH, WeightPolicy.DOUBLE_BUFFER)
    current = 0
    in_flight: set[int] = set()
    stashed: dict[int, int] = {}  # mb -> version kept for its backward
    copies = in_flight_max = 0
    for a in actions:
        if a.kind is F:
            v = report.passes[(stage, a.mb)]
            in_flight.add(a.mb)
            if keeps_versions:
                stashed[a.mb] = v.forward_version
            extra = 1 if v.predicted else 0  # the predicted copy exists during the forward
            copies = max(copies, len(set(stashed.values()) | {current}) + extra)
            in_flight_max = max(in_flight_max, len(in_flight))
        elif a.kind is B:
            in_flight.discard(a.mb)
            stashed.pop(a.mb, None)
        elif a.kind is U:
            grads = [report.passes[(stage, a.mb * m + j)] for j in range(m)]
            report.updates[(stage, a.mb)] = UpdateVersions(
                stage, a.mb, current, min(g.backward_version for g in grads)
            )
            current += 1
            copies = max(copies, len(set(stashed.values()) | {current}))
    report.weight_copies[stage] = max(copies, 1)
    report.max_in_flight[stage] = in_flight_max
