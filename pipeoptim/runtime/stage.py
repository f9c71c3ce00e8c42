"""One pipeline stage: a slice of layers, its own optimizer, and its method's weight versions.

Why this shape: in an asynchronous pipeline a stage updates its weights while mini-batches
whose forward already ran are still waiting for their backward. What weights those forwards
and backwards see is the method (DESIGN.md, "Weight-version semantics"); the version of each
pass comes from ``plan.versions.analyze_versions`` of the very schedule the executor runs, so
the runtime and the analysis cannot disagree (the stage checks it at every action).

How weights are handed to autograd: the forward does not read the parameters themselves but
*aliases* of their storage (``_Alias``: a tensor on the same memory with its own version
counter, whose gradient flows to the parameter). Two things follow:

* an optimizer step between a forward and its backward is legal (it bumps the parameter's
  version counter, not the alias's), and the backward reads whatever the aliased storage
  holds when it runs;
* a version is kept simply by keeping its storage: before an update, if some pass still
  needs the current version (PipeDream's stash, 2BW's previous buffer), the parameter moves
  to a fresh copy and the old storage stays frozen with the graphs that alias it.

Per policy: FLUSH runs everything on the live weights. STASH forwards on the live weights,
which are frozen at the next update if the mini-batch is still in flight (one copy per
version in flight). DOUBLE_BUFFER runs every micro-batch of mini-batch t on ``W^(t-1)`` (the
live weights or the one frozen previous version). PREDICT copies the live weights aside,
writes the prediction ``Ŵ = W - lr·s·Δ`` into the parameters' storage for the forward and
copies the live weights back, so the graph aliases the live storage and the backward runs
on the current weights, as DESIGN.md specifies.

Mixed precision (``amp``): the forward runs under ``torch.autocast``; master weights,
optimizer state and prediction stay fp32. Autocast casts a weight to bf16/fp16 and the op
saves that cast for its backward, so the backward would see the cast of the *forward's*
weights (Ŵ). The stage keeps DESIGN.md's rule instead: a saved tensor that is a cast (or a
view of a cast) of a weight alias is not kept; the backward re-casts the weights the policy
says it uses (the live ones for predicting methods, the stashed version for PipeDream) when
it needs them. Weights derived by other computations (``torch.nn.utils.parametrize``, weight
norm) cannot be re-derived generically: for predicting methods their backward uses the value
computed from Ŵ, and the stage says so once (``Stage.notes``).

Split backward (zero-bubble schedules, synchronous methods only): the forward runs the
stage's units one by one and keeps the output of each unit that has weights. The input half
``I`` (:meth:`Stage.backward_input`) asks autograd for the gradient of the stage's input and
of every such unit output at once (``torch.autograd.grad(..., retain_graph=True)``): no
weight gradient is computed, and the graph stays. The weight half ``W``
(:meth:`Stage.backward_weight`) runs, per unit, ``torch.autograd.backward(unit output,
its gradient, inputs=unit weights)``, which walks that unit's part of the graph only, then
drops the graph: the micro-batch's activations (and the captured gradients) are held until
``W``. Where the units cannot be told apart (a weight shared by two units, a container with
its own forward or hooks) the stage is one unit: ``W`` then walks the whole graph for the
weights only. No random number is drawn again: both halves reuse the forward's graph.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.utils import parametrize
from torch.optim import SGD, Adam, AdamW, Optimizer, RMSprop
from torch.optim.lr_scheduler import ReduceLROnPlateau

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.methods import Method, WeightPolicy
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.plan.versions import MicroBatchVersions, prediction_distance
from pipeoptim.runtime.closure import PredictionClosure
from pipeoptim.runtime.diagnose import describe_failure
from pipeoptim.runtime.predict import WeightPredictor, future_lrs, predictor_for

__all__ = [
    "AMP_DTYPES",
    "OPTIMIZERS",
    "LossFn",
    "OptimizerFactory",
    "SchedulerFactory",
    "Stage",
    "StageError",
    "build_optimizer",
    "checked_loss",
    "make_optimizer",
]

OptimizerFactory = Callable[[list[Tensor]], Optimizer]
"""Called with a stage's trainable parameters; returns the torch.optim optimizer over them."""
SchedulerFactory = Callable[[Optimizer], Any]
"""Called with a stage's optimizer; returns a torch.optim.lr_scheduler scheduler of it."""
LossFn = Callable[[Tensor, Tensor], Tensor]
"""(output of the last stage, targets) -> scalar loss (the mean over the micro-batch)."""

AMP_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


class StageError(RuntimeConfigError):
    """User code (a layer, the loss, the optimizer or scheduler factory) failed in a stage;
    the message names the stage, the unit and the values."""


OPTIMIZERS: dict[str, type[Optimizer]] = {
    "sgd": SGD,
    "adam": Adam,
    "adamw": AdamW,
    "rmsprop": RMSprop,
}
_DEFAULT_OPTIONS: dict[str, dict[str, float | bool]] = {"sgd": {"momentum": 0.9}}


def make_optimizer(spec: OptimizerSpec, params: Iterable[Tensor]) -> Optimizer:
    """The torch.optim optimizer of ``spec`` (SGD defaults to momentum 0.9)."""
    cls = OPTIMIZERS.get(spec.family)
    if cls is None:
        raise RuntimeConfigError(
            f"unknown optimizer {spec.family!r}; choose one of: {', '.join(OPTIMIZERS)}"
        )
    options = {**_DEFAULT_OPTIONS.get(spec.family, {}), **spec.options}
    try:
        kwargs: dict[str, Any] = {"lr": spec.lr, **options}
        return cls(list(params), **kwargs)
    except (TypeError, ValueError) as err:
        raise RuntimeConfigError(
            f"cannot build {cls.__name__} with lr={spec.lr} and options {options}: {err}; "
            f"fix the optimizer options in the plan"
        ) from None


def build_optimizer(
    optimizer: OptimizerSpec | OptimizerFactory, params: Sequence[Tensor], stage: int
) -> Optimizer:
    """The stage's optimizer from a spec or a user factory, checked: it must be a
    torch.optim.Optimizer over exactly the stage's trainable parameters."""
    if isinstance(optimizer, OptimizerSpec):
        return make_optimizer(optimizer, params)
    try:
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
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    if held != {id(p) for p in params}:
        raise StageError(
            f"stage {stage}: the optimizer factory built an optimizer over {len(held)} tensors "
            f"that are not exactly the stage's {len(params)} trainable parameters; build it "
            f"from the params argument it is given"
        )
    return opt


def _build_scheduler(factory: SchedulerFactory, opt: Optimizer, stage: int) -> Any:
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


@dataclass(frozen=True)
class _Recast:
    """A saved weight cast, dropped at forward time: re-cast from ``source`` at backward."""

    source: Tensor
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


# Backward nodes of ops whose output shares its input's storage.
_VIEW_NODES = frozenset(
    {
        "TBackward0",
        "TransposeBackward0",
        "PermuteBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ExpandBackward0",
        "UnsqueezeBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "SliceBackward0",
        "SelectBackward0",
        "AsStridedBackward0",
    }
)


def _cast_source(t: Tensor, aliases: dict[Any, Tensor]) -> Tensor | None:
    """The weight storage ``t`` is a cast (or a view of a cast) of, else None."""
    node = t.grad_fn
    while node is not None and type(node).__name__ in _VIEW_NODES:
        node = node.next_functions[0][0]
    if node is None or type(node).__name__ != "ToCopyBackward0":
        return None
    source = aliases.get(node.next_functions[0][0])
    if source is None or not source.is_contiguous():
        return None
    if t.untyped_storage().nbytes() != source.numel() * t.element_size():
        return None  # not laid out like a plain cast of the whole weight
    return source


def _derived_weights(module: nn.Module) -> list[str]:
    """Submodules whose weights are computed in the forward (parametrizations, weight norm)."""
    found = []
    for name, sub in module.named_modules():
        hooks = getattr(sub, "_forward_pre_hooks", {}).values()
        if parametrize.is_parametrized(sub) or any(type(h).__name__ == "WeightNorm" for h in hooks):
            found.append(name or type(sub).__name__)
    return found


_RANDOM_MODULES: tuple[type[nn.Module], ...] = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
    nn.RReLU,
)


def _draws_random_numbers(module: nn.Module) -> bool:
    """Whether a pass through ``module`` may draw random numbers: a dropout-like layer, a
    layer with a dropout rate above 0 (attention), or any module not from torch.nn (user
    code may call torch.rand): conservative, since a wrong False changes results."""
    for sub in module.modules():
        if isinstance(sub, _RANDOM_MODULES):
            return True
        if not type(sub).__module__.startswith("torch.nn"):
            return True
        rate = getattr(sub, "dropout", 0.0)
        if isinstance(rate, float) and rate > 0:
            return True
    return False


class _Alias(torch.autograd.Function):
    """Forward: a fresh tensor on ``source``'s storage; backward: the gradient to ``param``."""

    @staticmethod
    def forward(ctx: Any, param: Tensor, source: Tensor) -> Tensor:
        out = source.new_empty((0,))
        return out.set_(
            source.untyped_storage(), source.storage_offset(), source.size(), source.stride()
        )

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _alias(param: Tensor, source: Tensor) -> Tensor:
    out: Tensor = _Alias.apply(param, source)  # type: ignore[no-untyped-call]
    return out


def _nbytes(tensors: Iterable[Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class Stage:
    """A module slice trained with its own optimizer under its method's weight policy.

    The executor calls :meth:`begin_segment` with this stage's passes (local micro-batch id
    to versions) of the segment's schedule, then :meth:`forward`, :meth:`backward` (or its
    halves :meth:`backward_input` and :meth:`backward_weight`) and :meth:`update` in the
    schedule's order. Micro-batch losses are scaled by 1/M so the
    accumulated gradient is that of the mini-batch mean. Nothing here reads a value back to
    the host: losses and correct counts stay on the device until the caller reads them.
    """

    def __init__(
        self,
        index: int,
        layers: nn.Sequential,
        *,
        num_stages: int,
        method: Method,
        optimizer: OptimizerSpec | OptimizerFactory,
        micro_batches: int,
        prediction_offset: int = 0,
        device: torch.device | str = "cpu",
        seed: int = 0,
        loss_fn: LossFn = F.cross_entropy,
        scheduler: SchedulerFactory | None = None,
        amp: str | None = None,
        grad_clip: float | None = None,
        first_unit: int = 0,
        predicted_backward: bool = False,
    ) -> None:
        self.index = index
        self.is_last = index == num_stages - 1
        self.device = torch.device(device)
        self.module = layers.to(self.device)
        self.method = method
        self.policy = method.weight_policy
        self.micro_batches = micro_batches
        self.prediction_offset = prediction_offset
        self.loss_fn = loss_fn
        self.first_unit = first_unit
        self.grad_clip = grad_clip
        self.notes: list[str] = []
        """What this stage does differently from DESIGN.md's rule, said once each."""
        self.amp_dtype = AMP_DTYPES[amp] if amp is not None else None
        if self.amp_dtype is torch.float16 and self.device.type != "cuda":
            raise StageError(
                f"amp='fp16' needs a CUDA device (stage {index} is on {self.device}); use "
                f"amp='bf16' on CPU"
            )
        if method.split_backward and self.policy is not WeightPolicy.FLUSH:
            raise StageError(_split_refusal(method.name, self.policy))
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        # A stage of parameter-free layers (a lone ReLU) has nothing to update.
        self.optimizer = build_optimizer(optimizer, self._params, index) if self._params else None
        self.scheduler = (
            _build_scheduler(scheduler, self.optimizer, index)
            if scheduler is not None and self.optimizer is not None
            else None
        )
        # The run's own base rates: a resume with other rates rescales the loaded ones.
        self._base_lrs = [
            float(g.get("initial_lr", g["lr"]))
            for g in (self.optimizer.param_groups if self.optimizer is not None else [])
        ]
        self.scaler = (
            torch.amp.GradScaler(self.device.type)
            if self.amp_dtype is torch.float16 and self.optimizer is not None
            else None
        )
        self.predictor: WeightPredictor | None = None
        if self.policy is WeightPolicy.PREDICT and self.optimizer is not None:
            self.predictor = predictor_for(self.optimizer, method.prediction_rule or "optimizer")
            derived = _derived_weights(self.module)
            if derived:
                self._note(
                    f"stage {index}: {', '.join(derived)} compute their weights in the forward "
                    f"(parametrization or weight norm); the backward uses that value computed "
                    f"from the predicted weights, not from the current ones"
                )
        self._future_lrs: list[list[float]] | None = None  # cached until the next update
        self._lrs_unknown = False  # the scheduler cannot be queried: lr·s it is
        self._tracks_versions = self.policy is not WeightPolicy.PREDICT
        self._passes: dict[int, MicroBatchVersions] = {}
        self._cur = 0  # updates in this segment: the live weights are version _cur
        self._stash: dict[int, list[Tensor]] = {}  # frozen versions still needed
        self._pending_f: Counter[int] = Counter()  # forwards still to run, by version
        self._inflight: Counter[int] = Counter()  # forwards awaiting backward, by version
        self._predicted: list[Tensor] | None = None  # Ŵ of a predicted forward (reused)
        self._saved: dict[int, tuple[Tensor, Tensor]] = {}  # mb -> (input, output or loss)
        self._act_bytes: dict[int, int] = {}
        self._act_total = 0  # the sum of _act_bytes, kept as it changes
        self._grad_bytes = 0  # gradients held since the last update (counted once per update)
        self.prediction_seconds: deque[float] = deque(maxlen=1024)
        """Seconds of the latest timed predictions (CPU), for calibration; bounded, so a
        long run keeps no per-forward list."""
        self.correct: Tensor | None = None
        """Last stage: correct predictions of the latest forward (None: not a classifier)."""
        self.peak_weight_copies = 1
        self.predicted_backward = predicted_backward and self.predictor is not None
        """Keep Ŵ of each predicted forward for its backward (input gradients through Ŵ,
        consistent as PipeDream's stash, at one weight copy per mini-batch in flight)."""
        self._held: set[int] = set()  # micro-batches whose graph holds their own Ŵ
        self.closure: PredictionClosure | None = None
        """Set to measure how much of the stale distance each prediction removes."""
        self.grad_sync: Callable[[Sequence[Tensor]], None] | None = None
        """Set under data parallelism: averages the gradients over the stage's replicas
        before each update (``replicas.GradientAverager``)."""
        self._static_bytes: dict[str, int] = {}
        self._unit_params = _unit_params(self.module, self._params)
        """Trainable weights of each unit, where the stage can run its units one by one for
        a split backward (None: it cannot; the stage is then one unit)."""
        self._split = method.split_backward
        self._units_out: dict[int, list[tuple[Tensor, list[Tensor]]]] = {}
        """mb -> (unit output, its weights) of each weighted unit, kept by a split forward."""
        self._weight_half: dict[int, list[tuple[Tensor, Sequence[Tensor], Tensor]]] = {}
        """mb -> what its W runs (root, weights, gradient of the root), set by its I."""
        self._random = _draws_random_numbers(self.module)
        """Whether passes run under the stage's own RNG stream (see :meth:`rng`)."""
        self._act_cache: dict[tuple[Any, ...], int] = {}
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self._rng_state: Tensor = gen.get_state()
        self._refresh_static_bytes()

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            warnings.warn(text, stacklevel=3)

    # -- segments --------------------------------------------------------------------------
    def begin_segment(self, passes: dict[int, MicroBatchVersions]) -> None:
        """Start a never-flushed pipeline segment; versions count from 0 within it."""
        if self._saved or self._stash:
            raise RuntimeError(f"stage {self.index}: a segment began with passes in flight")
        self._passes = passes
        self._cur = 0
        self._inflight = Counter()
        self._pending_f = Counter(
            p.forward_version for p in passes.values() if self._tracks_versions
        )

    # -- passes ----------------------------------------------------------------------------
    def _autocast(self) -> Any:
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _run_units(self, weights: dict[str, Tensor] | None, x: Tensor) -> Tensor:
        """The stage's units on ``x``, with ``weights`` swapped in (None: its parameters)."""
        try:
            out: Tensor = (
                self.module(x) if weights is None else functional_call(self.module, weights, (x,))
            )
        except Exception as err:
            raise StageError(self._failure(x, err)) from err
        return out

    def _run_units_kept(
        self, x: Tensor, unit_params: list[list[Tensor]]
    ) -> tuple[Tensor, list[tuple[Tensor, list[Tensor]]] | None]:
        """The stage's units on ``x`` one by one (what ``nn.Sequential`` does), keeping the
        output of each unit with weights for a split backward; None in place of the kept
        outputs where two units hand on the same tensor (an in-place unit with weights)."""
        kept: list[tuple[Tensor, list[Tensor]]] | None = []
        seen = {id(x)}
        h = x
        try:
            for unit, params in zip(self.module, unit_params, strict=True):
                h = unit(h)
                if not params or not isinstance(h, Tensor) or not h.requires_grad:
                    continue
                if kept is not None and id(h) not in seen:
                    seen.add(id(h))
                    kept.append((h, params))
                else:
                    kept = None
        except Exception as err:
            raise StageError(self._failure(x, err)) from err
        if not isinstance(h, Tensor):
            raise StageError(
                f"stage {self.index}: the last unit returned {type(h).__name__}, not a tensor"
            )
        return h, kept

    def _failure(self, x: Tensor, err: Exception) -> str:
        with self._autocast():
            return describe_failure(
                list(self.module), x, stage=self.index, first_unit=self.first_unit, error=err
            )

    def loss(self, out: Tensor, target: Tensor, where: str) -> Tensor:
        """``loss_fn(out, target)``, checked to be a scalar; errors name the values."""
        return checked_loss(self.loss_fn, out, target, where, self.index)

    def count_correct(self, out: Tensor, target: Tensor) -> Tensor | None:
        """Correct argmax predictions, where the output is a score per class of each target."""
        if target.is_floating_point() or out.dim() != target.dim() + 1:
            return None
        if out.shape[:-1] != target.shape:
            return None
        with torch.no_grad():
            return (out.argmax(dim=-1) == target).sum()

    def forward(self, mb: int, x: Tensor, target: Tensor | None = None) -> Tensor:
        """Run micro-batch ``mb``; returns the (detached) output, or on the last stage the
        loss already divided by M."""
        v = self.versions(mb)
        if v.forward_base != self._cur:
            raise RuntimeError(
                f"stage {self.index}: forward of micro-batch {mb} after {self._cur} updates, "
                f"the schedule analysis says {v.forward_base}"
            )
        x_in = x.detach().requires_grad_(True) if x.is_floating_point() and self.index > 0 else x
        s = self.distance(mb)
        sources = self._sources(v.forward_version, mb)
        # Flush methods never update between a forward and its backward: the module runs on
        # its own parameters, with no alias per parameter.
        direct = self.policy is WeightPolicy.FLUSH
        recast = self.amp_dtype is not None and not direct
        held = s > 0 and self.predicted_backward
        # A predicted forward runs on Ŵ in the stage's prediction buffer; what the graph
        # saves of it is re-pointed at the live weights, which the backward is to read.
        predicted = s > 0 and not held
        # Activation bytes are counted by a saved-tensor hook on the first forward of each
        # input shape, then reused (the hook runs on every pass only to re-cast under amp
        # and to re-point a predicted forward's saved weights).
        shape_key = (tuple(x.shape), x.dtype)
        known = self._act_cache.get(shape_key)
        hooked = recast or known is None or predicted
        weight_ptrs = {t.untyped_storage().data_ptr() for t in sources} if hooked else set()
        counted: set[int] = set()
        act = 0
        aliases: dict[Any, Tensor] = {}
        live_of: dict[int, tuple[Tensor, Tensor]] = {}  # buffer storage -> (buffer, live)

        def pack(t: Tensor) -> Tensor | _Recast:
            nonlocal act
            if recast and t.dtype == self.amp_dtype:
                source = _cast_source(t, aliases)
                if source is not None:
                    return _Recast(
                        source, t.dtype, tuple(t.shape), t.stride(), int(t.storage_offset())
                    )
            ptr = t.untyped_storage().data_ptr()
            if ptr in live_of:  # a view of Ŵ: the same view of the live weights
                buffer, live = live_of[ptr]
                offset = live.storage_offset() + t.storage_offset() - buffer.storage_offset()
                return _Recast(live, t.dtype, tuple(t.shape), t.stride(), int(offset))
            if ptr not in weight_ptrs and ptr not in counted:
                counted.add(ptr)
                act += t.untyped_storage().nbytes()
            return t

        with (
            self.rng(),
            torch.autograd.graph.saved_tensors_hooks(pack, _unpack) if hooked else nullcontext(),
            self._autocast(),
        ):
            live = sources
            if held:
                # Ŵ in its own storage: the graph keeps it, so the backward reads it too.
                sources = self._held_prediction(s)
                weight_ptrs.update(t.untyped_storage().data_ptr() for t in sources)
            elif predicted:
                sources = self._write_prediction(s)
                for buffer, w in zip(sources, live, strict=True):
                    live_of[buffer.untyped_storage().data_ptr()] = (buffer, w)
                weight_ptrs.update(live_of)
            if s > 0 and self.closure is not None:
                self.closure.forward(self.index, mb, s, sources, self._params)
            weights: dict[str, Tensor] | None = None
            if not direct:
                weights = {}
                for n, p, src, now in zip(self._names, self._params, sources, live, strict=True):
                    weights[n] = w = _alias(p, src)
                    # a saved cast is re-cast at backward from the weights it is to read
                    aliases[w.grad_fn] = src if held else now
            units: list[tuple[Tensor, list[Tensor]]] | None = None
            if self._split and weights is None and self._unit_params is not None:
                out, units = self._run_units_kept(x_in, self._unit_params)
            else:
                out = self._run_units(weights, x_in)
            if self.is_last:
                if target is None:
                    raise RuntimeError(f"stage {self.index}: the last stage needs targets")
                self.correct = self.count_correct(out, target)
                out = self.loss(out, target, f"micro-batch {mb}") / self.micro_batches
        if hooked:
            pack(out)
            self._act_cache.setdefault(shape_key, act)
        if held:
            self._held.add(mb)
        if units is not None:
            self._units_out[mb] = units
        self._saved[mb] = (x_in, out)
        self._act_bytes[mb] = act if hooked else self._act_cache[shape_key]
        self._act_total += self._act_bytes[mb]
        return out.detach()

    def forward_eval(self, x: Tensor) -> Tensor:
        """Forward on the live weights without autograd (evaluation); the caller puts the
        module in eval mode."""
        with torch.no_grad(), self._autocast():
            try:
                out: Tensor = self.module(x)
            except Exception as err:
                raise StageError(self._failure(x, err)) from err
        return out

    def backward(self, mb: int, grad: Tensor | None = None) -> Tensor | None:
        """Backward of micro-batch ``mb``; returns the gradient of its input (None on the
        first stage). Gradients accumulate until :meth:`update`."""
        v = self.versions(mb)
        if v.backward_version != self._cur and v.backward_version not in self._stash:
            raise RuntimeError(
                f"stage {self.index}: backward of micro-batch {mb} needs version "
                f"{v.backward_version}, which the stage no longer holds (live {self._cur})"
            )
        x_in, out = self._saved.pop(mb)
        self._units_out.pop(mb, None)
        self._act_total -= self._act_bytes.pop(mb, 0)
        if self.closure is not None:
            self.closure.backward(self.index, mb, self._params)
        self._held.discard(mb)
        scaler = self.scaler
        if out.requires_grad:
            with self.rng():
                if self.is_last:
                    torch.autograd.backward(scaler.scale(out) if scaler else out)
                elif grad is not None:
                    torch.autograd.backward(out, scaler.scale(grad) if scaler else grad)
        self._retire(v)
        return self._true_gradient(x_in.grad if x_in.requires_grad else None)

    def _retire(self, v: MicroBatchVersions) -> None:
        """A micro-batch's backward is complete (its B, or the W of a split one): release
        the weight version its forward held and count the gradients it accumulated."""
        if self._tracks_versions:
            self._inflight[v.forward_version] -= 1
            self._release(v.forward_version)
        if not self._grad_bytes:  # later backwards accumulate into the same buffers
            self._grad_bytes = _nbytes(p.grad for p in self._params)

    def _true_gradient(self, g_in: Tensor | None) -> Tensor | None:
        """The input gradient as sent upstream: unscaled where fp16 loss scaling runs."""
        scaler = self.scaler
        if g_in is not None and scaler is not None:
            g_in = g_in / scaler.scale(torch.ones((), device=g_in.device))
        return g_in

    def backward_input(self, mb: int, grad: Tensor | None = None) -> Tensor | None:
        """The input half I of micro-batch ``mb``'s split backward: returns the gradient of
        its input (None on the first stage), as :meth:`backward` does, and keeps the graph
        and the gradient of each weighted unit's output for :meth:`backward_weight`; no
        weight gradient is computed. Synchronous (flush) methods only."""
        self._check_split("I", mb)
        if mb in self._weight_half:
            raise RuntimeError(f"stage {self.index}: a second I of micro-batch {mb}")
        v = self.versions(mb)
        if v.backward_version != self._cur:
            raise RuntimeError(
                f"stage {self.index}: I of micro-batch {mb} needs version {v.backward_version} "
                f"(live {self._cur})"
            )
        x_in, out = self._saved[mb]
        if self.closure is not None:
            self.closure.backward(self.index, mb, self._params)
        scaler = self.scaler
        root: Tensor | None = None
        root_grad: Tensor | None = None
        if out.requires_grad:
            if self.is_last:
                root = scaler.scale(out) if scaler else out
            elif grad is not None:
                root, root_grad = out, scaler.scale(grad) if scaler else grad
        units = self._units_out.pop(mb, None)
        half: list[tuple[Tensor, Sequence[Tensor], Tensor]] = []
        g_in: Tensor | None = None
        if root is not None:
            wants_input = x_in.requires_grad
            targets = [x_in] if wants_input else []
            if units is not None:
                targets += [t for t, _ in units]
            elif self._params:  # one unit: W walks the whole graph for the weights only
                half.append(
                    (root, self._params, torch.ones_like(root) if root_grad is None else root_grad)
                )
            if targets:
                with self.rng():
                    found = torch.autograd.grad(
                        root, targets, root_grad, retain_graph=True, allow_unused=True
                    )
                if wants_input:
                    g_in, found = found[0], found[1:]
                for (t, params), g in zip(units or [], found, strict=True):
                    if g is not None:
                        half.append((t, params, g))
        self._weight_half[mb] = half
        extra = _nbytes(g for _, _, g in half)  # held until W, with the activations
        self._act_bytes[mb] = self._act_bytes.get(mb, 0) + extra
        self._act_total += extra
        return self._true_gradient(g_in)

    def backward_weight(self, mb: int) -> None:
        """The weight half W of micro-batch ``mb``'s split backward, after its I: the weight
        gradients accumulate into ``.grad`` (until :meth:`update`), then the micro-batch's
        graph and activations are released."""
        self._check_split("W", mb)
        half = self._weight_half.pop(mb, None)
        if half is None:
            raise RuntimeError(f"stage {self.index}: W of micro-batch {mb} before its I")
        v = self.versions(mb)
        with self.rng():
            for root, params, g in half:
                # inputs=: autograd walks only what leads to these weights (this unit).
                torch.autograd.backward(root, g, inputs=params, retain_graph=True)
        del half
        self._saved.pop(mb)
        self._act_total -= self._act_bytes.pop(mb, 0)
        self._held.discard(mb)
        self._retire(v)

    def _check_split(self, half: str, mb: int) -> None:
        if self.policy is not WeightPolicy.FLUSH:
            raise StageError(_split_refusal(self.method.name, self.policy, half))
        if mb not in self._saved:
            raise RuntimeError(f"stage {self.index}: {half} of micro-batch {mb} before its F")

    def update(self) -> None:
        """Apply the accumulated gradient with the optimizer (one update per mini-batch),
        then step the LR scheduler. The predictor records its state through the optimizer's
        step hooks, so a step a GradScaler skips records nothing."""
        cur = self._cur
        if self._tracks_versions and self._pending_f[cur] + self._inflight[cur] > 0:
            self._freeze(cur)
        opt = self.optimizer
        if opt is not None:
            if self.grad_sync is not None:  # before unscaling, clipping: replicas stay equal
                self.grad_sync(self._params)
            if self.scaler is not None:
                if self.grad_clip is not None:
                    self.scaler.unscale_(opt)
                    nn.utils.clip_grad_norm_(self._params, self.grad_clip)
                self.scaler.step(opt)
                self.scaler.update()
            else:
                if self.grad_clip is not None:
                    nn.utils.clip_grad_norm_(self._params, self.grad_clip)
                opt.step()
            if self.scheduler is not None:
                self.scheduler.step()
            opt.zero_grad(set_to_none=True)
        self._future_lrs = None
        self._cur += 1
        self._note_copies()
        self._static_dirty = True  # recounted when memory() is next read, not per update
        self._grad_bytes = 0  # zero_grad(set_to_none=True) freed them

    # -- versions --------------------------------------------------------------------------
    def versions(self, mb: int) -> MicroBatchVersions:
        """The versions micro-batch ``mb`` of this segment meets on this stage."""
        try:
            return self._passes[mb]
        except KeyError:
            raise RuntimeError(
                f"stage {self.index}: micro-batch {mb} is not in this segment"
            ) from None

    @property
    def version(self) -> int:
        """Updates made in this segment: the live weights are this version."""
        return self._cur

    def activation_bytes(self, mb: int) -> int:
        """Bytes the forward of ``mb`` saved for its backward (0 once it ran)."""
        return self._act_bytes.get(mb, 0)

    def distance(self, mb: int) -> int:
        """The prediction distance this stage uses for ``mb`` (0 if it does not predict)."""
        if self.predictor is None:
            return 0
        return prediction_distance(self.versions(mb).distance, self.prediction_offset)

    def _sources(self, version: int, mb: int) -> list[Tensor]:
        if not self._tracks_versions or version == self._cur:
            sources = [p.data for p in self._params]
        elif version in self._stash:
            sources = self._stash[version]
        else:
            raise RuntimeError(
                f"stage {self.index}: forward of micro-batch {mb} needs version {version}, "
                f"which the stage does not hold (live {self._cur}, kept {sorted(self._stash)})"
            )
        if self._tracks_versions:
            self._pending_f[version] -= 1
            self._inflight[version] += 1
        return sources

    def _freeze(self, version: int) -> None:
        # The live storage becomes the frozen version (graphs alias it); the parameter moves
        # to a copy, which the optimizer updates.
        self._stash[version] = [p.data for p in self._params]
        for p in self._params:
            p.data = p.data.clone()
        self._note_copies()

    def _release(self, version: int) -> None:
        if version in self._stash and self._pending_f[version] + self._inflight[version] <= 0:
            del self._stash[version]

    def _lrs(self, s: int) -> list[list[float]] | None:
        """Learning rates of the next s updates under the scheduler (None: use lr·s)."""
        if self.scheduler is None or self.optimizer is None or self._lrs_unknown:
            return None
        cached = self._future_lrs
        if cached is None or any(len(row) < s for row in cached):
            cached = future_lrs(self.scheduler, self.optimizer, s)
            if cached is None:
                self._lrs_unknown = True
                self._note(
                    f"stage {self.index}: {type(self.scheduler).__name__} cannot be queried for "
                    f"its future learning rates; prediction uses the current lr times s"
                )
            self._future_lrs = cached
        return cached

    def _write_prediction(self, s: int) -> list[Tensor]:
        """Ŵ in the stage's prediction buffer (the one extra weight copy, reused)."""
        assert self.predictor is not None
        timed = self.device.type == "cpu"  # on CUDA reading a clock here would need a sync
        started = time.perf_counter() if timed else 0.0
        if self._predicted is None:
            self._predicted = [torch.empty_like(p) for p in self._params]
            self._note_copies()
        kept = self.predictor.kept_computations
        self.predictor.predict_into(self._predicted, s, self._lrs(s))
        if self.predictor.kept_computations != kept:
            self._static_dirty = True  # a newly kept Δ counts in the predictor's bytes
        if timed:
            self.prediction_seconds.append(time.perf_counter() - started)
        return self._predicted

    def _held_prediction(self, s: int) -> list[Tensor]:
        assert self.predictor is not None
        predicted = [torch.empty_like(p) for p in self._params]
        self.predictor.predict_into(predicted, s, self._lrs(s))
        self.peak_weight_copies = max(self.peak_weight_copies, self.weight_copies() + 1)
        return predicted

    @property
    def prediction_s(self) -> float | None:
        """Median seconds a recent predicted forward spent writing Ŵ (CPU only), or None
        when none was timed."""
        times = self.prediction_seconds
        return statistics.median(times) if times else None

    def weight_copies(self) -> int:
        """Weight copies held now: live, frozen versions, the predicted-forward buffer."""
        buffer = 1 if self._predicted is not None else 0
        return 1 + len(self._stash) + buffer + len(self._held)

    def _note_copies(self) -> None:
        self.peak_weight_copies = max(self.peak_weight_copies, self.weight_copies())

    # -- randomness ------------------------------------------------------------------------
    @contextmanager
    def rng(self) -> Iterator[None]:
        """Run under this stage's own RNG stream (dropout...), so results do not depend on
        how many stages share a process, and a checkpoint can restore it. A stage whose
        modules draw no random numbers skips the two state copies per pass."""
        if not self._random:
            yield
            return
        cuda = self.device.type == "cuda"
        saved = torch.cuda.get_rng_state(self.device) if cuda else torch.get_rng_state()
        if cuda:
            torch.cuda.set_rng_state(self._rng_state, self.device)
        else:
            torch.set_rng_state(self._rng_state)
        try:
            yield
        finally:
            if cuda:
                self._rng_state = torch.cuda.get_rng_state(self.device)
                torch.cuda.set_rng_state(saved, self.device)
            else:
                self._rng_state = torch.get_rng_state()
                torch.set_rng_state(saved)

    # -- memory ----------------------------------------------------------------------------
    def _refresh_static_bytes(self) -> None:
        # Sizes that change only at an update, kept out of the per-action memory sample.
        opt = 0
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                opt += _nbytes(v for v in st.values() if isinstance(v, Tensor))
        if self.predictor is not None:
            opt += _nbytes(self.predictor.held_tensors())
        self._static_bytes = {"weights": _nbytes(self._params), "optimizer": opt}
        self._static_dirty = False

    def memory(self) -> dict[str, int]:
        """Bytes held by this stage, by kind (weights, stash, optimizer, activations...)."""
        if self._static_dirty:
            self._refresh_static_bytes()
        weights = self._static_bytes["weights"]
        return {
            **self._static_bytes,
            "stash": weights * (self.weight_copies() - 1),  # every copy but the live one
            "gradients": self._grad_bytes,
            "activations": self._act_total,
        }

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Weights, optimizer, scheduler, loss scaler, predictor and RNG state; only valid
        between segments."""
        if self._saved or self._stash:
            raise RuntimeError(f"stage {self.index}: checkpoint with passes in flight")
        return {
            "module": self.module.state_dict(),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "predictor": None if self.predictor is None else self.predictor.state_dict(),
            "rng": self._rng_state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Load a :meth:`state_dict`. Where this stage was built with other base learning
        rates than the saved run, the loaded (scheduled) rates are rescaled to them, so a
        resume can change the lr and keep the schedule's progress; returns what changed."""
        self.module.load_state_dict(state["module"])
        changes: list[str] = []
        if self.optimizer is not None:
            saved = state["optimizer"]["param_groups"]
            # A copy: torch.optim keeps same-device tensors as given, which would alias a
            # state dict that is still in use elsewhere.
            self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
            for i, (group, old) in enumerate(zip(self.optimizer.param_groups, saved, strict=True)):
                old_base, new_base = float(old.get("initial_lr", old["lr"])), self._base_lrs[i]
                if old_base != new_base and old_base > 0:
                    group["lr"] = float(group["lr"]) * new_base / old_base
                    if "initial_lr" in group:
                        group["initial_lr"] = new_base
                    changes.append(f"stage {self.index} lr {old_base:g} -> {new_base:g}")
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
            if changes and self.optimizer is not None:
                self.scheduler.base_lrs = list(self._base_lrs)
                self.scheduler._last_lr = [float(g["lr"]) for g in self.optimizer.param_groups]
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        if self.predictor is not None and state.get("predictor") is not None:
            self.predictor.load_state_dict(state["predictor"])
        self._rng_state = state["rng"].clone()
        self._future_lrs = None
        self._refresh_static_bytes()
        return changes


def checked_loss(loss_fn: LossFn, out: Tensor, target: Tensor, where: str, stage: int) -> Tensor:
    """``loss_fn(out, target)``, checked to be a scalar; errors name the stage and values."""
    try:
        loss = loss_fn(out, target)
    except Exception as err:
        raise StageError(
            f"stage {stage} (the last): the loss failed on {where}: {type(err).__name__}: "
            f"{err} (output shape {tuple(out.shape)} {out.dtype}, targets shape "
            f"{tuple(target.shape)} {target.dtype}{_target_range(target)}); check the targets "
            f"and the loss function"
        ) from err
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise StageError(
            f"the loss function returned {shape}, not a scalar tensor; reduce it (e.g. "
            f"reduction='mean' or .mean()) so every micro-batch gives one number"
        )
    return loss


def _split_refusal(name: str, policy: WeightPolicy, half: str | None = None) -> str:
    what = f"an {half} (half of a split backward)" if half else "a split backward (I/W)"
    return (
        f"method {name!r} runs {what} under the {policy.name} weight policy; the runtime "
        f"splits backwards only for synchronous (flush) methods, where no update comes "
        f"between a forward and its W: merge each I and W into one B "
        f"(pipeoptim.plan.passes.merge_backward) for this method"
    )


def _unit_params(module: nn.Module, params: Sequence[Tensor]) -> list[list[Tensor]] | None:
    """The trainable weights of each unit of ``module``, where a forward may run its units
    one by one with each unit's weights its own: a plain ``nn.Sequential`` without hooks,
    whose every weight belongs to exactly one unit. None otherwise."""
    if type(module).forward is not nn.Sequential.forward:
        return None
    if module._forward_hooks or module._forward_pre_hooks:
        return None
    owner: dict[int, int] = {}
    units: list[list[Tensor]] = []
    for i, unit in enumerate(module._modules.values()):  # as the forward runs them
        if unit is None:
            return None
        mine: list[Tensor] = [p for p in unit.parameters() if p.requires_grad]
        for p in mine:
            if owner.setdefault(id(p), i) != i:
                return None  # shared by two units: one W pass would count it twice
        units.append(mine)
    if set(owner) != {id(p) for p in params}:
        return None
    return units


def _unpack(saved: Tensor | _Recast) -> Tensor:
    if isinstance(saved, _Recast):
        cast = saved.source.detach().to(saved.dtype)
        return cast.as_strided(saved.size, saved.stride, saved.offset)
    return saved


def _target_range(target: Tensor) -> str:
    if target.is_floating_point() or target.numel() == 0:
        return ""
    return f", values {int(target.min())}..{int(target.max())}"
