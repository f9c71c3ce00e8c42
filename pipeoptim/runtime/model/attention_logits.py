"""How an attention module exposes its largest pre-softmax logits, per head (for QK-Clip).

QK-Clip (``runtime/optim/corrections/qk_clip.py``) needs two things of an attention module:
the largest logit ``S_h = max q_i·k_j·scale`` of each head h over the training forwards since
the stage's last update, and where head h's rows of the query and key projections are, so it
can rescale them. A module exposes both by holding an :class:`AttentionLogits` under the
attribute ``attention_logits`` (:class:`ExposesAttentionLogits`):

* its forward calls ``attention_logits.record(q, k, scale)`` with the q and k it already has
  (``(B, heads, T, head_dim)`` and ``(B, kv_heads, T, head_dim)``, after any rotary
  embedding), guarded by ``attention_logits.active(self.training)``, which is False unless a
  correction started the recording, in eval mode and under ``torch.no_grad`` (the pipeline's
  dry run, evaluation). Recording is off by default, so it costs one attribute test per
  forward until a correction asks for it;
* :class:`HeadRows` name, relative to the module, the parameters holding each head's query
  and key rows (a weight and its bias; a fused ``qkv`` weight holds both, at two offsets).

Recording computes ``q·kᵀ·scale`` under ``torch.no_grad`` from detached q and k, in float32,
outside autocast, in batch chunks of at most :data:`CHUNK_BYTES`: the forward's result and
its autograd graph are those of a forward without it, and nothing is read back to the host.

A module that shares one key head among several query heads (grouped-query attention,
``kv_heads < heads``) is clipped on its query rows alone, by γ_h, since its key rows serve
other heads too (as Kimi K2 leaves its shared rotary key alone); otherwise the query and the
key rows of head h are each scaled by √γ_h.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.model.replay import is_recomputing

__all__ = [
    "CHUNK_BYTES",
    "AttentionLogits",
    "ExposesAttentionLogits",
    "HeadRows",
    "attention_logits_of",
    "find_attention",
    "looks_like_attention",
    "max_logits",
]

CHUNK_BYTES = 64 * 2**20
"""The most bytes of float32 logits one recording step materialises (it loops over the
batch in chunks of this size)."""


@dataclass(frozen=True)
class HeadRows:
    """Where the rows of each head are in one parameter of an attention module: ``heads``
    consecutive blocks of ``head_dim`` entries along dimension ``dim`` of the parameter
    ``name`` (relative to the module, as ``module.get_parameter`` takes it), from ``offset``;
    block h is head h's. ``nn.Linear`` keeps its output rows on ``dim`` 0 (its bias too),
    GPT-2's ``Conv1D`` on ``dim`` 1."""

    name: str
    dim: int
    offset: int
    heads: int
    head_dim: int

    def scale_(self, module: nn.Module, factors: Tensor) -> None:
        """Multiply head h's rows by ``factors[h]`` in place (under ``torch.no_grad``)."""
        tensor = module.get_parameter(self.name)
        rows = tensor.narrow(self.dim, self.offset, self.heads * self.head_dim)
        split = list(rows.shape)
        split[self.dim : self.dim + 1] = [self.heads, self.head_dim]  # a view: one dim in two
        shape = [1] * len(split)
        shape[self.dim] = self.heads
        with torch.no_grad():
            rows.view(split).mul_(factors.to(device=tensor.device, dtype=tensor.dtype).view(shape))


def max_logits(
    query: Tensor,
    key: Tensor,
    scale: float | None = None,
    mask: Tensor | None = None,
    *,
    causal: bool = True,
) -> Tensor:
    """The largest pre-softmax logit ``q_i·k_j·scale`` of each query head, over the batch and
    the positions the attention may see, in float32 ``(heads,)``.

    ``query`` ``(B, heads, Tq, d)``, ``key`` ``(B, kv_heads, Tk, d)`` (query head h reads key
    head ``h // (heads / kv_heads)``, as ``repeat_kv`` lays them out); ``scale`` defaults to
    ``d**-0.5``. Without ``mask`` the positions are the causal ones (``j ≤ i``) or, with
    ``causal=False``, all; a boolean ``mask`` (True: attend) or an additive float one
    (0 and a large negative number, as eager attention adds it), broadcast as
    ``(B, heads, Tq, Tk)``, gives them instead."""
    b, heads, tq, d = query.shape
    kv_heads, tk = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise RuntimeConfigError(
            f"the attention's {heads} query heads are not a multiple of its {kv_heads} key "
            f"heads; record q (B, heads, T, d) and k (B, kv_heads, T, d)"
        )
    if mask is not None and mask.dim() != 4:
        raise RuntimeConfigError(
            f"recording the attention's max logit takes a 4-D mask (B, heads, Tq, Tk) or "
            f"none, got one of shape {tuple(mask.shape)}; use sdpa or eager attention"
        )
    factor = d**-0.5 if scale is None else float(scale)
    with torch.no_grad(), torch.autocast(query.device.type, enabled=False):
        q = query.detach().float()
        k = key.detach().float()
        if kv_heads != heads:
            k = k.repeat_interleave(heads // kv_heads, dim=1)
        # causal: one fused q·kᵀ·scale + (0 or −inf above the diagonal), a (Tq, Tk) bias
        bias = None
        if mask is None and causal:
            above = torch.ones(tq, tk, dtype=torch.bool, device=q.device).triu(1)
            bias = torch.zeros(tq, tk, device=q.device).masked_fill_(above, -math.inf)
        step = max(1, CHUNK_BYTES // max(1, heads * tq * tk * 4))
        peak = torch.full((heads,), -math.inf, device=q.device)
        for start in range(0, b, step):
            n = min(step, b - start)
            qs = q[start : start + n].reshape(n * heads, tq, d)
            ks = k[start : start + n].reshape(n * heads, tk, d).transpose(-1, -2)
            if bias is not None:
                s = torch.baddbmm(bias, qs, ks, alpha=factor)
            else:
                s = torch.bmm(qs, ks).mul_(factor)
            s = s.view(n, heads, tq, tk)
            if mask is not None:
                part = mask if mask.shape[0] == 1 else mask[start : start + n]
                if part.dtype == torch.bool:
                    s.masked_fill_(~part, -math.inf)
                else:
                    s.add_(part.float())
            peak = torch.maximum(peak, s.amax(dim=(0, 2, 3)))
    return peak


class AttentionLogits:
    """An attention module's recorder of its per-head max logit, and where its heads' query
    and key rows are (:class:`HeadRows`, each over ``heads`` query heads or ``kv_heads`` key
    heads). Held as the module's ``attention_logits`` attribute; see the module docstring."""

    def __init__(
        self,
        heads: int,
        query: Sequence[HeadRows],
        key: Sequence[HeadRows],
        *,
        kv_heads: int | None = None,
    ) -> None:
        self.heads = heads
        self.kv_heads = heads if kv_heads is None else kv_heads
        if heads < 1 or self.kv_heads < 1 or heads % self.kv_heads:
            raise RuntimeConfigError(
                f"an attention of {heads} query heads cannot share {self.kv_heads} key heads; "
                f"give heads >= 1 and kv_heads dividing it"
            )
        wrong = [r.name for r in query if r.heads != heads]
        wrong += [r.name for r in key if r.heads != self.kv_heads]
        if wrong or not query:
            raise RuntimeConfigError(
                f"the query rows must cover the {heads} query heads and the key rows the "
                f"{self.kv_heads} key heads (wrong: {wrong}; query rows given: "
                f"{len(query)}); name each projection's rows with HeadRows"
            )
        self.query = tuple(query)
        self.key = tuple(key)
        self.recording = False
        """Set by :meth:`start` (a correction that reads the logits): off by default."""
        self.peak: Tensor | None = None
        """The largest logit of each head (float32, ``(heads,)``, on the module's device)
        over the training forwards since the last :meth:`take` (None: none since)."""
        self.records = 0
        """Training forwards recorded since :meth:`start`."""

    @property
    def shares_keys(self) -> bool:
        """Several query heads read one key head (grouped-query attention)."""
        return self.kv_heads < self.heads

    def start(self, module: nn.Module | None = None) -> None:
        """Record from now on (what a correction that reads the logits calls); ``module`` is
        the attention module holding this recorder, for a recorder that must hook into it
        to record (the Hugging Face one does)."""
        self.recording = True
        self.peak = None
        self.records = 0

    def stop(self) -> None:
        self.recording = False
        self.peak = None

    def active(self, training: bool) -> bool:
        """Whether this forward records: recording started, the module in training mode and
        autograd on (the dry run and evaluation run under ``torch.no_grad``), and not a
        recomputation (``replay.py``: that forward was recorded when it first ran)."""
        return self.recording and training and torch.is_grad_enabled() and not is_recomputing()

    def record(
        self,
        query: Tensor,
        key: Tensor,
        scale: float | None = None,
        mask: Tensor | None = None,
        *,
        causal: bool = True,
    ) -> None:
        """Fold this forward's per-head max logit (:func:`max_logits`) into :attr:`peak`."""
        found = max_logits(query, key, scale, mask, causal=causal)
        if found.shape != (self.heads,):
            raise RuntimeConfigError(
                f"the attention recorded logits of {found.shape[0]} heads, but its "
                f"attention_logits describes {self.heads}; record q as (B, heads, T, d)"
            )
        self.peak = found if self.peak is None else torch.maximum(self.peak, found)
        self.records += 1

    def take(self) -> Tensor | None:
        """:attr:`peak`, which starts over."""
        peak, self.peak = self.peak, None
        return peak

    def clip_(self, module: nn.Module, gamma: Tensor) -> None:
        """Scale head h's logits by ``gamma[h]`` through its weights: its query and key rows
        each by √γ_h, or where key heads are shared its query rows by γ_h alone."""
        if self.shares_keys:
            for rows in self.query:
                rows.scale_(module, gamma)
            return
        root = gamma.sqrt()
        for rows in (*self.query, *self.key):
            rows.scale_(module, root)


@runtime_checkable
class ExposesAttentionLogits(Protocol):
    """An attention module QK-Clip can read and clip: it holds its :class:`AttentionLogits`
    and records into it in its training forwards."""

    attention_logits: AttentionLogits


def attention_logits_of(module: nn.Module) -> AttentionLogits | None:
    """The module's :class:`AttentionLogits`, or None where it exposes none."""
    found = getattr(module, "attention_logits", None)
    return found if isinstance(found, AttentionLogits) else None


_ATTENTION_NAME = re.compile("attention|attn", re.IGNORECASE)


def looks_like_attention(module: nn.Module) -> bool:
    """An ``nn.MultiheadAttention`` or a class named like attention (``*Attention*``,
    ``*Attn*``): what a stage with QK-Clip must see expose its logits."""
    return isinstance(module, nn.MultiheadAttention) or bool(
        _ATTENTION_NAME.search(type(module).__name__)
    )


def find_attention(
    module: nn.Module,
) -> tuple[list[tuple[str, nn.Module, AttentionLogits]], list[tuple[str, nn.Module]]]:
    """The submodules of ``module`` that expose their logits (name, module, recorder), and
    those that look like attention (:func:`looks_like_attention`) but expose none and hold
    no submodule that does; the submodules of an exposing module are not looked at."""
    exposing: list[tuple[str, nn.Module, AttentionLogits]] = []
    silent: list[tuple[str, nn.Module]] = []

    def walk(name: str, sub: nn.Module) -> None:
        logits = attention_logits_of(sub)
        if logits is not None:
            exposing.append((name, sub, logits))
            return
        before = len(exposing)
        for child_name, child in sub.named_children():
            walk(f"{name}.{child_name}" if name else child_name, child)
        if looks_like_attention(sub) and len(exposing) == before:
            silent.append((name or type(sub).__name__, sub))

    walk("", module)
    return exposing, silent
