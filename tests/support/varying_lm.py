"""A tiny GPT fed the way fine-tuning feeds a language model: each batch padded to its own
longest sequence (the lengths change from batch to batch), padding ignored by the loss.
The model and data of the varying-shapes tests, in one process and over ``dist``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from pipeoptim.plan.methods import get_method
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.workloads.gpt import gpt, lm_loss

VOCAB, CONTEXT, BATCH, MICRO = 11, 16, 4, 2
PAD, IGNORED = 0, -100


def tiny_gpt() -> list[nn.Module]:
    torch.manual_seed(0)
    return gpt(vocab_size=VOCAB, context=CONTEXT, dim=16, heads=2, blocks=2, split_blocks=True)


def pad_to_longest(sequences: list[Tensor]) -> tuple[Tensor, Tensor]:
    """The usual collate: inputs padded with ``PAD`` to the batch's longest sequence, the
    next-token targets ``IGNORED`` where there is no next token."""
    longest = max(len(s) for s in sequences) - 1
    ids = torch.full((len(sequences), longest), PAD, dtype=torch.long)
    targets = torch.full((len(sequences), longest), IGNORED, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s) - 1] = s[:-1]
        targets[i, : len(s) - 1] = s[1:]
    return ids, targets


def padded_batches(n: int, seed: int = 3) -> list[tuple[Tensor, Tensor]]:
    """``n`` batches of ``BATCH`` sequences of 3 to ``CONTEXT + 1`` tokens, each batch
    padded to its own longest (so the batches' lengths differ)."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for b in range(n):
        longest = 4 + (5 * b + seed) % (CONTEXT - 3)  # a different length every batch
        lengths = torch.randint(3, longest + 2, (BATCH,), generator=g).tolist()
        lengths[b % BATCH] = longest + 1
        sequences = [torch.randint(1, VOCAB, (int(k),), generator=g) for k in lengths]
        batches.append(pad_to_longest(sequences))
    return batches


def adam(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def padded_pipeline(method: str, **kw: Any) -> Pipeline:
    """A Pipeline of :func:`tiny_gpt` on 2 stages with varying shapes on, M = ``MICRO``
    where the method micro-batches (``kw`` adds)."""
    options: dict[str, Any] = {
        "stages": 2,
        "micro_batches": MICRO,
        "optimizer": adam,
        "loss_fn": lm_loss,
        "varying_shapes": True,
        **kw,
    }
    if not get_method(method).micro_batched:
        options["micro_batches"] = 1
    return Pipeline(tiny_gpt(), method=method, **options)


def single_device(steps: int, make_optimizer: Callable[[Any], Any] = adam) -> list[float]:
    """The same batches on one device, the loss the batch's token mean (the pipeline's: its
    micro-batches weighted by their counted targets), one optimizer step per batch."""
    model = nn.Sequential(*tiny_gpt())
    optimizer = make_optimizer(list(model.parameters()))
    losses = []
    for x, y in padded_batches(steps):
        optimizer.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def weights(pipe: Pipeline) -> dict[int, dict[str, Tensor]]:
    return {
        k: {n: t.detach().clone() for n, t in s.module.state_dict().items()}
        for k, s in pipe.stages.items()
    }
