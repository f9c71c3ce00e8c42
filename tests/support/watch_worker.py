"""One rank of the dist callback tests, started by ``torchrun`` (4 processes) from
test_watching_dist.py: a stop asked by a callback at log points on P = 4 ranks, and on D = 2
replicas x P = 2, each against a run of ``max_steps`` where the stop ended, with loggers on.
Each rank saves what it saw to ``OUT/rank-G.pt``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeoptim import Callback, JsonlLogger, Pipeline, TensorBoardLogger


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16),
        nn.ReLU(), nn.Linear(16, 4),
    )  # fmt: skip


def make_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(20)
    ]


class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step
        self.decided: list[bool] = []

    def on_step_end(self, info: Any, pipeline: Any) -> None:
        self.decided.append(info.decides)
        if info.step >= self.step:
            info.request_stop(f"reached {info.step}")


def run(stages: int, replicas: int, callbacks: list[Any], **fit: Any) -> dict[str, Any]:
    pipe = Pipeline(
        make_model(), "pipeoptim", stages=stages, transport="dist", device="cpu", log_every=1,
        data_parallel=replicas, callbacks=callbacks, timeout=60,
    )  # fmt: skip
    result = pipe.fit(make_data(), **fit)
    out = {
        "step": pipe.step,
        "losses": result.losses,
        "weights": {
            k: [p.detach().clone() for p in s.module.parameters()] for k, s in pipe.stages.items()
        },
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    torch.set_num_threads(1)
    seen: dict[str, Any] = {}
    stopper = StopAt(5)
    tb = TensorBoardLogger(out / "tb")
    lines = JsonlLogger(out / "run.jsonl")
    seen["deep"] = run(4, 1, [stopper, tb, lines], epochs=1)
    seen["deep_decided"] = stopper.decided
    seen["deep_plain"] = run(4, 1, [], max_steps=seen["deep"]["step"])
    seen["replicas"] = run(2, 2, [StopAt(5)], epochs=1)
    seen["replicas_plain"] = run(2, 2, [], max_steps=seen["replicas"]["step"])
    seen["tb"] = str(tb.written)
    seen["jsonl"] = str(lines.written)
    rank = int(__import__("os").environ["RANK"])
    torch.save(seen, out / f"rank-{rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
