"""What a rank of ``pipeoptim train`` imports before it trains (``pipeoptim.workloads.train``,
the worker every launched rank runs): torch's checkpoint and ZeRO packages load only where a
run writes DCP or shards its optimizer. A rank's imports and first AdamW step took 2.4 s
against 2.7 s with them (three quiet starts each on this machine; torch loads much of what
they loaded, its compiler stack, when the first optimizer is built)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

LAZY = ("torch.distributed.checkpoint", "torch.distributed.optim")


def _loaded_after(statement: str) -> set[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_a_rank_starts_without_torchs_checkpoint_and_zero_packages() -> None:
    loaded = _loaded_after("import pipeoptim.workloads.train")
    assert "torch" in loaded and "pipeoptim.runtime.stage.stage" in loaded
    assert not [m for m in loaded if m.startswith(LAZY)]


@pytest.mark.parametrize("package", LAZY)
def test_the_code_that_needs_them_loads_them(package: str) -> None:
    """The DCP format and ZeRO still find their packages when used."""
    if package == "torch.distributed.checkpoint":
        use = (
            "import pathlib, tempfile, torch\n"
            "from pipeoptim.runtime.checkpoint.dcp_format import DistributedCheckpoint\n"
            "folder = pathlib.Path(tempfile.mkdtemp()) / 'stage-0.dcp'\n"
            "DistributedCheckpoint().write_folder({'w': torch.ones(2)}, folder)\n"
            "read = DistributedCheckpoint().read(folder, torch.device('cpu'))\n"
            "assert torch.equal(read['w'], torch.ones(2))"
        )
    else:
        use = (
            "from pipeoptim.runtime.optim import sharded\n"
            "assert sharded._zero_class().__name__ == 'ZeroRedundancyOptimizer'"
        )
    assert package in _loaded_after(use)
