"""One weight prediction against one optimizer step, per optimizer family and stage size.

Run from the repository root::

    .venv/bin/python benchmarks/bench_predict.py            # 1 M to 50 M parameters
    .venv/bin/python benchmarks/bench_predict.py --quick    # 1 M and 5 M

A "prediction" is what a stage does before a predicted forward: write Ŵ = W − Σlr·Δ into
its prediction buffer (``predict_into``, Δ read from the optimizer's state; the forward runs
on the buffer, and the backward reads the live weights, so nothing is set aside or put
back). A "step" is ``optimizer.step()`` on the same parameters with a
gradient present. Each is timed as the median of ``--repeat`` runs after a warm-up, on one
CPU thread per default (``--threads``), or on CUDA with ``--device cuda`` (synchronised).
Goal: prediction <= 1.2x a step.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch

from pipeoptim.runtime.optim.predict import predictor_for

FAMILIES: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9),
}


def params_of(count: int, device: torch.device) -> list[torch.Tensor]:
    """Layers of 1024 x 1024 weights plus biases, about ``count`` parameters in all."""
    layers = max(1, round(count / (1024 * 1024 + 1024)))
    out: list[torch.Tensor] = []
    for _ in range(layers):
        out.append(torch.randn(1024, 1024, device=device, requires_grad=True))
        out.append(torch.randn(1024, device=device, requires_grad=True))
    return out


def timed(fn: Callable[[], None], repeat: int, device: torch.device) -> float:
    times = []
    for i in range(repeat + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:  # warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(family: str, count: int, repeat: int, device: torch.device) -> tuple[float, float]:
    params = params_of(count, device)
    opt = FAMILIES[family](params)
    predictor = predictor_for(opt, "optimizer")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # state to predict from
    opt.step()
    buffer = [torch.empty_like(p) for p in params]

    def predict() -> None:
        predictor.predict_into(buffer, 3)

    def step() -> None:
        opt.step()

    return timed(predict, repeat, device), timed(step, repeat, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,5,20,50", help="millions of parameters")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true")
    a = parser.parse_args()
    if a.quick:
        a.sizes, a.repeat = "1,5", 3
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{device}, {a.threads} thread(s), median of {a.repeat}"
    )
    print("| optimizer | parameters | prediction ms | step ms | prediction / step |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for family in FAMILIES:
        for millions in (float(x) for x in a.sizes.split(",")):
            pred, step = bench(family, int(millions * 1e6), a.repeat, device)
            worst = max(worst, pred / step)
            print(
                f"| {family} | {millions:g} M | {1e3 * pred:.2f} | {1e3 * step:.2f} | "
                f"{pred / step:.2f}x |"
            )
    print(f"\nworst prediction / step: {worst:.2f}x (goal <= 1.2x)")


if __name__ == "__main__":
    main()
