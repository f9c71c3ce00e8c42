"""The method registry: each method is a schedule generator, a weight policy and a predictor.

The weight policy says which weight version a forward and a backward read (DESIGN.md,
"Weight-version semantics"); ``versions.py`` applies it to any schedule, the runtime's
stage implements it, and the simulator's memory model counts the copies it keeps.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, replace

from pipeoptim.errors import PlanError
from pipeoptim.plan import schedules, zero_bubble
from pipeoptim.plan.actions import Schedule
from pipeoptim.plan.limits import check_grid, check_work, estimate_work
from pipeoptim.plan.orders import OrderArrays
from pipeoptim.plan.schedules import Order, Shape


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


@dataclass(frozen=True)
class Method:
    """One pipeline training method."""

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
    the weight policy and the prediction rule (DESIGN.md, "Delay corrections")."""
    corrects: str | None = None
    """The registered method whose schedule, weight versions and memory this one keeps,
    changing only its update (a delay correction) or its prediction's distance; None for a
    method of its own."""
    max_delay: int | None = None
    """Bounded delay: every stage accumulates its gradients over ``A_k = ⌈τ_k/D⌉``
    mini-batches and updates once, so a forward meets at most D updates before its
    backward (``schedules.bounded_async_one_f_one_b_arrays``); None: one update per
    mini-batch."""

    def accumulation(self, stage: int, num_stages: int) -> int:
        """A_k: the mini-batches stage ``stage`` accumulates per update (1 without a bound)."""
        if self.max_delay is None:
            return 1
        return schedules.accumulation_steps(num_stages - 1 - stage, self.max_delay)

    @property
    def schedule_name(self) -> str:
        """The method whose schedule, versions and memory this one has (itself, or the
        method it corrects): what the simulator and the memory model look up."""
        return self.corrects or self.name

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
            m = micro_batches if micro_batches is not None else num_ranks
        else:
            if micro_batches not in (None, 1):
                raise PlanError(
                    f"{self.name} runs each mini-batch as one unit (got {micro_batches} "
                    f"micro-batches); drop --micro-batches, or use a micro-batching method "
                    f"({', '.join(n for n, m in METHODS.items() if m.micro_batched)})"
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
        v = virtual_stages if virtual_stages is not None else (2 if self.interleaved else 1)
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

    def schedule(self, shape: Shape) -> Schedule:
        """The clock grid of this method for ``shape``; refuses a grid over
        :data:`pipeoptim.plan.limits.MAX_GRID_CELLS` before building it."""
        check_grid(estimate_work(self, shape))
        return schedules.retime(self.generator(shape), shape.micro_batches)


_REGISTRY = [
    Method(
        "gpipe",
        "GPipe: all forwards then all backwards of M micro-batches, one update, flush",
        schedules.gpipe,
        WeightPolicy.FLUSH,
    ),
    Method(
        "1f1b",
        "1F1B with a flush per mini-batch (PipeDream-Flush, DAPPLE); needs M >= P",
        schedules.one_f_one_b,
        WeightPolicy.FLUSH,
        min_micro_batches_per_stage=True,
    ),
    Method(
        "interleaved-1f1b",
        "interleaved 1F1B (Megatron-LM): v stages per rank, flush; M a multiple of P",
        schedules.interleaved_one_f_one_b,
        WeightPolicy.FLUSH,
        min_micro_batches_per_stage=True,
        interleaved=True,
    ),
    Method(
        "pipedream",
        "PipeDream: asynchronous 1F1B, forward on the latest weights, stashed for backward",
        schedules.async_one_f_one_b,
        WeightPolicy.STASH,
        array_generator=schedules.async_one_f_one_b_arrays,
        micro_batched=False,
        asynchronous=True,
    ),
    Method(
        "2bw",
        "PipeDream-2BW: asynchronous 1F1B over micro-batches, weights one version behind",
        schedules.async_one_f_one_b,
        WeightPolicy.DOUBLE_BUFFER,
        array_generator=schedules.async_one_f_one_b_arrays,
        asynchronous=True,
        min_micro_batches_per_stage=True,
    ),
    Method(
        "spectrain",
        "SpecTrain: asynchronous 1F1B, forward on weights predicted along the momentum",
        schedules.async_one_f_one_b,
        WeightPolicy.PREDICT,
        array_generator=schedules.async_one_f_one_b_arrays,
        prediction_rule="spectrain",
        micro_batched=False,
        asynchronous=True,
    ),
    Method(
        "xpipe",
        "XPipe: micro-batched asynchronous 1F1B, Adam-form prediction of the update target",
        schedules.async_one_f_one_b,
        WeightPolicy.PREDICT,
        array_generator=schedules.async_one_f_one_b_arrays,
        prediction_rule="xpipe",
        asynchronous=True,
    ),
    Method(
        "pipeoptim",
        "PipeOptim: asynchronous 1F1B, forward on weights predicted by the optimizer's rule",
        schedules.async_one_f_one_b,
        WeightPolicy.PREDICT,
        array_generator=schedules.async_one_f_one_b_arrays,
        prediction_rule="optimizer",
        micro_batched=False,
        asynchronous=True,
    ),
]


def _zb_h1(shape: Shape) -> Order:
    return zero_bubble.zb_h1_order(shape.num_ranks, shape.micro_batches, shape.mini_batches)


def _zb_v(shape: Shape) -> Order:
    return zero_bubble.zb_v_order(2 * shape.num_ranks, shape.micro_batches, shape.mini_batches)


_REGISTRY += [
    Method(
        "zb-h1",
        "ZB-H1 zero bubble: backward split into input (I) and weight (W) passes, the W's "
        "fill 1F1B's cool-down; 1F1B's memory, flush; needs M >= P",
        _zb_h1,
        WeightPolicy.FLUSH,
        min_micro_batches_per_stage=True,
        split_backward=True,
    ),
    Method(
        "zb-v",
        "ZB-V zero bubble: 2 stages per rank in a V, split backward, PyTorch's "
        "ScheduleZBVZeroBubble order, flush; near-zero bubble from M >= 2P-1",
        _zb_v,
        WeightPolicy.FLUSH,
        interleaved=True,
        v_shape=True,
        split_backward=True,
    ),
]


def _corrected(base: Method, correction: str, suffix: str, what: str) -> Method:
    """``base`` with a delay correction: its schedule, weight policy and prediction, and the
    correction's update (a prediction fixes the forward's weights, a correction the update)."""
    return replace(
        base,
        name=f"{base.name}+{suffix}",
        description=f"{base.name} with {what} (delay correction {correction!r})",
        delay_correction=correction,
        corrects=base.name,
    )


_BASES = {m.name: m for m in _REGISTRY}
_PIPEMARE = "PipeMare's rescheduling: stage rate lr/τ^(1-min(t/T,1)), T = 1000 updates"
_NESTEROV = (
    "the Nesterov method's delay-dependent momentum β_k = β0 + τ_k(0.99-β0)/P; the paper "
    "pairs it with --optimizer nadam; pipeoptim+nesterov with --optimizer muon is the "
    "study's closest never-micro-batched LM row at 8 stages (+5.9 % over gpipe under Muon)"
)
_REGISTRY += [
    replace(
        _BASES["pipeoptim"],
        name="pipeoptim+shrink",
        description="pipeoptim with its prediction over the distance the optimizer's update "
        "persists: Σ lr·(φ + (1-φ)β^i), φ from the measured correlation of successive updates "
        "(φ = 1 is pipeoptim's Σ lr)",
        prediction_rule="shrunk",
        corrects="pipeoptim",
    ),
    _corrected(_BASES["pipedream"], "pipemare-lr", "pipemare", _PIPEMARE),
    _corrected(_BASES["pipeoptim"], "pipemare-lr", "pipemare", _PIPEMARE),
    _corrected(_BASES["pipedream"], "delay-momentum", "nesterov", _NESTEROV),
    _corrected(_BASES["pipeoptim"], "delay-momentum", "nesterov", _NESTEROV),
    _corrected(
        _BASES["pipedream"],
        "qk-clip",
        "qk-clip",
        "Kimi K2's QK-Clip: after each step a head whose max attention logit S exceeds "
        "τ = 100 has its query and key rows scaled by √(τ/S)",
    ),
    _corrected(
        _BASES["pipeoptim"],
        "qk-clip",
        "qk-clip",
        "Kimi K2's QK-Clip: after each step a head whose max attention logit S exceeds "
        "τ = 100 has its query and key rows scaled by √(τ/S)",
    ),
]


def _bounded(base: Method, max_delay: int) -> Method:
    """``base`` (never micro-batched, asynchronous) with its delay bounded by local gradient
    accumulation: a schedule of its own (fewer updates on the early stages)."""

    def arrays(shape: Shape) -> OrderArrays:
        return schedules.bounded_async_one_f_one_b_arrays(shape, max_delay)

    def order(shape: Shape) -> Order:
        return arrays(shape).to_order()

    return replace(
        base,
        name=f"{base.name}+bounded",
        description=f"{base.name} with its delay bounded to {max_delay} update by local "
        f"gradient accumulation (PACI): stage k updates once per A_k = ⌈(P−1−k)/"
        f"{max_delay}⌉ mini-batches, on their mean gradient",
        generator=order,
        array_generator=arrays,
        max_delay=max_delay,
    )


_REGISTRY += [_bounded(_BASES["pipedream"], 1), _bounded(_BASES["pipeoptim"], 1)]

METHODS: dict[str, Method] = {m.name: m for m in _REGISTRY}
CORRECTED: frozenset[str] = frozenset(m.name for m in _REGISTRY if m.delay_correction)
"""The registered methods with a delay correction."""
RANKED_BY_DEFAULT: tuple[str, ...] = tuple(
    m.name for m in _REGISTRY if not m.interleaved and m.max_delay is None
)
"""The methods the planners rank when not told which: all but the interleaved ones (they
need a virtual-stage count) and the bounded-delay ones, whose cost, 1/A_k of the updates on
the early stages at equal samples, is outside the κ·e risk model, and which the study never
measured as the best row (docs/choosing-a-method.md); name them to rank them."""


def get_method(name: str) -> Method:
    """Look a method up by name; the error lists the valid names."""
    try:
        return METHODS[name]
    except KeyError:
        raise PlanError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}") from None


def build_schedule(
    method: str,
    num_ranks: int,
    micro_batches: int | None = None,
    mini_batches: int | None = None,
    virtual_stages: int | None = None,
) -> tuple[Schedule, Shape]:
    """Generate and retime ``method``'s schedule; returns the grid and the resolved shape."""
    m = get_method(method)
    shape = m.shape(num_ranks, micro_batches, mini_batches, virtual_stages)
    return m.schedule(shape), shape


def check_schedule_size(
    method: str | Method,
    num_ranks: int,
    micro_batches: int | None = None,
    mini_batches: int | None = None,
    virtual_stages: int | None = None,
    *,
    max_actions: int | None = None,
    what: str = "running",
) -> Shape:
    """Resolve and check the shape (the method's own rules first), then refuse a run of more
    than ``max_actions`` actions (:attr:`~pipeoptim.plan.limits.WorkEstimate.cost`: actions
    plus ``STAGE_COST`` per stage). Returns the resolved :class:`Shape`; builds nothing.

    ``what`` starts the message (``"training"`` gives "training pipeoptim with P=4, ...").
    It lives with the registry, not in :mod:`pipeoptim.plan.limits`, because it looks the
    method up: the limits import nothing from the plan at run time.
    """
    spec = get_method(method) if isinstance(method, str) else method
    shape = spec.shape(num_ranks, micro_batches, mini_batches, virtual_stages)
    check_work(estimate_work(spec, shape), max_actions=max_actions, what=what)
    return shape
