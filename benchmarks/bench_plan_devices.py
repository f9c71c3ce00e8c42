"""The plan search over 1,024 devices: ``pipeoptim plan --devices 1024 --gpus-per-node 8``.

Run from the repository root::

    .venv/bin/python benchmarks/bench_plan_devices.py            # a 65B model (~3 s)
    .venv/bin/python benchmarks/bench_plan_devices.py --quick    # an 8.5B model, for CI

Both search 1,024 devices. The model is a synthetic GPT of hidden size 8,192 and 80
transformer blocks between an embedding and an LM head: 82 layers, about 65 billion
parameters (``--quick``: hidden size 4,096, 40 blocks, 42 layers, 8.5 billion). Per block,
measured on 8 sequences of 2,048 tokens: 12 h^2 parameters in bf16, 12 bytes of Adam state
and fp32 master weights per parameter, 1 ms of the forward and 2 ms of the backward fixed
per call (kernel launches), the rest at 400 TFLOP/s. Each layer keeps 4 bytes per token and
hidden unit for its backward. The cluster has 8 GPUs per node with
80 GiB each, 300 GB/s within a node (NVLink) and 25 GB/s between nodes; the global batch is
2,048 sequences.

The timed run is the command itself, in-process from the profile file to the printed
explanation (``--out`` a plan file): the best of ``--repeat`` runs, and the first. The
search on its own (``pipeoptim.planning.search_devices``) is timed too. Goal: the
1,024-device command in under 10 s on a 2-core machine; the script exits with status 1
when it takes longer (with ``--quick`` as well, which
``tests/benchmarks/test_bench_plan_devices.py`` runs).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import platform
import sys
import tempfile
import time
from pathlib import Path

from pipeoptim.cli import main as cli
from pipeoptim.plan.plan import Plan
from pipeoptim.plan.profile import Profile
from pipeoptim.planning import search_devices
from pipeoptim.sim.collectives import Cluster

GOAL_S = 10.0
GPUS_PER_NODE = 8
INTRA, INTER = 300e9, 25e9  # bytes per second
CAP = "80GiB"


def gpt_profile(hidden: int, blocks: int, vocab: int = 50_257) -> Profile:
    """The synthetic GPT of the module docstring, measured on 8 sequences of 2,048 tokens."""
    tokens = 8 * 2048
    flops = 400e12
    block_params = 12 * hidden * hidden
    embed_params = vocab * hidden

    def times(params: int) -> tuple[float, float, float, float]:
        forward = 2 * params * tokens / flops
        return 1e-3 + forward, 2e-3 + 2 * forward, 1e-3, 2e-3

    layers = [("embedding", embed_params, (2e-3, 3e-3, 1e-3, 2e-3))]
    layers += [(f"block{i}", block_params, times(block_params)) for i in range(blocks)]
    layers += [("lm_head", embed_params, times(embed_params))]
    activation = 4 * tokens * hidden
    return Profile.from_dict(
        {
            "format": "pipeoptim.profile",
            "version": 1,
            "batch_size": 8,
            "optimizer": "adam",
            "device": "synthetic",
            "dtype_bytes": 2,
            "meta": {"model": f"gpt-h{hidden}-l{blocks}"},
            "layers": [
                {
                    "name": name,
                    "forward_s": f,
                    "backward_s": b,
                    "forward_fixed_s": ff,
                    "backward_fixed_s": bf,
                    "activation_bytes": activation,
                    "param_bytes": 2 * params,
                    "optimizer_state_bytes": 12 * params,
                    "param_count": params,
                }
                for name, params, (f, b, ff, bf) in layers
            ],
        }
    )


def run_command(profile_path: Path, plan_path: Path, devices: int) -> tuple[float, str]:
    argv = [
        "plan", "--profile", str(profile_path), "--devices", str(devices),
        "--gpus-per-node", str(GPUS_PER_NODE), "--bandwidth", "300GB/s",
        "--inter-node-bandwidth", "25GB/s", "--inter-node-latency", "0.00001",
        "--latency", "0.000005", "--memory-cap", CAP, "--global-batch", "2048",
        "--out", str(plan_path),
    ]  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli(argv)
    elapsed = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"pipeoptim plan failed ({code}):\n{err.getvalue()}")
    return elapsed, out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model (CI)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs (best counts)")
    args = parser.parse_args(argv)
    devices, hidden, blocks = (1024, 4096, 40) if args.quick else (1024, 8192, 80)
    profile = gpt_profile(hidden, blocks)
    params = sum(x.param_count for x in profile.layers)
    print(
        f"python {platform.python_version()} on {platform.machine()}: {devices:,} devices, "
        f"{GPUS_PER_NODE} per node, {profile.num_layers} layers, {params / 1e9:.1f}B "
        f"parameters, global batch 2,048, cap {CAP}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        profile_path, plan_path = Path(tmp) / "profile.json", Path(tmp) / "plan.json"
        profile.save(profile_path)
        runs = [run_command(profile_path, plan_path, devices) for _ in range(max(1, args.repeat))]
        plan = Plan.load(plan_path)
    first, best = runs[0][0], min(t for t, _ in runs)
    cluster = Cluster(INTRA, 5e-6, GPUS_PER_NODE, INTER, 1e-5)
    started = time.perf_counter()
    result = search_devices(
        profile, devices, cluster=cluster, batch_size=2048, memory_cap_bytes=80 * 2**30,
        optimizer="adam",
    )  # fmt: skip
    search_s = time.perf_counter() - started
    simulated = sum(1 for c in result.ranked if c.infeasible is None)
    print(
        f"command: best {best:.2f} s of {len(runs)}, first {first:.2f} s; search alone "
        f"{search_s:.2f} s ({len(result.ranked)} candidates, {simulated} simulated)"
    )
    print(
        f"chosen: P={plan.num_stages} x D={plan.data_parallel}, {plan.method}, "
        f"M={plan.micro_batches}, {plan.notes['predicted_samples_per_s']:,.0f} samples/s"
    )
    text = runs[0][1]
    table = text.split("\n\n")[1] if "\n\n" in text else ""
    print(table)
    print(str(plan.notes["why"]))
    met = best < GOAL_S
    print(f"goal: the {devices:,}-device command under {GOAL_S:g} s: {'met' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
