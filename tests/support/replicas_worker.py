"""One rank of a run of runtime/comm/test_replica_buffers_and_data_checks.py, started there by
``torchrun``.

Cases (``--case``):

* ``bn``: a 2-stage model with a BatchNorm on each stage under ``data_parallel=2``; after
  every update of each of its stages, a hash of the stage's buffers (running statistics and
  ``num_batches_tracked``); then an evaluation.
* ``read-order``: ``targets="read"`` on data whose batch order depends on the rank (a list
  of batches shuffled with the global rank as seed).
* ``sampler``: a ``DataLoader`` with a ``DistributedSampler`` under ``data_parallel=2``.

Writes ``OUT/rank-G.pt``: the hashes, the final buffers, the evaluation, and the message of
a ``PipeoptimError`` the run stopped with (None: it trained).
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from pipeoptim import Pipeline
from pipeoptim.errors import PipeoptimError
from pipeoptim.runtime.stage.stage import Stage

BATCH = 16


def bn_model() -> nn.Sequential:
    """Units 0-3 on stage 0 and 4-6 on stage 1 (the even split): a BatchNorm on each."""
    torch.manual_seed(7)
    return nn.Sequential(
        nn.Linear(6, 24),
        nn.BatchNorm1d(24),
        nn.ReLU(),
        nn.Linear(24, 24),
        nn.BatchNorm1d(24),
        nn.ReLU(),
        nn.Linear(24, 3),
    )


def plain_model() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 24), nn.ReLU(), nn.Linear(24, 3))


def samples() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 6, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 2] > 0.5).long()


def digest(tensors: list[Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def record_buffers(stage: Stage, hashes: list[str]) -> None:
    update = stage.update

    def recorded() -> None:
        update()
        hashes.append(digest(list(stage.module.buffers())))

    stage.update = recorded  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=("bn", "read-order", "sampler"), required=True)
    parser.add_argument("--method", default="pipeoptim")
    parser.add_argument("--micro-batches", type=int, default=None)
    parser.add_argument("--data-parallel", type=int, default=2)
    parser.add_argument("--targets", default="send")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y = samples()
    train, test = TensorDataset(x[:192], y[:192]), TensorDataset(x[192:], y[192:])
    pipe = Pipeline(
        bn_model() if args.case == "bn" else plain_model(),
        method=args.method,
        stages=2,
        micro_batches=args.micro_batches,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        transport="dist",
        device="cpu",
        timeout=60,
        data_parallel=args.data_parallel,
        targets=args.targets,
    )
    rank = dist.get_rank()
    data: Any
    if args.case == "read-order":  # the order depends on the rank: not the same batches
        order = torch.randperm(192, generator=torch.Generator().manual_seed(rank))
        data = [(x[i], y[i]) for i in order.split(BATCH)]
    elif args.case == "sampler":  # shards what pipeoptim shards again
        data = DataLoader(
            train, batch_size=BATCH, sampler=DistributedSampler(train), drop_last=True
        )
    else:
        data = DataLoader(train, batch_size=BATCH, shuffle=True, drop_last=True)
    hashes: dict[int, list[str]] = {k: [] for k in pipe.stages}
    for k, stage in pipe.stages.items():
        record_buffers(stage, hashes[k])
    error: str | None = None
    evaluation: dict[str, Any] | None = None
    try:
        result = pipe.fit(data, max_steps=args.steps, eval_data=DataLoader(test, batch_size=32))
        assert result.eval is not None
        evaluation = {"loss": result.eval.loss, "accuracy": result.eval.accuracy}
    except PipeoptimError as err:
        error = str(err)
    buffers = {
        k: {n: b.clone() for n, b in s.module.named_buffers()} for k, s in pipe.stages.items()
    }
    torch.save(
        {
            "replica": pipe.replica,
            "hashes": hashes,
            "buffers": buffers,
            "eval": evaluation,
            "error": error,
        },
        args.out / f"rank-{rank}.pt",
    )
    pipe.close()


if __name__ == "__main__":
    main()
