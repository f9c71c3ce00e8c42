"""Peak memory per stage with and without activation recomputation, for every method, and
with the optimizer state sharded over D = 2 replicas; the simulator's prediction beside each.

The model (``--model``) is a small GPT (an embedding, 8 pre-norm transformer blocks, a head;
4 stages, batch 16 of 64 tokens), whose blocks save far more for their backward than they
take in, as a language model's do; or a wide MLP (width 1024, batch 256; every stage but the
last ends in a wide Linear, whose output a recomputed stage lets go of once sent). Two
parts, all figures measured in this run:

1. Every method of the registry trains it for a few mini-batches in this process (local
   transport), with ``recompute`` ``none`` and ``full``. Per stage: the runtime's own peak
   (its byte counts: weights, copies, optimizer state, gradients, activations) and the
   simulator's, calibrated on that run's trace (``pipeoptim calibrate``); and the
   throughput of the recomputed run over the other's (interleaved rounds, median).
2. For ``--rss-methods``, one process per stage under ``torchrun`` (gloo): each rank's
   peak RSS over what it had before the pipeline was built, at D = 1 and at D = 2 with
   ``shard_optimizer``, with and without recomputation, and the runtime's optimizer bytes.

    python benchmarks/bench_memory.py                   # about 12 minutes on 2 CPU cores
    python benchmarks/bench_memory.py --methods pipeoptim,1f1b --rss-methods pipeoptim
    python benchmarks/bench_memory.py --json            # the figures as JSON
    python benchmarks/bench_memory.py --model wide-mlp --methods 1f1b --rss-methods 1f1b
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
from pathlib import Path
from typing import Any

from torchrun_ranks import run_ranks

VOCAB, DIM, HEADS, BLOCKS, SEQ, BATCH, STAGES, STEPS = 96, 96, 4, 8, 64, 16, 4, 6
MIB = 2**20


MODEL = "gpt"
"""The model both parts run: ``gpt`` or ``wide-mlp`` (``--model``)."""
WIDE, WIDE_IN, WIDE_CLASSES, WIDE_BATCH = 1024, 64, 10, 256


def _units() -> list[Any]:
    import torch
    from torch import nn

    from pipeoptim.workloads.gpt import Block

    torch.manual_seed(0)
    if MODEL == "wide-mlp":
        # 9 units, 3|2|2|2 over 4 stages: every stage but the last ends in a wide Linear,
        # whose output a recomputed stage lets go of once sent
        hidden = [m for _ in range(3) for m in (nn.ReLU(), nn.Linear(WIDE, WIDE))]
        head = [nn.ReLU(), nn.Linear(WIDE, WIDE_CLASSES)]
        return [nn.Linear(WIDE_IN, WIDE), *hidden, *head]
    blocks = [Block(DIM, HEADS, BLOCKS) for _ in range(BLOCKS)]
    return [nn.Embedding(VOCAB, DIM), *blocks, nn.Linear(DIM, VOCAB)]


def _batches(n: int) -> list[tuple[Any, Any]]:
    import torch

    g = torch.Generator().manual_seed(1)
    if MODEL == "wide-mlp":
        x = torch.randn(n, WIDE_BATCH, WIDE_IN, generator=g)
        y = torch.randint(0, WIDE_CLASSES, (n, WIDE_BATCH), generator=g)
        return list(zip(x, y, strict=True))
    ids = torch.randint(0, VOCAB, (n, BATCH, SEQ + 1), generator=g)
    return [(s[:, :-1], s[:, 1:]) for s in ids]


def _shape(method: str) -> dict[str, Any]:
    from pipeoptim.plan.methods import get_method

    spec = get_method(method)
    kw: dict[str, Any] = {"stages": STAGES}
    if spec.micro_batched_by_default:
        kw["micro_batches"] = STAGES
    if spec.interleaved and not spec.split_backward:
        kw["virtual_stages"] = 2
    return kw


def _pipeline(method: str, recompute: str, **options: Any) -> Any:
    """The model under ``method`` as both parts run it (AdamW, its loss)."""
    import torch

    from pipeoptim import Pipeline
    from pipeoptim.plan.plan import OptimizerSpec
    from pipeoptim.workloads.gpt import lm_loss

    if MODEL == "wide-mlp":
        options.setdefault("loss_fn", torch.nn.functional.cross_entropy)
    else:
        options.setdefault("loss_fn", lm_loss)
    return Pipeline(
        _units(),
        method=method,
        optimizer=OptimizerSpec("adamw", 1e-3),
        recompute=recompute,
        **_shape(method),
        **options,
    )


def _local(method: str, recompute: str, steps: int) -> dict[str, Any]:
    """One run in this process: per rank the runtime's and the calibrated simulator's peak
    bytes (a rank of zb-v or the interleaved schedule holds two stages), and the steady
    throughput the trace measured."""
    from pipeoptim.calibrate import predict_run
    from pipeoptim.metrics import compute_metrics
    from pipeoptim.trace import Trace

    pipe = _pipeline(method, recompute, memory_every=1)
    pipe.fit(_batches(steps), epochs=1)
    trace = pipe.trace()
    predicted = predict_run(trace)
    pipe.close()

    def peaks(t: Trace) -> dict[int, int]:  # per rank: the most its stages held at once
        out: dict[int, int] = {}
        for m in t.memory:
            out[m.rank] = max(out.get(m.rank, 0), m.bytes)
        return out

    return {
        "measured": peaks(trace),
        "predicted": peaks(predicted),
        "samples_per_s": compute_metrics(trace).steady_throughput,
    }


def _worker(method: str, recompute: str, replicas: int, shard: bool, out: Path) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    pipe = _pipeline(
        method,
        recompute,
        transport="dist",
        device="cpu",
        data_parallel=replicas,
        shard_optimizer=shard,
        timeout=300,
    )
    data = _batches(STEPS)
    pipe.fit(data, epochs=1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stage, counts = next(iter(pipe.stages.items()))
    rank = dist.get_rank()
    report: dict[str, Any] = {
        "stage": stage,
        "rss_rise": peak - before,
        "optimizer": counts.memory()["optimizer"],
    }
    if pipe.replica == 0:  # the runtime's peak of each stage and the calibrated simulator's
        from pipeoptim.calibrate import predict_run
        from pipeoptim.metrics import compute_metrics

        trace = pipe.trace()
        measured = compute_metrics(trace).stages
        predicted = compute_metrics(predict_run(trace)).stages
        report["counted"] = measured[stage].peak_memory_bytes
        report["simulated"] = predicted[stage].peak_memory_bytes
    (out / f"rank-{rank}.json").write_text(json.dumps(report))
    pipe.close()


def _torchrun(method: str, recompute: str, replicas: int, shard: bool) -> list[dict[str, Any]]:
    args = ["--worker", method, recompute, str(replicas), "shard" if shard else "whole", MODEL]
    return run_ranks(__file__, args, STAGES * replicas)


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:7.2f}"


def main() -> None:
    global MODEL
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        method, recompute, replicas, shard, MODEL = sys.argv[2:7]
        _worker(method, recompute, int(replicas), shard == "shard", Path(sys.argv[8]))
        return
    from pipeoptim.plan.methods import METHODS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    parser.add_argument("--rss-methods", default="1f1b,pipedream,pipeoptim")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per method")
    parser.add_argument("--steps", type=int, default=STEPS, help="mini-batches per local run")
    parser.add_argument("--model", choices=("gpt", "wide-mlp"), default="gpt")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    MODEL = args.model
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    local: dict[str, dict[str, Any]] = {}
    for method in methods:
        runs: dict[str, list[dict[str, Any]]] = {"none": [], "full": []}
        for _ in range(args.rounds):
            for recompute in ("none", "full"):
                runs[recompute].append(_local(method, recompute, args.steps))
        local[method] = {
            rc: {
                "measured": r[0]["measured"],
                "predicted": r[0]["predicted"],
                "samples_per_s": statistics.median(x["samples_per_s"] for x in r),
            }
            for rc, r in runs.items()
        }
        print(f"  measured {method}", file=sys.stderr)
    rss: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for method in [m for m in args.rss_methods.split(",") if m]:
        rss[method] = {}
        for replicas, shard in ((1, False), (2, False), (2, True)):
            for recompute in ("none", "full"):
                key = f"D={replicas}{' sharded' if shard else ''}, recompute {recompute}"
                rss[method][key] = _torchrun(method, recompute, replicas, shard)
                print(f"  measured {method} {key}", file=sys.stderr)
    if args.json:
        print(json.dumps({"local": local, "rss": rss}, indent=2))
        return
    if MODEL == "wide-mlp":
        print(f"Peak bytes per rank (MiB): MLP of width {WIDE}, {STAGES} ranks, batch")
        print(f"{WIDE_BATCH}, AdamW; runtime counted / simulated (calibrated);")
    else:
        print(f"Peak bytes per rank (MiB): GPT of {BLOCKS} blocks, dim {DIM}, {STAGES} ranks,")
        print(f"batch {BATCH} x {SEQ} tokens, AdamW; runtime counted / simulated (calibrated);")
    print("speed: steady throughput recomputed over without (median of interleaved rounds)")
    print(f"{'method':20} {'rank':>5} {'none':>17} {'full':>17} {'saved':>7} {'speed':>6}")
    for method, rows in local.items():
        none, full = rows["none"], rows["full"]
        speed = full["samples_per_s"] / none["samples_per_s"]
        for k in none["measured"]:
            a, b = none["measured"][k], full["measured"][k]
            cells = [
                f"{_mib(a)} /{_mib(none['predicted'].get(k))}",
                f"{_mib(b)} /{_mib(full['predicted'].get(k))}",
            ]
            saved = f"{100 * (1 - b / a):6.1f}%" if a else "-"
            head = method if k == 0 else ""
            tail = f"{speed:5.2f}x" if k == 0 else ""
            print(f"{head:20} {k:>5} {cells[0]:>17} {cells[1]:>17} {saved:>7} {tail:>6}")
    if rss:
        print("\nPer stage, one process each (MiB): peak RSS rise (max over the stage's replicas)")
        print("(optimizer state per replica; runtime-counted / simulated peak, replica 0)")
        for method, runs in rss.items():
            for key, ranks in runs.items():
                per_stage: dict[int, list[Any]] = {}
                for r in ranks:
                    row = per_stage.setdefault(r["stage"], [0, r["optimizer"], None, None])
                    row[0] = max(row[0], r["rss_rise"])
                    if "counted" in r:
                        row[2], row[3] = r["counted"], r["simulated"]
                cells = " | ".join(
                    f"{_mib(rise).strip()} ({_mib(opt).strip()}; "
                    f"{_mib(c).strip()}/{_mib(p).strip()})"
                    for _, (rise, opt, c, p) in sorted(per_stage.items())
                )
                print(f"{method:10} {key:30} {cells}")


if __name__ == "__main__":
    main()
