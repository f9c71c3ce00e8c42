"""A stage's update rule, built in one call: its optimizer, the update around the optimizer's
step, the delay correction its method names and the predictor that reads its optimizer.

Why one builder: the four depend on each other in one order (the correction and the
predictor act on the optimizer, the update carries the correction), and whether the stage's
delay τ_k is needed at all depends on what the user's factory takes and what the method
names. The stage and the assembly ask here, so that logic is written once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from pipeoptim.plan.methods import Method
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.runtime.optim.corrections.protocol import DelayCorrection, StageContext
from pipeoptim.runtime.optim.corrections.registry import build_correction
from pipeoptim.runtime.optim.predict import WeightPredictor, predictor_for
from pipeoptim.runtime.optim.sharded import local_optimizer, shard_optimizer, shard_predictor
from pipeoptim.runtime.optim.update import (
    OptimizerFactory,
    SchedulerFactory,
    StageUpdate,
    build_optimizer,
    takes_context,
)

__all__ = ["StageRule", "build_stage_rule", "reads_delays"]


def reads_delays(method: Method, optimizer: OptimizerSpec | OptimizerFactory) -> bool:
    """Whether a stage's rule reads its delay τ_k: where the method names a delay correction
    or the optimizer factory takes the stage's :class:`StageContext`. τ_k is read off a long
    schedule, so the assembly computes it only then."""
    if method.correction is not None:
        return True
    return not isinstance(optimizer, OptimizerSpec) and takes_context(optimizer)


@dataclass(frozen=True)
class StageRule:
    """What a stage updates and predicts with (all None for a stage without trainable
    weights: a lone ReLU has nothing to update)."""

    context: StageContext
    """What the optimizer factory and the delay correction were told of the stage."""
    optimizer: Optimizer | None
    """The user's torch.optim optimizer over the stage's trainable parameters."""
    update: StageUpdate | None
    """The step around the optimizer: sync, unscale, clip, the correction, the scheduler."""
    predictor: WeightPredictor | None
    """Reads the optimizer to predict the weights a forward meets (predicting methods)."""

    @property
    def correction(self) -> DelayCorrection | None:
        """The delay correction the method names, built for this stage (in the update)."""
        return None if self.update is None else self.update.correction


def build_stage_rule(
    params: Sequence[Tensor],
    *,
    context: StageContext,
    method: Method,
    optimizer: OptimizerSpec | OptimizerFactory,
    scheduler: SchedulerFactory | None,
    scaler: torch.amp.GradScaler | None,
    grad_clip: float | None,
    note: Callable[[str], None],
    shard_group: dist.ProcessGroup | None = None,
) -> StageRule:
    """The stage's optimizer (from the spec or the user's factory, checked), its update with
    the method's delay correction, and its predictor where the method predicts. With
    ``shard_group`` (the stage's data-parallel replicas) the optimizer's state is sharded
    across them (``sharded.py``: ZeRO-1) and the predictor reads this replica's shard."""
    if not params:
        return StageRule(context, None, None, None)
    policy = method.stage_policy(context.index, context.num_stages)
    opt = build_optimizer(optimizer, params, context.index, context)
    if shard_group is not None:
        opt = shard_optimizer(opt, shard_group, stage=context.index)
    update = StageUpdate(
        opt,
        stage=context.index,
        scheduler=scheduler,
        scaler=scaler,
        grad_clip=grad_clip,
        correction=build_correction(policy.correction, method.name, context, opt),
        accumulation=policy.accumulation,
        note=note,
    )
    predictor = None
    if policy.predictor is not None:
        predictor = shard_predictor(predictor_for(local_optimizer(opt), policy.predictor), opt)
    return StageRule(context, opt, update, predictor)
