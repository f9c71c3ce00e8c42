"""One builder of a stage's update rule: optimizer, update, correction and predictor
together, and whether the rule reads the stage's delay."""

from __future__ import annotations

import torch
from torch import nn

from pipeoptim.errors import (
    NonFiniteLossError,
    PeerLostError,
    RankFailedError,
    RuntimeConfigError,
    TrainingFailedError,
)
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.runtime.optim.builder import StageRule, build_stage_rule, reads_delays
from pipeoptim.runtime.optim.corrections.delay_momentum import DelayMomentum
from pipeoptim.runtime.optim.corrections.protocol import StageContext
from pipeoptim.runtime.optim.predict import WeightPredictor

SPEC = OptimizerSpec("adamw", 1e-3)


def rule(method: str, params: list[torch.Tensor], delay: int = 2) -> StageRule:
    context = StageContext(1, 4, method, delay, 1)
    return build_stage_rule(
        params,
        context=context,
        method=get_method(method),
        optimizer=SPEC,
        scheduler=None,
        scaler=None,
        grad_clip=None,
        note=lambda text: None,
    )


def test_a_predicting_method_gets_all_four_parts_over_one_optimizer() -> None:
    params = list(nn.Linear(3, 2).parameters())
    built = rule("pipeoptim", params)
    assert isinstance(built.optimizer, torch.optim.AdamW)
    assert built.update is not None and built.update.optimizer is built.optimizer
    assert isinstance(built.predictor, WeightPredictor)
    assert built.correction is None
    assert rule("pipedream", params).predictor is None


def test_a_method_naming_a_correction_gets_it_built_on_its_optimizer() -> None:
    params = list(nn.Linear(3, 2).parameters())
    built = rule("pipeoptim+nesterov", params, delay=2)
    assert isinstance(built.correction, DelayMomentum)
    assert built.optimizer is not None
    beta1 = built.optimizer.param_groups[0]["betas"][0]
    assert beta1 == 0.9 + 2 * (0.99 - 0.9) / 4  # set from the context's delay and P


def test_a_stage_without_trainable_weights_has_nothing_to_update() -> None:
    built = rule("pipeoptim", [])
    assert (built.optimizer, built.update, built.predictor, built.correction) == (None,) * 4


def test_the_delay_is_read_only_where_a_correction_or_a_factory_asks_for_it() -> None:
    assert not reads_delays(get_method("pipeoptim"), SPEC)
    assert reads_delays(get_method("pipeoptim+nesterov"), SPEC)
    assert not reads_delays(get_method("pipeoptim"), lambda params: torch.optim.SGD(params, 0.1))
    assert reads_delays(get_method("pipeoptim"), lambda params, stage: torch.optim.SGD(params, 0.1))


def test_a_failed_run_is_not_a_configuration_error() -> None:
    for error in (
        NonFiniteLossError("nan", 3),
        RankFailedError("rank 1 failed", 1),
        PeerLostError("lost rank 2", 2),
    ):
        assert isinstance(error, TrainingFailedError)
        assert not isinstance(error, RuntimeConfigError)
