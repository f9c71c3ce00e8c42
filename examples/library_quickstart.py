"""PipeOptim in your own training script: your model, DataLoader, loss, schedule, precision.

One process, every stage in it (emulates P pipeline stages on one device)::

    python examples/library_quickstart.py

One process per stage, the same script, under torchrun (gloo on CPU, NCCL on GPUs; add
``--nnodes``/``--rdzv-endpoint`` for several machines)::

    torchrun --nproc-per-node 2 examples/library_quickstart.py --transport dist --stages 2

Data-parallel replicas of the pipeline (PP x DP): D x P processes, here 2 replicas of a
2-stage pipeline; each replica trains on half of every batch::

    torchrun --nproc-per-node 4 examples/library_quickstart.py --transport dist --stages 2 \
        --data-parallel 2

Only the rank of the first stage reads the data; every rank builds the model and the
loaders from the same code, so the script is the same everywhere.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR
from torch.utils.data import DataLoader, TensorDataset

from pipeoptim import Pipeline


def make_data(batch_size: int) -> tuple[DataLoader, DataLoader]:
    """8x8 digits (bundled with scikit-learn, no download): 1,500 to train, 297 to test."""
    x, y = load_digits(return_X_y=True)
    inputs = torch.tensor(x / 16.0, dtype=torch.float32)
    targets = torch.tensor(y)
    order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(0))
    train, test = order[:1500], order[1500:]
    train_loader = DataLoader(
        TensorDataset(inputs[train], targets[train]),
        batch_size=batch_size,
        shuffle=True,  # re-seeded per epoch by the pipeline, so resume is exact
        drop_last=True,  # every training batch the same size
    )
    test_loader = DataLoader(TensorDataset(inputs[test], targets[test]), batch_size=128)
    return train_loader, test_loader


def make_model() -> nn.Sequential:
    """A plain nn.Sequential; each entry is a unit the pipeline may put on any stage."""
    torch.manual_seed(0)  # every rank builds the same initial weights
    return nn.Sequential(
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.Linear(128, 128),
        nn.ReLU(),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", default="pipeoptim")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--transport", choices=("local", "dist"), default="local")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--amp", choices=("bf16", "fp16"))
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--targets",
        choices=("send", "read"),
        default="send",
        help="dist: stage 0 sends the targets to the last stage, or the last stage's rank "
        "reads the (deterministic) loader itself",
    )
    parser.add_argument(
        "--data-parallel", type=int, default=1, help="replicas of the pipeline (dist only)"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()

    train_loader, test_loader = make_data(batch_size=32)
    updates = args.epochs * len(train_loader)
    pipe = Pipeline(
        make_model(),
        method=args.method,
        stages=args.stages,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01),
        scheduler=lambda opt: CosineAnnealingLR(opt, T_max=updates),
        loss_fn=F.cross_entropy,
        transport=args.transport,
        device=args.device,
        amp=args.amp,
        grad_clip=1.0,
        targets=args.targets,
        data_parallel=args.data_parallel,
    )
    result = pipe.fit(train_loader, epochs=args.epochs, eval_data=test_loader)
    pipe.close()
    if 0 not in pipe.stages or pipe.replica != 0:
        return  # every rank holds the same result; replica 0's first stage reports it
    if args.json:
        print(json.dumps(result.summary()))
        return
    assert result.eval is not None
    print(
        f"{result.method} on {result.num_stages} stages ({result.transport}, {result.device}): "
        f"final training loss {result.final_loss:.4f}, test accuracy {result.test_accuracy:.1%}, "
        f"{result.samples_per_second:.0f} samples/s"
    )


if __name__ == "__main__":
    main()
