"""benchmarks/bench_async_step.py at its smallest: it runs every path it compares and prints
the table benchmarks/README.md quotes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_async_step.py"


def _run(*args: str, status: int = 0) -> subprocess.CompletedProcess[str]:
    """The script at 4 stages, one round of 2 steps, with ``args``; checked to exit with
    ``status``."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--stages", "4", "--rounds", "1", "--steps", "2", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == status, done.stderr[-2000:]
    return done


def test_bench_async_step_prints_each_method_beside_gpipe() -> None:
    done = _run("--methods", "gpipe", "xpipe", "--old-path")
    rows = re.findall(r"\| 4 \| (\w+) \| (fast|old) \| (\d+\.\d) \| (\d+\.\d\d)x \|", done.stdout)
    assert [(m, path) for m, path, *_ in rows] == [
        ("gpipe", "fast"),
        ("xpipe", "fast"),
        ("xpipe", "old"),
    ], done.stdout
    assert rows[0][3] == "1.00" and all(float(ms) > 0 for *_, ms, _ in rows)


def test_bench_async_step_micro_factor_runs_m_of_a_multiple_of_p_with_the_batch_scaled() -> None:
    done = _run("--methods", "gpipe", "1f1b", "--micro-factor", "2")
    assert "batch 64, M = 2 x P" in done.stdout, done.stdout
    rows = re.findall(r"\| 4 \| (\w+) \| fast \| (\d+\.\d) \| (\d+\.\d\d)x \|", done.stdout)
    assert [m for m, *_ in rows] == ["gpipe", "1f1b"], done.stdout


def test_bench_async_step_refuses_a_micro_factor_below_one() -> None:
    done = _run("--micro-factor", "0", status=2)
    assert "--micro-factor must be 1 or more (got 0)" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_recorded_order_is_the_local_runs_own() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_async_step as bench

    gpipe, bounds, micro = bench.recorded_order("gpipe", 2, 1)
    # the benchmark clips at 1.0: a synchronous method clips by the pipeline's norm, so the
    # updates wait for every stage's backward of the step
    assert [str(a) for a in gpipe] == [
        *("0F0", "0F1", "1F0", "1F1", "1B0", "1B1", "0B0", "0B1", "0U0", "1U0")
    ]
    assert bounds == [(0, 9), (9, 17)] and micro == 16  # 17 units; batch 32 in M = 2
    xpipe, _, _ = bench.recorded_order("xpipe", 2, 2)
    # drive_local's waves: forwards rank by rank up to each one's next backward, then
    # backwards from the last rank up to each one's next forward
    assert [str(a) for a in xpipe] == [
        *("0F0", "0F1", "1F0", "1B0", "0B0", "0F2", "1F1", "1B1", "1U0", "0B1", "0U0"),
        *("0F3", "1F2", "1B2", "0B2", "1F3", "1B3", "1U1", "0B3", "0U1"),
    ]
    assert bench.replay_seconds(xpipe, bounds, micro, 2) > 0


def test_bench_async_step_replay_rows_set_each_order_beside_gpipes() -> None:
    done = _run("--methods", "gpipe", "xpipe", "--replay")
    rows = re.findall(
        r"\| 4 \| (\w+) \| (fast|replay) \| (\d+\.\d) \| (\d+\.\d\d)x \|", done.stdout
    )
    assert [(m, path) for m, path, *_ in rows] == [
        ("gpipe", "fast"),
        ("xpipe", "fast"),
        ("gpipe", "replay"),
        ("xpipe", "replay"),
    ], done.stdout
    assert rows[2][3] == "1.00", done.stdout


def test_bench_async_step_forwards_first_rows_and_their_replay() -> None:
    done = _run("--methods", "gpipe", "xpipe", "--forwards-first", "--replay")
    rows = re.findall(
        r"\| 4 \| (\w+) \| (fast|forwards first|replay|replay, forwards first) \| "
        r"(\d+\.\d) \| (\d+\.\d\d)x \|",
        done.stdout,
    )
    assert [(m, path) for m, path, *_ in rows] == [
        ("gpipe", "fast"),
        ("xpipe", "fast"),
        ("xpipe", "forwards first"),
        ("gpipe", "replay"),
        ("xpipe", "replay"),
        ("xpipe", "replay, forwards first"),
    ], done.stdout


def test_the_recorded_order_with_forwards_first_runs_each_ranks_forwards_in_a_row() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_async_step as bench

    xpipe, _, _ = bench.recorded_order("xpipe", 2, 2, forwards_first=True)
    # rank 0 runs 0F2 before 0B0 (both before its update 0U0), rank 1 both its forwards
    assert [str(a) for a in xpipe] == [
        *("0F0", "0F1", "0F2", "1F0", "1F1", "1B0", "1B1", "1U0", "0B0", "0B1", "0U0"),
        *("0F3", "1F2", "1F3", "1B2", "1B3", "1U1", "0B2", "0B3", "0U1"),
    ]
