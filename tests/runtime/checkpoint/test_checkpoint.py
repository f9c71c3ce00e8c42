"""Checkpoints: a resumed run equals an uninterrupted one; NaN keeps the last good one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.compare import assert_same
from torch import Tensor, nn

from pipeoptim.errors import NonFiniteLossError, RuntimeConfigError
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.runtime.checkpoint.store import latest_step
from pipeoptim.runtime.config import TrainConfig
from pipeoptim.runtime.result import FitResult
from pipeoptim.runtime.segments import Segment, plan_segments
from pipeoptim.trace import Trace
from pipeoptim.workloads.data import Dataset
from pipeoptim.workloads.train import train

HERE = Path(__file__)


class NanAfter(nn.Module):
    """Multiplies by NaN from the n-th training forward on (a deterministic blow-up)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.calls = n, 0

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled():
            self.calls += 1
            if self.calls >= self.n:
                return x * float("nan")
        return x


def net() -> list[nn.Module]:
    """With dropout, so the stages' RNG streams must travel in the checkpoint too."""
    return [
        nn.Linear(5, 8),
        nn.Tanh(),
        nn.Dropout(0.2),
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 2),
    ]


def nan_net() -> list[nn.Module]:
    return [*net(), NanAfter(7)]  # the 7th forward of the last stage: mini-batch 6


def dataset() -> Dataset:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(90, 5, generator=g)
    y = (x.sum(dim=1) > 0).long()
    return Dataset("toy", x[:80], y[:80], x[80:], y[80:], 2)


def config(
    tmp: Path,
    steps: int,
    *,
    model: str = "net",
    resume: bool = False,
    lr: float = 0.05,
    **kw: object,
) -> TrainConfig:
    method = str(kw.pop("method", "pipeoptim"))
    plan = Plan(
        method,
        3,
        micro_batches=4 if method == "2bw" else 1,
        optimizer=OptimizerSpec(str(kw.pop("family", "rmsprop")), lr),
        model=f"{HERE}:{model}",
        batch_size=8,
    )
    return TrainConfig(
        plan,
        max_steps=steps,
        checkpoint_dir=str(tmp),
        checkpoint_every=4,
        resume=resume,
        device="cpu",
        **kw,  # type: ignore[arg-type]
    )


def saved(folder: Path) -> list[dict[str, object]]:
    step = latest_step(folder)
    assert step is not None
    return [
        torch.load(folder / f"step-{step['step']:08d}" / f"stage-{k}.pt", weights_only=True)
        for k in range(3)
    ]


@pytest.mark.parametrize(
    ("method", "family"),
    [
        ("pipeoptim", "rmsprop"),
        ("pipedream", "adam"),
        ("2bw", "sgd"),
        ("pipeoptim+extrapolate", "adam"),  # its kept update travels in the checkpoint
    ],
)
def test_resumed_run_equals_uninterrupted_run(tmp_path: Path, method: str, family: str) -> None:
    """RMSprop without momentum makes the predictor keep displacement state: it must travel
    in the checkpoint too. Segments [0,4) [4,8) [8,12): the last one runs across the epoch
    boundary at step 10 without a drain, before and after the resume."""
    whole = train(config(tmp_path / "a", 12, method=method, family=family))
    first = train(config(tmp_path / "b", 8, method=method, family=family))
    rest = train(config(tmp_path / "b", 12, method=method, family=family, resume=True))
    assert (
        isinstance(whole, FitResult)
        and isinstance(first, FitResult)
        and isinstance(rest, FitResult)
    )
    assert (rest.start_step, rest.end_step) == (8, 12)
    assert first.losses + rest.losses == whole.losses  # bit for bit
    for a, b in zip(saved(tmp_path / "a"), saved(tmp_path / "b"), strict=True):
        assert_same(a["state"], b["state"])
    record = latest_step(tmp_path / "b")
    assert record is not None and record["step"] == 12 and record["epoch"] == 1
    kept = sorted(p.name for p in (tmp_path / "b").iterdir() if p.is_dir())
    assert kept == ["step-00000008", "step-00000012"]  # the newest two (--keep-checkpoints)


def test_nan_loss_stops_names_the_step_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    cfg = config(tmp_path / "ckpt", 12, model="nan_net", family="sgd", trace=str(trace))
    with pytest.raises(NonFiniteLossError, match="non-finite loss \\(nan\\) at step 6") as err:
        train(cfg)
    assert err.value.step == 6
    record = latest_step(tmp_path / "ckpt")
    assert record is not None and record["step"] == 4  # segment [4, 8) never finished
    for payload in saved(tmp_path / "ckpt"):
        state = payload["state"]
        assert isinstance(state, dict)
        assert all(torch.isfinite(t).all() for t in state["module"].values())
    ran = Trace.load(trace)
    # Losses are read at log points (here the segment's end), not per micro-batch: the
    # segment [4, 8) ran to its end before the NaN of step 6 was seen.
    assert ran.events and max(e.mb for e in ran.events_of(kinds=["U"])) == 7
    # The kept checkpoint resumes: the rebuilt NaN layer counts from 0 again, so two more
    # mini-batches from step 4 run clean.
    resumed = train(config(tmp_path / "ckpt", 6, model="nan_net", family="sgd", resume=True))
    assert resumed is not None and (resumed.start_step, resumed.end_step) == (4, 6)


def test_resume_refuses_a_different_run(tmp_path: Path) -> None:
    """What fixes the state's shapes must match (the optimizer family); the lr may change."""
    train(config(tmp_path, 4))
    with pytest.raises(RuntimeConfigError, match=r"from a different run .*optimizer"):
        train(config(tmp_path, 8, family="adam", resume=True))
    resumed = train(config(tmp_path, 8, lr=0.1, resume=True))
    assert resumed is not None and resumed.start_step == 4
    assert any("lr 0.05 -> 0.1" in note for note in resumed.notes)


def test_resume_without_checkpoint_starts_fresh(tmp_path: Path) -> None:
    result = train(config(tmp_path / "empty", 4, resume=True))
    assert result is not None and result.start_step == 0 and result.end_step == 4


def test_pointer_names_only_complete_checkpoints(tmp_path: Path) -> None:
    train(config(tmp_path, 4))
    # A crash while writing step 8 leaves a partial folder but no pointer to it.
    partial = tmp_path / "step-00000008"
    partial.mkdir()
    (partial / "stage-0.pt").write_bytes(b"half a file")
    record = json.loads((tmp_path / "latest.json").read_text())
    assert record["step"] == 4 and record["num_stages"] == 3
    result = train(config(tmp_path, 8, resume=True))
    assert result is not None and result.start_step == 4
    assert latest_step(tmp_path) == {
        **record,
        "step": 8,
        "epoch": 0,
        "data_position": {"epoch": 0, "batch": 8},
    }


def test_segments_are_a_function_of_the_step() -> None:
    assert list(plan_segments(0, 12, [4])) == [
        Segment(0, 0, 4),
        Segment(1, 4, 4),
        Segment(2, 8, 4),
    ]
    resumed = plan_segments(8, 12, [4])
    assert [(s.first_step, s.num_steps) for s in resumed] == [(8, 4)]
    # No period: one never-flushed pipeline over the whole run, whatever the epochs.
    assert [(s.first_step, s.num_steps) for s in plan_segments(0, 25, [None])] == [(0, 25)]
    # Checkpoints every 4 and evaluations every 6 both cut.
    assert [(s.first_step, s.num_steps) for s in plan_segments(0, 13, [4, 6])] == [
        (0, 4),
        (4, 2),
        (6, 2),
        (8, 4),
        (12, 1),
    ]


def test_damaged_checkpoint_is_reported_not_unpickled(tmp_path: Path) -> None:
    train(config(tmp_path, 4))
    (tmp_path / "step-00000004" / "stage-1.pt").write_bytes(b"\x80\x02garbage")
    with pytest.raises(RuntimeConfigError, match=r"cannot read checkpoint .*stage-1\.pt"):
        train(config(tmp_path, 8, resume=True))
