"""torch.distributed.checkpoint as a checkpoint format: each stage a DCP folder, its tensors under
model-level names, written and read without a process group (local and under dist); a resume
onto another cut reads only the units it needs; torch-save checkpoints keep loading."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.utils.data import DataLoader, TensorDataset

from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.runtime.checkpoint.dcp_format import DistributedCheckpoint
from pipeoptim.runtime.checkpoint.formats import FORMATS
from pipeoptim.runtime.checkpoint.recut import SavedCut
from pipeoptim.runtime.checkpoint.store import CheckpointStore
from pipeoptim.runtime.config import TrainConfig
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.runtime.result import FitResult
from pipeoptim.workloads.train import train


def units() -> list[nn.Module]:
    """Nine units: five linear layers and four activations."""
    torch.manual_seed(0)
    out: list[nn.Module] = []
    for a, b in itertools.pairwise((6, 8, 8, 8, 8, 3)):
        out += [nn.Linear(a, b), nn.Tanh()]
    return out[:-1]


def data() -> DataLoader[tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 6, generator=g)
    order = torch.Generator().manual_seed(1)
    return DataLoader(
        TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16, shuffle=True, generator=order
    )


def model_level(p: Pipeline) -> tuple[dict[str, Tensor], dict[str, Any]]:
    saved = SavedCut({k: s.state_dict() for k, s in p.stages.items()}, p.parts.bounds)
    return saved.tensors, {name: param.state for name, param in saved.params.items()}


def pipe(ckpt: Path | None, stages: int, fmt: str = "dcp") -> Pipeline:
    return Pipeline(
        units(),
        "gpipe",
        stages=stages,
        micro_batches=8,
        optimizer=lambda p: torch.optim.Adam(p, lr=0.01),
        checkpoint_dir=str(ckpt) if ckpt is not None else None,
        checkpoint_every=2 if ckpt is not None else None,
        checkpoint_format=fmt,
        device="cpu",
    )


def fit(p: Pipeline, steps: int, resume: bool = False) -> FitResult:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return p.fit(data(), max_steps=steps, resume=resume)


def dcp_names(folder: Path) -> set[str]:
    return set(FileSystemReader(folder).read_metadata().state_dict_metadata)


def test_each_stage_is_a_dcp_folder_under_model_level_names(tmp_path: Path) -> None:
    fit(pipe(tmp_path, 4), 2)
    step = tmp_path / "step-00000002"
    assert sorted(p.name for p in step.iterdir()) == [f"stage-{k}.dcp" for k in range(4)]
    # stage 1 holds units 3 and 4 (a Tanh and a Linear): the Linear under its unit's number
    names = dcp_names(step / "stage-1.dcp")
    assert {n for n in names if n.startswith("model/")} == {"model/4.weight", "model/4.bias"}
    assert {"optim/4.weight/exp_avg", "optim/4.weight/exp_avg_sq", "optim/4.bias/step"} <= names
    assert "stage/state/rng" in names


def test_a_dcp_checkpoint_resumes_at_another_depth_as_if_cut_so_from_the_start(
    tmp_path: Path,
) -> None:
    whole_pipe = pipe(None, 2)
    whole = fit(whole_pipe, 6)
    first = fit(pipe(tmp_path, 4), 4)
    resumed_pipe = pipe(tmp_path, 2)
    rest = fit(resumed_pipe, 6, resume=True)
    assert first.losses + rest.losses == whole.losses
    ours, theirs = model_level(resumed_pipe), model_level(whole_pipe)
    assert ours[0].keys() == theirs[0].keys() and ours[1].keys() == theirs[1].keys()
    for name, value in ours[0].items():
        assert torch.equal(value, theirs[0][name])


def test_a_re_cut_reads_only_the_units_it_needs(tmp_path: Path) -> None:
    fit(pipe(tmp_path, 2), 2)
    store = CheckpointStore(tmp_path, {}, num_stages=2, format=FORMATS["dcp"])
    part = store.load(2, 0, torch.device("cpu"), (0, 3))["state"]
    whole = store.load(2, 0, torch.device("cpu"))["state"]
    # stage 0 holds units 0..4; units 0..2 asked: the Linear of unit 2 and the rest of the
    # stage's state (RNG, scheduler) only
    assert sorted(part["module"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert sorted(whole["module"]) == [f"{u}.{k}" for u in (0, 2, 4) for k in ("bias", "weight")]
    assert torch.equal(part["rng"], whole["rng"])


@pytest.mark.parametrize(("written", "read"), [("torch-save", "dcp"), ("dcp", "torch-save")])
def test_a_run_resumes_whichever_format_its_checkpoint_was_written_in(
    tmp_path: Path, written: str, read: str
) -> None:
    whole = fit(pipe(None, 2), 6)
    first = fit(pipe(tmp_path, 4, written), 4)
    rest = fit(pipe(tmp_path, 2, read), 6, resume=True)
    assert first.losses + rest.losses == whole.losses
    suffix = FORMATS[read].suffix
    assert (tmp_path / "step-00000006" / f"stage-0{suffix}").exists()


def test_the_dcp_format_writes_folders_not_files() -> None:
    fmt = DistributedCheckpoint()
    with pytest.raises(TypeError, match="writes a folder"):
        fmt.write({}, None)  # type: ignore[arg-type]


@pytest.mark.slow
def test_dcp_under_dist_ranks_writes_and_reads_without_a_process_group_of_its_own(
    tmp_path: Path,
) -> None:
    """Written by one process at 3 stages, resumed by two gloo ranks at 2 stages: equal to
    the 2-stage run from the start (local equals dist, bit for bit)."""

    def config(steps: int, stages: int, transport: str, **kw: Any) -> TrainConfig:
        plan = Plan("gpipe", stages, micro_batches=4, optimizer=OptimizerSpec("adam", 0.01))
        return TrainConfig(
            plan, max_steps=steps, transport=transport, device="cpu", timeout=120, **kw
        )

    ckpt = {"checkpoint_dir": str(tmp_path), "checkpoint_every": 2, "checkpoint_format": "dcp"}
    whole = train(config(4, 2, "local"))
    first = train(config(2, 3, "local", **ckpt))
    rest = train(config(4, 2, "dist", resume=True, **ckpt))
    assert whole is not None and first is not None and rest is not None
    assert first.losses + rest.losses == whole.losses
    assert sorted(p.name for p in (tmp_path / "step-00000004").iterdir()) == [
        "stage-0.dcp",
        "stage-1.dcp",
    ]
