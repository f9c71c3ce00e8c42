"""benchmarks/bench_plan_devices.py at its quick size: the plan search over 1,024 devices
(a smaller model than the full run's) runs as the command, writes a PP x DP plan and stays
under its 10 s goal (the script exits 1 otherwise)."""

from __future__ import annotations

import re

import pytest
from support import benchmark_scripts


def test_bench_plan_devices_quick(capsys: pytest.CaptureFixture[str]) -> None:
    module = benchmark_scripts.load("bench_plan_devices")
    assert module.main(["--quick", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"^chosen: P=(\d+) x D=(\d+), ", out, re.MULTILINE)
    assert found is not None
    assert int(found[1]) * int(found[2]) == 1024
    assert "goal: the 1,024-device command under 10 s: met" in out
    assert "Run " in out and "Against the other factorisations" in out
