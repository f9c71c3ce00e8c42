"""A small character-level language model on Python source, for realistic pipeline runs.

The classification toys in :mod:`pipeoptim.workloads.data` converge in seconds and say little
about how weight prediction behaves on the workloads pipelines are built for. This module
gives a real, if small, one: a decoder-only transformer learning next-character prediction
on the Python standard library's own ``.py`` files. The corpus is read from the interpreter's
installation, so it is offline and needs no download, and it is a pure function of the
installed standard library, so every rank of a pipeline builds the same samples (ranks on
different machines need the same Python version for that).

The model is a flat list of units that each take and return one tensor (embedding,
transformer blocks, final norm, head), which is what lets a pipeline cut it anywhere.
"""

from __future__ import annotations

import math
import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.model.attention_logits import AttentionLogits, HeadRows
from pipeoptim.workloads.data import Dataset

__all__ = [
    "CONTEXT",
    "DEEP_CONTEXT",
    "GPT_DEFAULTS",
    "TEST_CHARS",
    "TRAIN_CHARS",
    "UNKNOWN",
    "VOCAB",
    "VOCAB_SIZE",
    "AttentionHalf",
    "Block",
    "Embedding",
    "MlpHalf",
    "corpus_files",
    "decode",
    "encode",
    "gpt",
    "gpt_deep",
    "gpt_deeper",
    "lm_loss",
    "python_corpus",
]

VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
"""Characters with their own id (id = position). Fixed rather than taken from the corpus so
that ids do not change with the Python version whose standard library is read."""

UNKNOWN = len(VOCAB)
"""The id of every other character: tabs, carriage returns and non-ASCII text (all rare in
the standard library, so one shared id costs little and keeps the vocabulary fixed)."""

VOCAB_SIZE = len(VOCAB) + 1

TRAIN_CHARS = 1_000_000
TEST_CHARS = 100_000
TEST_EVERY = 10
"""File i (in sorted order, counting readable files only) is a test file when
``i % TEST_EVERY == TEST_EVERY - 1``: the split is by file, so no file is in both."""

CONTEXT = 64
DEEP_CONTEXT = 32
"""The context of ``gpt-deep``: half of ``gpt``'s, so the depth study's every method, correction
and depth train in the 90 minutes the study is allowed on a 2-core machine (the cost of a
step is about proportional to the tokens it trains on)."""

SKIP_DIRS = frozenset(
    {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__"}
)
"""Test suites are huge and repetitive, idlelib and lib2to3 are applications rather than
library code, and site-packages depends on what happens to be installed."""

GPT_DEFAULTS: dict[str, float | int | str] = {
    "optimizer": "adamw",
    "lr": 2e-3,
    "batch_size": 32,
    "weight_decay": 0.01,
}
"""Training settings for the default model, chosen by measurement: single-process on two CPU
cores (about 23 steps a second) the test perplexity falls from 98 to 6.8 after 700 steps,
5.3 after 1400 (about a minute) and 4.7 after 2800; the unigram perplexity is 22. A wider
model (dim 128) or a higher rate did worse within the same minute."""

_LOOKUP = np.full(128, UNKNOWN, dtype=np.int64)
_LOOKUP[[ord(c) for c in VOCAB]] = np.arange(len(VOCAB))


def encode(text: str) -> Tensor:
    """Character ids of ``text`` (int64), characters outside :data:`VOCAB` as UNKNOWN."""
    # UTF-32 gives one code point per element, so the mapping is one vectorised lookup.
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ids = np.full(len(points), UNKNOWN, dtype=np.int64)
    ascii_mask = points < 128
    ids[ascii_mask] = _LOOKUP[points[ascii_mask]]
    return torch.from_numpy(ids)


def decode(ids: Iterable[int] | Tensor) -> str:
    """The text of character ids, UNKNOWN shown as U+FFFD; for reading samples, not for
    round trips of non-ASCII text."""
    values = ids.tolist() if isinstance(ids, Tensor) else list(ids)
    return "".join(VOCAB[i] if 0 <= i < len(VOCAB) else "\N{REPLACEMENT CHARACTER}" for i in values)


def _stdlib_sources(root: Path) -> list[str]:
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        rel = Path(dirpath).relative_to(root)
        found.extend((rel / f).as_posix() for f in filenames if f.endswith(".py"))
    return sorted(found)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _select(root: Path, train_chars: int, test_chars: int) -> tuple[list[str], list[str], str, str]:
    train_files: list[str] = []
    test_files: list[str] = []
    train_parts: list[str] = []
    test_parts: list[str] = []
    have = {"train": 0, "test": 0}
    budget = {"train": train_chars, "test": test_chars}
    index = 0
    for rel in _stdlib_sources(root):
        if have["train"] >= budget["train"] and have["test"] >= budget["test"]:
            break
        text = _read(root / rel)
        if text is None or not text.strip():
            continue
        split = "test" if index % TEST_EVERY == TEST_EVERY - 1 else "train"
        index += 1
        # A file whose split is already full is dropped, not moved, so the split stays a
        # function of the file's position alone.
        if have[split] >= budget[split]:
            continue
        (test_files if split == "test" else train_files).append(rel)
        (test_parts if split == "test" else train_parts).append(text)
        have[split] += len(text)
    train_text = "".join(train_parts)[:train_chars]
    test_text = "".join(test_parts)[:test_chars]
    return train_files, test_files, train_text, test_text


def corpus_files(
    train_chars: int = TRAIN_CHARS, test_chars: int = TEST_CHARS
) -> tuple[list[str], list[str]]:
    """The standard-library files (paths relative to it) of the train and test split."""
    train_files, test_files, _, _ = _select(
        Path(sysconfig.get_paths()["stdlib"]), train_chars, test_chars
    )
    return train_files, test_files


def _windows(ids: Tensor, context: int) -> tuple[Tensor, Tensor]:
    count = len(ids) // (context + 1)
    windows = ids[: count * (context + 1)].view(count, context + 1)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def python_corpus(
    context: int = CONTEXT, train_chars: int = TRAIN_CHARS, test_chars: int = TEST_CHARS
) -> Dataset:
    """Next-character prediction on the standard library's Python source.

    Files are taken in sorted order of their relative paths until each split has its
    character budget (the last file is cut); every ``TEST_EVERY``-th file is a test file.
    Samples are non-overlapping windows of ``context + 1`` characters: ``x`` the first
    ``context``, ``y`` the last ``context`` (both int64, shape ``(N, context)``).
    """
    if context < 1:
        raise RuntimeConfigError(f"context must be at least 1, got {context}")
    root = Path(sysconfig.get_paths()["stdlib"])
    _, _, train_text, test_text = _select(root, train_chars, test_chars)
    train_x, train_y = _windows(encode(train_text), context)
    test_x, test_y = _windows(encode(test_text), context)
    if len(train_x) == 0 or len(test_x) == 0:
        raise RuntimeConfigError(
            f"the standard library at {root} holds too little Python source for windows of "
            f"{context + 1} characters ({len(train_text)} train, {len(test_text)} test "
            f"characters); use a smaller context"
        )
    return Dataset("python", train_x, train_y, test_x, test_y, VOCAB_SIZE)


class Embedding(nn.Module):
    """Token plus learned position embedding: (B, T) int64 to (B, T, dim)."""

    def __init__(self, vocab_size: int, context: int, dim: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Parameter(torch.zeros(context, dim))
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions, std=0.02)

    def forward(self, ids: Tensor) -> Tensor:
        tokens: Tensor = self.tokens(ids)
        return tokens + self.positions[: ids.shape[1]]


def _qkv_logits(dim: int, heads: int) -> AttentionLogits:
    """The max-logit recorder of an attention over the fused ``qkv`` Linear: head h's query
    rows are ``qkv``'s output rows ``h·d .. (h+1)·d`` (weight and bias), its key rows the
    same ``dim`` further on (``runtime/model/attention_logits.py``)."""
    head_dim = dim // heads

    def rows(offset: int) -> list[HeadRows]:
        return [HeadRows(f"qkv.{n}", 0, offset, heads, head_dim) for n in ("weight", "bias")]

    return AttentionLogits(heads, rows(0), rows(dim))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP, each residual.

    It exposes its per-head max attention logit (``attention_logits``, recorded only while a
    correction such as QK-Clip asks for it)."""

    def __init__(self, dim: int, heads: int, blocks: int, dropout: float = 0.0) -> None:
        super().__init__()
        if dim % heads:
            raise RuntimeConfigError(f"dim {dim} is not a multiple of heads {heads}")
        self.heads = heads
        self.dropout = dropout
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)
        self.attention_logits = _qkv_logits(dim, heads)
        # GPT-2 initialisation: small weights, and residual outputs scaled down with depth
        # so the residual stream's variance does not grow with the number of blocks.
        for layer in (self.qkv, self.up):
            nn.init.normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)
        for layer in (self.proj, self.down):
            nn.init.normal_(layer.weight, std=0.02 / math.sqrt(2 * blocks))
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.attend(x))

    def attend(self, x: Tensor) -> Tensor:
        """The attention half with its residual."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        logits: AttentionLogits | None = getattr(self, "attention_logits", None)
        if logits is not None and logits.active(self.training):
            logits.record(q, k)  # sdpa's scale, causal positions; no grad, same output
        att = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        out: Tensor = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return out

    def mlp(self, x: Tensor) -> Tensor:
        """The MLP half with its residual."""
        out: Tensor = x + self.drop(self.down(F.gelu(self.up(self.norm2(x)))))
        return out


class AttentionHalf(nn.Module):
    """A :class:`Block`'s attention half as a unit of its own (its norm1, qkv and proj),
    exposing its max attention logit as the block does."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        self.heads, self.dropout = block.heads, block.dropout
        self.norm1, self.qkv, self.proj, self.drop = block.norm1, block.qkv, block.proj, block.drop
        self.attention_logits = _qkv_logits(block.qkv.in_features, block.heads)

    def forward(self, x: Tensor) -> Tensor:
        return Block.attend(self, x)  # type: ignore[arg-type]  # the same fields


class MlpHalf(nn.Module):
    """A :class:`Block`'s MLP half as a unit of its own (its norm2, up and down)."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        self.norm2, self.up, self.down, self.drop = block.norm2, block.up, block.down, block.drop

    def forward(self, x: Tensor) -> Tensor:
        return Block.mlp(self, x)  # type: ignore[arg-type]  # the same fields


def gpt(
    vocab_size: int = VOCAB_SIZE,
    context: int = CONTEXT,
    dim: int = 64,
    heads: int = 4,
    blocks: int = 6,
    dropout: float = 0.0,
    split_blocks: bool = False,
) -> list[nn.Module]:
    """A decoder-only transformer as ``blocks + 3`` units: embedding, blocks, final
    LayerNorm, linear head ((B, T) int64 ids to (B, T, vocab_size) logits). The head is not
    tied to the embedding because the two usually live on different pipeline stages.

    ``split_blocks`` cuts every block into its attention and its MLP half (``2·blocks + 3``
    units), so a deep pipeline has a unit per stage without a deeper model: the same
    weights, drawn in the same order, and the same function."""
    head = nn.Linear(dim, vocab_size)
    nn.init.normal_(head.weight, std=0.02)
    nn.init.zeros_(head.bias)
    embedding = Embedding(vocab_size, context, dim)
    body: list[nn.Module] = []
    for block in [Block(dim, heads, blocks, dropout) for _ in range(blocks)]:
        body += [AttentionHalf(block), MlpHalf(block)] if split_blocks else [block]
    return [embedding, *body, nn.LayerNorm(dim), head]


def gpt_deep() -> list[nn.Module]:
    """The study's language model at depth: :func:`gpt` with 7 blocks, each cut into its
    two halves (17 units: up to 16 stages with at least one unit each), on a context of
    ``DEEP_CONTEXT`` characters."""
    return gpt(context=DEEP_CONTEXT, blocks=7, split_blocks=True)


def gpt_deeper() -> list[nn.Module]:
    """The study's deeper language model: :func:`gpt` with 16 blocks, each cut into its two
    halves (35 units: up to 32 stages with at least one unit each), on ``gpt-deep``'s
    windows of ``DEEP_CONTEXT`` characters."""
    return gpt(context=DEEP_CONTEXT, blocks=16, split_blocks=True)


def python_corpus_deep() -> Dataset:
    """:func:`python_corpus` in windows of ``DEEP_CONTEXT`` characters (``gpt-deep``'s data)."""
    return python_corpus(context=DEEP_CONTEXT)


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy over every position: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
