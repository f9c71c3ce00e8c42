"""Bytes one stage holds, by kind: weights, weight copies, optimizer state, gradients,
activations.

Why counted rather than read from the allocator: several stages share a process under the
local transport, and CPU has no allocator statistics; counting what the stage itself holds
gives the per-stage figures the simulator's memory model predicts (docs/design.md, "Calibration"),
on any device. The executor samples :meth:`StageMemory.snapshot` after every action, so
everything here is kept up to date as it changes, never recomputed per sample: sizes that
change only at an update are recounted the first time they are read after one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from pipeoptim.runtime.optim.sharded import local_optimizer

__all__ = ["StageMemory", "nbytes"]


def nbytes(tensors: Iterable[Tensor | None]) -> int:
    """Bytes of the tensors given (None counts 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class StageMemory:
    """The running byte counts of one stage."""

    def __init__(
        self,
        params: Sequence[Tensor],
        optimizer: Optimizer | None,
        predictor_tensors: Callable[[], Iterable[Tensor]] | None,
    ) -> None:
        self._params = params
        self._optimizer = optimizer
        self._predictor_tensors = predictor_tensors
        self._static: dict[str, int] = {}
        self._dirty = False
        self._activations: dict[int, int] = {}  # mb -> bytes saved for its backward
        self._act_total = 0  # the sum of _activations, kept as it changes
        self._gradients = 0  # gradients held since the last update (counted once per update)
        self._held: dict[int, int] = {}  # mb -> bytes of Ŵ its recomputed units hold
        self._held_total = 0
        self.by_shape: dict[tuple[Any, ...], int] = {}
        """Activation bytes of a forward by input (shape, dtype): counted once, then reused."""
        self.refresh()

    def refresh(self) -> None:
        """Recount the sizes that change only at an update (weights, optimizer state). A
        sharded optimizer counts this replica's shard only: the state it holds."""
        opt = 0
        if self._optimizer is not None:
            for st in local_optimizer(self._optimizer).state.values():
                opt += nbytes(v for v in st.values() if isinstance(v, Tensor))
        if self._predictor_tensors is not None:
            opt += nbytes(self._predictor_tensors())
        self._static = {"weights": nbytes(self._params), "optimizer": opt}
        self._dirty = False

    def stale(self) -> None:
        """The static sizes changed (an update, a newly kept Δ): recount at the next read."""
        self._dirty = True

    def add_activations(self, mb: int, n: int) -> None:
        self._activations[mb] = self._activations.get(mb, 0) + n
        self._act_total += n

    def release_activations(self, mb: int) -> None:
        self._act_total -= self._activations.pop(mb, 0)

    def hold(self, mb: int, n: int) -> None:
        """Micro-batch ``mb``'s recomputed units hold ``n`` bytes of predicted weights until
        its backward (``recompute.py``): counted as weight copies."""
        self._held[mb] = self._held.get(mb, 0) + n
        self._held_total += n

    def release_held(self, mb: int) -> None:
        self._held_total -= self._held.pop(mb, 0)

    def activation_bytes(self, mb: int) -> int:
        """Bytes the forward of ``mb`` saved for its backward (0 once it ran)."""
        return self._activations.get(mb, 0)

    def count_gradients(self, params: Sequence[Tensor]) -> None:
        """A backward accumulated gradients: counted at the first after an update (later
        backwards accumulate into the same buffers)."""
        if not self._gradients:
            self._gradients = nbytes(p.grad for p in params)

    def updated(self) -> None:
        """An update ran: ``zero_grad(set_to_none=True)`` freed the gradients."""
        self._dirty = True
        self._gradients = 0

    def snapshot(self, weight_copies: int) -> dict[str, int]:
        """Bytes held now, by kind; ``weight_copies`` counts the live weights too."""
        if self._dirty:
            self.refresh()
        weights = self._static["weights"]
        return {
            **self._static,
            # every copy but the live one, and the Ŵ recomputed units hold
            "stash": weights * (weight_copies - 1) + self._held_total,
            "gradients": self._gradients,
            "activations": self._act_total,
        }
