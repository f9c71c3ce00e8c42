"""What one training step of the depth study's language model costs, by context length.

Run from the repository root::

    .venv/bin/python benchmarks/bench_lm_step.py

Why: the convergence study's run time is its steps times this cost. ``gpt-deep`` trains on
windows of ``DEEP_CONTEXT`` (32) characters, half of ``gpt``'s 64, so that its whole grid
fits in 90 minutes on 2 cores. The script times a plain forward, backward and AdamW step
of the 17 units in one process, one thread, batch 32, for both contexts, interleaved round
by round, and prints the median of each and their ratio.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from pipeoptim.workloads.gpt import CONTEXT, DEEP_CONTEXT, gpt, lm_loss, python_corpus

BATCH, STEPS, ROUNDS = 32, 20, 3


def step_seconds(context: int) -> float:
    """Mean seconds of one step at ``context`` (after 3 warm-up steps)."""
    torch.manual_seed(0)
    model = nn.Sequential(*gpt(context=context, blocks=7, split_blocks=True))
    data = python_corpus(context=context)
    x, y = data.train_x[:BATCH], data.train_y[:BATCH]
    opt = torch.optim.AdamW(model.parameters(), 2e-3)

    def step() -> None:
        lm_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    return (time.perf_counter() - start) / STEPS


def main() -> None:
    torch.set_num_threads(1)
    times: dict[int, list[float]] = {CONTEXT: [], DEEP_CONTEXT: []}
    for _ in range(ROUNDS):
        for context in times:
            times[context].append(step_seconds(context))
    median = {c: statistics.median(t) for c, t in times.items()}
    print(f"# one thread, batch {BATCH}, median of {ROUNDS} rounds of {STEPS} steps")
    print("| context | ms per step | vs context 64 |")
    print("|---|---|---|")
    for context, seconds in median.items():
        print(f"| {context} | {1e3 * seconds:.1f} | {seconds / median[CONTEXT]:.2f}x |")


if __name__ == "__main__":
    main()
