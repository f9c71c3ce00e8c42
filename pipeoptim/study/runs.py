"""One training run of the convergence study: a spec in, a curve out (plain JSON data).

Every stage runs in this process (the local transport, bitwise equal to the distributed
run): P stages are emulated on one device, which is what makes a study of every method at
several depths affordable.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.optimizer_families import find_family
from pipeoptim.plan.risk import row_label
from pipeoptim.plan.risk import split_row as split_label
from pipeoptim.study.variants import optimizer_options

__all__ = ["CurvePoint", "RunRecord", "RunSpec", "run_one", "split_label"]

MODEL_METRIC = {
    "mlp": "accuracy",
    "cnn": "accuracy",
    "transformer": "accuracy",
    "gpt": "perplexity",
    "gpt-deep": "perplexity",
    "gpt-deeper": "perplexity",
}
"""The test metric each built-in model is judged by (accuracy: higher is better)."""


@dataclass(frozen=True)
class RunSpec:
    """One configuration of the study."""

    model: str
    """Built-in model (``mlp``, ``cnn``, ``gpt``...)."""
    method: str
    optimizer: str
    """sgd (momentum 0.9), adam or adamw."""
    lr: float
    stages: int
    seed: int
    steps: int
    """Mini-batches to train (equal for every method of a model)."""
    eval_every: int
    """Mini-batches between test evaluations (each drains the pipeline)."""
    batch_size: int = 32
    closure: bool = False
    """Also measure how much of the stale distance each prediction removes."""
    eval_samples: int | None = None
    """Evaluate on the first this many test samples (None: all)."""
    weight_decay: float = 0.0
    predicted_backward: bool = False
    """The variant beyond the paper: input gradients through Ŵ as well (``Pipeline``)."""
    warmup: float = 0.0
    """Share of the run spent in a linear learning-rate warm-up (0: a constant rate, unless
    ``final_lr`` is below 1)."""
    final_lr: float = 1.0
    """The rate at the end of a cosine decay after the warm-up, as a share of ``lr`` (1: no
    decay)."""
    grad_clip: float | None = None
    """Clip each stage's gradient norm to this (None: no clipping)."""
    trained_optimizer: str | None = None
    """The optimizer actually trained where it is not ``optimizer`` (the study's column):
    the NAdam and Muon rows of the AdamW column, at its rate (None: ``optimizer``)."""
    micro_batch_count: int | None = None
    """Micro-batches per update where the row does not use its method's default (the dial
    between PipeOptim and XPipe: ``pipeoptim`` at M = P/4, P/2); None: the default."""
    extrapolation: float | None = None
    """The extrapolation correction's λ (``Pipeline(extrapolation=λ)``); None: its default."""
    equal_time: bool = False
    """A run of the equal-time comparison: ``steps`` are as many updates as the row's
    simulated throughput buys in the time the reference (zb-h1) needs for the study's
    updates (:mod:`pipeoptim.study.equal_time`); keyed apart from the equal-sample run."""

    @property
    def recipe(self) -> str:
        """The schedule and clipping as the key names them ("" for the plain recipe)."""
        if self.warmup == 0.0 and self.final_lr == 1.0 and self.grad_clip is None:
            return ""
        clip = "none" if self.grad_clip is None else f"{self.grad_clip:g}"
        return f"/warmup={self.warmup:g}/final={self.final_lr:g}/clip={clip}"

    @property
    def options(self) -> str:
        """Every other field that changes the run's result, where it differs from its
        default ("" for none): whatever a key does not name would let a rerun with another
        value reuse this run (a new field is keyed here without further code)."""
        parts = []
        for f in fields(self):
            if f.name in _NAMED_IN_KEY:
                continue
            value = getattr(self, f.name)
            if value != f.default:
                shown = f"{value:g}" if isinstance(value, float) else str(value)
                parts.append(f"/{f.name}={shown}")
        return "".join(parts)

    @property
    def label(self) -> str:
        """The row as the tables name it: ``pipeoptim+Ŵbackward`` for the variant, its
        settings where set (``pipeoptim M=2 (muon)``, ``xpipe+extrapolate λ=0.5``); an
        equal-time run has its row's label (its key tells it apart)."""
        return row_label(
            self.method,
            self.trained_optimizer,
            micro_batches=self.micro_batch_count,
            extrapolation=self.extrapolation,
            predicted_backward=self.predicted_backward,
        )

    @property
    def key(self) -> str:
        """Unique name of the configuration (the resume key of ``runs.jsonl``)."""
        return (
            f"{self.model}/{self.label}/{self.optimizer}/lr={self.lr:g}/P={self.stages}/"
            f"seed={self.seed}/steps={self.steps}/B={self.batch_size}/eval={self.eval_every}"
            f"{self.recipe}{self.options}"
        )

    @property
    def micro_batches(self) -> int:
        """Micro-batches per update: ``micro_batch_count``, else the method's default."""
        if self.micro_batch_count is not None:
            return self.micro_batch_count
        from pipeoptim.plan.methods import get_method

        return get_method(self.method).default_micro_batches_at(self.stages)


_NAMED_IN_KEY = frozenset(
    {
        "model",
        "method",
        "optimizer",
        "lr",
        "stages",
        "seed",
        "steps",
        "eval_every",
        "batch_size",
        "predicted_backward",
        "trained_optimizer",
        "warmup",
        "final_lr",
        "grad_clip",
        # measuring the closure reads the weights, it changes nothing trained
        "closure",
    }
)
"""RunSpec fields that :attr:`RunSpec.key` names in its fixed part (or that change nothing
trained); every other field goes into :attr:`RunSpec.options`."""


@dataclass(frozen=True)
class CurvePoint:
    step: int
    samples: int
    test_loss: float
    test_metric: float
    """Accuracy (classifiers) or perplexity (language models)."""
    train_loss: float
    """Mean training loss of the mini-batches since the previous point."""


@dataclass
class RunRecord:
    spec: RunSpec
    curve: list[CurvePoint]
    diverged_at: int | None
    """Step of the first non-finite loss (None: trained to the end)."""
    seconds: float
    closure: list[dict[str, Any]] = field(default_factory=list)
    """Per stage: samples, max_distance, median_ratio, mean_ratio
    (``runtime/optim/prediction_closure.py``)."""

    @property
    def final(self) -> CurvePoint | None:
        return self.curve[-1] if self.curve else None

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.spec.key, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunRecord:
        return cls(
            RunSpec(**d["spec"]),
            [CurvePoint(**p) for p in d["curve"]],
            d["diverged_at"],
            float(d["seconds"]),
            list(d.get("closure", [])),
        )


def _metric(model: str, loss: float, accuracy: float | None) -> float:
    if MODEL_METRIC.get(model) == "perplexity":
        return math.exp(loss) if loss < 700 else math.inf
    return float("nan") if accuracy is None else accuracy


def run_one(spec: RunSpec) -> RunRecord:
    """Train ``spec`` on the local transport and record the test metric and the training
    loss every ``eval_every`` mini-batches. A non-finite loss ends the run and is recorded."""
    import torch
    from torch.optim.lr_scheduler import LambdaLR

    from pipeoptim.errors import NonFiniteLossError
    from pipeoptim.plan.plan import OptimizerSpec
    from pipeoptim.runtime.optim.lr import WarmupCosine
    from pipeoptim.runtime.pipeline import Pipeline
    from pipeoptim.workloads.data import DatasetLoader
    from pipeoptim.workloads.loader import build_model, model_loss

    if spec.steps < 1 or spec.eval_every < 1:
        raise RuntimeConfigError(
            f"a study run needs steps >= 1 and eval_every >= 1 (got {spec.steps}, "
            f"{spec.eval_every})"
        )
    layers, data = build_model(spec.model, spec.seed)
    family, set_options = optimizer_options(spec.trained_optimizer or spec.optimizer)
    options: dict[str, float | bool] = {**set_options}
    if spec.weight_decay:
        options["weight_decay"] = spec.weight_decay
        known = find_family(family)
        if known is not None and known.decoupled_decay_option:  # as AdamW's, Nesterov's
            options["decoupled_weight_decay"] = True
    scheduler = None
    if spec.recipe:
        warmup = max(1, round(spec.warmup * spec.steps))
        shape = WarmupCosine(warmup, spec.steps, spec.final_lr)
        scheduler = functools.partial(LambdaLR, lr_lambda=shape)
    # passed only where set, so a run of the default is the call it always was
    settings: dict[str, Any] = {}
    if spec.extrapolation is not None:
        settings["extrapolation"] = spec.extrapolation
    pipe = Pipeline(
        list(layers),
        method=spec.method,
        stages=spec.stages,
        micro_batches=spec.micro_batches,
        optimizer=OptimizerSpec(family, spec.lr, options),
        loss_fn=model_loss(spec.model),
        seed=spec.seed,
        predicted_backward=spec.predicted_backward,
        scheduler=scheduler,
        grad_clip=spec.grad_clip,
        **settings,
        progress=False,
        log_every=10**9,
        forwards_first=True,  # the same weights, a cheaper order on one thread (issue 34)
    )
    probe = pipe.measure_prediction_closure() if spec.closure else None
    train = DatasetLoader(data.train_x, data.train_y, spec.batch_size, seed=spec.seed)
    n_eval = len(data.test_x) if spec.eval_samples is None else spec.eval_samples
    test = DatasetLoader(data.test_x[:n_eval], data.test_y[:n_eval], 256, shuffle=False)
    start = time.perf_counter()
    diverged: int | None = None
    with torch.random.fork_rng():
        try:
            result = pipe.fit(
                train, max_steps=spec.steps, eval_data=test, eval_every=spec.eval_every
            )
        except NonFiniteLossError as err:
            if err.partial is None:
                raise
            result, diverged = err.partial, err.step
    seconds = time.perf_counter() - start
    curve = []
    previous = result.start_step
    for ev in result.eval_history:
        window = result.losses[previous - result.start_step : ev.step - result.start_step]
        curve.append(
            CurvePoint(
                ev.step,
                ev.step * spec.batch_size,
                ev.loss,
                _metric(spec.model, ev.loss, ev.accuracy),
                math.fsum(window) / len(window) if window else math.nan,
            )
        )
        previous = ev.step
    closure = [asdict(s) for s in probe.summary()] if probe is not None else []
    return RunRecord(spec, curve, diverged, seconds, closure)
