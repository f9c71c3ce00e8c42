"""One process per stage over torch.distributed (gloo): same numbers as the local transport,
and failures end the run with an error naming the rank, within a bounded time.

The spawned ranks load the model from ``support/toy_net.py`` (``path.py:factory``), so the
model and its synthetic data cost no download and no scikit-learn import.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from support import toy_net
from support.toy_net import config

from pipeoptim.errors import NonFiniteLossError, RankFailedError, RuntimeConfigError
from pipeoptim.runtime.checkpoint.store import latest_step
from pipeoptim.runtime.result import FitResult
from pipeoptim.trace import Trace
from pipeoptim.workloads.train import train

pytestmark = pytest.mark.slow
MODELS = Path(toy_net.__file__)


@pytest.mark.parametrize(
    ("method", "stages", "micro", "recompute", "model"),
    [
        ("2bw", 2, 2, None, None),
        ("pipeoptim", 4, 1, None, None),
        ("pipeoptim+bounded", 3, 1, None, None),
        ("pipeoptim", 3, 1, "full", None),  # activation recomputation (test_recompute.py)
        ("1f1b", 2, 2, "units:Linear", None),
        ("1f1b", 2, 2, None, "wide_net"),  # weight gradients added after the send
        ("pipeoptim", 3, 1, None, "wide_net"),  # and so asynchronously
    ],
)
def test_dist_transport_equals_local_bit_for_bit(
    tmp_path: Path,
    one_thread: None,
    method: str,
    stages: int,
    micro: int,
    recompute: str | None,
    model: str | None,
) -> None:
    runs: dict[str, FitResult] = {}
    for transport in ("local", "dist"):
        cfg = config(
            method,
            stages,
            micro,
            transport,
            model=None if model is None else f"{MODELS}:{model}",
            recompute=recompute,
            max_steps=14,
            checkpoint_every=6,
            checkpoint_dir=str(tmp_path / transport),
            trace=str(tmp_path / f"{transport}.json"),
        )
        result = train(cfg)
        assert result is not None
        runs[transport] = result
    local, dist = runs["local"], runs["dist"]
    assert dist.losses == local.losses  # bitwise: same ops in the same order per stage
    assert dist.test_accuracy == local.test_accuracy
    assert dist.weight_copies == local.weight_copies
    for k in range(stages):  # and the final weights, optimizer and RNG states
        step = latest_step(tmp_path / "dist")
        assert step is not None and step["step"] == 14
        a = torch.load(tmp_path / "local" / "step-00000014" / f"stage-{k}.pt", weights_only=True)
        b = torch.load(tmp_path / "dist" / "step-00000014" / f"stage-{k}.pt", weights_only=True)
        for name, tensor in a["state"]["module"].items():
            assert torch.equal(tensor, b["state"]["module"][name])
        assert torch.equal(a["state"]["rng"], b["state"]["rng"])
    trace = Trace.load(tmp_path / "dist.json")
    assert trace.ranks == list(range(stages))
    assert len(trace.events) == len(Trace.load(tmp_path / "local.json").events)
    assert trace.meta["transport"] == "dist"


def test_killed_rank_ends_the_run_with_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPEOPTIM_TEST_KILL_RANK", "1")
    trace = tmp_path / "trace.json"
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 failed: was killed by signal SIGKILL") as err:
        train(config("pipeoptim", 3, 1, "dist", max_steps=40, trace=str(trace)))
    elapsed = time.monotonic() - start
    assert err.value.rank == 1
    assert "rank 0" in str(err.value) and "rank 2" in str(err.value)  # both stopped, non-zero
    assert elapsed < 45, f"took {elapsed:.0f} s: the survivors waited for a timeout"
    ran = Trace.load(trace)  # what the surviving ranks ran
    assert ran.events and 1 not in ran.ranks


def test_nan_on_one_rank_stops_all_with_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPEOPTIM_TEST_NAN_AT", "9")
    cfg = config(
        "pipedream", 2, 1, "dist", max_steps=20, checkpoint_every=4, checkpoint_dir=str(tmp_path)
    )
    with pytest.raises(
        NonFiniteLossError, match="rank 1: non-finite loss \\(nan\\) at step 8"
    ) as err:
        train(cfg)
    assert err.value.step == 8
    record = latest_step(tmp_path)
    assert record is not None and record["step"] == 8  # the segment [8, 12) never finished


def test_world_size_must_match_the_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun: the check comes before any rendezvous, so nothing waits."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(
        RuntimeConfigError, match="world size 2 does not match the plan's 4 pipeline stages"
    ):
        train(config("pipeoptim", 4, 1, "dist", max_steps=2))


def test_resume_under_dist_equals_an_uninterrupted_run(tmp_path: Path, one_thread: None) -> None:
    """Stop a 2-process pipeoptim run at a checkpoint, resume it over dist again: the same
    losses and weights as one uninterrupted (local) run, bit for bit."""

    def run(transport: str, steps: int, folder: str, resume: bool = False) -> FitResult:
        cfg = config(
            "pipeoptim",
            2,
            1,
            transport,
            max_steps=steps,
            checkpoint_every=3,
            checkpoint_dir=str(tmp_path / folder),
            resume=resume,
        )
        result = train(cfg)
        assert result is not None
        return result

    whole = run("local", 12, "whole")
    first = run("dist", 6, "parts")
    rest = run("dist", 12, "parts", resume=True)
    assert rest.start_step == 6
    assert first.losses + rest.losses == whole.losses
    for k in range(2):
        a = torch.load(tmp_path / "whole" / "step-00000012" / f"stage-{k}.pt", weights_only=True)
        b = torch.load(tmp_path / "parts" / "step-00000012" / f"stage-{k}.pt", weights_only=True)
        for name, tensor in a["state"]["module"].items():
            assert torch.equal(tensor, b["state"]["module"][name])
