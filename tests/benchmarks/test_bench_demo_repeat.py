"""benchmarks/bench_demo_repeat.py: the demo's real runs repeated with nothing changed, and
the offline prediction set against each. Its run on a finished quick demo is in
``tests/cli/test_demo.py``, which has one."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from support import benchmark_scripts

SCRIPT = benchmark_scripts.FOLDER / "bench_demo_repeat.py"


def bench() -> Any:
    return benchmark_scripts.load("bench_demo_repeat")


def test_the_summary_gives_each_methods_spread_and_the_predictions_hits() -> None:
    found = {
        "methods": ["pipeoptim", "1f1b"],
        "simulated": {"pipeoptim": 12_000.0, "1f1b": 4_000.0},
        # pipeoptim off by +20 %, -4 %, +9 % of these; 1f1b by +33 %, 0 %, 0 %
        "rates": {"pipeoptim": [10_000.0, 12_500.0, 11_000.0], "1f1b": [3_000.0] + [4_000.0] * 2},
    }
    assert bench().summary(found) == [
        "pipeoptim: median 11,000 samples/s, lowest 10,000, highest 12,500, spread 1.25x; "
        "offline 12,000 within 15% of 2 of 3",
        "1f1b: median 4,000 samples/s, lowest 3,000, highest 4,000, spread 1.33x; "
        "offline 4,000 within 15% of 2 of 3",
        "pipeoptim / 1f1b: measured 3.12x (lowest 2.75x, highest 3.33x), offline 3.00x",
    ]


def test_a_repeat_count_below_one_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--repeats", "0"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "--repeats must be at least 1 (got 0)" in done.stderr


def test_a_stage_count_below_one_is_refused_by_the_demos_rule() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--stages", "0"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--stages must be at least 1 (got 0)" in done.stderr
