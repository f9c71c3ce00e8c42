"""``+qk-clip`` on a model with no attention anywhere can never clip: it is refused where
the whole model is known (the Pipeline's build, and ``pipeoptim train``'s up-front check
before any process starts), with the base method as the fix. A stage without attention
beside stages with it keeps training (nothing to clip there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.gpt import corpus, tiny_gpt
from torch import nn

from pipeoptim.cli import build_parser, main
from pipeoptim.commands.train import build_config
from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.runtime.optim.corrections.qk_clip import QKClip
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.workloads.gpt import lm_loss
from pipeoptim.workloads.train import check_run


def mlp() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)]


@pytest.mark.parametrize("base", ["pipeoptim", "pipedream"])
def test_a_model_without_attention_is_refused_with_the_base_method(base: str) -> None:
    with pytest.raises(RuntimeConfigError) as refused:
        Pipeline(mlp(), method=f"{base}+qk-clip", stages=2, loss_fn=F.cross_entropy)
    said = str(refused.value)
    assert said.startswith(f"{base}+qk-clip clips the attention logits (qk-clip)"), said
    assert "none of the model's 5 units holds one" in said
    assert f"so it would train as {base}; train with {base} instead" in said
    Pipeline(mlp(), method=base, stages=2, loss_fn=F.cross_entropy)  # the fix builds


def test_a_stage_without_attention_beside_attention_still_trains_and_clips() -> None:
    pipe = Pipeline(
        tiny_gpt(),
        method="pipeoptim+qk-clip",
        stages=4,
        optimizer=OptimizerSpec("adamw", 3e-3),
        loss_fn=lm_loss,
    )
    units = {}
    for k, stage in pipe.stages.items():
        assert stage.updater is not None
        clip = stage.updater.correction
        assert isinstance(clip, QKClip)
        units[k] = len(clip.units)
    assert 0 in units.values() and sum(units.values()) > 0, units  # the last stages: none
    result = pipe.fit(corpus(3), max_steps=3)
    assert len(result.losses) == 3 and all(torch.isfinite(torch.tensor(result.losses)))


def test_train_refuses_it_before_training(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", "--method", "pipeoptim+qk-clip", "--max-steps", "1", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    (line,) = err.strip().splitlines()
    assert line.startswith("pipeoptim train: error: pipeoptim+qk-clip clips the attention")
    assert "train with pipeoptim instead" in line
    # under dist, the launcher's check refuses it once, before any process starts
    args = build_parser().parse_args(
        ["train", "--method", "pipedream+qk-clip", "--transport", "dist", "--stages", "2"]
    )
    with pytest.raises(RuntimeConfigError, match="train with pipedream instead"):
        check_run(build_config(args))
    args = build_parser().parse_args(
        ["train", "--method", "pipeoptim+qk-clip", "--model", "gpt", "--stages", "2"]
    )
    check_run(build_config(args))  # attention there: nothing refused
