"""benchmarks/bench_split_backward.py at tiny sizes: it runs the runtime's I, W and B on
real stages and prints the ratios the README quotes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_split_backward.py"


def test_bench_split_backward_small() -> None:
    args = ["--width", "64", "--blocks", "2", "--batch", "8", "--micro-batches", "5"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    match = re.search(r"W/I (\d+\.\d+)  \(I \+ W\)/B (\d+\.\d+)", done.stdout)
    assert match is not None, done.stdout
    assert float(match.group(1)) > 0 and float(match.group(2)) > 0
