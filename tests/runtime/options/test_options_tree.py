"""The options tree: its defaults are the Pipeline's keyword defaults, keywords and a tree
build the same run, every check names the option, the value and a fix, and ``pipeoptim
train`` and a Plan file build the same tree."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from pipeoptim.cli import build_parser
from pipeoptim.commands.train import build_config
from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.runtime.options import (
    GROUPS,
    CheckpointOptions,
    CommOptions,
    MemoryOptions,
    ObserveOptions,
    OptimizerOptions,
    PipelineConfig,
    PrecisionOptions,
    ScheduleOptions,
    keyword_homes,
)
from pipeoptim.runtime.pipeline import Pipeline

KEYWORD_DEFAULTS: dict[str, Any] = {
    "plan": None,
    "seed": 0,
    "method": None,
    "stages": None,
    "optimizer": None,
    "scheduler": None,
    "loss_fn": None,
    "micro_batches": None,
    "virtual_stages": None,
    "prediction_offset": None,
    "transport": "local",
    "device": "auto",
    "amp": None,
    "grad_clip": None,
    "clip_scope": None,
    "extrapolation": None,
    "checkpoint_dir": None,
    "checkpoint_every": None,
    "timeout": 300.0,
    "progress": False,
    "log_every": 50,
    "memory_every": 4,
    "keep_checkpoints": 2,
    "checkpoint_format": "torch-save",
    "targets": "send",
    "one_tag": False,
    "varying_shapes": False,
    "store": None,
    "run_identity": None,
    "hyperparameters": None,
    "predicted_backward": False,
    "data_parallel": None,
    "init_weights": None,
    "recompute": None,
    "shard_optimizer": None,
    "loggers": None,
    "callbacks": None,
    "tune_allocator": True,
    "forwards_first": False,
    "compile": False,
}
"""Pipeline's keywords and their defaults before the tree (its signature then)."""


def layers() -> list[nn.Module]:
    return [nn.Linear(4, 4) for _ in range(4)]


def test_the_trees_defaults_are_the_pipelines_keyword_defaults() -> None:
    assert PipelineConfig().keywords() == KEYWORD_DEFAULTS
    assert set(keyword_homes()) == set(KEYWORD_DEFAULTS)
    # each option lives in one group, under its keyword's name
    names = [f.name for kind in GROUPS.values() for f in fields(kind)]
    assert len(names) == len(set(names)) == len(KEYWORD_DEFAULTS) - 2  # plan, seed: the root


def test_keywords_and_a_tree_build_the_same_pipeline() -> None:
    stack = layers()
    by_keywords = Pipeline(
        stack,
        "xpipe",
        stages=2,
        micro_batches=2,
        prediction_offset=1,
        predicted_backward=True,
        grad_clip=1.0,
        seed=7,
        log_every=5,
        memory_every=2,
        recompute="full",
        tune_allocator=False,
        forwards_first=True,
    )
    tree = PipelineConfig(
        seed=7,
        schedule=ScheduleOptions(
            method="xpipe",
            stages=2,
            micro_batches=2,
            prediction_offset=1,
            predicted_backward=True,
            forwards_first=True,
        ),
        optim=OptimizerOptions(grad_clip=1.0),
        memory=MemoryOptions(recompute="full", tune_allocator=False),
        observe=ObserveOptions(log_every=5, memory_every=2),
    )
    by_tree = Pipeline(stack, options=tree)
    assert by_keywords.config == by_tree.config == tree
    assert by_keywords.parts.options == by_tree.parts.options
    assert by_keywords.options == by_tree.options
    assert by_keywords.plan == by_tree.plan
    assert by_tree.parts.options.stage.predicted_backward
    assert by_tree.options.forwards_first and by_tree.options.log_every == 5
    # keywords given with a tree replace its options
    mixed = Pipeline(stack, options=tree, seed=3)
    assert mixed.config.seed == 3 and mixed.config.schedule == tree.schedule


def test_an_unknown_keyword_or_a_wrong_tree_is_refused() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'stage'.*stages"):
        Pipeline(layers(), stage=2)
    with pytest.raises(RuntimeConfigError, match=r"options must be a PipelineConfig.*dict"):
        Pipeline(layers(), options={"stages": 2})  # type: ignore[arg-type]
    with pytest.raises(RuntimeConfigError, match=r"PipelineConfig.comm must be a CommOptions"):
        PipelineConfig(comm=PrecisionOptions())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("keyword", "value", "fix"),
    [
        ("optimizer", 3, "e.g. lambda params"),
        ("scheduler", 3, "e.g. lambda opt"),
        ("grad_clip", -1.0, "e.g. grad_clip=1.0"),
        ("loss_fn", 3, "(output, target) -> scalar"),
        ("init_weights", 3, "(index, unit) -> None"),
        ("amp", "fp8", "use None, 'bf16' or 'fp16'"),
        ("transport", "carrier-pigeon", "local"),
        ("device", 0, "'auto', 'cpu', 'cuda' or 'cuda:N'"),
        ("timeout", 0, "e.g. timeout=300"),
        ("targets", "mail", "use 'send' or 'read'"),
        ("seed", -1, "0.."),
        ("log_every", 0, "e.g. log_every=50"),
        ("memory_every", 0, "e.g. memory_every=4"),
        ("keep_checkpoints", 0, "e.g. keep_checkpoints=2"),
        ("checkpoint_dir", 3, "e.g. checkpoint_dir='ckpt'"),
        ("checkpoint_every", 5, "needs checkpoint_dir"),
        ("run_identity", [], "a dict or None"),
        ("hyperparameters", [], "a dict or None"),
        ("predicted_backward", "yes", "True or False"),
        ("forwards_first", 1, "True or False"),
        ("tune_allocator", None, "True or False"),
        ("loggers", "tensorboard", "e.g. loggers=["),
        ("callbacks", [object()], "override the hooks you need"),
        ("plan", "plan.json", "Plan.load('plan.json')"),
    ],
)
def test_each_check_names_the_option_the_value_and_the_fix(
    keyword: str, value: object, fix: str
) -> None:
    with pytest.raises(RuntimeConfigError) as raised:
        PipelineConfig().with_keywords(**{keyword: value})
    message = str(raised.value)
    assert keyword in message or keyword.replace("_", " ") in message, message
    assert fix in message, message
    if keyword not in ("checkpoint_every", "callbacks"):  # those name the object's type
        assert repr(value) in message or type(value).__name__ in message, message


def test_the_checks_that_need_the_plan_name_the_option_and_the_fix() -> None:
    with pytest.raises(RuntimeConfigError, match=r"predicted_backward.*gpipe does not predict"):
        Pipeline(layers(), "gpipe", stages=2, predicted_backward=True)
    with pytest.raises(RuntimeConfigError, match=r"forwards_first.*transport='dist'.*leave"):
        PipelineConfig(
            schedule=ScheduleOptions(forwards_first=True), comm=CommOptions(transport="dist")
        )
    with pytest.raises(RuntimeConfigError, match=r"data_parallel 2.*transport='dist'"):
        Pipeline(layers(), "gpipe", stages=2, data_parallel=2)


def train_tree(*flags: str) -> PipelineConfig:
    return build_config(build_parser().parse_args(["train", *flags])).options()


def test_pipeoptim_train_and_a_plan_file_build_the_same_tree(tmp_path: Path) -> None:
    plan = Plan(
        "xpipe",
        2,
        micro_batches=4,
        optimizer=OptimizerSpec("adamw", 0.001),
        model="mlp",
        batch_size=32,
        recompute=["full", "none"],
    )
    path = tmp_path / "plan.json"
    plan.save(path)
    settings = ["--seed", "3", "--amp", "bf16", "--grad-clip", "1.0", "--timeout", "60"]
    from_file = train_tree("--plan", str(path), *settings)
    from_flags = train_tree(
        "--method", "xpipe", "--stages", "2", "--micro-batches", "4",
        "--optimizer", "adamw", "--lr", "0.001", "--model", "mlp", "--batch-size", "32",
        "--recompute", "stages:0", *settings,
    )  # fmt: skip
    expected = PipelineConfig.from_plan(
        plan,
        seed=3,
        amp="bf16",
        grad_clip=1.0,
        timeout=60.0,
    )
    assert from_file == expected
    assert from_file.plan == plan
    # the flags say the same run; their recompute is a flag over the plan's (None)
    assert from_flags.plan is not None and from_flags.plan.recompute is None
    assert from_flags.memory.recompute is not None
    assert from_flags.with_keywords(recompute=None) == PipelineConfig.from_plan(
        Plan(**{**vars(plan), "recompute": None}),
        seed=3,
        amp="bf16",
        grad_clip=1.0,
        timeout=60.0,
    )
    assert from_file.checkpoint == CheckpointOptions() and from_file.comm.timeout == 60.0
