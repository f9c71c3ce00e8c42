"""Replicas under data parallelism and ``targets="read"``, over gloo.

Buffers (BatchNorm's running statistics) stay equal across the replicas, bit for bit
after every update, so every replica evaluates alike. The ranks that read the data
check, once per fit, that they read the same first batch and epoch length, and refuse
otherwise (a rank-dependent order under ``targets="read"``; a ``DistributedSampler`` under
``data_parallel=2``).

The ranks run ``replicas_worker.py`` under torchrun, as comm/test_data_parallel.py runs its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support import replicas_worker
from support.launch import dp_torchrun

from pipeoptim import Pipeline

pytestmark = pytest.mark.slow
WORKER = Path(replicas_worker.__file__)
ROOT = WORKER.parents[2]


def torchrun(tmp_path: Path, *args: str, nproc: int = 4) -> list[dict[str, Any]]:
    """Run replicas_worker.py on ``nproc`` processes; each rank's record."""
    return dp_torchrun(tmp_path, *args, nproc=nproc, worker=WORKER)


@pytest.mark.parametrize(("method", "micro"), [("pipeoptim", 1), ("gpipe", 2), ("pipedream", 1)])
def test_buffers_stay_equal_across_replicas_and_evaluations_agree(
    tmp_path: Path, method: str, micro: int
) -> None:
    """2 replicas x 2 stages with a BatchNorm on each stage: after every update, each
    stage's buffers (running mean and variance, num_batches_tracked) are the same bytes on
    both replicas, and both replicas report the same evaluation. Under an asynchronous
    method a later forward's graph (which saved the running statistics) is in flight when
    the update's broadcast writes them: pipedream failed its backward here until the
    broadcast wrote untracked."""
    steps = 12
    ranks = torchrun(
        tmp_path,
        "--case",
        "bn",
        "--method",
        method,
        "--micro-batches",
        str(micro),
        "--steps",
        str(steps),
        "--targets",
        "read",  # both readers of each replica agree on a shuffled DataLoader: no refusal
    )
    assert [r["error"] for r in ranks] == [None] * 4
    assert [r["replica"] for r in ranks] == [0, 0, 1, 1]
    for stage in (0, 1):
        seen = [r["hashes"][stage] for r in ranks if stage in r["hashes"]]
        assert len(seen) == 2 and len(seen[0]) == steps
        assert seen[0] == seen[1]  # after every update, not only at the end
        a, b = (r["buffers"][stage] for r in ranks if stage in r["buffers"])
        assert sorted(n.split(".")[1] for n in a) == [
            "num_batches_tracked",
            "running_mean",
            "running_var",
        ]
        for name in a:
            assert torch.equal(a[name], b[name]), name
        tracked = next(v for n, v in a.items() if n.endswith("num_batches_tracked"))
        assert int(tracked) == steps * micro  # every replica's forwards count alike
    evals = [r["eval"] for r in ranks]
    assert all(e == evals[0] for e in evals), evals  # the same merged result on every rank


def test_no_buffer_sync_without_replicas_or_buffers() -> None:
    """No cost when D = 1: the stages of a one-replica pipeline get no buffer sync."""
    pipe = Pipeline(replicas_worker.bn_model(), method="1f1b", stages=2, device="cpu")
    assert all(s.buffer_sync is None for s in pipe.stages.values())


def test_targets_read_refuses_data_whose_order_depends_on_the_rank(
    tmp_path: Path,
) -> None:
    ranks = torchrun(
        tmp_path,
        "--case",
        "read-order",
        "--data-parallel",
        "1",
        "--targets",
        "read",
        nproc=2,
    )
    errors = [r["error"] for r in ranks]
    assert errors[0] is not None and errors == [errors[0]] * 2, errors  # every rank stops
    assert "targets='read'" in errors[0]
    assert "the first batch's targets differ" in errors[0]
    assert "targets='send'" in errors[0]
    assert all(not any(h) for r in ranks for h in r["hashes"].values())  # nothing trained


def test_distributed_sampler_under_data_parallel_is_refused(tmp_path: Path) -> None:
    ranks = torchrun(tmp_path, "--case", "sampler")
    errors = [r["error"] for r in ranks]
    assert errors[0] is not None and errors == [errors[0]] * 4, errors
    assert "replica 1 read other data than replica 0" in errors[0]
    assert "DistributedSampler" in errors[0]
    assert "give every replica the same data" in errors[0]
    assert all(not any(h) for r in ranks for h in r["hashes"].values())


def test_fingerprints_name_what_differs() -> None:
    """The cheap fingerprint (first batch's shapes and targets, the epoch length) and the
    differences it names, in one process; inputs drawn otherwise (an augmentation) agree."""
    from pipeoptim.runtime.feed import DataFingerprint  # new in this item

    x, y = replicas_worker.samples()
    x, y = x[:16], y[:16]
    same = DataFingerprint.of(x, y, 12, 0)
    assert same == DataFingerprint.of(x.clone(), y.clone(), 12, 0)
    assert same.differences(DataFingerprint.of(x, y, 12, 0)) == []
    assert same.differences(DataFingerprint.of(x, y.flip(0), 6, 0)) == [
        "epoch length 12 against 6 batches",
        "the first batch's targets differ",
    ]
    assert same.differences(DataFingerprint.of(x + 0.1, y, 12, 0)) == []
    assert same.differences(DataFingerprint.of(x, y, 12, 3)) == [
        "0 against 3 samples left out per epoch"
    ]
    assert (
        "the first batch's shapes differ"
        in same.differences(DataFingerprint.of(x[:8], y[:8], 12, 0))[0]
    )
