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
