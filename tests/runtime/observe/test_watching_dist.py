"""A callback's stop under torchrun (gloo): one launch of ``watch_worker.py`` (4 processes) stops
a P = 4 pipeline and a D = 2 x P = 2 one at log points, checked against ``max_steps`` runs
where the stops ended and against the same run in one process (bit for bit: the same
computation); each process's loggers write files of their own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support import watch_worker
from support.launch import torchrun

from pipeoptim import Pipeline

pytestmark = pytest.mark.slow
WORKER = Path(watch_worker.__file__)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return torchrun(WORKER, tmp_path_factory.mktemp("watch"), nproc=4, timeout=240)


def same(a: dict[int, list[torch.Tensor]], b: dict[int, list[torch.Tensor]]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(x, y) for k in a for x, y in zip(a[k], b[k], strict=True)
    )


def test_a_stop_on_four_ranks_gives_max_steps_weights_and_the_local_runs(
    ranks: list[dict[str, Any]],
) -> None:
    steps = {r["deep"]["step"] for r in ranks}
    assert steps == {9}  # asked at 5, with 3 mini-batches in flight at 4 stages
    for r in ranks:
        assert same(r["deep"]["weights"], r["deep_plain"]["weights"])
    # the decider is the last stage's process; the others only follow
    assert [all(r["deep_decided"]) for r in ranks] == [False, False, False, True]
    assert not any(any(r["deep_decided"]) for r in ranks[:3])
    torch.set_num_threads(1)
    local = Pipeline(
        watch_worker.make_model(), "pipeoptim", stages=4, log_every=1,
        callbacks=[watch_worker.StopAt(5)],
    )  # fmt: skip
    result = local.fit(watch_worker.make_data(), epochs=1)
    assert local.step == 9 and result.losses == ranks[3]["deep"]["losses"]
    for g, r in enumerate(ranks):
        assert same(r["deep"]["weights"], {g: list(local.stages[g].module.parameters())})


def test_a_stop_with_replicas_stops_every_replica_alike(ranks: list[dict[str, Any]]) -> None:
    assert {r["replicas"]["step"] for r in ranks} == {7}  # 5, and one in flight at 2 stages
    for r in ranks:
        assert same(r["replicas"]["weights"], r["replicas_plain"]["weights"])


def test_each_process_logs_its_own_stages_to_its_own_files(
    ranks: list[dict[str, Any]],
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folders = [Path(r["tb"]) for r in ranks]
    assert [f.name for f in folders] == ["rank0", "rank1", "rank2", "rank3"]
    for g, folder in enumerate(folders):
        events = EventAccumulator(str(folder))
        events.Reload()
        tags = set(events.Tags()["scalars"])
        assert {t.split("/")[0] for t in tags if t.startswith("stage")} == {f"stage{g}"}
        assert ("train/loss" in tags) == (g == 3)  # the losses are the last stage's
    losses = ranks[3]["deep"]["losses"]
    lines = [json.loads(x) for x in Path(ranks[3]["jsonl"]).read_text().splitlines()]
    read = {
        x["step"]: x["values"]["train/loss"]
        for x in lines
        if x["event"] == "scalars" and "train/loss" in x["values"]
    }
    assert read == dict(enumerate(losses))
    assert lines[-1]["stopped_by"] == "reached 5"
