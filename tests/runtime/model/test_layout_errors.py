""" "Too few layers" (issue 33, item 11): the error names the model as it is known (a Pipeline
of the user's layers has no model name), counts the stages of a method with several stages
per rank, names the library's argument (the command line's flag from ``pipeoptim train``),
and the stage count it suggests is accepted."""

from __future__ import annotations

import re

import pytest
import torch.nn.functional as F
from torch import nn

from pipeoptim.cli import main
from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.pipeline import Pipeline


def _pipeline(method: str, stages: int, layers: int) -> Pipeline:
    return Pipeline(
        nn.Sequential(*(nn.Linear(2, 2) for _ in range(layers))),
        method=method,
        stages=stages,
        loss_fn=F.mse_loss,
        progress=False,
    )


@pytest.mark.parametrize(
    ("method", "stages", "layers"),
    [("zb-v", 4, 6), ("interleaved-1f1b", 2, 3), ("zb-v", 3, 2), ("gpipe", 4, 3)],
)
def test_the_suggested_stage_count_is_accepted(method: str, stages: int, layers: int) -> None:
    with pytest.raises(RuntimeConfigError) as refused:
        _pipeline(method, stages, layers)
    text = str(refused.value)
    assert "the model" in text and "'the model'" not in text
    assert "--stages" not in text  # the library's argument, not the command line's flag
    match = re.search(r"use stages=(\d+) or fewer", text)
    assert match is not None, text
    suggested = int(match.group(1))
    assert suggested < stages
    pipe = _pipeline(method, suggested, layers)  # the suggestion is accepted
    assert len(pipe.stages) >= suggested


def test_the_error_counts_the_stages_per_rank() -> None:
    with pytest.raises(RuntimeConfigError, match=r"zb-v's 8 stages \(2 per rank on 4 ranks"):
        _pipeline("zb-v", 4, 6)


def test_a_model_with_fewer_layers_than_stages_per_rank_is_told_to_use_another_method() -> None:
    with pytest.raises(RuntimeConfigError, match=r"one stage per rank"):
        _pipeline("zb-v", 1, 1)


def test_the_command_line_names_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """pipeoptim train with the digits MLP: the suggestion is a --stages that trains."""
    assert main(["train", "--method", "zb-v", "--stages", "16", "--max-steps", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "model 'mlp'" in err and "Traceback" not in err, err
    match = re.search(r"use --stages (\d+) or fewer", err)
    assert match is not None, err
    flags = ["train", "--method", "zb-v", "--stages", match.group(1), "--max-steps", "1"]
    assert main([*flags, "--quiet"]) == 0
