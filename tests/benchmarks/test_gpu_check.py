"""benchmarks/gpu_check.py's CPU fallback (``--device cpu --quick``) runs every section on a
few methods and writes the JSON the GPU run would: its fields, every compared loss within the
tolerance it states, the skips with their reasons."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from support import benchmark_scripts

METHODS = "gpipe,1f1b,pipedream,pipeoptim,zb-v"
SECTIONS = {
    "losses fp32",
    "bf16 autocast",
    "recompute full",
    "sharded state D=2",
    "memory model",
    "calibrated simulator",
    "vs PyTorch",
}


def _run(tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "check.json"
    script = benchmark_scripts.FOLDER / "gpu_check.py"
    argv = [sys.executable, str(script), "--device", "cpu", "--quick", "--methods", METHODS]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*argv, "--out", str(out)], capture_output=True, text=True, timeout=600, env=env
    )
    return done, json.loads(out.read_text())


def test_cpu_fallback_writes_every_section_within_its_tolerances(tmp_path: Path) -> None:
    done, record = _run(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert record["device"] == "cpu" and record["left_out"] == []
    assert record["tolerance"]["fp32_step0"] > 0
    assert record["tolerance"]["bf16_step0"] > record["tolerance"]["fp32_step0"]
    rows = record["rows"]
    assert {r["check"] for r in rows} == SECTIONS
    for r in rows:
        assert set(r) == {"check", "subject", "status", "measured", "bound", "values"}
        assert r["status"] in ("pass", "info", "skip"), r
    for r in (r for r in rows if r["check"] == "memory model"):
        predicted = r["values"]["predicted_per_stage"]
        assert predicted.keys() == r["values"]["counted_per_stage"].keys()
        assert all(v > 0 for v in predicted.values())
    losses = [r for r in rows if r["check"] == "losses fp32"]
    assert [r["subject"] for r in losses] == METHODS.split(",")
    size = record["size"]
    for r in losses:
        values = r["values"]
        assert len(values["device_losses"]) == size["steps"]
        for step, (ours, ref) in enumerate(
            zip(values["device_losses"], values["cpu_fp64_losses"], strict=True)
        ):
            assert abs(ours - ref) / abs(ref) <= (step + 1) * record["tolerance"]["fp32_step0"]
    bf16 = next(r for r in rows if r["check"] == "bf16 autocast")["values"]
    pairs = zip(bf16["device_losses"], bf16["cpu_fp64_losses"], strict=True)
    for step, (ours, ref) in enumerate(pairs):
        assert abs(ours - ref) / abs(ref) <= (step + 1) * record["tolerance"]["bf16_step0"]
    sharded = next(r for r in rows if r["check"] == "sharded state D=2")
    assert sharded["status"] == "skip" and "two GPUs" in sharded["values"]["note"]
    torch_rows = {r["subject"].split(" / ")[0]: r for r in rows if r["check"] == "vs PyTorch"}
    assert torch_rows["1f1b"]["status"] == "skip"
    assert torch_rows["gpipe"]["values"]["torch_samples_per_s"] > 0
    for r in (r for r in rows if r["check"] == "calibrated simulator"):
        assert {q["quantity"] for q in r["values"]["rows"]} >= {"whole-run throughput"}
        assert r["values"]["shared_device_step_s"] > 0
    table = done.stdout.splitlines()
    assert table[0] == "| check | subject | status | measured | bound | note |"
    assert len([line for line in table if line.startswith("| ")]) == len(rows) + 1


def test_every_registered_method_is_checked_by_default() -> None:
    from pipeoptim.plan.methods.registry import registered
    from pipeoptim.plan.methods.synchronous import GPIPE

    probe = dataclasses.replace(GPIPE, name="gpu-check-probe")

    module = benchmark_scripts.load("gpu_check")
    assert module.parse([]).methods is None
    with registered(probe):
        chosen = module.chosen_methods(None)
    assert chosen[-1] == probe.name and "zb-v" in chosen
    assert module.chosen_methods("gpipe,zb-v") == ["gpipe", "zb-v"]
