"""A tiny GPT and its corpus, trained as a Pipeline: the model of the tests of the
asynchronous fast path and of each rank's forwards first."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.workloads.gpt import gpt, lm_loss

VOCAB = 11


def tiny_gpt() -> list[nn.Module]:
    """A GPT of attention and MLP units with dropout (the RNG stream) and an embedding."""
    torch.manual_seed(0)
    return gpt(
        vocab_size=VOCAB, context=8, dim=16, heads=2, blocks=2, dropout=0.1, split_blocks=True
    )


def corpus(n: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (n, 16, 9), generator=g)
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in ids]


def trained_pipeline(method: str, steps: int = 4, **kw: Any) -> tuple[Pipeline, list[float]]:
    """A Pipeline of :func:`tiny_gpt` (4 stages, M = 4 where micro-batched, AdamW,
    clipping) after ``steps`` mini-batches, and its losses; ``kw`` goes to the Pipeline."""
    options: dict[str, Any] = {"stages": 4, "micro_batches": 4, **kw}
    if not get_method(method).micro_batched:
        options["micro_batches"] = 1
    pipe = Pipeline(
        tiny_gpt(),
        method=method,
        optimizer=OptimizerSpec("adamw", 3e-3, {"weight_decay": 0.01}),
        loss_fn=lm_loss,
        grad_clip=1.0,
        log_every=1,
        **options,
    )
    result = pipe.fit(corpus(steps), max_steps=steps)
    return pipe, list(result.losses)
