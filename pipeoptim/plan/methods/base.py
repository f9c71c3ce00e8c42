"""A method as an object: its schedule, its size rules, its weight-version rule, the policy
each of its stages follows, and the questions the rest of the package asks it.

The raw fields of :class:`Method` are how a method module declares a method; everything
outside ``plan/methods/`` asks the questions (``flushes``, ``micro_batches_for``,
``stage_policy(...).forward_reads``, ...) so that a new method changes one module and one
registry line, not every reader. The weight-version rule is the project's
"weight-version semantics" (docs/architecture.md, "Adding a method");
:mod:`pipeoptim.plan.versions` applies it to any schedule, the runtime's stage implements
it, and the simulator's memory model counts the copies it keeps.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, overload

from pipeoptim.errors import PlanError
from pipeoptim.plan import schedules
from pipeoptim.plan.actions import Schedule
from pipeoptim.plan.limits import WorkEstimate, check_grid
from pipeoptim.plan.orders import OrderArrays
from pipeoptim.plan.schedules import Order
from pipeoptim.plan.shape import Shape

__all__ = [
    "REGISTERED",
    "BackwardReads",
    "CopiesRule",
    "ForwardReads",
    "Method",
    "SlotsRule",
    "StagePolicy",
    "WeightPolicy",
]


class WeightPolicy(str, enum.Enum):
    """Which weights a forward and a backward read."""

    FLUSH = "flush"
    """Synchronous: every micro-batch of mini-batch t runs on W^(t); one copy."""
    STASH = "stash"
    """PipeDream: the forward reads the latest version and stashes it for its backward."""
    DOUBLE_BUFFER = "double-buffer"
    """PipeDream-2BW: all micro-batches of t read W^(t-1) (one behind); two buffers."""
    PREDICT = "predict"
    """Forward reads predicted weights of the version its backward will meet."""

    # The questions the stage, the simulator and the risk model ask of a rule, so that
    # no code outside the methods and the version analysis compares the members.
    @property
    def keeps_one_version(self) -> bool:
        """Every pass of mini-batch t reads W^(t): no update between a micro-batch's passes."""
        return self is WeightPolicy.FLUSH

    @property
    def keeps_past_versions(self) -> bool:
        """A stage keeps versions older than the live one for later passes (a stash, or the
        second buffer)."""
        return self in (WeightPolicy.STASH, WeightPolicy.DOUBLE_BUFFER)

    @property
    def reads_predicted(self) -> bool:
        """Forwards read predicted weights (the live weights moved forward)."""
        return self is WeightPolicy.PREDICT


ForwardReads = Literal["mini-batch version", "latest", "one behind", "predicted"]
"""What a forward reads: the version of its mini-batch (a flush keeps every micro-batch of
mini-batch t on W^(t)), the latest version, the version one behind the latest, or the
latest version moved forward by a predictor."""
BackwardReads = Literal["mini-batch version", "stashed", "one behind", "latest"]
"""What a backward reads: as its forward (flush, one behind), the version its forward
stashed, or the latest version (a predicting method's backward meets the real weights)."""

_FORWARD_READS: dict[WeightPolicy, ForwardReads] = {
    WeightPolicy.FLUSH: "mini-batch version",
    WeightPolicy.STASH: "latest",
    WeightPolicy.DOUBLE_BUFFER: "one behind",
    WeightPolicy.PREDICT: "predicted",
}
_BACKWARD_READS: dict[WeightPolicy, BackwardReads] = {
    WeightPolicy.FLUSH: "mini-batch version",
    WeightPolicy.STASH: "stashed",
    WeightPolicy.DOUBLE_BUFFER: "one behind",
    WeightPolicy.PREDICT: "latest",
}

CopiesRule = Callable[[int, int], int]
"""``(stage, num_stages) -> weight copies`` a stage holds (the memory model's count)."""
SlotsRule = Callable[[int, int, int], int]
"""``(stage, num_stages, micro_batches) -> activation slots`` a stage holds."""


def _copies_by_policy(policy: WeightPolicy) -> CopiesRule:
    """Weight copies a version rule implies, for a method that gives no rule of its own:
    one (flush), one per mini-batch in flight (stash), two buffers, or current plus
    predicted (the last stage predicts over distance 0: one copy)."""
    if policy is WeightPolicy.STASH:
        return lambda k, p: p - k
    if policy is WeightPolicy.DOUBLE_BUFFER:
        return lambda k, p: 2
    if policy is WeightPolicy.PREDICT:
        return lambda k, p: 1 if k == p - 1 else 2
    return lambda k, p: 1


def _slots_in_flight(k: int, p: int, m: int) -> int:
    """1F1B's activations: the micro-batches in flight at stage k."""
    return min(p - k, m)


@dataclass(frozen=True)
class StagePolicy:
    """What one stage of a method does, built once per stage by
    :meth:`Method.stage_policy`; the runtime's stage, its optimizer builder, the memory
    model and the planners ask it rather than the method's flags."""

    method: str
    """The method's registry name (for messages)."""
    stage: int
    """This stage's index, 0-based."""
    num_stages: int
    """P, the pipeline's stage count."""
    versions: WeightPolicy
    """The weight-version rule this stage keeps."""
    weight_copies: int
    """Weight-sized copies this stage holds (stashed versions, buffers, predicted weights)."""
    predictor: str | None
    """The prediction rule the runtime builds for this stage (``optimizer``, ``spectrain``,
    ``xpipe``, ``shrunk``), or None where the forward reads real weights."""
    correction: str | None
    """The delay correction the stage's update applies (a key of the runtime's
    ``CORRECTIONS``), or None."""
    accumulation: int
    """A_k: the mini-batches this stage accumulates per update (1 without a bound)."""
    splits_backward: bool
    """Whether each backward runs as an input half I and a weight half W."""
    flushes: bool
    """Whether the pipeline drains before every update (no update meets work in flight)."""

    @property
    def forward_reads(self) -> ForwardReads:
        """Which weights a forward of this stage reads."""
        return _FORWARD_READS[self.versions]

    @property
    def backward_reads(self) -> BackwardReads:
        """Which weights a backward of this stage reads."""
        return _BACKWARD_READS[self.versions]

    @property
    def keeps_one_version(self) -> bool:
        """Whether every pass of mini-batch t reads W^(t) (the flush's version rule)."""
        return self.versions is WeightPolicy.FLUSH

    @property
    def stashes(self) -> bool:
        """Whether the stage keeps each forward's version for its backward."""
        return self.versions is WeightPolicy.STASH

    @property
    def double_buffers(self) -> bool:
        """Whether every forward and backward read the version one behind the latest."""
        return self.versions is WeightPolicy.DOUBLE_BUFFER

    @property
    def predicts(self) -> bool:
        """Whether the stage's forwards read predicted weights."""
        return self.predictor is not None


@dataclass(frozen=True)
class Method:
    """One pipeline training method.

    The fields declare the method (a method module fills them in); readers elsewhere ask
    the questions below the fields.
    """

    name: str
    """Registry key, as typed on the command line."""
    description: str
    """One line for ``pipeoptim methods``."""
    generator: Callable[[Shape], Order]
    """Pure schedule generator."""
    weight_policy: WeightPolicy
    """Which weight version each forward/backward reads."""
    prediction_rule: str | None = None
    """Predictor the runtime builds (``optimizer``, ``spectrain``, ``xpipe``), if any."""
    micro_batched: bool = True
    """Splits a mini-batch into M micro-batches; if False, M is always 1."""
    default_micro_batches: int | None = None
    """M when the user names none (a micro-batched method): None for P, one per stage, or a
    count of its own (PipeOptim's dial: 1, whole mini-batches, unless asked for more)."""
    asynchronous: bool = False
    """Never flushes: updates happen while other mini-batches are in flight."""
    min_micro_batches_per_stage: bool = False
    """Needs M >= P (number of ranks)."""
    interleaved: bool = False
    """Runs ``virtual_stages`` chunks per rank; needs M to be a multiple of P."""
    array_generator: Callable[[Shape], OrderArrays] | None = None
    """The same generator building numpy arrays (long runs), if the method has one."""
    v_shape: bool = False
    """Two stages per rank in a V (ZB-V: rank r holds stages r and 2P-1-r); implies
    ``interleaved`` with exactly 2 virtual stages and any micro-batch count."""
    split_backward: bool = False
    """Splits each backward into its input half I and its weight half W."""
    delay_correction: str | None = None
    """Delay correction the runtime's update applies (a key of
    ``pipeoptim.runtime.optim.corrections.registry.CORRECTIONS``), if any; it composes with
    the weight policy and the prediction rule."""
    corrects: str | None = None
    """The registered method whose schedule, weight versions and memory this one keeps,
    changing only its update (a delay correction) or its prediction's distance; None for a
    method of its own."""
    max_delay: int | None = None
    """Bounded delay: every stage accumulates its gradients over ``A_k = ⌈τ_k/D⌉``
    mini-batches and updates once, so a forward meets at most D updates before its
    backward (``schedules.bounded_async_one_f_one_b_arrays``); None: one update per
    mini-batch."""
    correction_buffers: int = 0
    """Weight-sized tensors the delay correction keeps on every stage between updates (the
    extrapolation's previous update): counted in :meth:`weight_copies` on top of the
    versions the weight policy keeps."""
    copies_rule: CopiesRule | None = None
    """Weight copies of each stage; None: what the weight policy implies."""
    slots_rule: SlotsRule | None = None
    """Activation slots of each stage; None: 1F1B's micro-batches in flight."""

    # ---- the questions ------------------------------------------------------------------

    @property
    def flushes(self) -> bool:
        """Whether the pipeline drains before every update (a synchronous method)."""
        return not self.asynchronous

    @property
    def keeps_one_version(self) -> bool:
        """Whether every pass of mini-batch t reads W^(t) (the flush's version rule): no
        update comes between a micro-batch's passes, and a stage holds one version."""
        return self.weight_policy is WeightPolicy.FLUSH

    @property
    def runs_whole_mini_batches(self) -> bool:
        """Whether a mini-batch runs as one unit (M is always 1)."""
        return not self.micro_batched

    @property
    def places_several_stages_per_rank(self) -> bool:
        """Whether a rank holds several stages (interleaved 1F1B, the V of ZB-V)."""
        return self.interleaved

    @property
    def folds_stages_in_a_v(self) -> bool:
        """Whether rank r holds stages r and 2P-1-r (ZB-V's V: exactly 2 per rank)."""
        return self.v_shape

    @property
    def default_virtual_stages(self) -> int:
        """Stages per rank when the user names none."""
        return 2 if self.interleaved else 1

    @property
    def splits_backward(self) -> bool:
        """Whether each backward runs as an input half I and a weight half W."""
        return self.split_backward

    @property
    def passes_per_micro_batch(self) -> int:
        """Actions each micro-batch runs on a stage: F and B, or F, I and W."""
        return 3 if self.split_backward else 2

    @property
    def predicts(self) -> bool:
        """Whether forwards read predicted weights."""
        return self.weight_policy is WeightPolicy.PREDICT

    @property
    def predictor(self) -> str | None:
        """The prediction rule the runtime builds, or None for a method that predicts
        nothing."""
        return (self.prediction_rule or "optimizer") if self.predicts else None

    @property
    def correction(self) -> str | None:
        """The delay correction the update applies, or None."""
        return self.delay_correction

    @property
    def bounds_delay(self) -> bool:
        """Whether updates are spread by local accumulation to bound the delay."""
        return self.max_delay is not None

    @property
    def version_rule(self) -> WeightPolicy:
        """The weight-version rule, as the version analysis and the simulator take it."""
        return self.weight_policy

    @property
    def schedule_family(self) -> str:
        """The method whose schedule, versions and memory this one has (itself, or the
        method it corrects): what the simulator and the study's references look up."""
        return self.corrects or self.name

    @property
    def schedule_name(self) -> str:
        """Old name of :attr:`schedule_family`, kept for callers that still use it."""
        return self.schedule_family

    @property
    def micro_batched_by_default(self) -> bool:
        """Whether a run that names no M splits its mini-batches (M = P, or a declared
        default above 1); False for the never-micro-batched methods and PipeOptim's dial."""
        return self.micro_batched and self.default_micro_batches != 1

    @property
    def dials_micro_batches(self) -> bool:
        """Whether M is a free choice from 1 up (its default below P): the delay per stage
        falls as M grows (PipeOptim's dial), so a planner tries counts from 1 to P."""
        return self.micro_batched and self.default_micro_batches is not None

    def default_micro_batches_at(self, num_stages: int) -> int:
        """M when the user names none, at ``num_stages`` stages: 1 where the method runs
        whole mini-batches, its declared default, else P."""
        if self.runs_whole_mini_batches:
            return 1
        return self.default_micro_batches or num_stages

    @overload
    def micro_batches_for(self, requested: int) -> int: ...
    @overload
    def micro_batches_for(self, requested: None) -> int | None: ...
    def micro_batches_for(self, requested: int | None) -> int | None:
        """The micro-batch count a run of this method has for a ``requested`` count: 1
        where it runs whole mini-batches, else the request; None asks for the default (the
        declared one, or None where it is P: :meth:`shape` fills it in). A caller that
        knows P and means "the default" asks :meth:`default_micro_batches_at`."""
        if self.runs_whole_mini_batches:
            return 1
        return requested if requested is not None else self.default_micro_batches

    def virtual_stages_for(self, requested: int | None) -> int | None:
        """The stages per rank to hand :meth:`shape`: the request where the method places
        several stages per rank, else None (one stage per rank)."""
        return requested if self.interleaved else None

    def accumulation(self, stage: int, num_stages: int) -> int:
        """A_k: the mini-batches stage ``stage`` accumulates per update (1 without a bound)."""
        if self.max_delay is None:
            return 1
        return schedules.accumulation_steps(num_stages - 1 - stage, self.max_delay)

    def weight_copies(self, stage: int, num_stages: int) -> int:
        """Weight-sized copies stage ``stage`` of ``num_stages`` holds: the versions its
        rule keeps and the buffers its correction keeps."""
        rule = self.copies_rule or _copies_by_policy(self.weight_policy)
        return rule(stage, num_stages) + self.correction_buffers

    def activation_slots(self, stage: int, num_stages: int, micro_batches: int) -> int:
        """Activation slots (units of one pipeline unit's activations) the stage holds."""
        return (self.slots_rule or _slots_in_flight)(stage, num_stages, micro_batches)

    def stage_policy(self, stage: int, num_stages: int) -> StagePolicy:
        """What stage ``stage`` of ``num_stages`` does under this method."""
        if not 0 <= stage < num_stages:
            raise PlanError(
                f"stage index {stage} is outside 0..{num_stages - 1} for {num_stages} stages; "
                f"ask for a stage of the pipeline"
            )
        return StagePolicy(
            method=self.name,
            stage=stage,
            num_stages=num_stages,
            versions=self.weight_policy,
            weight_copies=self.weight_copies(stage, num_stages),
            predictor=self.predictor,
            correction=self.delay_correction,
            accumulation=self.accumulation(stage, num_stages),
            splits_backward=self.split_backward,
            flushes=self.flushes,
        )

    # ---- sizes and schedules ------------------------------------------------------------

    def shape(
        self,
        num_ranks: int,
        micro_batches: int | None = None,
        mini_batches: int | None = None,
        virtual_stages: int | None = None,
    ) -> Shape:
        """Check the sizes against this method's rules and fill in the defaults."""
        if num_ranks < 1:
            raise PlanError(f"need at least 1 stage (got {num_ranks}); pass --stages 1 or more")
        if self.micro_batched:
            m = (
                micro_batches
                if micro_batches is not None
                else self.default_micro_batches_at(num_ranks)
            )
        else:
            if micro_batches not in (None, 1):
                raise PlanError(
                    f"{self.name} runs each mini-batch as one unit (got {micro_batches} "
                    f"micro-batches); drop --micro-batches, or use a micro-batching method "
                    f"({', '.join(n for n, m in REGISTERED.items() if m.micro_batched)})"
                )
            m = 1
        if m < 1:
            raise PlanError(f"need at least 1 micro-batch (got {m}); pass --micro-batches 1+")
        if self.min_micro_batches_per_stage and m < num_ranks:
            raise PlanError(
                f"{self.name} needs at least as many micro-batches as stages (got {m} "
                f"micro-batches for {num_ranks} stages); raise --micro-batches to "
                f"{num_ranks} or more"
            )
        v = virtual_stages if virtual_stages is not None else self.default_virtual_stages
        if self.v_shape and v != 2:
            raise PlanError(
                f"{self.name} places exactly 2 stages on every rank, in a V (got {v} virtual "
                f"stages); leave --virtual-stages out"
            )
        if v < 1:
            fix = (
                "pass --virtual-stages 2 (the default) or more"
                if self.interleaved
                else "leave --virtual-stages out (it is for interleaved-1f1b)"
            )
            raise PlanError(f"need at least 1 virtual stage per rank (got {v}); {fix}")
        if v > 1 and not self.interleaved:
            raise PlanError(
                f"{self.name} runs one stage per rank (got {v} virtual stages); "
                f"use interleaved-1f1b or zb-v for several stages per rank"
            )
        if self.interleaved and not self.v_shape and m % num_ranks:
            raise PlanError(
                f"{self.name} needs the micro-batch count to be a multiple of the rank "
                f"count (got {m} micro-batches for {num_ranks} ranks); use "
                f"--micro-batches {(m // num_ranks + 1) * num_ranks}"
            )
        n = mini_batches if mini_batches is not None else self.default_mini_batches(num_ranks)
        if n < 1:
            raise PlanError(f"need at least 1 mini-batch (got {n}); pass --mini-batches 1+")
        return Shape(num_ranks, m, n, v)

    def default_mini_batches(self, num_ranks: int) -> int:
        """Enough mini-batches to show a steady state: 2P for asynchronous methods, else 2."""
        return 2 * num_ranks if self.asynchronous else 2

    def order(self, shape: Shape) -> Order:
        return self.generator(shape)

    def order_arrays(self, shape: Shape) -> OrderArrays:
        """The order as flat arrays: what the simulator compiles and the version analysis
        reads (built without an object per action where the method can)."""
        if self.array_generator is not None:
            return self.array_generator(shape)
        return OrderArrays.from_order(self.generator(shape))

    def work(self, shape: Shape) -> WorkEstimate:
        """The work of this method at ``shape`` (resolved by :meth:`shape`), estimated in
        closed form before anything is built (:mod:`pipeoptim.plan.limits`)."""
        return WorkEstimate(
            self.name,
            not self.flushes,
            shape,
            self.passes_per_micro_batch,
            self.folds_stages_in_a_v,
        )

    def schedule(self, shape: Shape) -> Schedule:
        """The clock grid of this method for ``shape``; refuses a grid over
        :data:`pipeoptim.plan.limits.MAX_GRID_CELLS` before building it."""
        check_grid(self.work(shape))
        return schedules.retime(self.generator(shape), shape.micro_batches)


REGISTERED: dict[str, Method] = {}
"""The registered methods by name: filled by :mod:`pipeoptim.plan.methods.registry` (which
exports it as ``METHODS``); it lives here so that a method's own errors can name the
others without importing the registry that imports it."""
