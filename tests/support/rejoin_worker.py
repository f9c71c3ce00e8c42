"""Under torchrun: several Pipelines one after another, each closed before the next starts
its process group (``tests/runtime/test_rejoin.py``). Prints each one's losses as JSON on
rank 0."""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from pipeoptim import Pipeline
from pipeoptim.plan.plan import OptimizerSpec


def layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipelines", type=int, default=3)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))] * 4
    runs = []
    for _ in range(args.pipelines):
        with Pipeline(
            layers(),
            "1f1b",
            stages=2,
            micro_batches=2,
            optimizer=OptimizerSpec("sgd", 0.1),
            transport="dist",
            device="cpu",
        ) as pipe:
            result = pipe.fit(data, max_steps=4)
            runs.append(result.losses)
            rank = torch.distributed.get_rank()
    if rank == 0:
        print(json.dumps(runs))


if __name__ == "__main__":
    main()
