"""The options tree resolved against the plan, the method and the model: the views the parts of
a run are built with (``options/built.py``).

Why here and once: an option such as ``recompute`` or ``predicted_backward`` means something
only once the method and the stage layout are known; the Pipeline resolves the tree here, and
every part then reads its own view instead of taking the options as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.methods import Method, get_method
from pipeoptim.plan.plan import Plan
from pipeoptim.plan.recompute import (
    UnitLabels,
    check_shard_optimizer,
    recompute_units,
    resolve_recompute,
)
from pipeoptim.runtime.comm.process_model import ProcessModel
from pipeoptim.runtime.model.layout import stage_boundaries
from pipeoptim.runtime.model.units import ModelUnits
from pipeoptim.runtime.optim.corrections.extrapolate import (
    refuse_extrapolation_without_correction,
)
from pipeoptim.runtime.optim.global_clip import clip_scope_of
from pipeoptim.runtime.options.built import PipelineOptions, StageOptions
from pipeoptim.runtime.options.checks import check_offset, check_replicas, resolve_plan
from pipeoptim.runtime.options.tree import PipelineConfig
from pipeoptim.runtime.stage.compiled import compile_refusal

__all__ = ["ResolvedRun", "resolve_run"]


@dataclass(frozen=True)
class ResolvedRun:
    """What the Pipeline builds its parts from."""

    plan: Plan
    """The run's plan: the tree's options over its plan over the defaults."""
    method: Method
    """The plan's method."""
    bounds: list[tuple[int, int]]
    """Each stage's unit range ``[start, end)``."""
    pipeline: PipelineOptions
    """What the assembly and every stage are built with."""


def resolve_run(config: PipelineConfig, model: ModelUnits, labels: UnitLabels) -> ResolvedRun:
    """Resolve ``config`` for ``model`` (whose units ``recompute`` may name by ``labels``),
    refusing what the method or the layout cannot run."""
    schedule, memory, comm = config.schedule, config.memory, config.comm
    base = config.plan
    loss_fn = config.model.loss_fn
    if loss_fn is None:
        loss_fn = model.loss_fn or F.cross_entropy
    init_weights = config.model.init_weights
    if init_weights is None:
        init_weights = model.init_weights
    run_plan = resolve_plan(
        base, schedule.method, schedule.stages, schedule.micro_batches, schedule.virtual_stages
    )
    replicas = schedule.data_parallel
    if replicas is None:
        replicas = base.data_parallel if base is not None else 1
    run_plan.data_parallel = check_replicas(replicas, comm.transport)
    if schedule.prediction_offset is not None:
        run_plan.prediction_offset = schedule.prediction_offset
    method = get_method(run_plan.method)
    if schedule.predicted_backward and not method.predicts:
        raise RuntimeConfigError(
            f"predicted_backward keeps the predicted weights of a forward for its backward, "
            f"and {method.name} does not predict; use pipeoptim, spectrain or xpipe, "
            f"or leave predicted_backward off"
        )
    refuse_extrapolation_without_correction(
        method.name, method.correction, config.optim.extrapolation
    )
    shape = run_plan.shape(1)
    check_offset(
        run_plan.prediction_offset,
        run_plan.method,
        shape.num_stages,
        given=schedule.prediction_offset is not None,
    )
    bounds = stage_boundaries(
        len(model.units),
        shape.num_stages,
        run_plan.boundaries,
        run_plan.model,
        virtual_stages=shape.virtual_stages,
        method=run_plan.method,
    )
    recompute = memory.recompute
    if recompute is None and base is not None:
        recompute = base.recompute
    run_plan.recompute = resolve_recompute(recompute, bounds, labels, error=RuntimeConfigError)
    shard = memory.shard_optimizer
    if shard is None:
        shard = base.shard_optimizer if base is not None else False
    run_plan.shard_optimizer = check_shard_optimizer(
        shard, run_plan.data_parallel, error=RuntimeConfigError
    )
    refusal = compile_refusal(
        config.model.compile,
        method=method.name,
        one_version=method.keeps_one_version,
        predicts=method.predicts,
        amp=config.precision.amp,
    )
    if refusal is not None:
        raise RuntimeConfigError(refusal)
    optim = config.optim
    stage = StageOptions(
        optimizer=optim.optimizer if optim.optimizer is not None else run_plan.optimizer,
        scheduler=optim.scheduler,
        loss_fn=loss_fn,
        amp=config.precision.amp,
        grad_clip=optim.grad_clip,
        clip_scope=clip_scope_of(method, optim.clip_scope),
        extrapolation=optim.extrapolation,
        prediction_offset=run_plan.prediction_offset,
        predicted_backward=schedule.predicted_backward,
        seed=config.seed,
        recompute={
            k: units_of
            for k, entry in enumerate(run_plan.recompute or [])
            if (units_of := recompute_units(entry, *bounds[k], labels))
        },
        shard_optimizer=run_plan.shard_optimizer,
        compile=config.model.compile,
    )
    process_model = ProcessModel.parse(comm.transport)
    pipeline = PipelineOptions(
        stage,
        process_model,
        comm.device,
        comm.timeout,
        comm.store,
        init_weights,
        one_tag=comm.one_tag,
        varying_shapes=comm.varying_shapes,
    )
    return ResolvedRun(run_plan, method, bounds, pipeline)
