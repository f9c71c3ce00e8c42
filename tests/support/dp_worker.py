"""One rank of a data-parallel test run, started by ``torchrun`` from test_data_parallel.py.

Trains the dropout-free model below with ``Pipeline(..., transport="dist",
data_parallel=D)`` and records, after every update of each of its stages, a hash of the
stage's weights and optimizer state; then saves them with its final weights and the losses
to ``OUT/rank-G.pt`` for the test to compare across replicas and against one process.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from pipeoptim import Pipeline
from pipeoptim.runtime.stage.stage import Stage
from pipeoptim.workloads.data import Dataset

BATCH = 16
LR = {"sgd": 0.05, "adam": 0.01}


def make_model() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(
        nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 3)
    )


def samples() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(192, 6, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 2] > 0.5).long()


def make_data() -> DataLoader[tuple[Tensor, ...]]:
    x, y = samples()
    return DataLoader(
        TensorDataset(x[:160], y[:160]), batch_size=BATCH, shuffle=True, drop_last=True
    )


def net() -> list[nn.Module]:
    """The model as ``pipeoptim train --model dp_worker.py:net`` loads it (with dataset)."""
    return list(make_model())


def dataset() -> Dataset:
    x, y = samples()
    return Dataset("dp-toy", x[:160], y[:160], x[160:], y[160:], 3)


def make_optimizer(family: str) -> Any:
    if family == "sgd":
        return lambda params: torch.optim.SGD(params, lr=LR["sgd"], momentum=0.9)
    return lambda params: torch.optim.Adam(params, lr=LR["adam"])


def digest(tensors: list[Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def record_updates(stage: Stage, hashes: list[str]) -> None:
    """After every update: the hash of the live weights and the optimizer's state."""
    update = stage.update

    def recorded() -> None:
        update()
        state = [
            v
            for per_param in (stage.optimizer.state.values() if stage.optimizer else [])
            for v in per_param.values()
            if isinstance(v, Tensor)
        ]
        hashes.append(digest([*stage.module.parameters(), *state]))

    stage.update = recorded  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", required=True)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=None)
    parser.add_argument("--data-parallel", type=int, default=2)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pipe = Pipeline(
        make_model(),
        method=args.method,
        stages=args.stages,
        micro_batches=args.micro_batches,
        optimizer=make_optimizer(args.optimizer),
        transport="dist",
        device="cpu",
        timeout=60,
        data_parallel=args.data_parallel,
    )
    hashes: dict[int, list[str]] = {k: [] for k in pipe.stages}
    for k, stage in pipe.stages.items():
        record_updates(stage, hashes[k])
    result = pipe.fit(make_data(), max_steps=args.steps)
    weights = {
        k: [p.detach().clone() for p in s.module.parameters()] for k, s in pipe.stages.items()
    }
    rank = torch.distributed.get_rank()
    torch.save(
        {
            "replica": pipe.replica,
            "hashes": hashes,
            "weights": weights,
            "losses": result.losses,
            "trace_meta": result.trace.meta,
            "batch_size": result.batch_size,
        },
        args.out / f"rank-{rank}.pt",
    )
    pipe.close()


if __name__ == "__main__":
    main()
