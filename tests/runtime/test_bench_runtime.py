"""benchmarks/bench_runtime.py at its smallest: pipeoptim's Pipeline trains the same split as
the limit (one unit per rank), and the script prints its table, the share of the limit and
each rank's breakdown."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import benchmark_scripts
import pytest

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


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_floors_add_the_weight_work_on_the_ranks_the_runtime_does_it(ranks: int) -> None:
    """The floors' rule (every rank but the last, distance P - 1 - rank) is the runtime's:
    PipeOptim's stages predict that distance, PipeDream's hold a stashed copy there."""
    from pipeoptim import Pipeline
    from pipeoptim.plan.plan import OptimizerSpec

    b = bench()
    distances = [b.floor_distance(k, ranks) for k in range(ranks)]
    sgd = OptimizerSpec("sgd", 0.01)
    pipe = Pipeline(b.pipeline_units(ranks), "pipeoptim", stages=ranks, optimizer=sgd)
    pipe.fit(b.data(8, 3 * ranks), max_steps=3 * ranks)
    assert [pipe.stages[k].distance(2 * ranks) for k in range(ranks)] == distances
    pipe = Pipeline(b.pipeline_units(ranks), "pipedream", stages=ranks, optimizer=sgd)
    pipe.fit(b.data(8, 3 * ranks), max_steps=3 * ranks)
    copies = pipe.rank_result().weight_copies
    assert [copies[k] > 1 for k in range(ranks)] == [d > 0 for d in distances]


def test_bench_runtime_prints_the_share_of_the_limit_and_where_the_time_goes() -> None:
    args = ["--rounds", "1", "--steps", "2", "--warmup", "1", "--batch", "32"]
    runs = "pipeoptim pipeoptim,limit,limit +prediction"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--runs", runs],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"\| limit \| [\d,]+ \|", done.stdout), done.stdout
    assert "host allocator: pipeoptim in every run" in done.stdout, done.stdout
    share = re.search(r"pipeoptim pipeoptim: (\d+\.\d\d)x", done.stdout)
    assert share is not None and float(share.group(1)) > 0, done.stdout
    floor = re.search(
        r"limit \+prediction: (\d+\.\d\d)x the limit; pipeoptim pipeoptim: (\d+\.\d\d)x its",
        done.stdout,
    )
    assert floor is not None and min(map(float, floor.groups())) > 0, done.stdout
    ranks = re.findall(r"\| pipeoptim pipeoptim \| (\d) \| (\d+\.\d+) \|", done.stdout)
    assert [r for r, _ in ranks] == ["0", "1"] and all(float(c) > 0 for _, c in ranks)
