"""One pipeline stage: the forward and backward of a slice of layers over its parts.

Why this shape: in an asynchronous pipeline a stage updates its weights while mini-batches
whose forward already ran are still waiting for their backward. What weights those forwards
and backwards see is the method (DESIGN.md, "Weight-version semantics"). The stage is the
forward/backward that ties together one part per concern:

* :mod:`~pipeoptim.runtime.stage.weights`: the version store (stash, double buffer, prediction
  buffer, in-flight counts) and the aliases through which autograd reads a version;
* :mod:`~pipeoptim.runtime.stage.precision`: autocast, the re-cast of saved weight casts, the fp16
  scaler;
* :mod:`~pipeoptim.runtime.optim.update`: optimizer, scheduler, gradient sync, clipping and the
  delay correction a method names;
* :mod:`~pipeoptim.runtime.stage.memory`: the bytes held, by kind;
* :mod:`~pipeoptim.runtime.stage.rng`: the stage's own random stream;
* :mod:`~pipeoptim.runtime.stage.split_backward`: the I and W halves of zero-bubble schedules.

PREDICT writes the prediction ``Ŵ = W - lr·s·Δ`` into the prediction buffer (once per distance
between two updates), runs the forward on it, and re-points what the graph saves of Ŵ at the
live weights, so the backward runs on the current weights, as DESIGN.md specifies; where every
predicted forward meets one update before its backward and several meet each one (XPipe), the
buffer becomes the live weights at that update instead (one weight copy per update), and the
forward runs with no saved-tensor hook.

A forward on a version other than the live one runs the module on aliases of that version's
storage, put in the module's parameter slots (:mod:`~pipeoptim.runtime.stage.swap`), one alias
per weight and version; a forward that no update separates from its backward runs on the
module's own parameters (issue 34: per micro-batch, ``functional_call`` and fresh aliases cost
XPipe 1.8x GPipe's step at 16 stages). Under mixed precision a saved cast of a weight is
re-cast at backward from the weights the policy says the backward uses (the live ones for
predicting methods, the stashed version for PipeDream). Weights derived by other computations
(``torch.nn.utils.parametrize``, weight norm) cannot be re-derived generically: for predicting
methods their backward uses the value computed from Ŵ, and the stage says so once
(``Stage.notes``).

A unit may return a tuple of tensors, which the next unit takes as its positional arguments
(:mod:`~pipeoptim.runtime.stage.chain`), and a stage's input and output may be such tuples
(:mod:`~pipeoptim.runtime.payload`): the floating-point tensors of an input take gradients,
the backward returns one per floating-point tensor (None for the others), and a last stage's
tuple output goes to the loss as it is. A single tensor keeps its own code path.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.optim import Optimizer

from pipeoptim.errors import StageError
from pipeoptim.plan.methods import Method, WeightPolicy
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.plan.versions import MicroBatchVersions, gradient_delays, prediction_distance
from pipeoptim.runtime.checkpoint.state_check import (
    check_module_state,
    check_predictor_state,
    check_stage_state,
)
from pipeoptim.runtime.optim.builder import build_stage_rule
from pipeoptim.runtime.optim.corrections.protocol import StageContext
from pipeoptim.runtime.optim.predict import WeightPredictor
from pipeoptim.runtime.optim.prediction_closure import PredictionClosure
from pipeoptim.runtime.optim.update import OptimizerFactory, SchedulerFactory, StageUpdate
from pipeoptim.runtime.options import StageOptions
from pipeoptim.runtime.payload import (
    Gradients,
    Payload,
    checked_payload_loss,
    checked_tuple,
    input_gradients,
    output_roots,
    payload_bytes,
)
from pipeoptim.runtime.stage.accumulate_in_product import AccumulateInProduct
from pipeoptim.runtime.stage.chain import UnitChain, as_chain
from pipeoptim.runtime.stage.diagnose import (
    describe_failure,
    out_of_memory,
    out_of_memory_message,
)
from pipeoptim.runtime.stage.loss import LossFn, count_correct
from pipeoptim.runtime.stage.memory import StageMemory
from pipeoptim.runtime.stage.precision import Precision, unpack
from pipeoptim.runtime.stage.recompute import Recomputation, RegionWeights, Steps, run_steps
from pipeoptim.runtime.stage.rng import StageRandom
from pipeoptim.runtime.stage.saved import ForwardSaves
from pipeoptim.runtime.stage.split_backward import (
    KeptUnits,
    Root,
    WeightHalf,
    input_half,
    reentrant_refusal,
    run_units_kept,
    split_refusal,
    unit_params,
    weight_half,
)
from pipeoptim.runtime.stage.swap import ParameterSlots
from pipeoptim.runtime.stage.weights import WeightVersions, alias

__all__ = ["Stage"]


def _derived_weights(module: nn.Module) -> list[str]:
    """Submodules whose weights are computed in the forward (parametrizations, weight norm)."""
    found = []
    for name, sub in module.named_modules():
        hooks = getattr(sub, "_forward_pre_hooks", {}).values()
        if parametrize.is_parametrized(sub) or any(type(h).__name__ == "WeightNorm" for h in hooks):
            found.append(name or type(sub).__name__)
    return found


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
        delay: int = 0,
        shard_group: Any = None,
        recompute: frozenset[int] = frozenset(),
    ) -> None:
        self.index = index
        self.is_last = index == num_stages - 1
        self.device = torch.device(device)
        # units may hand on tuples (unit(*h)); the same object, so state_dict keys stay
        self.module = as_chain(layers).to(self.device)
        self.method = method
        self.stage_policy = method.stage_policy(index, num_stages)
        """What this stage does under its method: versions, copies, predictor, A_k."""
        self.policy = self.stage_policy.versions
        self.micro_batches = micro_batches
        self.prediction_offset = prediction_offset
        self.loss_fn = loss_fn
        self.first_unit = first_unit
        self.grad_clip = grad_clip
        self.notes: list[str] = []
        """What this stage does differently from DESIGN.md's rule, said once each."""
        self._params = [p for p in self.module.parameters() if p.requires_grad]
        self.precision = Precision(amp, self.device, stage=index, has_weights=bool(self._params))
        if self.stage_policy.splits_backward and not self.stage_policy.keeps_one_version:
            raise StageError(split_refusal(method.name, self.policy))
        self.amp_dtype = self.precision.dtype
        rule = build_stage_rule(
            self._params,
            context=StageContext(
                index, num_stages, method.name, delay, micro_batches, module=self.module
            ),
            method=method,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=self.precision.scaler,
            grad_clip=grad_clip,
            note=self._note,
            shard_group=shard_group,  # the replicas' group: optimizer state sharded (ZeRO-1)
        )
        self.context = rule.context
        """What the optimizer factory and the delay correction are told of this stage."""
        self.accumulation = self.stage_policy.accumulation
        """A_k: the mini-batches this stage accumulates per update (1 but under a bounded
        delay, where :meth:`update` applies their mean gradient)."""
        adds_up = micro_batches > 1 or self.accumulation > 1
        sends_gradient = index > 0
        in_product = (
            AccumulateInProduct(self.module)
            if (adds_up or sends_gradient) and not self.stage_policy.splits_backward
            else None
        )
        self._in_product = in_product if in_product is not None and in_product.active else None
        """Where several backwards add up before an update, or a stage sends its input's
        gradient upstream: linear layers' weight gradients added inside their products, on
        forwards that run on the parameters themselves (``accumulate_in_product.py``); not
        where a backward is split, whose input half must leave the weights' gradients
        alone."""
        if self._in_product is not None and sends_gradient:
            self._in_product.defer = True
        self._unfinished: tuple[MicroBatchVersions, Payload] | None = None
        """The latest backward (its versions and input) where its weight gradients wait
        for :meth:`finish_backward`: a stage that sends its input's gradient upstream adds
        them after that send, at the start of its next action
        (``accumulate_in_product.py``)."""
        # A stage of parameter-free layers (a lone ReLU) has nothing to update: all None.
        self.optimizer: Optimizer | None = rule.optimizer
        self.updater: StageUpdate | None = rule.update
        self.predictor: WeightPredictor | None = rule.predictor
        if self.predictor is not None:
            derived = _derived_weights(self.module)
            if derived:
                self._note(
                    f"stage {index}: {', '.join(derived)} compute their weights in the forward "
                    f"(parametrization or weight norm); the backward uses that value computed "
                    f"from the predicted weights, not from the current ones"
                )
        self.weights = WeightVersions(self.policy, self._params, index)
        self._slots = ParameterSlots(self.module, self._params)
        """Where the module holds each weight: a forward on another version fills them."""
        self._prediction_key: tuple[int, int] | None = None
        """(updates made, s) of the Ŵ in the prediction buffer; None: none is valid."""
        self._reads_buffer = False
        """This segment's predicted forwards leave their graphs on the prediction buffer,
        which becomes the live weights at the next update (``weights.py``), instead of
        re-pointing what they save at the live weights with a hook."""
        self._saved: dict[int, tuple[Payload, Payload]] = {}  # mb -> (input, output or loss)
        self._group_order: list[int] | None = None  # the stage's param index, group order
        self._delays: dict[int, int] = {}  # local update -> its delay (with a correction)
        self._backwards_since_update = 0  # micro-batches whose gradient the next update applies
        self._updates_before_segment = 0  # this process's updates in earlier segments
        self.prediction_seconds: deque[float] = deque(maxlen=1024)
        """Seconds of the latest timed predictions (CPU), for calibration; bounded, so a
        long run keeps no per-forward list."""
        self.correct: Tensor | None = None
        """Last stage: correct predictions of the latest forward (None: not a classifier)."""
        self.predicted_backward = predicted_backward and self.predictor is not None
        """Keep Ŵ of each predicted forward for its backward (input gradients through Ŵ,
        consistent as PipeDream's stash, at one weight copy per mini-batch in flight)."""
        self.closure: PredictionClosure | None = None
        """Set to measure how much of the stale distance each prediction removes."""
        self.memory_count = StageMemory(
            self._params,
            self.optimizer,
            self.predictor.held_tensors if self.predictor is not None else None,
        )
        self._unit_params = unit_params(self.module, self._params)
        """Trainable weights of each unit, where the stage can run its units one by one for
        a split backward (None: it cannot; the stage is then one unit)."""
        self._split = self.stage_policy.splits_backward
        self._units_out: dict[int, KeptUnits] = {}
        """mb -> (unit output, its weights) of each weighted unit, kept by a split forward."""
        self._weight_half: dict[int, WeightHalf] = {}
        """mb -> what its W runs (root, weights, gradient of the root), set by its I."""
        # the chain is pipeoptim's class, not torch.nn's, which rng would take for user code
        # that draws random numbers: its units decide
        chained = isinstance(self.module, UnitChain)
        units = nn.ModuleList(self.module) if chained else self.module
        self.random = StageRandom(units, self.device, seed)
        self.recompute: Recomputation | None = (
            Recomputation(self.module, recompute, self._params, index) if recompute else None
        )
        """The units whose activations the backward recomputes (``recompute.py``)."""
        self.buffer_sync: Callable[[], None] | None = None
        """Set under data parallelism where the stage has floating-point buffers: gives
        every replica replica 0's buffers at each update (``replicas.BufferBroadcast``)."""

    @classmethod
    def from_options(
        cls,
        index: int,
        layers: nn.Sequential,
        options: StageOptions,
        *,
        num_stages: int,
        method: Method,
        micro_batches: int,
        device: torch.device | str,
        first_unit: int,
        delay: int,
        shard_group: Any = None,
    ) -> Stage:
        """Stage ``index`` of a run built with the run's :class:`StageOptions` (the
        Pipeline's path; the keyword form serves a stage built alone)."""
        return cls(
            index,
            layers,
            num_stages=num_stages,
            method=method,
            optimizer=options.optimizer,
            micro_batches=micro_batches,
            prediction_offset=options.prediction_offset,
            device=device,
            seed=options.stage_seed(index),
            loss_fn=options.loss_fn,
            scheduler=options.scheduler,
            amp=options.amp,
            grad_clip=options.grad_clip,
            first_unit=first_unit,
            predicted_backward=options.predicted_backward,
            delay=delay,
            shard_group=shard_group,
            recompute=options.recompute.get(index, frozenset()),
        )

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            warnings.warn(text, stacklevel=3)

    # -- the parts' public faces -----------------------------------------------------------
    @property
    def scheduler(self) -> Any:
        """The stage's LR scheduler (None: constant rates, or no weights)."""
        return None if self.updater is None else self.updater.scheduler

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The fp16 gradient scaler (None: no fp16 loss scaling)."""
        return self.precision.scaler

    @property
    def grad_sync(self) -> Callable[[Sequence[Tensor]], None] | None:
        """Averages the gradients over the stage's replicas before each update (set under
        data parallelism: ``replicas.GradientAverager``)."""
        return None if self.updater is None else self.updater.grad_sync

    @grad_sync.setter
    def grad_sync(self, sync: Callable[[Sequence[Tensor]], None] | None) -> None:
        if self.updater is not None:
            self.updater.grad_sync = sync

    @property
    def recompute_held_bytes(self) -> int:
        """Bytes of Ŵ a predicted forward's recomputed units hold until its backward (0: the
        stage does not predict, or recomputes nothing)."""
        if self.recompute is None or self.policy is not WeightPolicy.PREDICT:
            return 0
        if self.predicted_backward or self.predictor is None:
            return 0  # a predicted backward's Ŵ is the copy its graph holds anyway
        return self.recompute.held_bytes

    @property
    def peak_weight_copies(self) -> int:
        """The most weight copies held at once so far (live ones included)."""
        return self.weights.peak_copies

    def weight_copies(self) -> int:
        """Weight copies held now: live, frozen versions, the predicted-forward buffer."""
        return self.weights.copies()

    def memory(self) -> dict[str, int]:
        """Bytes held by this stage, by kind (weights, stash, optimizer, activations...)."""
        return self.memory_count.snapshot(self.weights.copies())

    def activation_bytes(self, mb: int) -> int:
        """Bytes the forward of ``mb`` saved for its backward (0 once it ran)."""
        return self.memory_count.activation_bytes(mb)

    @contextmanager
    def rng(self) -> Iterator[None]:
        """Run under this stage's own RNG stream (see :mod:`pipeoptim.runtime.stage.rng`)."""
        with self.random.stream():
            yield

    # -- segments --------------------------------------------------------------------------
    def begin_segment(self, passes: dict[int, MicroBatchVersions]) -> None:
        """Start a never-flushed pipeline segment; versions count from 0 within it."""
        self.finish_backward()
        if self._saved or self.weights.stash:
            raise RuntimeError(f"stage {self.index}: a segment began with passes in flight")
        self._updates_before_segment += self.weights.current
        self.weights.begin_segment(passes)
        self._prediction_key = None
        self._reads_buffer = self._buffer_becomes_live(passes)
        self.weights.leaf_grads = self._grads_on_leaves()
        self._delays = {}
        if self.updater is not None and self.updater.correction is not None:
            self._delays = gradient_delays(passes.values(), self.policy, self.accumulation)

    def forget_passes(self, mbs: list[int]) -> None:
        """The forwards of ``mbs`` will not run: a stop cut the segment short."""
        self.finish_backward()
        self.weights.forget(mbs)

    def _buffer_becomes_live(self, passes: dict[int, MicroBatchVersions]) -> bool:
        """Whether the predicted forwards of a segment of ``passes`` leave their graphs on
        the prediction buffer: every one meets exactly one update before its backward (at
        which the buffer becomes the live weights) and every other pass none (so no graph
        reads the live storage the parameters leave). In fp32 only: under autocast a saved
        cast of Ŵ is re-cast from the live weights by the hook anyway. And only where some
        update is met by several predicted forwards (XPipe's micro-batches): the buffer
        costs a copy of the weights per update, the hook a few calls per saved tensor of
        each predicted forward, so one forward per update (PipeOptim's whole mini-batches)
        is cheaper hooked (``bench_runtime.py``: the copy was 2 ms of a 90 ms step)."""
        if self.predictor is None or self.predicted_backward or self.precision.dtype is not None:
            return False
        predicted: list[MicroBatchVersions] = []
        others: list[MicroBatchVersions] = []
        for v in passes.values():
            moved = prediction_distance(v.distance, self.prediction_offset) > 0
            (predicted if moved else others).append(v)
        shared = len(predicted) > len({v.forward_base for v in predicted})
        return (
            shared
            and all(v.distance == 1 for v in predicted)
            and all(v.distance == 0 for v in others)
        )

    def _grads_on_leaves(self) -> bool:
        """Whether the forwards of a segment read leaves on a version's storage rather than
        aliases of the parameters (``weights.leaf``): under every asynchronous policy (a
        flush method's forwards run on the parameters themselves), in fp32 (a saved cast is
        re-cast from the weights an alias's node names), without recomputation (a
        recomputed unit reruns on fresh aliases, whose gradients reach the parameters in
        the middle of a backward that also adds to the leaves)."""
        if self.policy is WeightPolicy.FLUSH or self.recompute is not None:
            return False
        return self.precision.dtype is None

    def versions(self, mb: int) -> MicroBatchVersions:
        """The versions micro-batch ``mb`` of this segment meets on this stage."""
        return self.weights.of(mb)

    def version_base(self, first_mini_batch: int) -> int:
        """The run's version of this segment's W^(0), for traces: the segment's first
        mini-batch with one update per mini-batch; under a bounded delay (fewer updates)
        the updates this process made before the segment (a resumed run counts from its
        resume)."""
        if self.accumulation == 1:
            return first_mini_batch
        return self._updates_before_segment

    @property
    def version(self) -> int:
        """Updates made in this segment: the live weights are this version."""
        return self.weights.current

    def distance(self, mb: int) -> int:
        """The prediction distance this stage uses for ``mb`` (0 if it does not predict)."""
        if self.predictor is None:
            return 0
        return prediction_distance(self.versions(mb).distance, self.prediction_offset)

    # -- passes ----------------------------------------------------------------------------
    def _run_units(self, weights: Sequence[Tensor] | None, x: Payload) -> Payload:
        """The stage's units on ``x``, with ``weights`` (one per parameter, in the stage's
        order) in the module's slots (None: its parameters); a tuple ``x`` is the first
        unit's positional arguments."""
        args = (x,) if isinstance(x, Tensor) else x
        try:
            if weights is None:
                out: Payload = self.module(*args)
            else:
                out = self._slots.call(self.module, weights, args)
        except Exception as err:
            raise StageError(self._failure(x, err)) from err
        return out

    def _run_recomputed(self, steps: Steps, x: Payload) -> Payload:
        """The stage's units on ``x`` as ``steps`` run them, some recomputed
        (``recompute.py``)."""
        try:
            return run_steps(steps, x)
        except Exception as err:
            raise StageError(self._failure(x, err)) from err

    def _failure(self, x: Payload, err: Exception) -> str:
        with self.precision.autocast():
            return describe_failure(
                list(self.module), x, stage=self.index, first_unit=self.first_unit, error=err
            )

    def loss(self, out: Payload, target: Tensor, where: str) -> Tensor:
        """``loss_fn(out, target)``, checked to be a scalar; errors name the values. A tuple
        output (the last unit returned one) is given to the loss as it is."""
        return checked_payload_loss(self.loss_fn, out, target, where, self.index)

    def count_correct(self, out: Payload, target: Tensor) -> Tensor | None:
        """Correct argmax predictions, where the output is a score per class of each target
        (None for a tuple output: which of its tensors holds the scores is the loss's)."""
        return count_correct(out, target) if isinstance(out, Tensor) else None

    def _tuple_out(self, out: tuple[Any, ...]) -> tuple[Tensor, ...]:
        """A tuple a non-last stage hands on, refused where it holds a non-tensor."""
        last = self.first_unit + len(self.module) - 1
        return checked_tuple(out, self.index, last, type(self.module[-1]).__name__)

    def _input_gradients(
        self, x_in: tuple[Tensor, ...], found: Sequence[Tensor | None]
    ) -> tuple[Tensor | None, ...] | None:
        """A tuple input's gradients as sent upstream (None on the first stage)."""
        if self.index == 0:
            return None
        return input_gradients(x_in, found, self.precision.true_gradient)

    def _on_parameters(self, v: MicroBatchVersions, s: int) -> bool:
        """Whether a forward runs the module on its own parameters, with no alias per
        parameter: where no update comes between it and its backward and it reads the live
        weights. Always under flush methods; under asynchronous ones a forward of s = 0 on
        the live weights (XPipe's that predict nothing). Its backward reads what the forward
        read, as an alias of the live storage would."""
        if self.policy is WeightPolicy.FLUSH:
            return True
        return s == 0 and v.distance == 0 and v.forward_version == self.weights.current

    def forward(self, mb: int, x: Payload, target: Tensor | None = None) -> Payload:
        """Run micro-batch ``mb``; returns the (detached) output, or on the last stage the
        loss already divided by M. ``x`` and the output may be tuples of tensors (a unit's
        positional arguments); the floating-point ones take gradients."""
        self.finish_backward()
        v = self.versions(mb)
        store = self.weights
        if v.forward_base != store.current:
            raise RuntimeError(
                f"stage {self.index}: forward of micro-batch {mb} after {store.current} "
                f"updates, the schedule analysis says {v.forward_base}"
            )
        x_in: Payload
        if isinstance(x, Tensor):
            x_in = (
                x.detach().requires_grad_(True) if x.is_floating_point() and self.index > 0 else x
            )
            shape_key: tuple[Any, ...] = (tuple(x.shape), x.dtype)
        else:
            x_in = tuple(
                t.detach().requires_grad_(True) if t.is_floating_point() and self.index > 0 else t
                for t in x
            )
            shape_key = tuple((tuple(t.shape), t.dtype) for t in x)
        s = self.distance(mb)
        sources = store.sources(v.forward_version, mb)
        direct = self._on_parameters(v, s)
        amp_dtype = self.precision.dtype
        recast = amp_dtype is not None and not direct
        held = s > 0 and self.predicted_backward
        # A predicted forward runs on Ŵ in the stage's prediction buffer; what the graph
        # saves of it is re-pointed at the live weights, which the backward is to read, or
        # the buffer becomes the live weights at the next update (_buffer_becomes_live).
        predicted = s > 0 and not held
        repoint = predicted and not self._reads_buffer
        # Activation bytes are counted by a saved-tensor hook on the first forward of each
        # input shape, then reused (the hook runs on every pass only to re-cast under amp
        # and to re-point a predicted forward's saved weights).
        by_shape = self.memory_count.by_shape
        hooked = recast or repoint or shape_key not in by_shape
        saves = ForwardSaves(sources, amp_dtype if recast else None) if hooked else None
        with (
            self.random.stream(),
            torch.autograd.graph.saved_tensors_hooks(saves.pack, unpack)
            if saves is not None
            else nullcontext(),
            self.precision.autocast(),
        ):
            live = sources
            if held:
                # Ŵ in its own storage: the graph keeps it, so the backward reads it too.
                sources = self._held_prediction(s)
                if saves is not None:
                    saves.add_weights(sources)
            elif repoint:
                sources = self._write_prediction(s)
                assert saves is not None  # a re-pointing forward is always hooked
                saves.repoint(sources, live)
            elif predicted:
                sources = self._write_prediction(s)
                store.on_buffer[mb] = store.current
                if saves is not None:
                    saves.add_weights(sources)
            if s > 0 and self.closure is not None:
                self.closure.forward(self.index, mb, s, sources, self._params)
            weights: list[Tensor] | None = None
            if not direct:
                # a held Ŵ is this forward's own; other storage is read by many forwards
                weights = (
                    [alias(p, src) for p, src in zip(self._params, sources, strict=True)]
                    if held
                    else store.aliases(sources, mb)
                )
                if saves is not None and not store.leaf_grads:
                    for w, src, now in zip(weights, sources, live, strict=True):
                        # a saved cast is re-cast at backward from the weights it is to read
                        saves.aliases[w.grad_fn] = src if held else now
            units: KeptUnits | None = None
            out: Payload
            steps = None
            if self.recompute is not None:
                region = (
                    RegionWeights(None)
                    if direct
                    else self.recompute.hold_prediction(sources, recast)
                    if predicted
                    else RegionWeights(sources)
                )
                if region.held:
                    self.memory_count.hold(mb, self.recompute.held_bytes)
                keep = saves.keep if saves is not None else None
                steps = self.recompute.steps(weights, region, keep)
            if self._split and weights is None and self._unit_params is not None:
                out, units = run_units_kept(
                    self.module,
                    x_in,
                    self._unit_params,
                    stage=self.index,
                    failure=self._failure,
                    steps=steps,
                )
            elif steps is not None:
                out = self._run_recomputed(steps, x_in)
            elif weights is None and self.closure is None and self._in_product is not None:
                with self._in_product:
                    out = self._run_units(weights, x_in)
            else:
                out = self._run_units(weights, x_in)
            if self.is_last:
                if target is None:
                    raise RuntimeError(f"stage {self.index}: the last stage needs targets")
                self.correct = self.count_correct(out, target)
                out = self.loss(out, target, f"micro-batch {mb}") / self.micro_batches
            elif not isinstance(out, Tensor):
                out = self._tuple_out(out)
        if self._split and shape_key not in by_shape:
            refusal = reentrant_refusal(out, self.module, self.index, self.first_unit)
            if refusal is not None:
                raise StageError(refusal)
        if saves is not None:
            if isinstance(out, Tensor):
                saves.pack(out)
            else:
                for t in out:
                    saves.pack(t)
            by_shape.setdefault(shape_key, saves.activation_bytes)
        if held:
            self.weights.held.add(mb)
        if units is not None:
            self._units_out[mb] = units
        self._saved[mb] = (x_in, out)
        act = saves.activation_bytes if saves is not None else by_shape[shape_key]
        self.memory_count.add_activations(mb, act)
        return out.detach() if isinstance(out, Tensor) else tuple(t.detach() for t in out)

    def forward_eval(self, x: Payload) -> Payload:
        """Forward on the live weights without autograd (evaluation); the caller puts the
        module in eval mode."""
        self.finish_backward()
        with torch.no_grad(), self.precision.autocast():
            try:
                out: Payload = self.module(x) if isinstance(x, Tensor) else self.module(*x)
            except Exception as err:
                raise StageError(self._failure(x, err)) from err
        if isinstance(out, tuple) and not self.is_last:
            out = self._tuple_out(out)
        return out

    def backward(self, mb: int, grad: Gradients | None = None) -> Gradients | None:
        """Backward of micro-batch ``mb``; returns the gradient of its input (None on the
        first stage); for a tuple input a tuple, with a gradient per floating-point tensor
        (zeros where it took none) and None for the others. ``grad``: the output's, for a
        tuple output one per floating-point tensor. Gradients accumulate until
        :meth:`update`; where this stage defers its weight gradients, they are added at
        its next action (:meth:`finish_backward`)."""
        self.finish_backward()
        v = self.versions(mb)
        self.weights.check_backward(v, mb)
        x_in, out = self._saved.pop(mb)
        self._units_out.pop(mb, None)
        self.memory_count.release_activations(mb)
        self.memory_count.release_held(mb)
        if self.closure is not None:
            self.closure.backward(self.index, mb, self._params)
        self.weights.held.discard(mb)
        self.weights.on_buffer.pop(mb, None)
        with self.weights.adding_for(mb):
            if isinstance(out, Tensor):
                if out.requires_grad:
                    with self._backward_pass(x_in):
                        if self.is_last:
                            torch.autograd.backward(self.precision.scaled(out))
                        elif grad is not None:
                            assert isinstance(grad, Tensor)
                            torch.autograd.backward(out, self.precision.scaled(grad))
            else:
                roots, grads = output_roots(out, grad, self.precision.scaled, self.index)
                if roots:
                    with self._backward_pass(x_in):
                        torch.autograd.backward(roots, grads)
        if self._in_product is not None and self._in_product.queued:
            self._unfinished = (v, x_in)  # retired when its weight gradients are added
        else:
            self._retire(v)
        if isinstance(x_in, Tensor):
            return self.precision.true_gradient(x_in.grad if x_in.requires_grad else None)
        return self._input_gradients(x_in, [t.grad if t.requires_grad else None for t in x_in])

    @contextmanager
    def _backward_pass(self, x: Payload) -> Iterator[None]:
        """A backward (or half of one) of the micro-batch whose input is ``x``, under the
        stage's RNG stream; running out of memory there (a recomputation rebuilds its
        activations in the backward) is said as such, with what frees memory."""
        with self.random.stream():
            try:
                yield
            except Exception as err:
                if out_of_memory(err):
                    raise StageError(out_of_memory_message(self.index, x, err, "backward")) from err
                raise

    def finish_backward(self) -> None:
        """Add the weight gradients the latest backward deferred past its input gradient
        (``accumulate_in_product.py``), and count that backward done; nothing where none
        waits. Every pass, update and checkpoint of this stage calls it first; the executor
        before another reads this stage's gradients (tied weights)."""
        if self._unfinished is None:
            return
        (v, x_in), self._unfinished = self._unfinished, None
        assert self._in_product is not None  # only its backwards defer
        with self._backward_pass(x_in):
            self._in_product.finish()
        self._retire(v)

    def _retire(self, v: MicroBatchVersions) -> None:
        """A micro-batch's backward is complete (its B, or the W of a split one): release
        the weight version its forward held and count the gradients it accumulated."""
        self.weights.retire(v)
        self.memory_count.count_gradients(self._params)
        self._backwards_since_update += 1

    def backward_input(self, mb: int, grad: Gradients | None = None) -> Gradients | None:
        """The input half I of micro-batch ``mb``'s split backward: returns the gradient of
        its input (None on the first stage), as :meth:`backward` does, and keeps the graph
        and the gradient of each weighted unit's output for :meth:`backward_weight`; no
        weight gradient is computed. Synchronous (flush) methods only."""
        self._check_split("I", mb)
        if mb in self._weight_half:
            raise RuntimeError(f"stage {self.index}: a second I of micro-batch {mb}")
        v = self.versions(mb)
        if v.backward_version != self.weights.current:
            raise RuntimeError(
                f"stage {self.index}: I of micro-batch {mb} needs version {v.backward_version} "
                f"(live {self.weights.current})"
            )
        x_in, out = self._saved[mb]
        if self.closure is not None:
            self.closure.backward(self.index, mb, self._params)
        root: Root | None = None
        root_grad: Root | None = None
        if not isinstance(out, Tensor):
            roots, grads = output_roots(out, grad, self.precision.scaled, self.index)
            if roots:
                root, root_grad = roots, grads
        elif out.requires_grad:
            if self.is_last:
                root = self.precision.scaled(out)
            elif grad is not None:
                assert isinstance(grad, Tensor)
                root, root_grad = out, self.precision.scaled(grad)
        units = self._units_out.pop(mb, None)
        half: WeightHalf = []
        g_in: Gradients | None = None
        if root is not None:
            with self._backward_pass(x_in):
                g_in, half = input_half(root, root_grad, x_in, units, self._params)
        self._weight_half[mb] = half
        # held until W, with the activations
        self.memory_count.add_activations(mb, sum(payload_bytes(g) for *_, g in half))
        if isinstance(x_in, Tensor):
            assert g_in is None or isinstance(g_in, Tensor)
            return self.precision.true_gradient(g_in)
        found = g_in if isinstance(g_in, tuple) else (None,) * len(x_in)
        return self._input_gradients(x_in, found)

    def backward_weight(self, mb: int) -> None:
        """The weight half W of micro-batch ``mb``'s split backward, after its I: the weight
        gradients accumulate into ``.grad`` (until :meth:`update`), then the micro-batch's
        graph and activations are released."""
        self._check_split("W", mb)
        half = self._weight_half.pop(mb, None)
        if half is None:
            raise RuntimeError(f"stage {self.index}: W of micro-batch {mb} before its I")
        v = self.versions(mb)
        with self._backward_pass(self._saved[mb][0]):
            weight_half(half)
        del half
        self._saved.pop(mb)
        self.memory_count.release_activations(mb)
        self.memory_count.release_held(mb)
        self.weights.held.discard(mb)
        self._retire(v)

    def _check_split(self, half: str, mb: int) -> None:
        if self.policy is not WeightPolicy.FLUSH:
            raise StageError(split_refusal(self.method.name, self.policy, half))
        if mb not in self._saved:
            raise RuntimeError(f"stage {self.index}: {half} of micro-batch {mb} before its F")

    def update(self) -> None:
        """Apply the accumulated gradient with the optimizer (one update per mini-batch, or
        per A_k mini-batches under a bounded delay, on their mean gradient), then step the
        LR scheduler once per mini-batch applied. The predictor records its state through
        the optimizer's step hooks, so a step a GradScaler skips records nothing. Under data
        parallelism the buffers follow replica 0's here, where every replica has run the
        same passes (a stage without weights updates nothing but its buffers)."""
        self.finish_backward()
        if self.buffer_sync is not None:
            self.buffer_sync()
        self.weights.before_update()
        self._prediction_key = None  # the weights and the optimizer state move
        mini_batches = max(1, self._backwards_since_update // self.micro_batches)
        self._backwards_since_update = 0
        if self.updater is not None:
            self.updater.step(self._params, self._delays.get(self.weights.current, 0), mini_batches)
        self.weights.after_update()
        self.memory_count.updated()  # recounted when memory() is next read, not per update

    # -- prediction ------------------------------------------------------------------------
    def _lrs(self, s: int) -> list[list[float]] | None:
        """Learning rates of the next s updates under the scheduler (None: use lr·s)."""
        if self.updater is None:
            return None
        # τ of each update the prediction looks ahead to: a correction may rescale its rate
        return self.updater.future_lrs(s, [self._delays.get(self.version + i, 0) for i in range(s)])

    def _write_prediction(self, s: int) -> list[Tensor]:
        """Ŵ in the stage's prediction buffer (the one extra weight copy, reused). Between
        two updates Ŵ depends on s alone (the weights, the optimizer state and the rates of
        the next updates stand still), so the micro-batches that predict the same distance
        (XPipe's, of one mini-batch) share one write."""
        assert self.predictor is not None
        key = (self._updates_before_segment + self.weights.current, s)
        buffer = self.weights.prediction_buffer()
        if key == self._prediction_key:
            return buffer
        timed = self.device.type == "cpu"  # on CUDA reading a clock here would need a sync
        started = time.perf_counter() if timed else 0.0
        kept = self.predictor.kept_computations
        self.predictor.predict_into(self._in_group_order(buffer), s, self._lrs(s))
        if self.predictor.kept_computations != kept:
            self.memory_count.stale()  # a newly kept Δ counts in the predictor's bytes
        if timed:
            self.prediction_seconds.append(time.perf_counter() - started)
        self._prediction_key = key
        return buffer

    def _held_prediction(self, s: int) -> list[Tensor]:
        assert self.predictor is not None
        predicted = self.weights.held_copy()
        self.predictor.predict_into(self._in_group_order(predicted), s, self._lrs(s))
        return predicted

    def _in_group_order(self, tensors: list[Tensor]) -> list[Tensor]:
        """``tensors`` (one per parameter, in the stage's order) in the order of the
        optimizer's param groups, which a predictor writes in: a factory may group the
        parameters in any order (decay and no-decay groups, Muon's matrices first)."""
        if self._group_order is None:
            assert self.optimizer is not None
            position = {id(p): i for i, p in enumerate(self._params)}
            self._group_order = [
                position[id(p)] for g in self.optimizer.param_groups for p in g["params"]
            ]
        return [tensors[i] for i in self._group_order]

    @property
    def prediction_s(self) -> float | None:
        """Median seconds a recent predicted forward spent writing Ŵ (CPU only), or None
        when none was timed."""
        times = self.prediction_seconds
        return statistics.median(times) if times else None

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Weights, optimizer, scheduler, loss scaler, correction, predictor and RNG state;
        only valid between segments."""
        self.finish_backward()
        if self._saved or self.weights.stash:
            raise RuntimeError(f"stage {self.index}: checkpoint with passes in flight")
        update = (
            self.updater.state_dict()
            if self.updater is not None
            else {"optimizer": None, "scheduler": None, "scaler": None, "correction": None}
        )
        return {
            "module": self.module.state_dict(),
            **update,
            "predictor": None if self.predictor is None else self.predictor.state_dict(),
            "rng": self.random.state,
        }

    def check_state(self, state: Any) -> None:
        """Refuse a :meth:`state_dict` that does not fit this stage, before anything is
        loaded (``state_check.py``): other layers or split, another optimizer, another
        prediction rule; the error names the stage and what differs."""
        self._check_own_state(state, optimizer=True)

    def _check_own_state(self, state: Any, *, optimizer: bool) -> None:
        """:meth:`check_state`; the optimizer's part (``StageUpdate``'s) only with
        ``optimizer`` (its own load checks it)."""
        where = f"stage {self.index}"
        check_stage_state(state, where)
        check_module_state(self.module, state["module"], where)
        if optimizer and self.updater is not None:
            self.updater.check_state(state)
        rule = self.predictor.name if self.predictor is not None else None
        saved = state.get("predictor")
        check_predictor_state(rule, saved, self.method.name, len(self._params), where)

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Load a :meth:`state_dict`; one that does not fit is refused with nothing loaded
        (:meth:`check_state`). Where this stage was built with other base learning rates
        than the saved run, the loaded (scheduled) rates are rescaled to them, so a resume
        can change the lr and keep the schedule's progress; returns what changed."""
        self.finish_backward()
        self._check_own_state(state, optimizer=False)
        # The optimizer first: it checks its part before it takes anything.
        changes = self.updater.load_state_dict(state) if self.updater is not None else []
        self.module.load_state_dict(state["module"])
        self._prediction_key = None  # other weights and optimizer state
        if self.predictor is not None and state.get("predictor") is not None:
            self.predictor.load_state_dict(state["predictor"])
        self.random.state = state["rng"].clone()
        self.memory_count.refresh()
        return changes
