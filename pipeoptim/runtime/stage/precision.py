"""A stage's mixed precision: autocast, the weight re-cast for the backward, fp16 loss scaling.

Why the re-cast: master weights, optimizer state and prediction stay fp32, and the forward
runs under ``torch.autocast``. Autocast casts a weight to bf16/fp16 and the op saves that cast
for its backward, so the backward would see the cast of the *forward's* weights (Ŵ, or a
stashed version). The rule of docs/design.md ("Weight-version semantics") is that the backward
reads the weights the policy says it uses, so a saved tensor that is a cast (or a view of a
cast) of a weight alias is not kept: it is replaced by a :class:`Recast` that casts those
weights again when the backward unpacks it. The stage's forward does the packing (it knows
which alias stands for which weights); this module holds what a cast is and how to tell one.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pipeoptim.errors import StageError

__all__ = ["AMP_DTYPES", "Precision", "Recast", "cast_source", "unpack"]

AMP_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Recast:
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


def cast_source(t: Tensor, aliases: dict[Any, Tensor]) -> Tensor | None:
    """The weight storage ``t`` is a cast (or a view of a cast) of, else None; ``aliases``
    maps each weight alias's autograd node to the weights its backward is to read."""
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


def unpack(saved: Tensor | Recast) -> Tensor:
    """The saved-tensor hook's unpack: a :class:`Recast` is cast again from its source."""
    if isinstance(saved, Recast):
        cast = saved.source.detach().to(saved.dtype)
        return cast.as_strided(saved.size, saved.stride, saved.offset)
    return saved


class Precision:
    """The autocast dtype of a stage (None: fp32) and, under fp16, its gradient scaler."""

    def __init__(
        self, amp: str | None, device: torch.device, *, stage: int, has_weights: bool
    ) -> None:
        self.dtype = AMP_DTYPES[amp] if amp is not None else None
        if self.dtype is torch.float16 and device.type != "cuda":
            raise StageError(
                f"amp='fp16' needs a CUDA device (stage {stage} is on {device}); use "
                f"amp='bf16' on CPU"
            )
        self.device = device
        self.scaler = (
            torch.amp.GradScaler(device.type)
            if self.dtype is torch.float16 and has_weights
            else None
        )

    def autocast(self) -> Any:
        """The context a forward runs in."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scaled(self, t: Tensor) -> Tensor:
        """``t`` times the loss scale where fp16 scaling runs (the root of a backward)."""
        return self.scaler.scale(t) if self.scaler is not None else t

    def true_gradient(self, g_in: Tensor | None) -> Tensor | None:
        """The input gradient as sent upstream: unscaled where fp16 loss scaling runs."""
        scaler = self.scaler
        if g_in is not None and scaler is not None:
            g_in = g_in / scaler.scale(torch.ones((), device=g_in.device))
        return g_in
