"""A DataLoader with dynamic padding (each batch padded to its own longest sequence, a
padding mask in the batch, labels -100 on padding) trains a cut Llama: the synchronous
methods equal the uncut model trained on one device, and a run over 2 gloo ranks (one tag:
NCCL's posting order) equals the one-process run bit for bit."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support import FOLDER

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402
from support import hf_lengths_worker as worker  # noqa: E402

from pipeoptim.hf import causal_lm_loss  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
METHODS = ["1f1b", "zb-h1", "pipeoptim", "xpipe"]
TOLERANCE = 1e-4  # float32: the same sums in other orders, over 5 AdamW steps


def one_device() -> list[float]:
    """The uncut model trained on the same batches: each step's loss the batch's token mean."""
    model = worker.llama()
    optimizer = worker.adamw(list(model.parameters()))
    losses = []
    for x, y in worker.padded_batches():
        optimizer.zero_grad()
        loss = causal_lm_loss(model(**x).logits, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_the_batches_change_length() -> None:
    lengths = {x["input_ids"].shape[1] for x, _ in worker.padded_batches()}
    assert len(lengths) == len(worker.LENGTHS)


@pytest.mark.parametrize("method", METHODS)
def test_dynamic_padding_trains_a_cut_llama(method: str) -> None:
    losses = worker.train(method, "local")
    assert losses is not None and len(losses) == len(worker.LENGTHS)
    assert all(math.isfinite(loss) for loss in losses)
    if method in ("1f1b", "zb-h1"):  # synchronous: the same updates as one device
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(one_device()), rtol=TOLERANCE, atol=TOLERANCE
        )


@pytest.mark.slow
def test_dynamic_padding_over_two_gloo_ranks_equals_one_process(tmp_path: Path) -> None:
    script = FOLDER / "hf_lengths_worker.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(port)]  # fmt: skip
    for where, command in [("dist", launcher), ("local", [sys.executable])]:
        extra = [] if where == "dist" else ["--transport", "local"]
        done = subprocess.run(
            [*command, str(script), "--out", str(tmp_path / where), *extra],
            capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    dist_run, local = (
        json.loads((tmp_path / w / "losses.json").read_text()) for w in ("dist", "local")
    )
    assert sorted(dist_run) == sorted(METHODS)
    assert dist_run == local
