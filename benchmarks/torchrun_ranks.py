"""Run a benchmark's worker under ``torchrun`` on this machine and read what each rank wrote.

Shared by the benchmarks that need one process per rank (a process's peak RSS is its own):
the worker is the script itself, called with ``args`` and ``--out DIR``, and writes
``DIR/rank-{global rank}.json``. One thread per rank, no GPU.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["run_ranks"]


def run_ranks(
    script: str, args: list[str], nproc: int, timeout: float = 900
) -> list[dict[str, Any]]:
    """``torchrun --nproc-per-node nproc script *args --out DIR``: each rank's JSON, by rank."""
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        argv += ["--master-port", str(port), script, *args, "--out", tmp]
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
            timeout=timeout,
        )
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(args)}: the run failed:\n{done.stderr[-3000:]}")
        return [json.loads((Path(tmp) / f"rank-{g}.json").read_text()) for g in range(nproc)]
