"""A :class:`~pipeoptim.runtime.config.TrainConfig` as a run: the built-in (or
``module:factory``) model it names, as a :class:`~pipeoptim.runtime.pipeline.Pipeline` with
its training and test data as loaders, exactly as a library user would write it.

``train(config)`` is the entry point of ``pipeoptim train``. Starting processes, joining
them and watching them is the runtime's (:mod:`pipeoptim.runtime.launch`); what a config's
model is, is this package's, so this module hands the launcher a
:class:`~pipeoptim.runtime.launch.Runner` and is itself the module every spawned rank runs
(``python -m pipeoptim.workloads.train``).
"""

from __future__ import annotations

import os
import sys

from torch._C._distributed_c10d import Store

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.recompute import resolve_recompute
from pipeoptim.plan.replicas import check_batch_split
from pipeoptim.runtime import launch
from pipeoptim.runtime.config import TrainConfig, run_length
from pipeoptim.runtime.model.layout import stage_boundaries
from pipeoptim.runtime.model.units import unit_labels
from pipeoptim.runtime.observe.loggers.spec import logger_from_spec
from pipeoptim.runtime.optim.corrections.qk_clip import refuse_clip_without_attention
from pipeoptim.runtime.optim.lr import scheduler_factory
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.runtime.result import FitResult
from pipeoptim.workloads.data import DatasetLoader
from pipeoptim.workloads.loader import build_model, model_loss

__all__ = ["RUNNER", "build_run", "check_run", "run_config", "train"]


def build_run(
    config: TrainConfig, *, store: Store | None = None
) -> tuple[Pipeline, DatasetLoader, DatasetLoader]:
    """``config`` as a library user would write it: the built-in model as a Pipeline, and
    its training and test data as loaders."""
    layers, data = build_model(config.model, config.seed)
    _check_layout(config, len(layers))  # in the command line's words, before the Pipeline's
    train_data = DatasetLoader(data.train_x, data.train_y, config.batch_size, seed=config.seed)
    test_data = DatasetLoader(data.test_x, data.test_y, config.batch_size, shuffle=False)
    per_epoch = len(train_data)
    total = run_length(config.epochs, config.max_steps, per_epoch)
    options = config.options().with_keywords(
        scheduler=scheduler_factory(config.lr_schedule, total, config.warmup),
        loss_fn=model_loss(config.model),
        progress=not config.quiet and sys.stderr.isatty(),
        targets="read",  # the built-in loaders yield the same batches on every rank
        store=store,
        run_identity=config.identity(),
        hyperparameters=config.hyperparameters(),
        loggers=[logger_from_spec(spec) for spec in config.log],
    )
    pipe = Pipeline(layers, options=options)
    return pipe, train_data, test_data


def check_run(config: TrainConfig) -> None:
    """The checks every rank would fail alike (the model, its stage layout, the batch split
    and the data), made once by the launcher before any process starts."""
    layers, data = build_model(config.model, config.seed)
    shape = config.plan.shape(1)
    bounds = _check_layout(config, len(layers))
    check_batch_split(
        config.batch_size, config.plan.data_parallel, shape.micro_batches, error=RuntimeConfigError
    )
    requested = config.options().memory.recompute
    resolve_recompute(
        config.plan.recompute if requested is None else requested,
        bounds,
        unit_labels(layers),
        error=RuntimeConfigError,
    )
    DatasetLoader(data.train_x, data.train_y, config.batch_size, seed=config.seed)
    for spec in config.log:  # the package is there and the target writable
        logger_from_spec(spec)
    method = get_method(config.plan.method)
    refuse_clip_without_attention(method.name, method.correction, method.corrects, layers)


def _check_layout(config: TrainConfig, num_layers: int) -> list[tuple[int, int]]:
    """The plan's stage layout against the built-in model, refused with ``--stages``."""
    shape = config.plan.shape(1)
    return stage_boundaries(
        num_layers,
        shape.num_stages,
        config.plan.boundaries,
        config.model,
        virtual_stages=shape.virtual_stages,
        method=config.plan.method,
        stages_flag="--stages ",
    )


RUNNER = launch.Runner(build_run, check_run, "pipeoptim.workloads.train")
"""What :mod:`pipeoptim.runtime.launch` runs a config with: its model from this package."""


def run_config(config: TrainConfig, *, store: Store | None = None) -> FitResult:
    """Train ``config`` in this process (one rank of several with ``store``)."""
    return launch.run_config(config, RUNNER, store=store)


def train(config: TrainConfig) -> FitResult | None:
    """Run ``config`` (``pipeoptim train``): in this process, as spawned processes or as one
    torchrun rank; returns the merged result (None on torchrun ranks other than 0)."""
    return launch.train(config, RUNNER)


if __name__ == "__main__":
    # os._exit: a failed rank must not block in process-group teardown on dead peers.
    os._exit(launch.worker_main(RUNNER))
