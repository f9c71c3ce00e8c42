"""What a split backward costs in pipeoptim's runtime: I and W against one full B.

Run from the repository root::

    .venv/bin/python benchmarks/bench_split_backward.py
    .venv/bin/python benchmarks/bench_split_backward.py --width 512 --blocks 8

Workload: one middle stage of ``--blocks`` x Linear(width, width) at batch ``--batch``
(SGD), built as the runtime builds it (``runtime.stage.Stage``). It runs ``--micro-batches``
micro-batches as F, I, W on a zb-h1 stage and as F, B on a 1f1b stage, interleaved, and
prints the median times and the ratios W/I and (I + W)/B. Zero-bubble schedules assume W
costs about I and I + W about B (Qi et al., ICLR 2024); the simulator takes the split from
the profile (``pipeoptim profile`` measures each layer's weight-gradient share).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from torch import nn

from pipeoptim.plan.actions import Action
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.plan.versions import MicroBatchVersions, analyze_versions
from pipeoptim.runtime.options import StageOptions
from pipeoptim.runtime.stage.stage import Stage


def build(method: str, width: int, blocks: int, micro_batches: int) -> Stage:
    torch.manual_seed(0)
    layers = nn.Sequential(*(nn.Linear(width, width) for _ in range(blocks)))
    stage = Stage(
        1,
        layers,
        num_stages=3,
        method=get_method(method),
        options=StageOptions(OptimizerSpec("sgd", 0.1)),
        micro_batches=micro_batches,
    )
    passes = ("F", "I", "W") if method == "zb-h1" else ("F", "B")
    text = [f"0{k}{j}" for j in range(micro_batches) for k in passes] + ["0U0"]
    order = {0: [Action.parse(a) for a in text]}
    report = analyze_versions(order, get_method(method).weight_policy, micro_batches)
    versions: dict[int, MicroBatchVersions] = {mb: v for (_, mb), v in report.passes.items()}
    stage.begin_segment(versions)
    return stage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=20)
    parser.add_argument("--skip", type=int, default=3, help="first micro-batches not timed")
    a = parser.parse_args()
    split = build("zb-h1", a.width, a.blocks, a.micro_batches)
    whole = build("1f1b", a.width, a.blocks, a.micro_batches)
    x, g = torch.randn(a.batch, a.width), torch.randn(a.batch, a.width)
    times: dict[str, list[float]] = {"F": [], "I": [], "W": [], "B": []}
    for mb in range(a.micro_batches):
        t0 = time.perf_counter()
        split.forward(mb, x)
        t1 = time.perf_counter()
        split.backward_input(mb, g)
        t2 = time.perf_counter()
        split.backward_weight(mb)
        t3 = time.perf_counter()
        whole.forward(mb, x)
        t4 = time.perf_counter()
        whole.backward(mb, g)
        t5 = time.perf_counter()
        if mb >= a.skip:
            for key, value in (("F", t1 - t0), ("I", t2 - t1), ("W", t3 - t2), ("B", t5 - t4)):
                times[key].append(value)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {a.blocks} x Linear({a.width}), batch {a.batch}, "
        f"median of {a.micro_batches - a.skip} micro-batches"
    )
    print(" ".join(f"{k} {1e3 * v:.2f} ms" for k, v in med.items()))
    print(f"W/I {med['W'] / med['I']:.2f}  (I + W)/B {(med['I'] + med['W']) / med['B']:.2f}")


if __name__ == "__main__":
    main()
