"""pipeoptim train --resume onto another --stages: the run continues as if cut so from the start;
a model whose units differ from the checkpoint's is refused in one line, exit 2, the checkpoint
untouched."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

from pipeoptim.cli import main
from pipeoptim.plan.plan import OptimizerSpec, Plan


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["train", "--quiet", *args])
    out, err = capsys.readouterr()
    return code, out, err


def losses(args: list[str], capsys: pytest.CaptureFixture[str]) -> list[float]:
    code, out, err = run_cli([*args, "--json"], capsys)
    assert code == 0, err
    found: list[float] = json.loads(out)["losses"]
    return found


@pytest.mark.parametrize(
    ("optimizer", "fmt"),
    [
        ("sgd", "torch-save"),
        ("muon", "torch-save"),
        ("basis-rotation", "torch-save"),
        ("muon", "dcp"),
    ],
)
def test_a_resume_onto_other_stages_continues_the_run_cut_so_from_the_start(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, optimizer: str, fmt: str
) -> None:
    """gpipe (synchronous), the same micro-batches: bit for bit. Muon's two parameter groups
    and basis rotation's per-parameter bases travel by parameter name, in either format."""
    common = ["--method", "gpipe", "--micro-batches", "4", "--optimizer", optimizer]
    ckpt = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"]
    ckpt += ["--checkpoint-format", fmt]
    whole = losses([*common, "--stages", "2", "--max-steps", "6"], capsys)
    first = losses([*common, *ckpt, "--stages", "4", "--max-steps", "4"], capsys)
    rest = losses([*common, *ckpt, "--stages", "2", "--max-steps", "6", "--resume"], capsys)
    assert first + rest == whole


def test_a_resume_onto_a_plan_with_another_partition(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """4 stages split evenly, then a plan's 3 stages of its own boundaries (--plan)."""
    plan = Plan("gpipe", 3, optimizer=OptimizerSpec("adam", 0.01), model="mlp", batch_size=32)
    plan.micro_batches = 4
    plan.boundaries = [(0, 2), (2, 7), (7, 9)]
    plan.save(tmp_path / "p.json")
    from_plan = ["--plan", str(tmp_path / "p.json")]
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"]
    whole = losses([*from_plan, "--max-steps", "6"], capsys)
    common = ["--method", "gpipe", "--micro-batches", "4", "--optimizer", "adam"]
    common += ["--lr", "0.01", "--batch-size", "32", "--stages", "4"]
    first = losses([*common, *ckpt, "--max-steps", "4"], capsys)
    rest = losses([*from_plan, *ckpt, "--max-steps", "6", "--resume"], capsys)
    assert first + rest == whole


def user_model(path: Path, widths: list[int]) -> None:
    layers = ", ".join(f"nn.Linear({a}, {b}), nn.Tanh()" for a, b in itertools.pairwise(widths))
    path.write_text(
        "import torch\nfrom torch import nn\n\n"
        f"def make():\n    return [{layers}]\n"
        "def dataset():\n    g = torch.Generator().manual_seed(0)\n"
        "    x = torch.randn(64, 5, generator=g)\n    y = (x[:, 0] > 0).long()\n"
        "    return x, y, x, y\n"
    )


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("widths", "message"),
    [
        (
            [5, 8, 9, 2],
            "stage 0: the checkpoint's units do not fit this model's (other shapes: 2.weight "
            "saved [8, 8], here [9, 8], 2.bias saved [8], here [9])",
        ),
        ([5, 8, 8, 8, 2], "; not in the checkpoint: 6.weight, 6.bias)"),
        ([5, 8], "the checkpoint holds units 2..5, which this model of 2 units does not have"),
    ],
    ids=["shape", "extra-unit", "missing-units"],
)
def test_a_resume_onto_units_that_differ_is_one_line_exit_2_nothing_lost(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    widths: list[int],
    message: str,
) -> None:
    source, ckpt = tmp_path / "net.py", tmp_path / "ckpt"
    user_model(source, [5, 8, 8, 2])
    base = ["--model", f"{source}:make", "--method", "gpipe", "--micro-batches", "2"]
    base += ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]
    assert run_cli([*base, "--stages", "3", "--max-steps", "2"], capsys)[0] == 0
    before = snapshot(ckpt)
    user_model(source, widths)  # the same file, edited: the model's units changed
    monkeypatch.delitem(sys.modules, "pipeoptim_user_model_net", raising=False)
    stages = "1" if len(widths) == 2 else "2"
    code, _, err = run_cli([*base, "--stages", stages, "--max-steps", "4", "--resume"], capsys)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "nothing was loaded" in lines[0], err
    assert snapshot(ckpt) == before
