"""The stage's forward path before issue 34, put back for comparison.

Why kept: ``bench_async_step.py --old-path`` times it beside the fast path in the same run,
and ``tests/runtime/stage/test_async_fast_path.py`` trains on both and compares the weights bit for
bit. Before issue 34 every forward on a version other than the module's own ran through
``torch.func.functional_call`` on fresh aliases, every predicted micro-batch wrote Ŵ, and
every predicted forward re-pointed what it saved with a saved-tensor hook. :func:`old_path`
undoes each part of the fast path: the parameter slots call ``functional_call``, every
forward makes its own aliases, every predicted forward writes Ŵ, only flush methods run on
the module's parameters, and no prediction buffer becomes the live weights (nor do its
forwards read leaves); XPipe forms and keeps its Δ at the first prediction after each
update rather than writing that one fused.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn
from torch.func import functional_call

from pipeoptim.plan.methods import WeightPolicy
from pipeoptim.plan.versions import MicroBatchVersions
from pipeoptim.runtime.optim.predict import XPipePredictor
from pipeoptim.runtime.stage import weights
from pipeoptim.runtime.stage.forward import StageForward
from pipeoptim.runtime.stage.prediction import StagePrediction
from pipeoptim.runtime.stage.stage import Stage
from pipeoptim.runtime.stage.swap import ParameterSlots

__all__ = ["old_path"]


@contextmanager
def old_path() -> Iterator[None]:
    """Stages built and run inside run the pre-issue-34 path."""
    names: dict[int, list[tuple[str, int]]] = {}  # id of the slots -> (name, parameter index)
    slots_init = ParameterSlots.__init__
    write = Stage._write_prediction

    def named_slots(self: ParameterSlots, module: nn.Module, params: Sequence[Tensor]) -> None:
        slots_init(self, module, params)
        index = {id(p): j for j, p in enumerate(params)}
        found = [(n, index.get(id(p))) for n, p in module.named_parameters()]
        names[id(self)] = [(n, j) for n, j in found if j is not None]

    def by_functional_call(
        self: ParameterSlots,
        fn: Any,
        tensors: Sequence[Tensor] | Mapping[int, Tensor],
        args: tuple[Any, ...],
    ) -> Any:
        return functional_call(fn, {n: tensors[j] for n, j in names[id(self)]}, args)

    def fresh_aliases(
        self: weights.WeightVersions, sources: Sequence[Tensor], mb: int
    ) -> list[Tensor]:
        return [weights.alias(p, t) for p, t in zip(self.params, sources, strict=True)]

    def every_time(self: Stage, s: int) -> list[Tensor]:
        self._prediction_key = None
        return write(self, s)

    def flush_only(self: Stage, v: MicroBatchVersions, s: int) -> bool:
        return self.policy is WeightPolicy.FLUSH

    def never(self: Stage, passes: dict[int, MicroBatchVersions]) -> bool:
        return False

    def no_leaves(self: Stage) -> bool:
        return False

    patches: list[tuple[Any, str, Any]] = [
        (ParameterSlots, "__init__", named_slots),
        (ParameterSlots, "call", by_functional_call),
        (weights.WeightVersions, "aliases", fresh_aliases),
        (StagePrediction, "_write_prediction", every_time),
        (StageForward, "_on_parameters", flush_only),
        (Stage, "_buffer_becomes_live", never),
        (Stage, "_grads_on_leaves", no_leaves),
        (XPipePredictor, "fuses_first_write", False),
    ]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    try:
        for owner, name, replacement in patches:
            setattr(owner, name, replacement)
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
