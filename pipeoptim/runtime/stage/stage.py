"""One pipeline stage: the forward and backward of a slice of layers over its parts.

Why this shape: in an asynchronous pipeline a stage updates its weights while mini-batches
whose forward already ran are still waiting for their backward. What weights those forwards
and backwards see is the method (docs/design.md, "Weight-version semantics"). The stage is the
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

The stage's own work is written one concern a module, as classes :class:`Stage` inherits
(their state declared in :mod:`~pipeoptim.runtime.stage.fields`):
:mod:`~pipeoptim.runtime.stage.forward`, :mod:`~pipeoptim.runtime.stage.backward`,
:mod:`~pipeoptim.runtime.stage.prediction` and :mod:`~pipeoptim.runtime.stage.state` (the
checkpoint state). Here: building the parts, their public faces, the segments and the update.

PREDICT writes the prediction ``Ŵ = W - lr·s·Δ`` into the prediction buffer (once per distance
between two updates), runs the forward on it, and re-points what the graph saves of Ŵ at the
live weights, so the backward runs on the current weights, as docs/design.md ("Weight-version
semantics") specifies; where every predicted forward meets one update before its backward and
several meet each one (XPipe), the buffer becomes the live weights at that update instead (one
weight copy per update), and the forward runs with no saved-tensor hook.

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

import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.optim import Optimizer

from pipeoptim.errors import StageError
from pipeoptim.plan.methods import Method
from pipeoptim.plan.versions import MicroBatchVersions, gradient_delays, prediction_distance
from pipeoptim.runtime.optim.builder import build_stage_rule
from pipeoptim.runtime.optim.corrections.protocol import HoldsTensors, StageContext
from pipeoptim.runtime.optim.global_clip import clip_note
from pipeoptim.runtime.optim.predict import WeightPredictor
from pipeoptim.runtime.optim.prediction_closure import PredictionClosure
from pipeoptim.runtime.optim.update import StageUpdate
from pipeoptim.runtime.options import StageOptions
from pipeoptim.runtime.payload import Payload
from pipeoptim.runtime.stage.accumulate_in_product import AccumulateInProduct
from pipeoptim.runtime.stage.chain import UnitChain, as_chain
from pipeoptim.runtime.stage.compiled import compile_units
from pipeoptim.runtime.stage.forward import StageForward
from pipeoptim.runtime.stage.memory import StageMemory
from pipeoptim.runtime.stage.precision import Precision
from pipeoptim.runtime.stage.recompute import Recomputation
from pipeoptim.runtime.stage.rng import StageRandom
from pipeoptim.runtime.stage.split_backward import (
    KeptUnits,
    WeightHalf,
    split_refusal,
    unit_params,
)
from pipeoptim.runtime.stage.state import StageState
from pipeoptim.runtime.stage.swap import ParameterSlots
from pipeoptim.runtime.stage.weights import WeightVersions

__all__ = ["Stage"]


def _derived_weights(module: nn.Module) -> list[str]:
    """Submodules whose weights are computed in the forward (parametrizations, weight norm)."""
    found = []
    for name, sub in module.named_modules():
        hooks = getattr(sub, "_forward_pre_hooks", {}).values()
        if parametrize.is_parametrized(sub) or any(type(h).__name__ == "WeightNorm" for h in hooks):
            found.append(name or type(sub).__name__)
    return found


class Stage(StageForward, StageState):
    """A module slice trained with its own optimizer under its method's weight policy.

    The executor calls :meth:`begin_segment` with this stage's passes (local micro-batch id
    to versions) of the segment's schedule, then :meth:`forward`, :meth:`backward` (or its
    halves :meth:`backward_input` and :meth:`backward_weight`) and :meth:`update` in the
    schedule's order. Micro-batch losses are weighted by their share of the mini-batch's
    counted targets (1/M where none is ignored) so the accumulated gradient is that of the
    mini-batch's token mean (``loss.token_share``). Nothing here reads a value back to
    the host: losses and correct counts stay on the device until the caller reads them.
    """

    def __init__(
        self,
        index: int,
        layers: nn.Sequential,
        options: StageOptions,
        *,
        num_stages: int,
        method: Method,
        micro_batches: int,
        device: torch.device | str = "cpu",
        first_unit: int = 0,
        delay: int = 0,
        shard_group: Any = None,
    ) -> None:
        """Stage ``index`` of ``num_stages``, built with the run's ``options`` (what every
        stage of the run is built with: ``options/built.py``) and what only this stage has:
        its ``layers``, the first unit's index, the steady ``delay`` a correction reads and
        its replicas' ``shard_group``."""
        self.index = index
        self.options = options
        """What every stage of the run is built with; the stage reads its options here."""
        optimizer, scheduler, grad_clip = options.optimizer, options.scheduler, options.grad_clip
        self.is_last = index == num_stages - 1
        self.device = torch.device(device)
        # units may hand on tuples (unit(*h)); the same object, so state_dict keys stay
        self.module = as_chain(layers).to(self.device)
        self.compiled_units = compile_units(
            self.module,
            options.compile,
            retains_graph=method.stage_policy(index, num_stages).splits_backward,
        )
        """Units compiled in place (``compiled.py``; 0: eager)."""
        self.method = method
        self.stage_policy = method.stage_policy(index, num_stages)
        """What this stage does under its method: versions, copies, predictor, A_k."""
        self.policy = self.stage_policy.versions
        self.micro_batches = micro_batches
        self.replicas = 1
        """D, the data-parallel replicas whose gradients are averaged (set by the assembly):
        a micro-batch's token share is scaled by it (``loss.token_share``)."""
        self.prediction_offset = options.prediction_offset
        self.loss_fn = options.loss_fn
        self.first_unit = first_unit
        self.grad_clip = grad_clip
        self.notes: list[str] = []
        """What this stage does differently from the rule of docs/design.md ("Weight-version
        semantics"), said once each."""
        if grad_clip is not None:  # said in the run's notes, not warned: it is the rule
            self.notes.append(clip_note(options.clip_scope, grad_clip, method.keeps_one_version))
        self._params = [p for p in self.module.parameters() if p.requires_grad]
        self.precision = Precision(
            options.amp, self.device, stage=index, has_weights=bool(self._params)
        )
        if self.stage_policy.splits_backward and not self.stage_policy.keeps_one_version:
            raise StageError(split_refusal(method.name, self.policy))
        self.amp_dtype = self.precision.dtype
        rule = build_stage_rule(
            self._params,
            context=StageContext(
                index,
                num_stages,
                method.name,
                delay,
                micro_batches,
                extrapolation=options.extrapolation,
                module=self.module,
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
            if (adds_up or sends_gradient)
            and not self.stage_policy.splits_backward
            and not self.compiled_units  # a function mode the compiled graph would not see
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
        self._predicted_bases: frozenset[int] = frozenset()
        """Updates made (in this segment) before which a predicted forward runs: after those
        updates the predictor's kept Δ is computed in the update (:meth:`_prepare_deltas`)."""
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
        self.predicted_backward = options.predicted_backward and self.predictor is not None
        """Keep Ŵ of each predicted forward for its backward (input gradients through Ŵ,
        consistent as PipeDream's stash, at one weight copy per mini-batch in flight)."""
        self.closure: PredictionClosure | None = None
        """Set to measure how much of the stale distance each prediction removes."""
        self.memory_count = StageMemory(self._params, self.optimizer, self._held_tensors())
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
        self.random = StageRandom(units, self.device, options.stage_seed(index))
        recompute = options.recompute.get(index, frozenset())
        self.recompute: Recomputation | None = (
            Recomputation(self.module, recompute, self._params, index) if recompute else None
        )
        """The units whose activations the backward recomputes (``recompute.py``)."""
        self.buffer_sync: Callable[[], None] | None = None
        """Set under data parallelism where the stage has floating-point buffers: gives
        every replica replica 0's buffers at each update (``replicas.BufferBroadcast``)."""

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
        if self.recompute is None or not self.policy.reads_predicted:
            return 0
        if self.predicted_backward or self.predictor is None:
            return 0  # a predicted backward's Ŵ is the copy its graph holds anyway
        return self.recompute.held_bytes

    def _held_tensors(self) -> Callable[[], list[Tensor]] | None:
        """What the predictor (its Δ) and the correction (a kept update) hold between
        updates, for the memory count's optimizer state; None: nothing."""
        predictor = self.predictor
        correction = None if self.updater is None else self.updater.correction
        if not isinstance(correction, HoldsTensors):
            correction = None
        if predictor is None and correction is None:
            return None

        def held() -> list[Tensor]:
            own = [] if predictor is None else list(predictor.held_tensors())
            return own + ([] if correction is None else correction.held_tensors())

        return held

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
        self._predicted_bases = frozenset(
            v.forward_base
            for v in passes.values()
            if self.predictor is not None
            and prediction_distance(v.distance, self.prediction_offset) > 0
        )
        self._prepare_deltas()  # after a resume: kept before the first forward, not in it
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
        if self.policy.keeps_one_version or self.recompute is not None:
            return False
        return self.precision.dtype is None

    def version_base(self, first_mini_batch: int) -> int:
        """The run's version of this segment's W^(0), for traces: the segment's first
        mini-batch with one update per mini-batch; under a bounded delay (fewer updates)
        the updates this process made before the segment (a resumed run counts from its
        resume)."""
        if self.accumulation == 1:
            return first_mini_batch
        return self._updates_before_segment

    # -- the update ------------------------------------------------------------------------
    def clip_norm_squared(self) -> Tensor:
        """The squared norm of the gradient this stage's coming update applies, as the
        pipeline's clipping norm counts it (``optim/global_clip.py``): the gradient is made
        final first (averaged over replicas, unscaled), and :meth:`update` applies it."""
        self.finish_backward()
        if self.updater is None:
            return torch.zeros((), device=self.device)
        mini_batches = max(1, self._backwards_since_update // self.micro_batches)
        self.updater.prepare(self._params, mini_batches)
        return self.updater.clip_norm_squared(self._params, self.device)

    def update(self, clip: Tensor | None = None) -> None:
        """Apply the accumulated gradient with the optimizer (one update per mini-batch, or
        per A_k mini-batches under a bounded delay, on their mean gradient), then step the
        LR scheduler once per mini-batch applied. The predictor records its state through
        the optimizer's step hooks, so a step a GradScaler skips records nothing. Under data
        parallelism the buffers follow replica 0's here, where every replica has run the
        same passes (a stage without weights updates nothing but its buffers). ``clip``: the
        factor of the pipeline's clipping norm (``optim/global_clip.py``); None: the stage
        clips by its own norm, where it clips."""
        self.finish_backward()
        if self.buffer_sync is not None:
            self.buffer_sync()
        self.weights.before_update()
        self._prediction_key = None  # the weights and the optimizer state move
        mini_batches = max(1, self._backwards_since_update // self.micro_batches)
        self._backwards_since_update = 0
        if self.updater is not None:
            delay = self._delays.get(self.weights.current, 0)
            self.updater.step(self._params, delay, mini_batches, clip)
        self.weights.after_update()
        self._prepare_deltas()
        self.memory_count.updated()  # recounted when memory() is next read, not per update

    def _prepare_deltas(self) -> None:
        """Have the predictor compute the Δ it keeps now, where a predicted forward is to
        read the weights as they now are: the work (Muon's Newton–Schulz) is then the
        update's, not that forward's, which in an asynchronous pipeline lies on the
        critical path of every later stage. Not where no forward predicts from these
        weights (the last stage, a segment's last update): nothing would read it."""
        if self.predictor is not None and self.weights.current in self._predicted_bases:
            kept = self.predictor.kept_computations
            self.predictor.prepare_deltas()
            if self.predictor.kept_computations != kept:
                self.memory_count.stale()  # a newly kept Δ counts in the predictor's bytes
