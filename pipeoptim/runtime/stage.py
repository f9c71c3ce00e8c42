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
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.optim import SGD, Adam, AdamW, Optimizer, RMSprop

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.methods import Method, WeightPolicy
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.plan.versions import MicroBatchVersions, prediction_distance
from pipeoptim.runtime.predict import WeightPredictor, predictor_for

__all__ = ["OPTIMIZERS", "Stage", "make_optimizer"]

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
    to versions) of the segment's schedule, then :meth:`forward`, :meth:`backward` and
    :meth:`update` in the schedule's order. Micro-batch losses are scaled by 1/M so the
    accumulated gradient is that of the mini-batch mean.
    """

    def __init__(
        self,
        index: int,
        layers: nn.Sequential,
        *,
        num_stages: int,
        method: Method,
        optimizer: OptimizerSpec,
        micro_batches: int,
        prediction_offset: int = 0,
        device: torch.device | str = "cpu",
        seed: int = 0,
        loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
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
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        # A stage of parameter-free layers (a lone ReLU) has nothing to update.
        self.optimizer = make_optimizer(optimizer, self._params) if self._params else None
        self.predictor: WeightPredictor | None = None
        if self.policy is WeightPolicy.PREDICT and self.optimizer is not None:
            self.predictor = predictor_for(self.optimizer, method.prediction_rule or "optimizer")
        self._tracks_versions = self.policy is not WeightPolicy.PREDICT
        self._passes: dict[int, MicroBatchVersions] = {}
        self._cur = 0  # updates in this segment: the live weights are version _cur
        self._stash: dict[int, list[Tensor]] = {}  # frozen versions still needed
        self._pending_f: Counter[int] = Counter()  # forwards still to run, by version
        self._inflight: Counter[int] = Counter()  # forwards awaiting backward, by version
        self._backup: list[Tensor] | None = None  # live weights aside during a predicted F
        self._saved: dict[int, tuple[Tensor, Tensor]] = {}  # mb -> (input, output or loss)
        self._act_bytes: dict[int, int] = {}
        self.correct = torch.zeros((), dtype=torch.long)
        """Last stage: correct predictions of the latest forward."""
        self.peak_weight_copies = 1
        self._static_bytes: dict[str, int] = {}
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self._rng_state: Tensor = gen.get_state()
        self._refresh_static_bytes()

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
        weight_ptrs = {t.untyped_storage().data_ptr() for t in sources}
        counted: set[int] = set()
        act = 0

        def pack(t: Tensor) -> Tensor:
            nonlocal act
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weight_ptrs and ptr not in counted:
                counted.add(ptr)
                act += t.untyped_storage().nbytes()
            return t

        with self.rng(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if s > 0:
                self._write_prediction(s)
            try:
                weights = {
                    n: _alias(p, src)
                    for n, p, src in zip(self._names, self._params, sources, strict=True)
                }
                out: Tensor = functional_call(self.module, weights, (x_in,))
            finally:
                if s > 0:
                    self._restore_live()
            if self.is_last:
                if target is None:
                    raise RuntimeError(f"stage {self.index}: the last stage needs labels")
                with torch.no_grad():
                    self.correct = (out.argmax(dim=-1) == target).sum()
                out = self.loss_fn(out, target) / self.micro_batches
        pack(out)
        self._saved[mb] = (x_in, out)
        self._act_bytes[mb] = act
        return out.detach()

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
        self._act_bytes.pop(mb, None)
        if out.requires_grad:
            with self.rng():
                if self.is_last:
                    torch.autograd.backward(out)
                elif grad is not None:
                    torch.autograd.backward(out, grad)
        if self._tracks_versions:
            self._inflight[v.forward_version] -= 1
            self._release(v.forward_version)
        return x_in.grad if x_in.requires_grad else None

    def update(self) -> None:
        """Apply the accumulated gradient with the optimizer (one update per mini-batch)."""
        cur = self._cur
        if self._tracks_versions and self._pending_f[cur] + self._inflight[cur] > 0:
            self._freeze(cur)
        if self.optimizer is not None:
            if self.predictor is not None:
                self.predictor.before_step()
            self.optimizer.step()
            if self.predictor is not None:
                self.predictor.after_step()
            self.optimizer.zero_grad(set_to_none=True)
        self._cur += 1
        self._note_copies()
        self._refresh_static_bytes()

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

    def _write_prediction(self, s: int) -> None:
        assert self.predictor is not None
        live = [p.data for p in self._params]
        if self._backup is None:
            self._backup = [torch.empty_like(t) for t in live]
            self._note_copies()
        torch._foreach_copy_(self._backup, live)
        # predict_into copies W into dest before adding -lr*s*Δ, so dest may be the params.
        self.predictor.predict_into(live, s)

    def _restore_live(self) -> None:
        assert self._backup is not None
        torch._foreach_copy_([p.data for p in self._params], self._backup)

    def weight_copies(self) -> int:
        """Weight copies held now: live, frozen versions, the predicted-forward buffer."""
        return 1 + len(self._stash) + (1 if self._backup is not None else 0)

    def _note_copies(self) -> None:
        self.peak_weight_copies = max(self.peak_weight_copies, self.weight_copies())

    # -- randomness ------------------------------------------------------------------------
    @contextmanager
    def rng(self) -> Iterator[None]:
        """Run under this stage's own RNG stream (dropout...), so results do not depend on
        how many stages share a process, and a checkpoint can restore it."""
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
            opt += _nbytes(self.predictor.state_dict()["displacement"].values())
        self._static_bytes = {"weights": _nbytes(self._params), "optimizer": opt}

    def memory(self) -> dict[str, int]:
        """Bytes held by this stage, by kind (weights, stash, optimizer, activations...)."""
        weights = self._static_bytes["weights"]
        return {
            **self._static_bytes,
            "stash": weights * (len(self._stash) + (1 if self._backup is not None else 0)),
            "gradients": _nbytes(p.grad for p in self._params),
            "activations": sum(self._act_bytes.values()),
        }

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Weights, optimizer, predictor and RNG state; only valid between segments."""
        if self._saved or self._stash:
            raise RuntimeError(f"stage {self.index}: checkpoint with passes in flight")
        return {
            "module": self.module.state_dict(),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "predictor": None if self.predictor is None else self.predictor.state_dict(),
            "rng": self._rng_state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        if self.optimizer is not None:
            # A copy: torch.optim keeps same-device tensors as given, which would alias a
            # state dict that is still in use elsewhere.
            self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        if self.predictor is not None and state.get("predictor") is not None:
            self.predictor.load_state_dict(state["predictor"])
        self._rng_state = state["rng"].clone()
        self._refresh_static_bytes()
