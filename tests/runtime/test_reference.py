"""Asynchronous methods against a sequential reference applying docs/design.md's table literally.

The reference never runs a pipeline: it walks mini-batches in order and, for every stage k
and micro-batch i of mini-batch t = i // M, picks weights by the closed forms of the
"Weight-version semantics" table for asynchronous 1F1B (d_k = P-1-k forwards in flight):

* updates stage k has made when forward i runs: ``base = max(0, (i - d_k) // M)``
  (``max(0, t - d_k)`` with M = 1);
* pipedream: forward and backward on ``W^(base)``;
* 2bw: forward and backward on ``W^(max(t-1, 0))``;
* spectrain / xpipe / pipeoptim: forward on ``Ŵ = W^(base) - lr·s·Δ`` with ``s = t - base``
  (= ``min(t, d_k)`` with M = 1) and Δ read from the optimizer state after ``base``
  updates (formulas written out below), backward on the current weights ``W^(t)``:
  the input gradient uses ``W^(t)``, the weight gradient the forward's activations;
* every method: ``W^(t+1) = optimizer step from W^(t)`` with the gradient of mini-batch t
  (mean loss over its micro-batches).

A run is a sequence of segments (cut every ``checkpoint_every`` K, never at epoch ends),
each a fresh never-flushed pipeline: t, i and the versions above count from the segment's
first mini-batch (``segment_start + ...``), which the reference applies too.

Backward "on the current weights" is written as a hand-made Linear whose backward takes the
weights to use as an argument, so the reference does not share the runtime's mechanism.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.runtime.config import TrainConfig
from pipeoptim.runtime.model.layout import stage_boundaries
from pipeoptim.runtime.optim.update import make_optimizer
from pipeoptim.workloads.data import BatchOrder, Dataset
from pipeoptim.workloads.loader import build_model
from pipeoptim.workloads.train import build_run

HERE = Path(__file__)
SEED = 3


def tiny() -> list[nn.Module]:
    """6 layers: Linear/Tanh pairs (smooth, so small weight differences stay visible)."""
    return [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3), nn.Identity()]


def dataset() -> Dataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(72, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return Dataset("tiny", x[:64], y[:64], x[64:], y[64:], 3)


def config(
    method: str, stages: int, micro: int, family: str, lr: float, **kw: object
) -> TrainConfig:
    steps = kw.pop("max_steps", 8)
    every = kw.pop("checkpoint_every", None)
    schedule = str(kw.pop("lr_schedule", "constant"))
    ckpt = kw.pop("checkpoint_dir", None)
    plan = Plan(
        method,
        stages,
        micro_batches=micro,
        optimizer=OptimizerSpec(family, lr),
        model=f"{HERE}:tiny",
        batch_size=8 if 8 % micro == 0 else 4 * micro,
        **kw,  # type: ignore[arg-type]
    )
    return TrainConfig(
        plan,
        max_steps=steps,  # type: ignore[arg-type]
        checkpoint_every=every,  # type: ignore[arg-type]
        checkpoint_dir=ckpt,  # type: ignore[arg-type]
        seed=SEED,
        device="cpu",
        lr_schedule=schedule,
    )


def run_pipeline(cfg: TrainConfig) -> tuple[list[float], list[list[Tensor]]]:
    p = cfg.plan.num_stages
    pipe, data, _ = build_run(cfg)
    pipe.fit(data, max_steps=cfg.max_steps)
    result = pipe.result
    losses = [result.losses[s] for s in sorted(result.losses)]
    weights = [[t.detach().clone() for t in pipe.stages[k].module.parameters()] for k in range(p)]
    return losses, weights


class LinearFB(torch.autograd.Function):
    """y = x W_f^T + b_f; backward: dx = g W_b (the weights the method's backward uses)."""

    @staticmethod
    def forward(ctx, x: Tensor, wf: Tensor, bf: Tensor, wb: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, wb)
        return x @ wf.T + bf

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:  # type: ignore[override]
        x, wb = ctx.saved_tensors
        return g @ wb, g.T @ x, g.sum(0), None


def delta(opt: torch.optim.Optimizer, p: Tensor, rule: str) -> Tensor:
    """Δ of docs/design.md's table, from the optimizer state, written out independently."""
    st = opt.state.get(p, {})
    if not st:
        return torch.zeros_like(p)
    if "momentum_buffer" in st:  # SGD (momentum > 0): the buffer, for every rule
        return st["momentum_buffer"].clone()
    m, v = st["exp_avg"], st["exp_avg_sq"]
    if rule == "spectrain":
        return m.clone()
    (b1, b2), eps, step = (
        opt.param_groups[0]["betas"],
        opt.param_groups[0]["eps"],
        float(st["step"]),
    )
    return (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)


def schedule(cfg: TrainConfig) -> list[float]:
    """The learning rate of every update, written out: constant, or cosine annealing to 0
    over the run (torch's closed form for CosineAnnealingLR)."""
    lr, total = cfg.plan.optimizer.lr, cfg.max_steps or 0
    if cfg.lr_schedule == "constant":
        return [lr] * (total + 8)
    assert cfg.lr_schedule == "cosine"
    return [lr * (1 + math.cos(math.pi * j / total)) / 2 for j in range(total + 8)]


def reference(
    cfg: TrainConfig, *, sum_of_lrs: bool = True, offset: int = 0
) -> tuple[list[float], list[list[Tensor]]]:
    """``sum_of_lrs``: predict with the learning rates of the next s updates (Σlr, the
    rule); False: with the current rate times s (what a schedule-blind predictor does).
    ``offset``: predict s + offset updates ahead (the plan's prediction_offset)."""
    lrs = schedule(cfg)
    method = get_method(cfg.plan.method)
    policy, rule = method.weight_policy.value, method.prediction_rule
    p, m = cfg.plan.num_stages, cfg.plan.shape(1).micro_batches
    layers, data = build_model(cfg.model, cfg.seed)
    bounds = stage_boundaries(len(layers), p, None, cfg.model)
    stages = [layers[a:b] for a, b in bounds]
    params = [[t for layer in st for t in layer.parameters()] for st in stages]
    opts = [make_optimizer(cfg.plan.optimizer, ps) if ps else None for ps in params]
    history = [[[t.detach().clone() for t in ps]] for ps in params]  # W^(j)
    deltas = [[[torch.zeros_like(t) for t in ps]] for ps in params]  # Δ after j updates
    order = BatchOrder(len(data.train_x), cfg.batch_size, cfg.seed)
    size = cfg.batch_size // m
    losses = []
    for t in range(cfg.max_steps or 0):
        start = t // cfg.checkpoint_every * cfg.checkpoint_every if cfg.checkpoint_every else 0
        idx = order.indices(t)
        grads = [[torch.zeros_like(w) for w in ps] for ps in params]
        total = 0.0
        for j in range(m):
            i = (t - start) * m + j  # micro-batch id within the segment
            x = data.train_x[idx[j * size : (j + 1) * size]]
            leaves = []
            for k, st in enumerate(stages):
                base = start + max(0, (i - (p - 1 - k)) // m)
                current = history[k][t]
                if policy == "stash":
                    wf = wb = history[k][base]
                elif policy == "double-buffer":
                    wf = wb = history[k][start + max(t - start - 1, 0)]
                else:  # predict
                    s = max(0, t - base + offset)
                    eta = sum(lrs[base : base + s]) if sum_of_lrs else lrs[base] * s
                    wf = [
                        w - eta * d for w, d in zip(history[k][base], deltas[k][base], strict=True)
                    ]
                    wb = current
                wf = [w.clone().requires_grad_() for w in wf]
                leaves.append(wf)
                pos = 0
                for layer in st:
                    if isinstance(layer, nn.Linear):
                        x = LinearFB.apply(x, wf[pos], wf[pos + 1], wb[pos])
                        pos += 2
                    else:
                        x = layer(x)
            loss = F.cross_entropy(x, data.train_y[idx[j * size : (j + 1) * size]]) / m
            loss.backward()
            total += float(loss.detach())
            for k in range(p):
                for g, w in zip(grads[k], leaves[k], strict=True):
                    g += w.grad
        losses.append(total)
        for k in range(p):
            with torch.no_grad():
                for w, cur in zip(params[k], history[k][t], strict=True):
                    w.copy_(cur)
            for w, g in zip(params[k], grads[k], strict=True):
                w.grad = g
            opt = opts[k]
            if opt is not None:  # a stage of parameter-free layers has nothing to update
                for group in opt.param_groups:
                    group["lr"] = lrs[t]
                opt.step()
            history[k].append([w.detach().clone() for w in params[k]])
            deltas[k].append([delta(opt, w, rule or "optimizer") for w in params[k]] if opt else [])
    return losses, [h[-1] for h in history]


CASES = [
    ("pipedream", 3, 1, "sgd", 0.1),
    ("pipedream", 4, 1, "adam", 0.01),
    ("2bw", 3, 3, "sgd", 0.1),
    ("2bw", 2, 4, "adamw", 0.01),
    ("spectrain", 3, 1, "sgd", 0.1),
    ("spectrain", 3, 1, "adam", 0.01),
    ("xpipe", 3, 3, "adam", 0.01),
    ("xpipe", 2, 2, "sgd", 0.1),
    ("pipeoptim", 3, 1, "sgd", 0.1),
    ("pipeoptim", 4, 1, "adam", 0.01),
    ("pipeoptim", 3, 1, "adamw", 0.01),
    # the dial: M < P, so a mini-batch's micro-batches predict over different distances
    ("pipeoptim", 4, 2, "adam", 0.01),
    ("pipeoptim", 3, 2, "sgd", 0.1),
]


@pytest.mark.parametrize(("method", "stages", "micro", "family", "lr"), CASES)
def test_async_method_matches_the_version_table(
    method: str, stages: int, micro: int, family: str, lr: float
) -> None:
    cfg = config(method, stages, micro, family, lr)
    got_losses, got_weights = run_pipeline(cfg)
    want_losses, want_weights = reference(cfg)
    assert got_losses == pytest.approx(want_losses, abs=1e-5)
    for k, (got, want) in enumerate(zip(got_weights, want_weights, strict=True)):
        for a, b in zip(got, want, strict=True):
            assert torch.allclose(a, b, atol=1e-5), f"stage {k} weights differ"
    assert all(math.isfinite(v) for v in got_losses)


@pytest.mark.parametrize("method", ["pipedream", "2bw", "pipeoptim"])
def test_segments_restart_the_pipeline(tmp_path: Path, method: str) -> None:
    """Cut every 3 mini-batches (checkpoints), not at the epoch end (8 steps): versions
    count from each segment's start, as the reference applies them."""
    micro = 3 if method == "2bw" else 1
    cfg = config(
        method, 3, micro, "sgd", 0.1, max_steps=11, checkpoint_every=3, checkpoint_dir=str(tmp_path)
    )
    got_losses, got_weights = run_pipeline(cfg)
    want_losses, want_weights = reference(cfg)
    assert got_losses == pytest.approx(want_losses, abs=1e-5)
    for got, want in zip(got_weights, want_weights, strict=True):
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want, strict=True))


def test_methods_differ_so_the_reference_is_discriminating() -> None:
    """The same data under pipedream and pipeoptim gives different numbers (and the
    reference of one does not match the run of the other)."""
    a = run_pipeline(config("pipedream", 3, 1, "sgd", 0.1))[0]
    b = reference(config("pipeoptim", 3, 1, "sgd", 0.1))[0]
    assert a != pytest.approx(b, abs=1e-4)


def test_prediction_offset_shifts_the_distance() -> None:
    """offset 1 predicts s+1 updates ahead: equal to the reference with s+1."""
    cfg = config("pipeoptim", 3, 1, "sgd", 0.1, prediction_offset=1)
    got, got_weights = run_pipeline(cfg)
    want, want_weights = reference(cfg, offset=1)
    assert got == pytest.approx(want, abs=1e-5)
    for a_stage, b_stage in zip(got_weights, want_weights, strict=True):
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(a_stage, b_stage, strict=True))
    plain, _ = run_pipeline(config("pipeoptim", 3, 1, "sgd", 0.1))
    assert got != pytest.approx(plain, abs=1e-6)  # and the offset changes the run


@pytest.mark.parametrize(("family", "lr"), [("sgd", 0.1), ("adam", 0.01)])
def test_prediction_under_a_schedule_uses_the_sum_of_the_next_rates(family: str, lr: float) -> None:
    """Cosine annealing over the run, 11 steps across an epoch end (8 steps), 4 stages: the
    forward of stage k predicts with the rates of the s updates to come (Σlr), and that is
    distinguishable from the current rate times s."""
    cfg = config("pipeoptim", 4, 1, family, lr, max_steps=11, lr_schedule="cosine")
    got_losses, got_weights = run_pipeline(cfg)
    want_losses, want_weights = reference(cfg)
    assert got_losses == pytest.approx(want_losses, abs=1e-5)
    for got, want in zip(got_weights, want_weights, strict=True):
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want, strict=True))
    blind, _ = reference(cfg, sum_of_lrs=False)
    assert got_losses != pytest.approx(blind, abs=1e-5)
