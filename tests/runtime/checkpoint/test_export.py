"""One checkpoint out: ``Pipeline.export`` and ``pipeoptim export`` write the trained model as
one state dict in the model's own names, which the user's model loads strictly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import tied_worker as tw
from torch import Tensor, nn

from pipeoptim import Pipeline
from pipeoptim.cli import main
from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.checkpoint.export import export_checkpoint
from pipeoptim.runtime.model.units import ModelUnits


class TinyLM(nn.Module):
    """The user's own model, with its own names; the pipeline gets its parts as units."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        table = nn.Embedding(tw.VOCAB, tw.DIM)
        self.embed = tw.Embed(table)
        self.body = nn.ModuleList([tw.Mix(), tw.Mix()])
        self.head = tw.TiedHead(table)

    def units(self) -> list[nn.Module]:
        return [self.embed, *self.body, self.head]

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids)
        for block in self.body:
            h = block(h)
        out: Tensor = self.head(h)
        return out


def train(units: list[nn.Module] | ModelUnits, folder: Path | None = None) -> Pipeline:
    pipe = tw.tied_pipeline("1f1b", units=units, checkpoint_dir=str(folder) if folder else None)
    pipe.fit(tw.batches(3), max_steps=3)
    return pipe


def test_plain_units_export_as_an_nn_sequential_of_them(tmp_path: Path) -> None:
    pipe = train(tw.tied_units())
    path = pipe.export(tmp_path / "model.pt")
    state = torch.load(path, weights_only=True)
    model = nn.Sequential(*tw.tied_units(seed=1))
    model.load_state_dict(state, strict=True)
    assert torch.equal(state["0.table.weight"], state["3.weight"])  # the tie, under both names
    assert torch.equal(state["1.proj.weight"], pipe.stages[0].module.get_parameter("1.proj.weight"))


def test_the_cli_exports_a_checkpoint_in_the_models_own_names(tmp_path: Path) -> None:
    model = TinyLM()
    pipe = train(ModelUnits.from_model(model, model.units()), tmp_path / "ckpt")
    out = tmp_path / "model.safetensors"
    assert main(["export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    from safetensors.torch import load_file

    state = load_file(str(out))
    assert set(state) == set(TinyLM().state_dict())
    fresh = TinyLM()
    fresh.load_state_dict(state, strict=True)
    ids = tw.batches(1)[0][0]
    live = pipe.stages[1].module(pipe.stages[0].module(ids))
    torch.testing.assert_close(fresh(ids), live, rtol=0, atol=0)
    # the same run exported from the live stages
    direct = torch.load(pipe.export(tmp_path / "direct.pt"), weights_only=True)
    assert all(torch.equal(direct[k], state[k]) for k in state)


def test_a_pipeoptim_train_checkpoint_of_an_even_split_exports(tmp_path: Path) -> None:
    """`pipeoptim train` names no boundaries for an even split (its run identity holds the
    plan's, None): the checkpoint records the units each stage held, and export reads them."""
    from pipeoptim.workloads.loader import build_model

    ckpt, out = tmp_path / "ckpt", tmp_path / "mlp.pt"
    argv = ["train", "--max-steps", "3", "--quiet", "--checkpoint-dir", str(ckpt)]
    assert main(argv) == 0
    assert main(["export", "--checkpoint-dir", str(ckpt), "--out", str(out)]) == 0
    layers, _ = build_model("mlp", 0)
    model = nn.Sequential(*layers)
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    stage = torch.load(ckpt / "step-00000003" / "stage-0.pt", weights_only=True)
    first = stage["state"]["module"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in first.items())


def test_export_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(RuntimeConfigError, match="no checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "m.pt")
    pipe = train(tw.tied_units(), tmp_path / "ckpt")
    with pytest.raises(RuntimeConfigError, match=r"\*\.pt or \*\.safetensors"):
        pipe.export(tmp_path / "model.bin2")
    with pytest.raises(RuntimeConfigError, match="no checkpoint of step 99"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "m.pt", step=99)
    with pytest.raises(RuntimeConfigError, match=r"cut with pipeoptim\.hf\.cut_causal_lm"):
        pipe.export(tmp_path / "folder", fmt="hf")
    assert main(["export", "--checkpoint-dir", str(tmp_path / "none"), "--out", "x.pt"]) == 2


@pytest.mark.parametrize(
    "record",
    [
        '{"step": 3, "config": {"boundaries": [[0, 2], [2, 4]]}}',
        '{"step": 3, "num_stages": 2}',
        "[1]",
    ],
)
def test_a_damaged_pointer_is_named_not_a_traceback(tmp_path: Path, record: str) -> None:
    train(tw.tied_units(), tmp_path / "ckpt")
    (tmp_path / "ckpt" / "latest.json").write_text(record)
    with pytest.raises(RuntimeConfigError, match=r"latest\.json is damaged"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "m.pt")


def test_model_units_refuse_name_maps_that_do_not_cover_the_units() -> None:
    units = tw.tied_units()
    good = ModelUnits.from_model(nn.Sequential(*units), units).names
    assert good is not None
    with pytest.raises(RuntimeConfigError, match="names 2"):
        ModelUnits(units, good[:2])
    with pytest.raises(RuntimeConfigError, match="names str"):
        ModelUnits(units, "abcd")  # type: ignore[arg-type]
    as_strings = [{k: v[0] for k, v in names.items()} for names in good]
    with pytest.raises(RuntimeConfigError, match=r"unit 0 \(Embed\) must map"):
        ModelUnits(units, as_strings)  # type: ignore[arg-type]
    with pytest.raises(RuntimeConfigError, match=r"missing \['proj.bias'\]"):
        ModelUnits(units, [good[0], {"proj.weight": ["w"]}, good[2], good[3]])
