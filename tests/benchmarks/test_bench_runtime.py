"""benchmarks/bench_runtime.py at its smallest: pipeoptim's Pipeline trains the same split as
the limit (one unit per rank), and the script prints its table, the share of the limit and
each rank's breakdown."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from support import benchmark_scripts

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


def test_the_cpu_floor_is_the_longer_of_a_ranks_own_thread_and_the_cores_full() -> None:
    b = bench()
    parts = {0: {"cpu": 3.0, "other threads": 1.0}, 1: {"cpu": 2.6, "other threads": 0.0}}
    assert b.cpu_floor(parts, 2) == pytest.approx(2.8)  # 5.6 s of CPU over 2 cores
    assert b.cpu_floor(parts, 4) == pytest.approx(2.6)  # rank 1's own thread
    assert b.cpu_floor({0: {"cpu": 1.0, "other threads": 0.0}}, 1) == pytest.approx(1.0)


def test_the_cpu_of_other_threads_is_told_apart_from_the_ranks_own() -> None:
    """What a backend thread burns (gloo's socket I/O) counts in the process's CPU and in
    ``other threads``, not in the rank's own thread."""
    b = bench()

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    then = b._cpu_now()
    worker = threading.Thread(target=burn, args=(0.2,))
    worker.start()
    worker.join()
    used = b._cpu_since(then)
    assert used["other threads"] >= 0.19, used
    assert used["cpu"] >= used["other threads"], used


def _smallest_run(runs: str, *more: str) -> subprocess.CompletedProcess[str]:
    """The script over ``runs`` at its smallest: one round of 2 steps of batch 32."""
    args = ["--rounds", "1", "--steps", "2", "--warmup", "1", "--batch", "32", *more]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--runs", runs],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.fixture(scope="module")
def two_rank_run() -> subprocess.CompletedProcess[str]:
    """One smallest run at 2 ranks of every run the tests below read (each run spawns its
    ranks, so one script start serves them all)."""
    return _smallest_run(
        "pipeoptim pipeoptim,limit,limit +prediction,"
        "pipeoptim pipedream,pipeoptim pipedream (gloo),limit +stash,locked +stash,"
        "pipeoptim 1f1b,pipeoptim 1f1b (weights in the backward)"
    )


def test_bench_runtime_prints_the_share_of_the_limit_and_where_the_time_goes(
    two_rank_run: subprocess.CompletedProcess[str],
) -> None:
    done = two_rank_run
    assert re.search(r"\| limit \| [\d,]+ \|", done.stdout), done.stdout
    assert "host allocator: pipeoptim in every run" in done.stdout, done.stdout
    share = re.search(
        r"pipeoptim pipeoptim: (\d+\.\d\d)x \((\d+\.\d\d)x\) "
        r"\[(\d+\.\d\d)x \((\d+\.\d\d)x\)\]",
        done.stdout,
    )
    assert share is not None and min(map(float, share.groups())) > 0, done.stdout
    floor = re.search(
        r"limit \+prediction: (\d+\.\d\d)x the limit \[(\d+\.\d\d)x\]; "
        r"pipeoptim pipeoptim: (\d+\.\d\d)x its floor, steady \[(\d+\.\d\d)x\]",
        done.stdout,
    )
    assert floor is not None and min(map(float, floor.groups())) > 0, done.stdout
    cpu = re.findall(
        r"\| (pipeoptim pipeoptim|limit) \| (\d+\.\d+) \| (\d+\.\d+) \| (\d+\.\d+) \| "
        r"(\d+\.\d\d)x \| (\d+\.\d\d)x \|",
        done.stdout,
    )
    assert [row[0] for row in cpu] == ["pipeoptim pipeoptim", "limit"], done.stdout
    for _, total, busiest, other, allows, reached in cpu:
        assert float(total) >= float(busiest) > 0 and float(other) >= 0, done.stdout
        assert float(allows) > 0 and float(reached) > 0, done.stdout
    ranks = re.findall(r"\| pipeoptim pipeoptim \| (\d) \| (\d+\.\d+) \|", done.stdout)
    assert [r for r, _ in ranks] == ["0", "1"] and all(float(c) > 0 for _, c in ranks)


def test_bench_runtime_sets_twin_runs_beside_their_base_runs(
    two_rank_run: subprocess.CompletedProcess[str],
) -> None:
    """Over gloo beside shared memory; weight gradients in the backward beside after the
    send."""
    done = two_rank_run
    assert re.search(r"\| pipeoptim pipedream \(gloo\) \| [\d,]+ \|", done.stdout), done.stdout
    for what, run in (
        ("against gloo alone", "pipeoptim pipedream"),
        ("against in the backward", "pipeoptim 1f1b"),
    ):
        twin = re.search(rf"{what}, same rounds \(steady\):\n  {run}: (\d+\.\d\d)x", done.stdout)
        assert twin is not None and float(twin.group(1)) > 0, done.stdout


def test_the_rounds_take_the_runs_in_turn_forwards_and_backwards() -> None:
    b = bench()
    runs = ["limit", "pipeoptim pipeoptim", "locked +stash"]
    assert b.round_order(runs, 0) == runs
    assert b.round_order(runs, 1) == ["locked +stash", "pipeoptim pipeoptim", "limit"]
    assert b.round_order(runs, 2) == runs
    assert runs == ["limit", "pipeoptim pipeoptim", "locked +stash"]  # the caller's untouched


def test_paired_ratios_are_the_median_of_each_rounds_own() -> None:
    """A machine that slows by half between two rounds: the rounds' own ratios stay 0.9;
    the ratio of the medians mixes the rounds (here 0.99)."""
    b = bench()
    assert b.paired([900.0, 450.0, 880.0], [1000.0, 500.0, 1000.0]) == pytest.approx(0.9)
    with pytest.raises(ValueError):
        b.paired([1.0, 2.0], [1.0])  # a run missing a round pairs nothing


@pytest.mark.parametrize("ranks", [2, 4])
def test_bench_runtime_locks_the_limits_loops_in_the_pipelines_order(
    ranks: int, request: pytest.FixtureRequest
) -> None:
    """The limit's loops with PipeDream's stash, waiting on one another as asynchronous
    1F1B's stages do: every rank finishes (no rank waits on a message never sent, rank 0
    three forwards ahead at 4 ranks), and the script sets pipedream against it."""
    if ranks == 2:
        done: subprocess.CompletedProcess[str] = request.getfixturevalue("two_rank_run")
    else:
        done = _smallest_run("pipeoptim pipedream,limit +stash,locked +stash", "--ranks", "4")
    locked = re.search(r"locked \+stash: (\d+\.\d\d)x limit \+stash \[(\d+\.\d\d)x\]", done.stdout)
    assert locked is not None and min(map(float, locked.groups())) > 0, done.stdout
    method = re.search(r"pipeoptim pipedream: (\d+\.\d\d)x locked \+stash", done.stdout)
    assert method is not None and float(method.group(1)) > 0, done.stdout


def test_runs_takes_the_known_runs_and_the_twins_of_pipeoptims() -> None:
    b = bench()
    for run in (
        "locked +stash",
        "limit (glibc defaults)",
        "pipeoptim xpipe",
        "pipeoptim pipeoptim +loggers",
        "pipeoptim 1f1b (weights in the backward) (glibc defaults)",
    ):
        assert b.run_refusal(run) is None, run
    unknown = b.run_refusal("locked")
    assert unknown is not None and "no run 'locked'" in unknown and "locked +stash" in unknown
    assert "a method of" in (b.run_refusal("pipeoptim nope") or "")
    twin = b.run_refusal("limit (gloo)")  # the limit reads no transport switch
    assert twin == (
        "--runs: 'limit (gloo)': only a pipeoptim run takes the ending ' (gloo)'; drop it, "
        "or name a pipeoptim run (e.g. 'pipeoptim pipeoptim (gloo)')"
    )


def test_an_unknown_run_exits_2_naming_it_before_any_run_starts() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--runs", "limit,locked +stash (gloo)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "only a pipeoptim run takes the ending ' (gloo)'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "round 1" not in done.stderr, done.stderr


def test_the_steady_window_leaves_out_the_fill_and_the_drain() -> None:
    """From the end of update ``skip`` to the end of update ``n - 1 - skip``: a slow first
    update (the fill) and a slow last one (the drain) do not count."""
    b = bench()
    ends = [4.0, 5.0, 6.0, 7.0, 8.0, 20.0]
    assert b.steady_window(ends, 1) == (3, 3.0)
    assert b.steady_window(ends, 2) == (1, 1.0)
    assert b.steady_window(ends, 3) == (0, 0.0)  # nothing left in the middle
    ranks = {
        0: {"steady updates": 3.0, "steady seconds": 3.0},
        1: {"steady updates": 3.0, "steady seconds": 6.0},
    }
    assert b.steady_rate(ranks, 10) == pytest.approx(5.0)  # the slower rank's 30 samples in 6 s
    ranks[1]["steady seconds"] = 0.0
    assert b.steady_rate(ranks, 10) is None  # a rank without a window: no steady rate
    assert b.steady_rate({0: {"cpu": 1.0}}, 10) is None  # the limit's and torch's runs


def test_runs_take_torch_dualpipe_v_beside_pipeoptims() -> None:
    """PyTorch's DualPipeV is a named run only (not in the default set), printed against
    pipeoptim dualpipev."""
    b = bench()
    assert b.run_refusal("torch ScheduleDualPipeV") is None
    assert b.run_refusal("pipeoptim dualpipev") is None
    assert "torch ScheduleDualPipeV" not in b.RUNS
    assert b.TORCH_TWINS["pipeoptim dualpipev"] == "torch ScheduleDualPipeV"
    assert len(b.pipeline_units(4)) == 4  # the V's 2P units on 2 ranks


def test_the_steady_window_counts_mini_batches_not_a_ranks_updates() -> None:
    """A rank of two stages updates twice per mini-batch: one end per mini-batch."""
    from types import SimpleNamespace

    b = bench()
    events = [
        SimpleNamespace(kind=kind, mb=mb, end=end)
        for kind, mb, end in [
            ("U", 0, 1.0),
            ("U", 0, 1.5),
            ("F", 1, 1.7),
            ("U", 1, 2.0),
            ("U", 1, 2.5),
        ]
    ]
    assert b.mini_batch_ends(events) == [1.5, 2.5]
