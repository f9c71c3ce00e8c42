"""``pipeoptim train``'s learning-rate flags (issue 33, item 12): a non-finite --lr and a
--warmup the schedule does not use are refused before any work (exit 2, one line, no
traceback), and the help states the defaults the run uses."""

from __future__ import annotations

import json
import re

import pytest

from pipeoptim.cli import build_parser, main
from pipeoptim.commands.train import build_config
from pipeoptim.errors import PlanError
from pipeoptim.plan.plan import OptimizerSpec


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lr", "inf"], "--lr must be a positive finite number (got inf)"),
        (["--lr=-inf"], "--lr must be a positive finite number (got -inf)"),
        (["--lr", "nan"], "--lr must be a positive finite number (got nan)"),
        (
            ["--warmup", "10"],
            "--warmup 10 sets the warm-up of --lr-schedule warmup-cosine, but the schedule is "
            "constant; add --lr-schedule warmup-cosine, or drop --warmup",
        ),
        (["--lr-schedule", "cosine", "--warmup", "5"], "but the schedule is cosine"),
    ],
)
def test_train_refuses_lr_flags_it_would_not_use(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main(["train", *flags, "--max-steps", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_an_optimizer_spec_refuses_a_non_finite_rate() -> None:
    with pytest.raises(PlanError, match=r"positive finite number \(got inf\)"):
        OptimizerSpec("adam", float("inf"))


def test_warmup_with_warmup_cosine_is_kept() -> None:
    args = build_parser().parse_args(["train", "--lr-schedule", "warmup-cosine", "--warmup", "3"])
    assert build_config(args).warmup == 3


def _help() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command" or a.choices)
    assert isinstance(sub.choices, dict)
    return " ".join(sub.choices["train"].format_help().split()).replace("- ", "-")


@pytest.mark.parametrize(
    ("model", "optimizer"),
    [
        ("mlp", None),
        ("mlp", "adam"),
        ("mlp", "basis-rotation"),
        ("gpt", None),
        ("gpt-deep", None),
        ("gpt", "sgd"),
    ],
)
def test_the_help_states_the_default_rate_the_run_uses(model: str, optimizer: str | None) -> None:
    flags = ["train", "--model", model] + (["--optimizer", optimizer] if optimizer else [])
    plan = build_config(build_parser().parse_args(flags)).plan
    text = _help()
    lr_help = re.search(r"--lr LR learning rate \(default ([^)]*)\)", text)
    assert lr_help is not None, text
    stated = lr_help.group(1)
    family, lr = plan.optimizer.family, plan.optimizer.lr
    if model.startswith("gpt") and optimizer is None:
        assert f"{lr:g} for {family} on gpt" in stated, stated
    elif family == "sgd":
        assert f"{lr:g} for sgd" in stated, stated
    elif family == "basis-rotation":
        assert f"{lr:g} for basis-rotation" in stated, stated
    else:
        assert f"else {lr:g}" in stated, stated
    # the epilog's word on the language model matches too
    gpt = re.search(r"AdamW, lr ([0-9.e-]+) unless given", text)
    assert gpt is not None and float(gpt.group(1)) == 5e-4


def test_compile_flag_trains_and_a_refused_combination_exits_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--compile BACKEND`` compiles the units (aot_eager: no C++ build); ``--compile``
    with ``--amp`` under a predicting method is refused in one line naming the flags."""
    code = main(["train", "--stages", "2", "--max-steps", "2", "--compile", "aot_eager", "--json"])
    out, _ = capsys.readouterr()
    assert code == 0, out
    assert len(json.loads(out)["losses"]) == 2
    code = main(["train", "--compile", "--amp", "bf16", "--max-steps", "2"])
    _, err = capsys.readouterr()
    assert code == 2
    assert err.strip().endswith(
        "--compile with --amp bf16 under pipeoptim: a predicted forward saves its casts of the "
        "predicted weights inside the compiled graph, where the stage cannot re-cast them from "
        "the live weights its backward is to read; drop --amp or --compile, or use a method "
        "that does not predict (pipedream, 2bw, 1f1b)"
    )
    assert "Traceback" not in err
