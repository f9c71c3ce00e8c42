"""One rank of the sharded-optimizer tests, started by ``torchrun`` from test_shard_optimizer.py.

D = 2 replicas x P = 2 stages (4 processes). One launch runs every case the test compares, so
the process start and the rendezvous are paid once: for each (method, optimizer) the same
run with the optimizer state unsharded and sharded (ZeRO-1); a sharded run checkpointed,
resumed and run through; resumes of checkpoints written at D = 1 (by the test, in one
process); an optimizer the sharding refuses. Each rank saves what it saw to ``OUT/rank-G.pt``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from pipeoptim import Pipeline
from pipeoptim.errors import PipeoptimError
from pipeoptim.runtime.optim.corrections.protocol import HoldsTensors
from pipeoptim.runtime.optim.optimizers import MuonWithAdamW

BATCH = 16
WIDTH = 16
STEPS = 6
CASES = [  # (method, optimizer, micro-batches, grad clip)
    ("gpipe", "adam", 2, None),
    ("gpipe", "sgd", 2, None),
    ("pipedream", "adam", 1, None),
    ("pipedream", "sgd", 1, None),
    ("pipeoptim", "adam", 1, None),
    ("pipeoptim", "sgd", 1, None),
    ("pipeoptim", "muon", 1, None),
    ("pipeoptim", "adamw", 1, 0.05),  # a clip that binds: the global norm, as unsharded
    ("xpipe", "adam", 2, None),  # a kept Δ and one prediction per micro-batch
    ("xpipe+extrapolate", "adamw", 2, None),  # its kept update is whole on every replica
]


def make_model() -> nn.Sequential:
    """Two equal 16 x 16 layers per stage: ZeRO's split by size is then exactly half."""
    torch.manual_seed(7)
    layers: list[nn.Module] = []
    for i in range(4):
        layers.append(nn.Linear(WIDTH, WIDTH))
        if i < 3:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def samples() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(160, WIDTH, generator=g)
    return x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()


def make_data() -> DataLoader[tuple[Tensor, ...]]:
    x, y = samples()
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, drop_last=True)


def make_optimizer(family: str) -> Any:
    if family == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if family == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    if family == "muon":
        return lambda params: MuonWithAdamW(params, lr=0.01)
    return lambda params: torch.optim.Adam(params, lr=0.01)


class MyAdam(torch.optim.Adam):
    """A subclass: its step may couple parameters, so sharding refuses it."""


def build(
    method: str,
    family: str,
    micro: int,
    shard: bool,
    clip: float | None = None,
    folder: Path | None = None,
    optimizer: Any = None,
) -> Pipeline:
    return Pipeline(
        make_model(),
        method=method,
        stages=2,
        micro_batches=micro,
        optimizer=optimizer or make_optimizer(family),
        transport="dist",
        device="cpu",
        timeout=60,
        data_parallel=2,
        shard_optimizer=shard,
        grad_clip=clip,
        checkpoint_dir=None if folder is None else str(folder),
        checkpoint_every=3 if folder is not None else None,
    )


def finished(pipe: Pipeline, result: Any) -> dict[str, Any]:
    """Losses, final weights and each stage's optimizer bytes of a run."""
    out = {
        "losses": list(result.losses),
        "weights": {
            k: [p.detach().clone() for p in s.module.parameters()] for k, s in pipe.stages.items()
        },
        "optimizer_bytes": {k: s.memory()["optimizer"] for k, s in pipe.stages.items()},
        # what a correction keeps (counted in the optimizer bytes, not sharded)
        "correction_bytes": {k: _correction_bytes(s) for k, s in pipe.stages.items()},
    }
    pipe.close()
    return out


def _correction_bytes(stage: Any) -> int:
    correction = None if stage.updater is None else stage.updater.correction
    if not isinstance(correction, HoldsTensors):
        return 0
    return sum(t.numel() * t.element_size() for t in correction.held_tensors())


def run(method: str, family: str, micro: int, shard: bool, clip: float | None) -> dict[str, Any]:
    pipe = build(method, family, micro, shard, clip)
    return finished(pipe, pipe.fit(make_data(), max_steps=STEPS))


def resumed(folder: Path, steps: int, shard: bool, resume: bool) -> dict[str, Any]:
    pipe = build("pipeoptim", "adam", 1, shard, folder=folder)
    return finished(pipe, pipe.fit(make_data(), max_steps=steps, resume=resume))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--from-one", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # every Pipeline below joins this one group
    record: dict[str, Any] = {"cases": {}}
    for method, family, micro, clip in CASES:
        record["cases"][(method, family)] = {
            shard: run(method, family, micro, shard, clip) for shard in (False, True)
        }
    # a sharded run checkpointed at step 6 and resumed equals the sharded run through 9
    work = args.out.parent
    record["part"] = resumed(work / "parts", 6, True, False)
    record["rest"] = resumed(work / "parts", 9, True, True)
    record["whole"] = resumed(work / "whole", 9, True, False)
    record["whole_unsharded"] = resumed(work / "whole-unsharded", 9, False, False)
    record["to_one"] = resumed(work / "two-to-one", 6, True, False)  # resumed at D = 1
    # checkpoints written at D = 1 (by the test) resumed at D = 2, sharded and not
    record["from_one"] = {
        shard: resumed(args.from_one / str(shard), 9, shard, True) for shard in (False, True)
    }
    try:
        build("pipeoptim", "adam", 1, True, optimizer=lambda p: MyAdam(p, lr=0.01))
        record["refused"] = None
    except PipeoptimError as err:
        record["refused"] = str(err)
    record["replica"] = dist.get_rank() // 2
    torch.save(record, args.out / f"rank-{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
