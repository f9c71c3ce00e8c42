"""torchrun launches of a worker script: each rank writes its record to ``--out``, and the
launch hands the records back by rank."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from support import FOLDER, ROOT

DP_WORKER = FOLDER / "dp_worker.py"
TIED_WORKER = FOLDER / "tied_worker.py"


def torchrun(
    worker: Path,
    tmp_path: Path,
    *args: str,
    nproc: int = 4,
    nodes: int = 1,
    env: dict[str, str] | None = None,
    timeout: float = 180,
) -> list[dict[str, Any]]:
    """Run ``worker`` on ``nproc`` processes, each writing its record to ``--out``; with
    ``nodes`` = 2, as two torchrun invocations that meet over TCP, the way two machines do
    (static rendezvous). One thread per rank, no GPU; ``env`` adds to the environment; each
    launch has ``timeout`` seconds."""
    out = tmp_path / "ranks"
    out.mkdir()
    per_node = nproc // nodes
    with socket.socket() as probe:  # a free port: the default one may be taken by another run
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rendezvous = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    launches = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                *(["--nnodes", str(nodes), "--node-rank", str(node)] if nodes > 1 else []),
                *rendezvous,
                "--nproc-per-node",
                str(per_node),
                str(worker),
                "--out",
                str(out),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})},
        )
        for node in range(nodes)
    ]
    try:
        for launch in launches:
            _, err = launch.communicate(timeout=timeout)
            assert launch.returncode == 0, err[-3000:]
    finally:
        for launch in launches:
            launch.kill()
    return [torch.load(out / f"rank-{g}.pt", weights_only=False) for g in range(nproc)]


def dp_torchrun(
    tmp_path: Path, *args: str, nproc: int = 4, nodes: int = 1, worker: Path = DP_WORKER
) -> list[dict[str, Any]]:
    """:func:`torchrun` of ``worker`` (default: dp_worker.py, the data-parallel ranks)."""
    return torchrun(worker, tmp_path, *args, nproc=nproc, nodes=nodes)


def tied_torchrun(
    tmp_path: Path, nproc: int, *args: str, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """:func:`torchrun` of tied_worker.py (the tied embedding and the meta-device runs)."""
    return torchrun(TIED_WORKER, tmp_path, *args, nproc=nproc, env=env)
