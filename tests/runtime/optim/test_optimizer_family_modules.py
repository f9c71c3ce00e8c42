"""The torch-side optimizer families: each builds its optimizer on a tiny model with its own
options, predicts with the rule the old class table gave, and agrees with the torch-free table
on every field the two share."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim import SGD, Adagrad, Adam, AdamW, Muon, NAdam, Optimizer, RMSprop

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.optimizer_families import ANY_TORCH_OPTIMIZER, FAMILIES
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.runtime.optim.basis_rotation import BasisRotation
from pipeoptim.runtime.optim.families import ANY_TORCH, TORCH_FAMILIES, own_predictor, torch_family
from pipeoptim.runtime.optim.optimizers import MuonWithAdamW
from pipeoptim.runtime.optim.predict import (
    AdamPredictor,
    BasisRotationPredictor,
    DisplacementPredictor,
    MuonPredictor,
    MuonWithAdamWPredictor,
    NAdamPredictor,
    RMSpropPredictor,
    SGDPredictor,
    WeightPredictor,
    predictor_for,
)
from pipeoptim.runtime.optim.sharded import SHARDABLE
from pipeoptim.runtime.optim.update import FAMILY_OF_CLASS, OPTIMIZERS, make_optimizer
from pipeoptim.runtime.profiling.layer_timing import SHAPED_STEPS

# What the tables held before the families became modules (update.OPTIMIZERS, predict._FAMILY).
OLD_CLASSES: dict[str, type[Optimizer]] = {
    "sgd": SGD,
    "adam": Adam,
    "adamw": AdamW,
    "rmsprop": RMSprop,
    "nadam": NAdam,
    "muon": MuonWithAdamW,
    "basis-rotation": BasisRotation,
}
OLD_PREDICTORS: dict[type[Optimizer], type[WeightPredictor]] = {
    SGD: SGDPredictor,
    Adam: AdamPredictor,
    AdamW: AdamPredictor,
    NAdam: NAdamPredictor,
    RMSprop: RMSpropPredictor,
    Muon: MuonPredictor,
    MuonWithAdamW: MuonWithAdamWPredictor,
    BasisRotation: BasisRotationPredictor,
}


def tiny_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def one_step(model: nn.Sequential, opt: Optimizer) -> None:
    model(torch.randn(5, 4)).pow(2).mean().backward()
    opt.step()


@pytest.mark.parametrize("name", list(OLD_CLASSES))
def test_each_family_builds_its_optimizer_and_predicts_by_the_old_rule(name: str) -> None:
    family = torch_family(name)
    model = tiny_model()
    opt = make_optimizer(OptimizerSpec(name, family.default_lr), model.parameters())
    assert type(opt) is OLD_CLASSES[name] is family.optimizer_class
    assert all(g["lr"] == family.default_lr for g in opt.param_groups)
    predictor = predictor_for(opt)
    assert type(predictor) is OLD_PREDICTORS[type(opt)] is family.predictor
    one_step(model, opt)
    predicted = predictor.predicted(2)
    moved = [not torch.equal(w, p) for w, p in zip(predicted, model.parameters(), strict=True)]
    assert any(moved)  # after a step every rule predicts a move
    predictor.close()


def test_the_family_options_and_the_plans_options_meet_as_before() -> None:
    params = tiny_model().parameters()
    sgd = make_optimizer(OptimizerSpec("sgd", 0.1), params)
    assert sgd.defaults["momentum"] == 0.9  # the family's default
    plain = make_optimizer(OptimizerSpec("sgd", 0.1, {"momentum": 0.0}), tiny_model().parameters())
    assert plain.defaults["momentum"] == 0.0  # the plan's wins
    with pytest.raises(RuntimeConfigError, match=r"cannot build Adam with lr=0.1 and options"):
        make_optimizer(OptimizerSpec("adam", 0.1, {"momentum": 0.9}), tiny_model().parameters())


def test_the_registry_tables_are_the_old_ones() -> None:
    assert OPTIMIZERS == OLD_CLASSES
    assert {cls.__name__: name for name, cls in OLD_CLASSES.items()} == FAMILY_OF_CLASS
    assert {"muon", "basis-rotation"} == SHAPED_STEPS
    assert {MuonWithAdamW, BasisRotation, SGD, Adam, AdamW, NAdam, RMSprop} <= SHARDABLE
    for cls, predictor in OLD_PREDICTORS.items():
        assert own_predictor(cls) is predictor

    class MySGD(SGD):  # a subclass may change the rule: only displacement is exact
        pass

    assert own_predictor(MySGD) is own_predictor(Adagrad) is DisplacementPredictor
    assert MySGD not in SHARDABLE


def test_the_torch_side_and_the_torch_free_table_list_the_same_families_and_agree() -> None:
    assert list(TORCH_FAMILIES) == list(FAMILIES)
    for name, family in TORCH_FAMILIES.items():
        table = FAMILIES[name]
        assert family.table is table
        assert family.name == table.name == name
        assert family.default_lr == table.default_lr
        assert family.shaped_step is table.shaped_step
        assert family.state_from_shapes is table.state_from_shapes
        assert (family.shaped_state_bytes is not None) is table.state_from_shapes
        assert family.state_factor() == table.state_factor()
        momentum = float(family.default_options.get("momentum", 0.0))
        if table.momentum_option:  # the usual setting is the one the family builds
            assert (momentum > 0) is table.momentum_by_default
    assert ANY_TORCH.table is ANY_TORCH_OPTIMIZER and ANY_TORCH.name not in TORCH_FAMILIES


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "rmsprop", "nadam"])
def test_the_state_size_is_what_the_torch_optimizer_keeps(name: str) -> None:
    """The element-wise families' ``state_copies`` count the parameter-sized tensors their
    torch optimizer keeps after a step (Muon's and basis rotation's are no fixed multiple)."""
    model = tiny_model()
    opt = make_optimizer(OptimizerSpec(name, 1e-3), model.parameters())
    one_step(model, opt)
    for p in model.parameters():
        sized = [v for v in opt.state[p].values() if torch.is_tensor(v) and v.shape == p.shape]
        assert len(sized) == torch_family(name).state_factor()


def test_an_unknown_family_is_refused_with_the_names() -> None:
    names = "sgd, adam, adamw, rmsprop, nadam, muon, basis-rotation"
    with pytest.raises(RuntimeConfigError, match=rf"unknown optimizer 'adagrad'; .*: {names}$"):
        torch_family("adagrad")
    spec = OptimizerSpec("sgd", 0.1)
    spec.family = "adagrad"  # past the plan's own check
    with pytest.raises(RuntimeConfigError, match=rf"choose one of: {names}"):
        make_optimizer(spec, tiny_model().parameters())
    with pytest.raises(TypeError, match="builds no optimizer of its own: pass an optimizer"):
        ANY_TORCH.build(tiny_model().parameters(), 1e-3, {})


@pytest.mark.parametrize(("family", "cls"), [("adam", Adam), ("adamw", AdamW), ("nadam", NAdam)])
def test_beta1_and_beta2_set_the_betas_pair_one_at_a_time(
    family: str, cls: type[Optimizer]
) -> None:
    """AsyncPP's NAdam (β1 = 0.99) from a plan, whose options are numbers: each given beta
    replaces its half of the constructor's default pair, and the predictor reads it."""
    params = list(nn.Linear(3, 2).parameters())
    default = make_optimizer(OptimizerSpec(family, 1e-3), params).param_groups[0]["betas"]
    first = make_optimizer(OptimizerSpec(family, 1e-3, {"beta1": 0.99}), params)
    assert isinstance(first, cls) and first.param_groups[0]["betas"] == (0.99, default[1])
    second = make_optimizer(OptimizerSpec(family, 1e-3, {"beta2": 0.95}), params)
    assert second.param_groups[0]["betas"] == (default[0], 0.95)
    both = make_optimizer(OptimizerSpec(family, 1e-3, {"beta1": 0.5, "beta2": 0.6}), params)
    assert both.param_groups[0]["betas"] == (0.5, 0.6)


def test_a_beta_on_an_optimizer_without_betas_is_refused_with_the_fix() -> None:
    params = list(nn.Linear(3, 2).parameters())
    with pytest.raises(RuntimeConfigError, match=r"SGD takes no betas pair.*drop them"):
        make_optimizer(OptimizerSpec("sgd", 1e-3, {"beta1": 0.99}), params)
