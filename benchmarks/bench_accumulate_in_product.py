"""A stage's forwards and backwards over M micro-batches, with the weight gradients added
inside their products (``pipeoptim/runtime/stage/accumulate_in_product.py``) against
autograd's own sums, alternating in one process.

Run from the repository root::

    .venv/bin/python benchmarks/bench_accumulate_in_product.py
    .venv/bin/python benchmarks/bench_accumulate_in_product.py --micro-batches 8 --rounds 20

Workload: ``bench_runtime.py``'s stage, 4 x (Linear(w, w) + ReLU) for each ``--widths`` w
(1024 there), batch 256 cut into ``--micro-batches`` micro-batches, one thread; each
micro-batch's forward, then its backward with a fixed output gradient, the gradients adding
up over the step as a pipeline stage's do before its update. Prints, per width, the median
milliseconds a step of each way over the rounds and their ratio. Every width is measured
with the size threshold off (``MIN_WEIGHTS``): the widths under it are where the threshold
keeps autograd's sums.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from pipeoptim.runtime.stage import accumulate_in_product
from pipeoptim.runtime.stage.accumulate_in_product import AccumulateInProduct


def measure(
    micro_batches: int, rounds: int, steps: int, batch: int, width: int = 1024
) -> dict[str, float]:
    """Median milliseconds a step, each way: ``{"autograd sums": ..., "in the product": ...}``."""
    torch.manual_seed(0)
    stage = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(width, width), nn.ReLU())])
    x = torch.randn(batch, width)
    grad = torch.randn(batch, width)
    threshold = accumulate_in_product.MIN_WEIGHTS
    accumulate_in_product.MIN_WEIGHTS = 0  # every width, the threshold's own too
    try:
        mode = AccumulateInProduct(stage)
    finally:
        accumulate_in_product.MIN_WEIGHTS = threshold

    def step(in_product: bool) -> None:
        for p in stage.parameters():
            p.grad = None
        for xs, gs in zip(x.chunk(micro_batches), grad.chunk(micro_batches), strict=True):
            if in_product:
                with mode:
                    out = stage(xs)
            else:
                out = stage(xs)
            out.backward(gs)

    times: dict[str, list[float]] = {"autograd sums": [], "in the product": []}
    for _ in range(rounds):
        for name, in_product in (("autograd sums", False), ("in the product", True)):
            step(in_product)
            start = time.perf_counter()
            for _ in range(steps):
                step(in_product)
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--widths", default="64,256,512,1024", help="comma-separated")
    a = parser.parse_args()
    if a.micro_batches < 1 or a.batch % a.micro_batches:
        parser.error(f"--micro-batches must divide --batch {a.batch}")
    widths = [int(w) for w in a.widths.split(",") if w]
    torch.set_num_threads(1)
    print(
        f"# 4 x Linear(w) + ReLU, batch {a.batch} in {a.micro_batches} micro-batches, 1 thread, "
        f"median of {a.rounds} alternating rounds of {a.steps} steps; the threshold: "
        f"{accumulate_in_product.MIN_WEIGHTS:,} weights"
    )
    print("| w | weights | autograd sums (ms) | in the product (ms) | ratio |")
    print("|---|---|---|---|---|")
    for width in widths:
        ms = measure(a.micro_batches, a.rounds, a.steps, a.batch, width)
        ratio = ms["in the product"] / ms["autograd sums"]
        print(
            f"| {width} | {width * width:,} | {ms['autograd sums']:.2f} | "
            f"{ms['in the product']:.2f} | {ratio:.2f}x |"
        )


if __name__ == "__main__":
    main()
