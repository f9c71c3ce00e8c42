"""One rank of the empty-share sharding test, started by ``torchrun`` from
test_shard_empty_share.py (2 processes: D = 2 replicas of one stage).

For every optimizer family and every split of :data:`SPLITS` (parameter shapes chosen so
that ZeRO's greedy split by size leaves a replica with no matrix, no vector, or nothing),
the rank shards the family's optimizer over both replicas and steps it beside the same
optimizer unsharded on a copy of the parameters, with the same gradients, predicting after
each step; it records what it owns, the largest difference of the weights and of the
predicted weights, or the error that stopped the build. Each rank saves its record to
``OUT/rank-G.pt``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from pipeoptim.runtime.optim.families import TORCH_FAMILIES
from pipeoptim.runtime.optim.predict import predictor_for
from pipeoptim.runtime.optim.sharded import local_optimizer, shard_optimizer, shard_predictor

SPLITS: dict[str, list[tuple[int, ...]]] = {
    # greedy by size: the matrix to replica 0, the three vectors to replica 1
    "a replica without a matrix": [(4, 4), (4,), (4,), (4,)],
    # one matrix each, the vector to replica 0: replica 1 has no vector
    "a replica without a vector": [(4, 4), (4, 4), (4,)],
    "a replica with nothing (one matrix)": [(4, 4)],
    "a replica with nothing (one vector)": [(4,)],
}
STEPS = 3
LR = 0.01


def builders() -> dict[str, Callable[[Iterable[Tensor]], Optimizer]]:
    """Every family by name, and ``any_torch`` as a user's factory of a torch optimizer no
    family builds (Adagrad: per-parameter, so shardable)."""
    out: dict[str, Callable[[Iterable[Tensor]], Optimizer]] = {
        name: (lambda params, f=family: f.build(params, LR, {}))
        for name, family in TORCH_FAMILIES.items()
    }
    out["any_torch"] = lambda params: torch.optim.Adagrad(list(params), lr=LR)
    return out


def largest_gap(a: list[Tensor], b: list[Tensor]) -> float:
    """The largest |a - b| relative to max(|b|, 1), over every element."""
    return max(
        float(((x - y).abs() / y.abs().clamp(min=1.0)).max()) for x, y in zip(a, b, strict=True)
    )


def one_case(build: Callable[[Iterable[Tensor]], Optimizer], shapes: list[tuple[int, ...]]) -> Any:
    torch.manual_seed(0)  # the same parameters and gradients on both replicas
    params = [nn.Parameter(torch.randn(shape)) for shape in shapes]
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    try:
        zero = shard_optimizer(build(params), dist.group.WORLD, stage=0)
    except Exception as err:  # the record carries the failure to the test
        return {"error": f"{type(err).__name__}: {err}"}
    plain = build(twins)
    sharded_predictor = shard_predictor(predictor_for(local_optimizer(zero)), zero)
    plain_predictor = predictor_for(plain)
    owned = [p for g in local_optimizer(zero).param_groups for p in g["params"]]
    weights_gap = predicted_gap = 0.0
    for _ in range(STEPS):
        for p, q in zip(params, twins, strict=True):
            g = torch.randn(p.shape)
            p.grad, q.grad = g.clone(), g.clone()
        zero.step()
        plain.step()
        weights_gap = max(weights_gap, largest_gap([p.detach() for p in params], twins))
        mine = [torch.zeros_like(p) for p in params]
        theirs = [torch.zeros_like(p) for p in twins]
        sharded_predictor.predict_into(mine, 2)
        plain_predictor.predict_into(theirs, 2)
        predicted_gap = max(predicted_gap, largest_gap(mine, theirs))
    return {
        "error": None,
        "matrices": sum(p.ndim == 2 for p in owned),
        "vectors": sum(p.ndim != 2 for p in owned),
        "weights_gap": weights_gap,
        "predicted_gap": predicted_gap,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    record = {
        (family, split): one_case(build, shapes)
        for family, build in builders().items()
        for split, shapes in SPLITS.items()
    }
    torch.save(record, args.out / f"rank-{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
