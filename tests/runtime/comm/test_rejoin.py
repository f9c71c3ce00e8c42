"""A Pipeline closed under torchrun, then another in the same processes: the second starts
its process group afresh and trains as the first did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import FOLDER

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]
WORKER = FOLDER / "rejoin_worker.py"


def test_pipelines_one_after_another_under_torchrun_train_alike() -> None:
    """Each later group once read the addresses the closed group's ranks had published in
    the launcher's store, and gloo's connect failed ("Connection refused") about one
    start in three; three Pipelines give two such starts."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         str(WORKER), "--pipelines", "3"],
        capture_output=True,
        text=True,
        timeout=90,  # a start that reads a stale address can hang until then
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("[")))
    assert len(runs) == 3 and len(runs[0]) == 4
    assert runs[1] == runs[0] and runs[2] == runs[0]  # the same computation, bit for bit
