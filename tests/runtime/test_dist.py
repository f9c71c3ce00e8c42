"""One process per stage over torch.distributed (gloo): same numbers as the local transport,
and failures end the run with an error naming the rank, within a bounded time.

The spawned ranks import this file for the model (``path.py:factory``), so the model and
its synthetic data cost no download and no scikit-learn import.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from pipeoptim.errors import NonFiniteLossError, RankFailedError, RuntimeConfigError
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.runtime.checkpoint.store import latest_step
from pipeoptim.runtime.config import TrainConfig
from pipeoptim.runtime.result import FitResult
from pipeoptim.trace import Trace
from pipeoptim.workloads.data import Dataset
from pipeoptim.workloads.train import train

pytestmark = pytest.mark.slow
HERE = Path(__file__)


class Trap(nn.Module):
    """Identity, except that in the rank named by $PIPEOPTIM_TEST_KILL_RANK it kills its own
    process (SIGKILL: no cleanup, no message) at the 6th training forward, or from
    $PIPEOPTIM_TEST_NAN_AT on returns NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled():
            return x
        self.calls += 1
        victim = os.environ.get("PIPEOPTIM_TEST_KILL_RANK")
        if victim is not None and victim == os.environ.get("RANK") and self.calls == 6:
            os.kill(os.getpid(), signal.SIGKILL)
        nan_at = os.environ.get("PIPEOPTIM_TEST_NAN_AT")
        if nan_at is not None and self.calls >= int(nan_at):
            return x * float("nan")
        return x


def net() -> list[nn.Module]:
    return [
        nn.Linear(6, 16),
        nn.Tanh(),
        Trap(),
        nn.Linear(16, 16),
        nn.Dropout(0.1),
        Trap(),
        nn.Linear(16, 16),
        nn.Tanh(),
        Trap(),
        nn.Linear(16, 16),
        nn.ReLU(),
        nn.Linear(16, 3),
        Trap(),
    ]


def wide_net() -> list[nn.Module]:
    """Layers of 524,288 weights, which add their gradients inside their products
    (``accumulate_in_product.py``): on the stages that send a gradient, after it."""
    return [
        nn.Linear(6, 512),
        nn.Tanh(),
        nn.Linear(512, 1024),
        nn.Tanh(),
        nn.Linear(1024, 512),
        nn.Tanh(),
        nn.Linear(512, 1024),
        nn.Tanh(),
        nn.Linear(1024, 3),
    ]


def dataset() -> Dataset:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(140, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 3] > 0.5).long()
    return Dataset("toy", x[:120], y[:120], x[120:], y[120:], 3)


def config(
    method: str,
    stages: int,
    micro: int,
    transport: str,
    data_parallel: int = 1,
    model: str | None = None,
    **kw: object,
) -> TrainConfig:
    """A run of ``model`` (default: net and dataset of this file, which the ranks load)."""
    plan = Plan(
        method,
        stages,
        micro_batches=micro,
        data_parallel=data_parallel,
        optimizer=OptimizerSpec("adam", 0.01),
        model=model or f"{HERE}:net",
        batch_size=12,
    )
    return TrainConfig(plan, transport=transport, device="cpu", timeout=60, **kw)  # type: ignore[arg-type]


@pytest.fixture
def one_thread(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """One intra-op thread in the ranks and in the local run: for the results to agree bit
    for bit, both must sum in the same order (a matmul's order depends on its threads)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
            model=None if model is None else f"{HERE}:{model}",
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
