"""One rank of the one-tag runs, started by ``torchrun`` from test_one_tag.py.

For every method named (``--methods``, default: every registered one), the rank trains the
same small model twice in this process group, with a tag per message (gloo's default) and
with one tag for every message (``one_tag=True``: gloo then matches a pair's messages in
posting order, as NCCL does), evaluating every few steps (so the run is cut into segments
with evaluation passes between them), and saves each run's losses, evaluation losses and
its stages' final weights to ``OUT/rank-R.pt``. ``--model tuples`` trains a model whose
stages hand on tuples of tensors (test_tuples.py's); ``--stop-at S``: a callback stops each
run at step S, inside a segment (a log point every step).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from pipeoptim import Callback, Pipeline
from pipeoptim.plan.methods.registry import METHODS

STEPS, EVAL_EVERY, BATCH = 4, 2, 8


def toy_units() -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Linear(6, 12),
        nn.Tanh(),
        nn.Linear(12, 12),
        nn.Dropout(0.1),  # each stage's own random stream: alike in both runs
        nn.Linear(12, 12),
        nn.Tanh(),
        nn.Linear(12, 12),
        nn.Linear(12, 3),
    ]


def tuple_units() -> list[nn.Module]:
    from runtime.test_tuples import net  # tests/ is on the path, as in every test run

    torch.manual_seed(0)
    return net()


def data(n: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, BATCH, 6, generator=g)
    y = (x[..., 0] > 0).long() + (x[..., 1] > 0.5).long()
    return list(zip(x, y, strict=True))


def adam(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, info: Any, pipeline: Any) -> None:
        if info.step >= self.step:
            info.request_stop(f"reached {info.step}")


def run(method: str, stages: int, model: str, one_tag: bool, stop_at: int) -> dict[str, Any]:
    units = tuple_units() if model == "tuples" else toy_units()
    stops: dict[str, Any] = {}
    if stop_at >= 0:
        stops = {"callbacks": [StopAt(stop_at)], "log_every": 1}
    pipe = Pipeline(
        units,
        method=method,
        stages=stages,
        optimizer=adam,
        loss_fn=F.cross_entropy,
        transport="dist",
        device="cpu",
        timeout=60,
        one_tag=one_tag,
        **stops,
    )
    steps = STEPS if stop_at < 0 else 2 * STEPS
    every = EVAL_EVERY if stop_at < 0 else steps  # no evaluation cuts the segment short
    result = pipe.fit(data(steps), max_steps=steps, eval_data=data(2), eval_every=every)
    record = {
        "ordered": [t.needs_order for t in pipe.parts.transports.values()],
        "step": pipe.step,
        "losses": result.losses,
        "evaluations": [e.loss for e in result.eval_history],
        "weights": {
            k: {n: t.detach().clone() for n, t in s.module.state_dict().items()}
            for k, s in pipe.stages.items()
        },
    }
    pipe.close()
    return record


def toy_methods() -> list[str]:
    """Every registered method the toy model can train: all but QK-Clip's, refused on a
    model without attention (its messages are its base method's: a correction changes
    only the update)."""
    return sorted(name for name, m in METHODS.items() if m.correction != "qk-clip")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", default="")
    parser.add_argument("--model", choices=("toy", "tuples"), default="toy")
    parser.add_argument("--stop-at", type=int, default=-1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # the Pipelines join it: one group for every run
    stages = dist.get_world_size()
    methods = args.methods.split(",") if args.methods else toy_methods()
    record = {
        method: {
            tag: run(method, stages, args.model, tag == "one", args.stop_at)
            for tag in ("each", "one")
        }
        for method in methods
    }
    torch.save(record, args.out / f"rank-{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
