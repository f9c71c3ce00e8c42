"""Optimizer-state bytes and peak RSS per stage, with and without ZeRO-1 sharding, at D = 2.

Runs the same small pipeline (an 8-layer MLP of width 1024, P = 2 stages, Adam, pipeoptim)
three times, each a fresh ``torchrun`` so a process's peak RSS is its own run's: D = 1
(2 processes), D = 2 unsharded and D = 2 with ``shard_optimizer=True`` (4 processes each).
Each rank reports its stage's ``memory()["optimizer"]`` (the runtime's own count: the state
this process holds) and its peak RSS (``ru_maxrss``), also as the rise over the RSS it had
before the pipeline was built (torch's import and the process group are the same in every
run). Prints one table of figures measured in this run.

    python benchmarks/bench_memory_shard.py            # about a minute on 2 CPU cores
    python benchmarks/bench_memory_shard.py --json     # the figures as JSON
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path
from typing import Any

from torchrun_ranks import run_ranks

WIDTH, LAYERS, BATCH, STEPS = 1024, 8, 32, 4


def _worker(shard: bool, replicas: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from pipeoptim import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(LAYERS):
        layers.append(nn.Linear(WIDTH, WIDTH))
        if i < LAYERS - 1:
            layers.append(nn.ReLU())
    x = torch.randn(BATCH * STEPS, WIDTH)
    y = torch.randint(0, WIDTH, (BATCH * STEPS,))
    pipe = Pipeline(
        nn.Sequential(*layers),
        method="pipeoptim",
        stages=2,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-4),
        transport="dist",
        device="cpu",
        data_parallel=replicas,
        shard_optimizer=shard,
        timeout=120,
    )
    pipe.fit(DataLoader(TensorDataset(x, y), batch_size=BATCH), max_steps=STEPS)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rank = dist.get_rank()
    record = {
        "rank": rank,
        "replica": pipe.replica,
        "stages": {
            k: {
                "optimizer": s.memory()["optimizer"],
                "weights": s.memory()["weights"],
                "stash": s.memory()["stash"],
            }
            for k, s in pipe.stages.items()
        },
        "peak_rss": peak,
        "rss_before": before,
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def _launch(shard: bool, replicas: int) -> list[dict[str, Any]]:
    args = ["--worker", "--replicas", str(replicas), *(["--shard"] if shard else [])]
    return run_ranks(__file__, args, 2 * replicas, timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shard", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--replicas", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    if args.worker:
        _worker(args.shard, args.replicas, args.out)
        return
    runs = {
        "D=1": _launch(False, 1),
        "D=2": _launch(False, 2),
        "D=2 sharded": _launch(True, 2),
    }
    rows = []
    for name, ranks in runs.items():
        for r in sorted(ranks, key=lambda r: (r["replica"], r["rank"])):
            for k, st in r["stages"].items():
                rows.append(
                    {
                        "run": name,
                        "replica": r["replica"],
                        "stage": int(k),
                        "optimizer_bytes": st["optimizer"],
                        "weight_bytes": st["weights"],
                        "peak_rss": r["peak_rss"],
                        "rss_rise": r["peak_rss"] - r["rss_before"],
                    }
                )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    mib = 2**20
    print(
        f"pipeoptim, Adam, MLP {LAYERS} x Linear({WIDTH}, {WIDTH}), P = 2, batch {BATCH}, "
        f"{STEPS} steps, CPU/gloo; MiB"
    )
    print(
        f"{'run':<12} {'replica':>7} {'stage':>5} {'optimizer':>10} {'weights':>8} "
        f"{'peak RSS':>9} {'RSS rise':>9}"
    )
    for row in rows:
        print(
            f"{row['run']:<12} {row['replica']:>7} {row['stage']:>5} "
            f"{row['optimizer_bytes'] / mib:>10.2f} {row['weight_bytes'] / mib:>8.2f} "
            f"{row['peak_rss'] / mib:>9.1f} {row['rss_rise'] / mib:>9.1f}"
        )


if __name__ == "__main__":
    main()
