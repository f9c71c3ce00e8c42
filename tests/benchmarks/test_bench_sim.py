"""benchmarks/bench_sim.py at its quick sizes: it runs, and SimPy, evaluate_program and
list_schedule agree to the bit on every case (the script exits otherwise)."""

from __future__ import annotations

import pytest
from support import benchmark_scripts


def test_bench_sim_quick(capsys: pytest.CaptureFixture[str]) -> None:
    module = benchmark_scripts.load("bench_sim")
    assert module.main(["--quick", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("1f1b", "gpipe", "pipeoptim"))]
    assert [r.split()[0] for r in rows] == ["1f1b", "gpipe", "pipeoptim"]
