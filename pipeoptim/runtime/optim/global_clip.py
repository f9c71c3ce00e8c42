"""Gradient clipping by the norm over every stage of the pipeline, as one device clips.

``torch.nn.utils.clip_grad_norm_`` on the uncut model scales every gradient by
``min(1, max_norm / (‖g‖ + 1e-6))``, ‖g‖ the 2-norm over all parameters. Cut into stages, each
stage holds part of g: each rank adds its stages' squared norms, the ranks of one pipeline
add theirs (:class:`NormBoard`: a mailbox in one process, one all-reduce of one number over
the pipeline's ranks under ``dist``) and every stage scales its gradients by the same factor.
A weight shared by several stages (``model/ties.py``) is counted once, by its first member
stage, after the members summed its gradient; data-parallel replicas average their gradients
before (``replicas.GradientAverager``), so every replica finds the same norm; fp16 loss scaling
unscales first (``StageUpdate.prepare``).

Which norm (:data:`CLIP_SCOPES`, ``OptimizerOptions.clip_scope``):

* ``"pipeline"``: the norm over the gradients of one mini-batch on every stage. Under a
  synchronous method that is the whole model's gradient, and clipping equals
  ``clip_grad_norm_`` on one device. Under an asynchronous one each stage's t-th update
  waits until every stage has mini-batch t's gradient (the last stage waits for the first
  one's backward at each update: the pipeline runs slower).
* ``"stage"``: each stage clips its own norm at its own update (no waiting).

The default (:func:`clip_scope_of`): ``"pipeline"`` for synchronous methods, ``"stage"`` for
asynchronous ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.methods import Method

__all__ = [
    "CLIP_SCOPES",
    "NormBoard",
    "clip_factor",
    "clip_note",
    "clip_scope_of",
    "squared_norm",
]

CLIP_SCOPES = ("pipeline", "stage")
"""The norms gradient clipping may use (module docstring)."""

_EPS = 1e-6  # clip_grad_norm_'s own


def clip_scope_of(method: Method, scope: str | None) -> str:
    """The clipping scope a run uses: ``scope``, or the method's default (module
    docstring); refused where a method cannot clip by the pipeline's norm."""
    if scope is None:
        return "pipeline" if method.keeps_one_version else "stage"
    if scope not in CLIP_SCOPES:
        raise RuntimeConfigError(
            f"clip_scope must be one of {', '.join(CLIP_SCOPES)} (got {scope!r}); 'pipeline' "
            f"clips by the norm over every stage's gradients of one mini-batch, 'stage' each "
            f"stage by its own"
        )
    if scope == "pipeline" and method.bounds_delay:
        raise RuntimeConfigError(
            f"clip_scope='pipeline' needs every stage to update once per mini-batch, but "
            f"{method.name} updates its early stages once per several (a bounded delay), so "
            f"no mini-batch's gradient leaves every stage at one update; use "
            f"clip_scope='stage' (each stage its own norm)"
        )
    return scope


def squared_norm(grads: Sequence[Tensor], device: torch.device) -> Tensor:
    """The sum of the squared 2-norms of ``grads``, in float32 (0 for none) on ``device``."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    if not grads:
        return total
    norms = torch._foreach_norm(list(grads), 2.0)
    return total + torch.stack([n.float() for n in norms]).square().sum().to(device)


def clip_factor(squared_total: Tensor, max_norm: float) -> Tensor:
    """``clip_grad_norm_``'s factor ``min(1, max_norm / (‖g‖ + 1e-6))`` from the squared
    norm; 1 where the norm is not finite (an fp16 step that overflowed: each stage's loss
    scaler skips its step as without clipping). On the device: no host sync."""
    norm = squared_total.sqrt()
    factor = (max_norm / (norm + _EPS)).clamp(max=1.0)
    return torch.where(torch.isfinite(norm), factor, torch.ones_like(factor))


class NormBoard:
    """The squared gradient norms of one pipeline's ranks, summed per update (``step``).

    In one process every rank adds its own and :meth:`total` is there once all have (in rank
    order, so the sum is the same whatever order the ranks ran in); under ``dist`` (one rank
    per process) :meth:`add` all-reduces over ``group``, the pipeline ranks of this replica,
    a group of its own so the collective never queues behind a pipeline message (NCCL)."""

    def __init__(self, ranks: Sequence[int], group: dist.ProcessGroup | None = None) -> None:
        self.ranks = sorted(ranks)
        self.group = group
        self._added: dict[int, dict[int, Tensor]] = {}  # step -> rank -> its squared norm
        self._totals: dict[int, tuple[Tensor, set[int]]] = {}  # step -> total, ranks to read

    @property
    def distributed(self) -> bool:
        return self.group is not None

    def add(self, step: int, rank: int, squared: Tensor) -> None:
        """Rank ``rank``'s squared norm of update ``step`` (all of its stages')."""
        if self.group is not None:
            total = squared.clone()
            dist.all_reduce(total, group=self.group)
            self._totals[step] = (total, {rank})
            return
        added = self._added.setdefault(step, {})
        added[rank] = squared
        if len(added) == len(self.ranks):
            del self._added[step]
            total = sum((added[r] for r in self.ranks[1:]), added[self.ranks[0]].clone())
            self._totals[step] = (total, set(self.ranks))

    def ready(self, step: int) -> bool:
        """Whether the total of ``step`` is known (every rank has added)."""
        return step in self._totals

    def take(self, step: int, rank: int) -> Tensor:
        """The total of ``step``, read once by each rank."""
        total, readers = self._totals[step]
        readers.discard(rank)
        if not readers:
            del self._totals[step]
        return total


def clip_note(scope: str, max_norm: float, synchronous: bool) -> str:
    """What the run's notes say of its clipping."""
    if scope == "pipeline":
        whose = (
            "the whole model's gradient norm (every stage, a shared weight once), as "
            "clip_grad_norm_ on one device"
            if synchronous
            else "the norm over every stage's gradients of one mini-batch (each stage's "
            "update waits for every stage's)"
        )
    else:
        whose = "each stage's own gradient norm"
        if not synchronous:
            whose += " (the asynchronous default; clip_scope='pipeline' for the norm over "
            whose += "every stage's gradients of one mini-batch)"
    return f"gradient clipping at {max_norm:g}: {whose}, clip_scope={scope!r}"
