"""A tiny language model trained on padded batches (targets -100 past each sequence's
length, one micro-batch's worth of samples entirely ignored), its single-device training
loop, and one rank of its dist runs, started by ``torchrun`` from test_token_mean_loss.py
and test_global_clip.py (``--out``: each rank writes its stages' weights and the losses).

The model is tied_worker's (its input embedding is its output projection, one Parameter on
two stages): a pipeline's clipping norm must count that weight once.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from pipeoptim import Pipeline

try:
    from support import tied_worker as tw
except ImportError:  # run as torchrun's script: this folder is the first on the path
    import tied_worker as tw  # type: ignore[no-redef]

IGNORE = -100
LR, MOMENTUM = 0.5, 0.9


def padded_batches(steps: int, batch: int = 8) -> list[tuple[Tensor, Tensor]]:
    """``steps`` batches of ``batch`` sequences, each padded (targets ignored) past its own
    random length; samples 2 and 3 wholly ignored (a whole micro-batch at M = 4)."""
    g = torch.Generator().manual_seed(11)
    out = []
    for x, y in tw.batches(steps, batch):
        y = y.clone()
        lengths = torch.randint(0, tw.CONTEXT + 1, (batch,), generator=g)
        for i, n in enumerate(lengths.tolist()):
            y[i, n:] = IGNORE
        y[2:4] = IGNORE
        out.append((x, y))
    return out


def sgd(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def single_device(
    batches: list[tuple[Tensor, Tensor]], clip: float | None = None
) -> tuple[list[Tensor], list[float], list[float]]:
    """Plain torch training of the uncut model: its weights (unit order), the losses and
    the gradient norms before clipping."""
    model = nn.Sequential(*tw.tied_units())
    opt = sgd(list(model.parameters()))
    losses, norms = [], []
    for x, y in batches:
        loss = tw.token_loss(model(x), y)
        loss.backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        norms.append(float(norm))
    return [p.detach().clone() for p in model.parameters()], losses, norms


def pipeline(method: str, micro: int, **kwargs: Any) -> Pipeline:
    return Pipeline(
        tw.tied_units(),
        method=method,
        stages=2,
        micro_batches=micro,
        optimizer=sgd,
        loss_fn=tw.token_loss,
        device="cpu",
        progress=False,
        **kwargs,
    )


def weights(pipe: Pipeline) -> list[Tensor]:
    """The pipeline's weights in the uncut model's order: a tied weight once, its first
    stage's copy (the others' copies are its equal: ``test_ties.py``)."""
    out: list[Tensor] = []
    for k in sorted(pipe.stages):
        stage = pipe.stages[k]
        copies = {id(t) for t in stage.updater.tied_elsewhere} if stage.updater else set()
        out += [p.detach().clone() for p in stage.module.parameters() if id(p) not in copies]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", default="gpipe")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pipe = pipeline(
        args.method, args.micro_batches, grad_clip=args.clip, transport="dist", timeout=60
    )
    result = pipe.fit(padded_batches(args.steps), max_steps=args.steps)
    rank = torch.distributed.get_rank()
    record = {
        "losses": result.losses,
        "weights": {
            k: {n: t.detach().clone() for n, t in s.module.state_dict().items()}
            for k, s in pipe.stages.items()
        },
    }
    torch.save(record, args.out / f"rank-{rank}.pt")
    # leave the process group before exit: a rank that exits with gloo's threads alive can
    # abort ("terminate called without an active exception") and fail the run
    pipe.close()


if __name__ == "__main__":
    main()
