"""The torch-free table of optimizer families: the names the CLI and the Plan file take, in
their order, and the state sizes, rates and step costs the planner reads from it."""

from __future__ import annotations

import pytest

from pipeoptim.errors import PlanError
from pipeoptim.plan.optimizer_families import (
    ANY_TORCH_OPTIMIZER,
    FAMILIES,
    FAMILY_NAMES,
    find_family,
    optimizer_family,
)
from pipeoptim.plan.plan import OPTIMIZER_FAMILIES, OptimizerSpec
from pipeoptim.plan.profile import OPTIMIZER_STATE_FACTORS
from pipeoptim.study.grid import DEFAULT_RATES

NAMES = ("sgd", "adam", "adamw", "rmsprop", "nadam", "muon", "basis-rotation")


def test_the_names_and_their_order_are_the_command_lines() -> None:
    assert FAMILY_NAMES == NAMES
    assert OPTIMIZER_FAMILIES == NAMES
    assert all(FAMILIES[name].name == name for name in NAMES)


def test_each_family_holds_the_values_the_old_tables_held() -> None:
    default_lr = {name: 1e-3 for name in NAMES} | {"sgd": 0.02, "basis-rotation": 3e-3}
    state = {
        "sgd": (0, 1),
        "adam": (2, 2),
        "adamw": (2, 2),
        "rmsprop": (1, 2),
        "nadam": (2, 2),
        "muon": (1, 1),
        "basis-rotation": (6, 6),
    }
    momentum = dict.fromkeys(NAMES, True) | {"rmsprop": False}
    for name in NAMES:
        family = optimizer_family(name)
        assert family.default_lr == default_lr[name]
        assert family.state_copies == state[name]
        assert family.momentum_by_default is momentum[name]
        assert family.shaped_step is (name in ("muon", "basis-rotation"))
        assert family.state_from_shapes is (name == "basis-rotation")
        assert family.momentum_option is (name in ("sgd", "rmsprop"))
        assert family.decoupled_decay_option is (name == "nadam")
    assert state == OPTIMIZER_STATE_FACTORS


def test_the_study_sweeps_the_rates_and_families_it_swept() -> None:
    adam_like = (5e-4, 1e-3, 2e-3, 4e-3)
    assert {
        "sgd": (0.01, 0.02, 0.04, 0.08),
        "adam": adam_like,
        "adamw": adam_like,
        "nadam": adam_like,
        "muon": adam_like,
    } == DEFAULT_RATES
    assert list(DEFAULT_RATES) == ["sgd", "adam", "adamw", "nadam", "muon"]  # the study's order


def test_the_state_factor_follows_the_momentum_setting() -> None:
    sgd, rmsprop = optimizer_family("sgd"), optimizer_family("rmsprop")
    assert (sgd.state_factor(), sgd.state_factor(momentum=False)) == (1, 0)
    assert (rmsprop.state_factor(), rmsprop.state_factor(momentum=True)) == (1, 2)


def test_a_family_is_found_in_any_case_and_an_unknown_one_is_refused_with_the_names() -> None:
    assert find_family("AdamW") is FAMILIES["adamw"]
    assert find_family("adagrad") is None
    names = "sgd, adam, adamw, rmsprop, nadam, muon, basis-rotation"
    with pytest.raises(PlanError, match=rf"unknown optimizer family 'adagrad'; .*: {names}$"):
        optimizer_family("adagrad")
    with pytest.raises(PlanError, match=rf"unknown optimizer 'adagrad'; choose one of: {names}"):
        OptimizerSpec("adagrad")


def test_any_torch_optimizer_is_no_name_to_type_and_has_no_state_size_before_a_step() -> None:
    assert ANY_TORCH_OPTIMIZER.name not in FAMILIES
    assert ANY_TORCH_OPTIMIZER.default_lr == 1e-3  # what train takes for a family it lacks
    with pytest.raises(PlanError, match="not known before a step; profile the model"):
        ANY_TORCH_OPTIMIZER.state_factor()
