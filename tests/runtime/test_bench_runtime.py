"""benchmarks/bench_runtime.py at its smallest: pipeoptim's Pipeline trains the same split as
the limit (one unit per rank), and the script prints its table, the share of the limit and
each rank's breakdown."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import benchmark_scripts

SCRIPT = benchmark_scripts.FOLDER / "bench_runtime.py"


def bench() -> Any:
    return benchmark_scripts.load("bench_runtime")


def test_the_pipeline_trains_the_split_of_torchs_stages_and_the_limit() -> None:
    from pipeoptim import Pipeline

    b = bench()
    parts = b.split(b.blocks(), 2)
    widths = [[m.out_features for m in p if hasattr(m, "out_features")] for p in parts]
    assert widths == [[b.WIDTH] * 4, [b.WIDTH] * 4 + [b.CLASSES]]
    pipe = Pipeline(b.pipeline_units(2), "pipeoptim", stages=2, device="cpu")
    sizes = [sum(p.numel() for p in pipe.stages[k].module.parameters()) for k in (0, 1)]
    assert sizes == [sum(p.numel() for p in part.parameters()) for part in parts]


def test_bench_runtime_prints_the_share_of_the_limit_and_where_the_time_goes() -> None:
    args = ["--rounds", "1", "--steps", "2", "--warmup", "1", "--batch", "32"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--runs", "pipeoptim pipeoptim,limit"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"\| limit \| [\d,]+ \|", done.stdout), done.stdout
    assert "host allocator: pipeoptim in every run" in done.stdout, done.stdout
    share = re.search(r"pipeoptim pipeoptim: (\d+\.\d\d)x", done.stdout)
    assert share is not None and float(share.group(1)) > 0, done.stdout
    ranks = re.findall(r"\| pipeoptim pipeoptim \| (\d) \| (\d+\.\d+) \|", done.stdout)
    assert [r for r, _ in ranks] == ["0", "1"] and all(float(c) > 0 for _, c in ranks)
