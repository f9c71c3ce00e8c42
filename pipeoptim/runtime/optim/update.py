"""A stage's update: its optimizer and LR scheduler, gradient sync, unscaling, clipping, and
the slot where a delay correction plugs in.

Why apart from the stage: the update is the one place an asynchronous method's training rule
differs beyond which weights a pass reads. A *delay correction* (docs/design.md, "Delay
corrections") changes how a stage updates as a function of its delay; it is one small object,
named by the method (``StagePolicy.correction``) and built from
:data:`~pipeoptim.runtime.optim.corrections.registry.CORRECTIONS` (by
:mod:`~pipeoptim.runtime.optim.builder`), so a correction is added without touching the
stage's forward or backward. The update is always the user's ``torch.optim`` optimizer; a
correction acts on it before and after its step. The scheduler's look-ahead
(:func:`future_lrs`, the rates of the next s updates a prediction sums) is here too, beside
the update that steps the scheduler.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer, lr_scheduler
from torch.optim.lr_scheduler import ReduceLROnPlateau

from pipeoptim.errors import RuntimeConfigError, StageError
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.runtime.optim.corrections.protocol import (
    DelayCorrection,
    FollowsScheduler,
    RescalesLr,
    StageContext,
)
from pipeoptim.runtime.optim.families import TORCH_FAMILIES, torch_family
from pipeoptim.runtime.optim.global_clip import squared_norm
from pipeoptim.runtime.optim.predict import check_distance
from pipeoptim.runtime.optim.sharded import (
    full_state_dict,
    load_full_state,
    optimizer_class_name,
    unsharded_twin,
)

__all__ = [
    "OPTIMIZERS",
    "OptimizerFactory",
    "SchedulerFactory",
    "StageUpdate",
    "build_optimizer",
    "build_scheduler",
    "future_lrs",
    "make_optimizer",
    "takes_context",
]


OptimizerFactory = Callable[..., Optimizer]
"""Called with a stage's trainable parameters, and with its :class:`StageContext` too where
it takes a second argument (per-stage hyper-parameters from the stage's delay); returns the
torch.optim optimizer over the parameters, e.g.
``lambda params, stage: torch.optim.AdamW(params, lr=1e-3 / (1 + stage.delay) ** 0.5)``."""
SchedulerFactory = Callable[[Optimizer], Any]
"""Called with a stage's optimizer; returns a torch.optim.lr_scheduler scheduler of it."""

OPTIMIZERS: dict[str, type[Optimizer]] = {
    name: family.optimizer_class
    for name, family in TORCH_FAMILIES.items()
    if family.optimizer_class is not None
}
"""The torch optimizer class each family builds (``families/``), by family name."""
FAMILY_OF_CLASS: dict[str, str] = {cls.__name__: name for name, cls in OPTIMIZERS.items()}
"""The family name (``--optimizer``) of each optimizer class name."""


def make_optimizer(spec: OptimizerSpec, params: Iterable[Tensor]) -> Optimizer:
    """The torch.optim optimizer of ``spec``, as its family builds it (``families/``: SGD
    defaults to momentum 0.9; muon is :class:`MuonWithAdamW` with one lr for both parts;
    basis rotation is :class:`~pipeoptim.runtime.optim.basis_rotation.BasisRotation` with
    the paper's defaults)."""
    family = torch_family(spec.family)
    options = {**family.default_options, **spec.options}
    try:
        return family.build(params, spec.lr, spec.options)
    except (TypeError, ValueError) as err:
        name = family.optimizer_class.__name__ if family.optimizer_class else family.name
        raise RuntimeConfigError(
            f"cannot build {name} with lr={spec.lr} and options {options}: {err}; "
            f"fix the optimizer options in the plan"
        ) from None


def takes_context(factory: Callable[..., Any]) -> bool:
    """The factory takes a second positional argument (the :class:`StageContext`)."""
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # no signature to read: the one-argument form
        return False
    positional = [
        p
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    star = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters)
    return len(positional) >= 2 or star


def build_optimizer(
    optimizer: OptimizerSpec | OptimizerFactory,
    params: Sequence[Tensor],
    stage: int,
    context: StageContext | None = None,
) -> Optimizer:
    """The stage's optimizer from a spec or a user factory, checked: it must be a
    torch.optim.Optimizer over exactly the stage's trainable parameters. A factory taking
    two arguments is called with the stage's :class:`StageContext` as the second."""
    if isinstance(optimizer, OptimizerSpec):
        return make_optimizer(optimizer, params)
    try:
        if context is not None and takes_context(optimizer):
            opt = optimizer(list(params), context)
        else:
            opt = optimizer(list(params))
    except Exception as err:
        raise StageError(
            f"stage {stage}: the optimizer factory raised {type(err).__name__}: {err}; it is "
            f"called with the list of the stage's trainable parameters, e.g. "
            f"optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4)"
        ) from err
    if not isinstance(opt, Optimizer):
        raise StageError(
            f"stage {stage}: the optimizer factory returned {type(opt).__name__}, not a "
            f"torch.optim.Optimizer; return e.g. torch.optim.SGD(params, lr=0.1)"
        )
    if _needs_closure(opt):
        raise StageError(
            f"stage {stage}: {type(opt).__name__}.step needs a closure that re-evaluates the "
            f"loss (several forwards and backwards of the whole model per update), which a "
            f"pipeline stage cannot give: it updates from one backward, while the other "
            f"stages hold mini-batches in flight; use a first-order optimizer (SGD, Adam, "
            f"AdamW, RMSprop...)"
        )
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    if held != {id(p) for p in params}:
        raise StageError(
            f"stage {stage}: the optimizer factory built an optimizer over {len(held)} tensors "
            f"that are not exactly the stage's {len(params)} trainable parameters; build it "
            f"from the params argument it is given"
        )
    return opt


def _needs_closure(opt: Optimizer) -> bool:
    """Its ``step`` cannot be called without a closure (``torch.optim.LBFGS``)."""
    if isinstance(opt, torch.optim.LBFGS):
        return True
    try:
        closure = inspect.signature(opt.step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read: assume the usual closure=None
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def build_scheduler(factory: SchedulerFactory, opt: Optimizer, stage: int) -> Any:
    """The stage's LR scheduler from the user's factory, checked: a step-indexed
    torch.optim.lr_scheduler scheduler of ``opt``."""
    try:
        sched = factory(opt)
    except Exception as err:
        raise StageError(
            f"stage {stage}: the scheduler factory raised {type(err).__name__}: {err}; it is "
            f"called with the stage's optimizer, e.g. scheduler=lambda opt: "
            f"torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)"
        ) from err
    if isinstance(sched, ReduceLROnPlateau):
        raise StageError(
            "ReduceLROnPlateau steps on a validation metric, which the stages of an "
            "asynchronous pipeline do not share at update time; use a step-indexed schedule "
            "(cosine, step, LambdaLR...)"
        )
    if not callable(getattr(sched, "step", None)) or getattr(sched, "optimizer", opt) is not opt:
        raise StageError(
            f"stage {stage}: the scheduler factory returned {type(sched).__name__}, not a "
            f"torch.optim.lr_scheduler scheduler of the optimizer it was given"
        )
    return sched


class StageUpdate:
    """One stage's optimizer step with everything around it, in this order: gradient sync
    over the replicas, unscaling (:meth:`prepare`) and clipping (by the stage's norm or by the
    pipeline's: ``global_clip.py``), the correction's ``before_step``, the step,
    its ``after_step``, the scheduler step, ``zero_grad``."""

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        stage: int,
        scheduler: SchedulerFactory | None,
        scaler: torch.amp.GradScaler | None,
        grad_clip: float | None,
        correction: DelayCorrection | None = None,
        accumulation: int = 1,
        note: Callable[[str], None],
    ) -> None:
        self.optimizer = optimizer
        self.accumulation = accumulation
        """A_k: mini-batches per update (a bounded delay); the next updates' rates are read
        this many scheduler steps apart."""
        self.stage = stage
        self.scheduler = (
            build_scheduler(scheduler, optimizer, stage) if scheduler is not None else None
        )
        self.scaler = scaler
        self.grad_clip = grad_clip
        self.correction = correction
        self._follow_scheduler()  # a scheduler's constructor may have written the momentum
        self.grad_sync: Callable[[Sequence[Tensor]], None] | None = None
        """Set under data parallelism: averages the gradients over the stage's replicas
        before each update (``replicas.GradientAverager``)."""
        self.tied: list[Tensor] = []
        """Weights this stage shares with other stages (``ties.py``): each is clipped on its
        own norm, which is the same on every member stage, so their copies stay equal."""
        self.tied_elsewhere: list[Tensor] = []
        """Those of :attr:`tied` whose first member stage is another: the pipeline's
        clipping norm counts a shared weight once, there."""
        self._prepared = False  # prepare() ran for the coming step
        self._note = note
        # The run's own base rates: a resume with other rates rescales the loaded ones.
        self._base_lrs = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
        self._future_lrs: list[list[float]] | None = None
        """The scheduler's rates of the next updates, from the current one on, per group:
        one scheduler copy stepped :data:`LR_HORIZON` updates ahead, shifted by one at
        each update (:meth:`_shifted_lrs`)."""
        self._lrs_unknown = False  # the scheduler cannot be queried: lr·s it is

    def prepare(self, params: Sequence[Tensor], mini_batches: int = 1) -> None:
        """Make the accumulated gradient of ``params`` the one the step applies, before its
        clipping: under a bounded delay the sum over ``mini_batches`` is divided into their
        mean (so the update, its clipping and its correction see one mini-batch's scale),
        the replicas average it, and fp16 loss scaling is undone where clipping or a
        correction reads it. Called by :meth:`step`, or before it where the clipping norm
        spans the pipeline (``global_clip.py``: the norm is read in between)."""
        if self._prepared:
            return
        self._prepared = True
        if mini_batches > 1:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                torch._foreach_div_(grads, float(mini_batches))
        if self.grad_sync is not None:  # before unscaling, clipping: replicas stay equal
            for bucket in self._buckets(params):
                self.grad_sync(bucket)
        scaler = self.scaler
        if scaler is not None and (self.grad_clip is not None or self.correction is not None):
            scaler.unscale_(self.optimizer)

    def clip_norm_squared(self, params: Sequence[Tensor], device: torch.device) -> Tensor:
        """The squared 2-norm of the prepared gradients of ``params`` this stage counts in
        the pipeline's norm: a weight shared with other stages only on its first member
        stage (:attr:`tied_elsewhere` left out)."""
        elsewhere = {id(t) for t in self.tied_elsewhere}
        grads = [p.grad for p in params if p.grad is not None and id(p) not in elsewhere]
        return squared_norm(grads, device)

    def step(
        self,
        params: Sequence[Tensor],
        delay: int,
        mini_batches: int = 1,
        clip: Tensor | None = None,
    ) -> None:
        """Apply the accumulated gradient of ``params``: one mini-batch's, or under a
        bounded delay the sum over ``mini_batches`` of them (:meth:`prepare`); the scheduler
        then steps once per mini-batch, so the rate follows the samples seen and an update
        uses the rate of the first mini-batch it applies. ``clip``: the factor of the
        pipeline's norm (``global_clip.clip_factor``) every gradient is scaled by; None: the
        stage clips by its own norm where ``grad_clip`` is set."""
        opt = self.optimizer
        self.prepare(params, mini_batches)
        self._prepared = False
        if clip is not None:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, clip.to(grads[0].device))
        elif self.grad_clip is not None:
            # a shared weight is clipped alone: its clipping factor is then the same on every
            # member stage (in one norm with others, the factor would differ)
            for bucket in self._buckets(params):
                nn.utils.clip_grad_norm_(bucket, self.grad_clip)
        if self.correction is not None:
            self.correction.before_step(opt, params, delay)
        scaler = self.scaler
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if self.correction is not None:
            self.correction.after_step(opt, params, delay)
        if self.scheduler is not None:
            for _ in range(mini_batches):
                self.scheduler.step()
            self._follow_scheduler()
        opt.zero_grad(set_to_none=True)
        self._future_lrs = self._shifted_lrs(mini_batches)

    def _buckets(self, params: Sequence[Tensor]) -> list[Sequence[Tensor]]:
        """``params`` as gradient sync and clipping take them: the stage's own together, each
        weight it shares with other stages (:attr:`tied`) alone."""
        if not self.tied:
            return [params]
        shared = {id(t) for t in self.tied}
        return [[p for p in params if id(p) not in shared], *([t] for t in self.tied)]

    def _follow_scheduler(self) -> None:
        """Let a correction that sets what a scheduler also writes (the momentum) apply to
        the scheduler's values (:class:`FollowsScheduler`)."""
        if self.scheduler is not None and isinstance(self.correction, FollowsScheduler):
            self.correction.after_scheduler(self.optimizer)

    def future_lrs(self, s: int, delays: Sequence[int] | None = None) -> list[list[float]] | None:
        """Learning rates of the next s updates as the steps will use them (None: use lr·s):
        the scheduler's, divided where the correction rescales the rate (PipeMare:
        :class:`RescalesLr`, with ``delays[i]`` the τ of the i-th next update; None: the
        stage's steady delay)."""
        rates = self._scheduled_lrs(s)
        correction = self.correction
        if not isinstance(correction, RescalesLr) or s == 0:
            return rates
        steady = int(getattr(correction, "steady_delay", 0))
        divisors = correction.lr_divisors(list(delays)[:s] if delays is not None else [steady] * s)
        if rates is None:  # constant (or unknown) rates: the current one s times
            rates = [[float(g["lr"])] * s for g in self.optimizer.param_groups]
        return [[lr / d for lr, d in zip(row[:s], divisors, strict=True)] for row in rates]

    def _scheduled_lrs(self, s: int) -> list[list[float]] | None:
        """Learning rates of the next s updates under the scheduler (None: use lr·s)."""
        if self.scheduler is None or self._lrs_unknown:
            return None
        cached = self._future_lrs
        groups = self.optimizer.param_groups
        if (
            cached is None
            or any(len(row) < s for row in cached)
            # a rate set since (a callback's, a resume's): the copy no longer tells
            or any(row[0] != float(g["lr"]) for row, g in zip(cached, groups, strict=True) if row)
        ):
            ahead = max(s, LR_HORIZON)
            cached = future_lrs(self.scheduler, self.optimizer, ahead, every=self.accumulation)
            if cached is None:
                self._lrs_unknown = True
                self._note(
                    f"stage {self.stage}: {type(self.scheduler).__name__} cannot be queried for "
                    f"its future learning rates; prediction uses the current lr times s"
                )
            self._future_lrs = cached
        return None if cached is None else [row[:s] for row in cached]

    def _shifted_lrs(self, mini_batches: int) -> list[list[float]] | None:
        """The cached rates after an update that stepped the scheduler ``mini_batches``
        times: the same list less its first rate, where the update stepped it as the copy
        did (else None: queried afresh at the next prediction)."""
        cached = self._future_lrs
        if cached is None or mini_batches != self.accumulation:
            return None
        return [row[1:] for row in cached]

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, scheduler, loss scaler and correction state. A sharded optimizer's
        state is gathered whole (a collective: every replica of the stage calls this), so
        the state reads as the unsharded run's and resumes at any D."""
        return {
            "optimizer": full_state_dict(self.optimizer),
            # what a resume checks before loading: another class's state does not fit
            "optimizer_class": optimizer_class_name(self.optimizer),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "correction": None if self.correction is None else self.correction.state_dict(),
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse a :meth:`state_dict` this stage's optimizer cannot take, before anything is
        loaded: another optimizer class, other parameter groups or counts. A state saved
        before the class was recorded is tried on the optimizer and put back, so a foreign
        one (SGD's into Adam) is refused here too instead of failing half loaded."""
        saved = state.get("optimizer")
        where, mine = f"stage {self.stage}", optimizer_class_name(self.optimizer)
        if saved is None:
            n = sum(len(g["params"]) for g in self.optimizer.param_groups)
            raise RuntimeConfigError(
                f"{where}: the state holds no optimizer state (it was saved from a stage "
                f"without trainable weights), but this stage trains {n} tensors with {mine}; "
                f"load a state saved from the same layers, with the same weights trainable; "
                f"nothing was loaded"
            )
        theirs = state.get("optimizer_class")
        if theirs is not None and theirs != mine:
            raise RuntimeConfigError(
                f"{where}: the saved optimizer state is {theirs}'s, but this stage's optimizer "
                f"is {mine} (the optimizer family fixes the state's shape and meaning); "
                f"build the Pipeline with an optimizer factory returning {theirs} (pipeoptim "
                f"train: --optimizer {FAMILY_OF_CLASS.get(theirs, theirs.lower())}), or start "
                f"fresh; nothing was loaded"
            )
        groups = saved.get("param_groups") if isinstance(saved, dict) else None
        if not isinstance(groups, list) or not isinstance(saved.get("state"), dict):
            raise RuntimeConfigError(
                f"{where}: the saved optimizer state is not a torch.optim state dict (no "
                f"param_groups and state); load what Pipeline.state_dict() or a pipeoptim "
                f"checkpoint holds; nothing was loaded"
            )
        counts = [len(g["params"]) for g in groups]
        ours = [len(g["params"]) for g in self.optimizer.param_groups]
        if counts != ours:
            raise RuntimeConfigError(
                f"{where}: the saved optimizer has parameter groups of {counts} tensors, this "
                f"stage's {mine} has {ours}; build the optimizer with the same parameter "
                f"groups as the run that saved it; nothing was loaded"
            )
        if theirs is None:
            self._try_load(saved, where, mine)

    def _try_load(self, saved: dict[str, Any], where: str, mine: str) -> None:
        """Load ``saved`` into the optimizer and put its own state back (a state saved
        before the optimizer class was recorded): an error is the refusal."""
        probe = unsharded_twin(self.optimizer)  # a sharded one is tried on a stateless twin
        own = probe.state_dict()
        try:
            probe.load_state_dict(copy.deepcopy(saved))
        except Exception as err:
            raise RuntimeConfigError(
                f"{where}: the saved optimizer state does not fit this stage's {mine} "
                f"({type(err).__name__}: {err}); it was saved with another optimizer: build "
                f"the Pipeline with that one, or start fresh; nothing was loaded"
            ) from None
        finally:
            if probe is self.optimizer:
                probe.load_state_dict(own)

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Load :meth:`state_dict`, after :meth:`check_state`. Where this stage was built
        with other base learning rates than the saved run, the loaded (scheduled) rates are
        rescaled to them, so a resume can change the lr and keep the schedule's progress;
        returns what changed."""
        self.check_state(state)
        changes: list[str] = []
        saved = state["optimizer"]["param_groups"]
        # A copy: torch.optim keeps same-device tensors as given, which would alias a
        # state dict that is still in use elsewhere.
        load_full_state(self.optimizer, copy.deepcopy(state["optimizer"]))
        for i, (group, old) in enumerate(zip(self.optimizer.param_groups, saved, strict=True)):
            old_base, new_base = float(old.get("initial_lr", old["lr"])), self._base_lrs[i]
            if old_base != new_base and old_base > 0:
                group["lr"] = float(group["lr"]) * new_base / old_base
                if "initial_lr" in group:
                    group["initial_lr"] = new_base
                changes.append(f"stage {self.stage} lr {old_base:g} -> {new_base:g}")
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
            if changes:
                self.scheduler.base_lrs = list(self._base_lrs)
                self.scheduler._last_lr = [float(g["lr"]) for g in self.optimizer.param_groups]
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        if self.correction is not None and state.get("correction") is not None:
            self.correction.load_state_dict(state["correction"])
        self._future_lrs = None
        return changes


class _LrOnlyOptimizer:
    """Stands in for the optimizer inside a scheduler copy: schedulers only read and write
    ``param_groups[i]["lr"]``, so the copy never touches parameters or optimizer state."""

    _opt_called = True  # silences the "scheduler.step() before optimizer.step()" check

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self.defaults: dict[str, Any] = {}
        self.param_groups = [
            {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in g.items() if k != "params"}
            for g in groups
        ]

    def step(self) -> None:  # pragma: no cover - never called
        return None


_LrOnlyOptimizer.step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]

# Schedulers whose next values depend only on their own fields and the group lrs.
_QUERYABLE: tuple[type[Any], ...] = (
    lr_scheduler.LambdaLR,
    lr_scheduler.MultiplicativeLR,
    lr_scheduler.StepLR,
    lr_scheduler.MultiStepLR,
    lr_scheduler.ConstantLR,
    lr_scheduler.LinearLR,
    lr_scheduler.ExponentialLR,
    lr_scheduler.PolynomialLR,
    lr_scheduler.CosineAnnealingLR,
)


LR_HORIZON = 16
"""Updates a stage's prediction looks the scheduler ahead at once: a copy of the scheduler
(:func:`future_lrs`) then serves that many updates instead of one (issue 34: a copy of
a LambdaLR per update and stage was about 0.6 % of XPipe's step at 16 stages)."""


def future_lrs(
    scheduler: Any, optimizer: Optimizer, s: int, *, every: int = 1
) -> list[list[float]] | None:
    """Learning rates of the next s updates, ``out[group][i]``, without touching either object.

    Assumes ``every`` ``scheduler.step()`` calls after each ``optimizer.step()`` (1; A_k
    under a bounded delay, the scheduler stepping once per mini-batch): the first rate is
    the current one. Steps a copy of the scheduler bound to an lr-only stand-in optimizer.
    Returns None for schedulers that cannot be queried this way (e.g. ReduceLROnPlateau,
    which needs future metrics); the caller then uses lr·s.
    """
    s = check_distance(s)
    if type(scheduler) not in _QUERYABLE:
        return None
    if getattr(scheduler, "optimizer", None) is not optimizer:
        raise RuntimeConfigError(
            "future_lrs needs the scheduler together with the optimizer it schedules (got a "
            "scheduler bound to another optimizer); pass the stage's own pair"
        )
    stub = _LrOnlyOptimizer(optimizer.param_groups)
    try:
        twin = copy.deepcopy(scheduler, {id(optimizer): stub})
    except Exception:  # e.g. an lr_lambda closing over something uncopyable
        return None
    out: list[list[float]] = [[] for _ in stub.param_groups]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(s):
            for _ in range(every if i else 0):
                twin.step()
            for row, g in zip(out, stub.param_groups, strict=True):
                row.append(float(g["lr"]))
    return out
