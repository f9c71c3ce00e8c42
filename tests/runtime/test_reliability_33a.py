"""Issue 33, items 1, 2, 6, 7 and 8: meta-device buffers, data-dependent boundary shapes,
export outputs, and export under data parallelism. Each ends working or refused before any
work with the value and the fix.

The dist runs import this file for their model (``path.py:trimming_net`` and ``dataset``).
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from pipeoptim import Pipeline
from pipeoptim.cli import main
from pipeoptim.errors import PipeoptimError, RuntimeConfigError, StageError
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.runtime.config import TrainConfig
from pipeoptim.workloads.data import Dataset
from pipeoptim.workloads.train import train

HERE = Path(__file__)
ROOT = HERE.resolve().parents[2]


# ---------------------------------------------------------------- item 1: meta-device buffers
class Rotary(nn.Module):
    """A projection followed by a rotary-style scaling whose table is a non-persistent buffer
    (in no state dict), computed in ``__init__``; ``reset_parameters`` recomputes it, the
    torch convention for modules built on the meta device."""

    def __init__(self, dim: int = 8, base: float = 100.0, resettable: bool = True) -> None:
        super().__init__()
        self.dim, self.base = dim, base
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("inv_freq", self._table(), persistent=False)
        if not resettable:
            self.reset_parameters = None  # type: ignore[assignment]

    def _table(self) -> Tensor:
        return 1.0 / (self.base ** (torch.arange(self.dim, dtype=torch.float32) / self.dim))

    def reset_parameters(self) -> None:  # type: ignore[no-redef]
        with torch.no_grad():
            self.inv_freq.copy_(self._table().to(self.inv_freq.device))

    def forward(self, x: Tensor) -> Tensor:
        h: Tensor = self.proj(x)
        return torch.cos(h * self.inv_freq) + h


class Plain(nn.Module):
    """The same, without ``reset_parameters``: nothing here knows how to recompute it."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        table = 1.0 / (100.0 ** (torch.arange(dim, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", table, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        h: Tensor = self.proj(x)
        return h * self.inv_freq


def _units(kind: type[nn.Module]) -> list[nn.Module]:
    torch.manual_seed(3)
    return [kind(), nn.Tanh(), kind(), nn.Linear(8, 8)]


def _meta(kind: type[nn.Module]) -> list[nn.Module]:
    with torch.device("meta"):
        return _units(kind)


def _loader(reference: list[nn.Module]):  # type: ignore[no-untyped-def]
    """The README's init_weights: load the unit's part of a state dict (strictly)."""
    states = [u.state_dict() for u in reference]

    def init(index: int, unit: nn.Module) -> None:
        unit.load_state_dict(states[index])

    return init


def _outputs(pipe: Pipeline, x: Tensor) -> Tensor:
    h = x
    for k in sorted(pipe.stages):
        h = pipe.stages[k].module(h)
    return h


def test_item1_non_persistent_buffers_come_from_the_modules_own_initialisation() -> None:
    reference = _units(Rotary)
    pipe = Pipeline(
        _meta(Rotary), method="gpipe", stages=2, device="cpu", init_weights=_loader(reference)
    )
    x = torch.randn(5, 8)
    with torch.no_grad():
        want = x
        for u in reference:
            want = u(want)
        torch.testing.assert_close(_outputs(pipe, x), want, rtol=0, atol=0)


def test_item1_a_buffer_nothing_initialises_is_refused_with_its_name() -> None:
    with pytest.raises(RuntimeConfigError) as err:
        Pipeline(
            _meta(Plain),
            method="gpipe",
            stages=2,
            device="cpu",
            init_weights=_loader(_units(Plain)),
        )
    text = str(err.value)
    assert "unit 0 (Plain)" in text and "inv_freq" in text, text
    assert "non-persistent" in text and "reset_parameters" in text, text


def test_item1_a_parameter_init_weights_leaves_unwritten_is_refused() -> None:
    def partial(index: int, unit: nn.Module) -> None:
        for m in unit.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight)  # forgets the bias

    with pytest.raises(
        RuntimeConfigError, match=r"unit 0 \(Rotary\).*'proj.bias' is still uninitialised"
    ):
        Pipeline(_meta(Rotary), method="gpipe", stages=2, device="cpu", init_weights=partial)


def test_item1_an_init_weights_that_returns_a_new_module_is_refused() -> None:
    def replace(index: int, unit: nn.Module) -> nn.Module:
        return nn.Linear(8, 8) if isinstance(unit, nn.Linear) else unit

    with pytest.raises(RuntimeConfigError, match=r"init_weights returned a new Linear for unit 3"):
        Pipeline(_meta(Rotary), method="gpipe", stages=2, device="cpu", init_weights=replace)


def test_item1_returning_the_unit_itself_stays_legal() -> None:
    def fill(index: int, unit: nn.Module) -> nn.Module:
        def one(m: nn.Module) -> None:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.3)
                nn.init.zeros_(m.bias)

        return unit.apply(one)  # apply returns the unit: filled in place

    pipe = Pipeline(_meta(Rotary), method="gpipe", stages=2, device="cpu", init_weights=fill)
    assert torch.isfinite(_outputs(pipe, torch.randn(3, 8))).all()


# ------------------------------------------------------- item 2: data-dependent boundary shapes
class Trim(nn.Module):
    """Drops the trailing time steps that are padding (zero) in every sample of the batch: the
    boundary's shape depends on the data."""

    def forward(self, x: Tensor) -> Tensor:
        used = (x.abs().sum(dim=(0, 2)) > 0).nonzero()
        return x[:, : int(used.max()) + 1]


class Pool(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=1)


class Grow(nn.Module):
    """Hands on a tuple that gains a tensor when the batch's first value is positive."""

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, ...]:
        h = torch.tanh(x)
        return (h, h * 2, h * 3) if bool(x[0, 0] > 0) else (h, h * 2)


class Sum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6, 3)

    def forward(self, *parts: Tensor) -> Tensor:
        out: Tensor = self.head(sum(parts))  # type: ignore[arg-type]
        return out


def trimming_net() -> list[nn.Module]:
    torch.manual_seed(0)
    return [Trim(), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), Pool(), nn.Linear(8, 3)]


def dataset() -> Dataset:
    """Samples of 3 to 6 time steps, padded with zeros to 6."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(160, 6, 4, generator=g)
    lengths = torch.randint(3, 7, (160,), generator=g)
    x[torch.arange(6)[None, :] >= lengths[:, None]] = 0
    y = torch.randint(0, 3, (160,), generator=g)
    return Dataset("trim", x[:120], y[:120], x[120:], y[120:], 3)


def batches(steps: int) -> list[tuple[Tensor, Tensor]]:
    data = dataset()
    return [
        (data.train_x[i * 8 : i * 8 + 8], data.train_y[i * 8 : i * 8 + 8]) for i in range(steps)
    ]


SHAPE_REFUSAL = (
    r"stage 0, unit 2 \(Tanh\) hands the next stage a tensor of per-sample shape \(\d, 8\) "
    r"torch.float32 at micro-batch \d+, where the dry run gave \(\d, 8\) torch.float32"
)


def test_item2_a_boundary_whose_shape_changes_is_refused_locally() -> None:
    pipe = Pipeline(trimming_net(), method="1f1b", stages=2, micro_batches=2, device="cpu")
    assert pipe.parts.bounds == [(0, 3), (3, 6)]
    with pytest.raises(StageError, match=SHAPE_REFUSAL) as err:
        pipe.fit(batches(8), max_steps=8)
    assert "pad every batch to one length" in str(err.value)


def test_item2_evaluation_refuses_it_too() -> None:
    pipe = Pipeline(trimming_net(), method="1f1b", stages=2, micro_batches=2, device="cpu")
    with pytest.raises(StageError, match=r"stage 0, unit 2 \(Tanh\) hands the next stage"):
        pipe.evaluate(batches(8))


def test_item2_a_tuple_that_gains_a_tensor_is_refused() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    data = [
        (torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(4)
    ]
    data[0][0][0, 0] = -5.0  # the dry run (the first batch) sees two tensors
    data[1][0][0, 0] = 5.0  # the next batch's unit hands on three
    pipe = Pipeline([Grow(), Sum()], method="gpipe", stages=2, micro_batches=1, device="cpu")
    with pytest.raises(
        StageError,
        match=r"stage 0, unit 0 \(Grow\) hands the next stage a tuple of 3 tensors .* at "
        r"micro-batch 1, where the dry run gave a tuple of 2",
    ):
        pipe.fit(data, max_steps=4)


def config(**kw: object) -> TrainConfig:
    plan = Plan(
        "1f1b",
        2,
        micro_batches=2,
        optimizer=OptimizerSpec("adam", 0.01),
        model=f"{HERE}:trimming_net",
        batch_size=12,
    )
    return TrainConfig(plan, transport="dist", device="cpu", timeout=30, **kw)  # type: ignore[arg-type]


@pytest.mark.slow
def test_item2_under_dist_the_same_refusal_names_stage_unit_and_shapes() -> None:
    with pytest.raises(PipeoptimError, match=SHAPE_REFUSAL):
        train(config(max_steps=8))


# ------------------------------------------------------------- items 6 and 7: export outputs
def _trained(folder: Path) -> Pipeline:
    import tied_worker as tw  # here: the dist ranks import this file without tests/runtime

    pipe = tw.tied_pipeline("1f1b", checkpoint_dir=str(folder))
    pipe.fit(tw.batches(3), max_steps=3)
    return pipe


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, err


def test_item7_export_outputs_are_checked_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    _trained(ckpt)
    pointer = (ckpt / "latest.json").read_bytes()
    (tmp_path / "folder.pt").mkdir()
    (tmp_path / "file.pt").write_bytes(b"not a folder")
    cases = {
        str(tmp_path / "folder.pt"): "is a folder",
        str(tmp_path / "file.pt" / "model.pt"): "is a file, not a folder",
        str(ckpt / "latest.json"): "checkpoint",
        str(next(ckpt.glob("step-*/stage-0*"))): "checkpoint",
    }
    step_files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    before = {p: p.read_bytes() for p in step_files}
    for (out, why), fmt in itertools.product(cases.items(), ([], ["--format", "pt"])):
        code, err = _cli(capsys, "export", "--checkpoint-dir", str(ckpt), "--out", out, *fmt)
        assert code == 2, (out, err)
        assert err.count("\n") == 1 and why in err and out in err, err
    assert (ckpt / "latest.json").read_bytes() == pointer
    assert {p: p.read_bytes() for p in step_files} == before
    # the checkpoint still exports, and a file beside it is fine
    code, _ = _cli(capsys, "export", "--checkpoint-dir", str(ckpt), "--out", str(ckpt / "m.pt"))
    assert code == 0 and (ckpt / "m.pt").is_file()


def test_item7_the_live_export_protects_the_checkpoint_folder_too(tmp_path: Path) -> None:
    pipe = _trained(tmp_path / "ckpt")
    with pytest.raises(PipeoptimError, match="would overwrite the checkpoint's own"):
        pipe.export(tmp_path / "ckpt" / "latest.json", fmt="pt")
    with pytest.raises(PipeoptimError, match="is the checkpoint folder it reads"):
        pipe.export(tmp_path / "ckpt", fmt="hf")
    (tmp_path / "out.pt").mkdir()
    with pytest.raises(PipeoptimError, match="is a folder, and the pt format writes one file"):
        pipe.export(tmp_path / "out.pt")


def test_item6_an_hf_export_onto_an_existing_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before any work (the output is checked before the model's source)."""
    ckpt = tmp_path / "ckpt"
    pipe = _trained(ckpt)
    target = tmp_path / "model"
    target.write_bytes(b"")
    with pytest.raises(PipeoptimError, match=r"is a file.*hf format writes a folder"):
        pipe.export(target, fmt="hf")
    code, err = _cli(
        capsys, "export", "--checkpoint-dir", str(ckpt), "--out", str(target), "--format", "hf"
    )
    assert code == 2 and "hf format writes a folder" in err and err.count("\n") == 1
    assert target.read_bytes() == b""


# -------------------------------------------------- item 8: export under dist, data parallel
WORKER = ROOT / "tests" / "runtime" / "export_dp_worker.py"


@pytest.mark.slow
def test_item8_export_under_data_parallel_waits_for_the_checkpoint(tmp_path: Path) -> None:
    """2 stages x 2 replicas; the worker fits and exports three times (the race lost 5 runs in
    6): every export succeeds on every rank and writes the final weights."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "4",
            "--master-port",
            str(port),
            str(WORKER),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("ok-*")) == sorted(
        f"ok-{rank}-{r}" for rank in range(4) for r in range(3)
    )
