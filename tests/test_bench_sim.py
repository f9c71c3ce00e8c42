"""benchmarks/bench_sim.py at its quick sizes: it runs, and SimPy, evaluate_program and
list_schedule agree to the bit on every case (the script exits otherwise)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_sim.py"


def test_bench_sim_quick(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_sim", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--quick", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("1f1b", "gpipe", "pipeoptim"))]
    assert [r.split()[0] for r in rows] == ["1f1b", "gpipe", "pipeoptim"]
