"""``examples/library_quickstart.py``: one process, and the same script under torchrun (gloo,
2 and 4 processes), train to the same numbers bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "library_quickstart.py"


def run(args: list[str], *, nproc: int | None = None) -> dict[str, Any]:
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        if nproc
        else [sys.executable]
    )
    done = subprocess.run(
        [*launcher, str(SCRIPT), "--epochs", "1", "--device", "cpu", "--json", *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        # one thread everywhere: a matmul's summation order depends on its thread count
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout  # only the first stage's rank reports
    result: dict[str, Any] = json.loads(lines[0])
    return result


@pytest.mark.parametrize(("stages", "targets"), [(2, "send"), (4, "read")])
def test_torchrun_equals_one_process_bit_for_bit(stages: int, targets: str) -> None:
    """Targets sent by stage 0's rank, or read by the last stage's rank from its own
    DataLoader (shuffled, re-seeded per epoch): the same numbers either way."""
    local = run(["--stages", str(stages)])
    dist = run(["--stages", str(stages), "--transport", "dist", "--targets", targets], nproc=stages)
    assert local["transport"] == "local" and dist["transport"] == "dist"
    assert dist["device"] == f"cpu x{stages}"
    assert len(local["losses"]) == 46  # 1,500 samples in batches of 32
    assert dist["losses"] == local["losses"]
    assert dist["eval"] == local["eval"]
    assert local["eval"]["accuracy"] > 0.5  # one epoch: well past chance (0.1)


def test_torchrun_data_parallel_replicas_train_as_one_pipeline() -> None:
    """2 replicas x 2 stages (4 processes): each replica trains on half of every batch and
    the replicas average their gradients, so the run follows the one-process run on the
    whole batch (to rounding: the two halves are summed in another order)."""
    local = run(["--stages", "2"])
    dist = run(["--stages", "2", "--transport", "dist", "--data-parallel", "2"], nproc=4)
    assert dist["device"] == "cpu x2"
    assert dist["losses"] == pytest.approx(local["losses"], abs=1e-5)
    assert dist["eval"]["accuracy"] == pytest.approx(local["eval"]["accuracy"], abs=0.01)
