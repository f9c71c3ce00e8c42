"""Data-parallel replicas of a pipeline (PP x DP) over gloo: D = 2 replicas x P = 2 stages
(4 processes) train to the weights of one process on the full batch, and the replicas hold
identical weights and optimizer state after every update.

The ranks run ``dp_worker.py`` under torchrun (the library path); the launcher path
(``pipeoptim train --data-parallel``) and the failure paths run through ``launch.train``.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support import dp_worker
from support.launch import dp_torchrun as torchrun
from support.toy_net import config

from pipeoptim import Pipeline
from pipeoptim.errors import PlanError, RankFailedError, RuntimeConfigError
from pipeoptim.plan.plan import Plan
from pipeoptim.runtime.config import TrainConfig
from pipeoptim.runtime.feed import iterate_epoch
from pipeoptim.workloads.train import train

pytestmark = pytest.mark.slow
WORKER = Path(dp_worker.__file__)
ROOT = WORKER.parents[2]


def launched(method: str, micro: int, data_parallel: int, steps: int) -> TrainConfig:
    """A dist run of dp_worker's dropout-free model (a replica's dropout mask on half a
    batch is not the mask of the whole batch, so the runs could not agree)."""
    model = f"{WORKER}:net"
    return config(method, 2, micro, "dist", data_parallel, model, max_steps=steps)


def one_process(method: str, optimizer: str, steps: int) -> tuple[list[torch.Tensor], list[float]]:
    """The reference: a plain torch loop on the full batch (synchronous methods train to
    exactly this), or the method's own one-process pipeline on the full batch."""
    torch.set_num_threads(1)
    model = dp_worker.make_model()
    make = dp_worker.make_optimizer(optimizer)
    if method in ("gpipe", "1f1b"):
        opt = make(list(model.parameters()))
        losses = []
        batches = iterate_epoch(dp_worker.make_data(), 0, 0)  # the order a pipeline reads
        for _ in range(steps):
            x, y = next(batches)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return [p.detach() for p in model.parameters()], losses
    pipe = Pipeline(model, method=method, stages=2, optimizer=make, device="cpu")
    result = pipe.fit(dp_worker.make_data(), max_steps=steps)
    params = [p.detach() for k in sorted(pipe.stages) for p in pipe.stages[k].module.parameters()]
    return params, result.losses


def replica_weights(ranks: list[dict[str, Any]], replica: int) -> list[torch.Tensor]:
    mine = [r for r in ranks if r["replica"] == replica]
    stages = {k: w for r in mine for k, w in r["weights"].items()}
    return [p for k in sorted(stages) for p in stages[k]]


@pytest.mark.parametrize(
    ("method", "optimizer", "micro", "nodes"),
    [
        ("gpipe", "sgd", 2, 1),
        ("1f1b", "sgd", 2, 2),  # two torchrun "machines", one replica each
        ("pipeoptim", "sgd", 1, 1),
        ("pipeoptim", "adam", 1, 1),
    ],
)
def test_two_replicas_of_two_stages_train_as_one_process_on_the_full_batch(
    tmp_path: Path, method: str, optimizer: str, micro: int, nodes: int
) -> None:
    steps = 10  # one epoch is 10 batches of 16
    ranks = torchrun(
        tmp_path,
        "--method",
        method,
        "--optimizer",
        optimizer,
        "--micro-batches",
        str(micro),
        "--steps",
        str(steps),
        nodes=nodes,
    )
    assert [r["replica"] for r in ranks] == [0, 0, 1, 1]  # global rank = replica x P + rank
    # every update of every stage: bit-identical weights and optimizer state across replicas
    for stage in (0, 1):
        seen = [r["hashes"][stage] for r in ranks if stage in r["hashes"]]
        assert len(seen) == 2 and len(seen[0]) == steps
        assert seen[0] == seen[1]
    reference, ref_losses = one_process(method, optimizer, steps)
    for replica in (0, 1):
        got = replica_weights(ranks, replica)
        assert len(got) == len(reference)
        for a, b in zip(got, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # the reported loss is the whole batch's: the mean of the two replicas' halves
    losses = next(r["losses"] for r in ranks if r["losses"])
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    meta = next(r["trace_meta"] for r in ranks if r["trace_meta"])
    assert meta["data_parallel"] == 2
    assert ranks[0]["batch_size"] == dp_worker.BATCH  # the global batch, split in two


def test_launcher_runs_replicas_and_names_a_killed_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pipeoptim train --transport dist --data-parallel 2`: 2 x 2 processes that train as
    the one-pipeline run; a rank of replica 1 killed mid-run stops every rank quickly and is
    named (global rank 3 = replica 1, pipeline rank 1)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    reference = launched("1f1b", 2, 1, 8)
    reference.transport = "local"  # one replica in one process: the transports agree bit for bit
    one = train(reference)
    two = train(launched("1f1b", 2, 2, 8))
    assert one is not None and two is not None
    assert two.losses == pytest.approx(one.losses, abs=1e-5)
    assert two.trace.meta["data_parallel"] == 2 and two.trace.ranks == [0, 1]
    monkeypatch.setenv("PIPEOPTIM_TEST_KILL_RANK", "3")
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 3 failed: was killed by signal SIGKILL"):
        train(config("pipeoptim", 2, 1, "dist", max_steps=40, data_parallel=2))
    assert time.monotonic() - start < 45  # the others did not wait out the 60 s timeout


def test_bad_replica_counts_say_how_to_fix_them(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RuntimeConfigError, match="needs --transport dist"):
        config("1f1b", 2, 2, "local", data_parallel=2)
    with pytest.raises(
        PlanError, match="data_parallel must be a whole number of pipeline replicas"
    ):
        Plan("1f1b", 2, micro_batches=2, data_parallel=0)
    with pytest.raises(RuntimeConfigError, match="needs transport='dist'"):
        Pipeline(dp_worker.make_model(), method="1f1b", stages=2, data_parallel=2)
    with pytest.raises(
        RuntimeConfigError, match="data_parallel must be a whole number of pipeline replicas"
    ):
        Pipeline(dp_worker.make_model(), method="1f1b", stages=2, data_parallel=0)
    # 12 samples do not split into 2 replicas x 4 micro-batches: refused before any process
    with pytest.raises(
        RuntimeConfigError,
        match=r"batch size 12 is not divisible by 2 replicas x 4 micro-batches \(each replica "
        r"trains 1/2 of every batch, in 4 micro-batches\); use a batch size of 8",
    ):
        train(config("1f1b", 2, 4, "dist", max_steps=2, data_parallel=2))
    # under torchrun: 2 processes for 2 replicas of 2 stages, refused before any rendezvous
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(
        RuntimeConfigError,
        match=r"world size 2 does not match 2 replicas x 2 pipeline ranks = 4 processes.*"
        r"or use --data-parallel 1",
    ):
        train(config("1f1b", 2, 2, "dist", max_steps=2, data_parallel=2))


def test_replicas_checkpoint_once_and_resume_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replica 0 writes the checkpoints; a resumed 2 x 2 run equals the uninterrupted one,
    bit for bit, and a checkpoint of 2 replicas resumes on 1 (the replica count is not part
    of a run's identity: the global batch and its mean gradient are the same)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    def run(replicas: int, steps: int, folder: str, resume: bool = False) -> Any:
        cfg = launched("pipeoptim", 1, replicas, steps)
        if replicas == 1:  # one replica in one process: the transports agree bit for bit
            cfg.transport = "local"
        cfg.checkpoint_dir, cfg.checkpoint_every, cfg.resume = str(tmp_path / folder), 3, resume
        result = train(cfg)
        assert result is not None
        return result

    whole = run(2, 9, "whole")
    first = run(2, 6, "parts")
    # the same 6 steps on 2 replicas, later resumed on 1: a copy, not a second launch
    shutil.copytree(tmp_path / "parts", tmp_path / "two-then-one")
    rest = run(2, 9, "parts", resume=True)
    assert rest.start_step == 6
    assert first.losses + rest.losses == whole.losses
    assert sorted(p.name for p in (tmp_path / "parts" / "step-00000009").iterdir()) == [
        "stage-0.pt",
        "stage-1.pt",
    ]
    for k in range(2):
        a = torch.load(tmp_path / "whole" / "step-00000009" / f"stage-{k}.pt", weights_only=True)
        b = torch.load(tmp_path / "parts" / "step-00000009" / f"stage-{k}.pt", weights_only=True)
        for name, tensor in a["state"]["module"].items():
            assert torch.equal(tensor, b["state"]["module"][name])
    one = run(1, 9, "one")  # the reference for a resume on one replica
    resumed = run(1, 9, "two-then-one", resume=True)
    assert resumed.start_step == 6
    assert resumed.losses == pytest.approx(one.losses[6:], abs=1e-5)
