"""The extrapolate correction (``runtime/optim/corrections/extrapolate.py``): the rule
``x_{t+1} = x_t − η_t[(1+λ)u_t − λu_{t−1}]`` against a literal loop, through the Pipeline
on a one-step delay, its methods and memory, and its option's checks."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.memory_factors import method_memory_factors
from pipeoptim.plan.methods import CORRECTED, get_method
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.runtime.config import TrainConfig
from pipeoptim.runtime.optim.corrections.extrapolate import Extrapolate
from pipeoptim.runtime.optim.corrections.protocol import StageContext
from pipeoptim.runtime.pipeline import Pipeline

EXTRAPOLATING = ("xpipe+extrapolate", "2bw+extrapolate", "pipeoptim+extrapolate")
DTYPE = torch.float64
TOL = 64 * torch.finfo(DTYPE).eps  # a few roundings of O(1) numbers per step

# the quadratic f(x) = ½ Σ a_i x_i² − b·x, well conditioned, in float64
A = torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=DTYPE)
B = torch.tensor([0.3, -0.2, 0.8, 0.1], dtype=DTYPE)
X0 = torch.tensor([1.0, -1.0, 2.0, 0.5], dtype=DTYPE)


def grad(x: Tensor) -> Tensor:
    return A * x - B


def sgd_direction(momentum: float) -> Callable[[Tensor, Tensor, int], Tensor]:
    """SGD's u_t written out: b_t = μ b_(t−1) + g_t (b_0 = g_0), u_t = b_t."""
    buf: list[Tensor] = []

    def u(x: Tensor, g: Tensor, t: int) -> Tensor:
        buf.append(g.clone() if not buf else momentum * buf[-1] + g)
        return buf[-1]

    return u


def adamw_direction(
    lrs: list[float], betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, wd: float = 0.1
) -> Callable[[Tensor, Tensor, int], Tensor]:
    """AdamW's u_t written out: its decoupled decay wd·x_t plus m̂_t / (√v̂_t + ε); the
    decay is scaled by the step's rate as the gradient part is, so u_t is the whole
    displacement over η_t."""
    state = {"m": torch.zeros_like(X0), "v": torch.zeros_like(X0)}

    def u(x: Tensor, g: Tensor, t: int) -> Tensor:
        b1, b2 = betas
        state["m"] = b1 * state["m"] + (1 - b1) * g
        state["v"] = b2 * state["v"] + (1 - b2) * g * g
        m_hat = state["m"] / (1 - b1 ** (t + 1))
        v_hat = state["v"] / (1 - b2 ** (t + 1))
        return wd * x + m_hat / (v_hat.sqrt() + eps)

    return u


def literal(
    direction: Callable[[Tensor, Tensor, int], Tensor], lrs: list[float], lam: float
) -> list[Tensor]:
    """x_(t+1) = x_t − η_t[(1+λ)u_t − λu_(t−1)], the first step plain."""
    x, previous, out = X0.clone(), None, []
    for t, lr in enumerate(lrs):
        u = direction(x, grad(x), t)
        step = u if previous is None else (1 + lam) * u - lam * previous
        x = x - lr * step
        previous = u
        out.append(x.clone())
    return out


def corrected(
    optimizer: Callable[[list[Tensor]], torch.optim.Optimizer], lrs: list[float], lam: float
) -> list[Tensor]:
    """The same steps through the optimizer and the correction (rates set per step)."""
    x = nn.Parameter(X0.clone())
    opt = optimizer([x])
    rule = Extrapolate(StageContext(0, 2, "2bw+extrapolate", 1, 1, extrapolation=lam), opt)
    out = []
    for lr in lrs:
        opt.param_groups[0]["lr"] = lr
        x.grad = grad(x.detach())
        rule.before_step(opt, [x], 1)
        opt.step()
        rule.after_step(opt, [x], 1)
        out.append(x.detach().clone())
    return out


CONSTANT = [0.05] * 6
SCHEDULED = [0.05, 0.08, 0.02, 0.06, 0.01, 0.04]  # each step its own rate


@pytest.mark.parametrize("lrs", [CONSTANT, SCHEDULED], ids=["constant", "scheduled"])
@pytest.mark.parametrize("lam", [0.5, 1.0])
def test_sgd_momentum_steps_are_the_extrapolation_written_out(lrs: list[float], lam: float) -> None:
    want = literal(sgd_direction(0.9), lrs, lam)
    got = corrected(lambda ps: torch.optim.SGD(ps, lr=lrs[0], momentum=0.9), lrs, lam)
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=TOL, atol=TOL, msg=f"step {t}")
    # and it is not the plain step: the correction moved the weights
    plain = literal(sgd_direction(0.9), lrs, 0.0)
    assert not torch.allclose(got[-1], plain[-1], rtol=1e3 * TOL, atol=1e3 * TOL)


@pytest.mark.parametrize("lrs", [CONSTANT, SCHEDULED], ids=["constant", "scheduled"])
def test_adamw_steps_are_the_extrapolation_written_out(lrs: list[float]) -> None:
    want = literal(adamw_direction(lrs), lrs, 0.5)
    got = corrected(lambda ps: torch.optim.AdamW(ps, lr=lrs[0], weight_decay=0.1), lrs, 0.5)
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=TOL, atol=TOL, msg=f"step {t}")


def test_a_skipped_step_keeps_the_weights_and_the_buffer() -> None:
    """A step that does not move the stage (an fp16 overflow skips ``optimizer.step``) is
    no update: the next one extrapolates from the last real one, as if the skip never was."""
    lrs = [0.05, 0.05, 0.05]
    x = nn.Parameter(X0.clone())
    opt = torch.optim.SGD([x], lr=0.05, momentum=0.9)
    rule = Extrapolate(StageContext(0, 2, "2bw+extrapolate", 1, 1, extrapolation=0.5), opt)
    for skip in (True, False, True, False, True):
        x.grad = grad(x.detach())
        rule.before_step(opt, [x], 1)
        if not skip:
            opt.step()
        before = x.detach().clone()
        rule.after_step(opt, [x], 1)
        if skip:
            assert torch.equal(x.detach(), before)  # nothing moved it
    want = literal(sgd_direction(0.9), lrs[:2], 0.5)
    torch.testing.assert_close(x.detach(), want[-1], rtol=TOL, atol=TOL)


def test_the_state_round_trips_and_a_resumed_rule_continues_bit_for_bit() -> None:
    def run(steps: int, rule_state: dict[str, object] | None = None, opt_state=None, x0=None):  # type: ignore[no-untyped-def]
        x = nn.Parameter(X0.clone() if x0 is None else x0.clone())
        opt = torch.optim.AdamW([x], lr=0.05)
        if opt_state is not None:
            opt.load_state_dict(opt_state)
        rule = Extrapolate(StageContext(0, 2, "xpipe+extrapolate", 1, 1, extrapolation=0.5), opt)
        if rule_state is not None:
            rule.load_state_dict(rule_state)
        for _ in range(steps):
            x.grad = grad(x.detach())
            rule.before_step(opt, [x], 1)
            opt.step()
            rule.after_step(opt, [x], 1)
        return x.detach().clone(), rule.state_dict(), opt.state_dict()

    whole, _, _ = run(6)
    half, rule_state, opt_state = run(3)
    assert rule_state["known"] == [True] and rule_state["strength"] == 0.5
    rest, _, _ = run(3, rule_state, opt_state, half)
    assert torch.equal(rest, whole)
    x = nn.Parameter(torch.zeros(3, dtype=DTYPE))
    rule = Extrapolate(StageContext(0, 2, "xpipe+extrapolate", 1, 1), torch.optim.SGD([x], lr=0.1))
    with pytest.raises(
        RuntimeConfigError, match=r"buffer 0 has shape \(4,\), its parameter \(3,\)"
    ):
        rule.load_state_dict(rule_state)


def _two_stage(method: str, lam: float | None, lr: float = 0.05) -> Pipeline:
    torch.manual_seed(0)
    return Pipeline(
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)),
        method=method,
        stages=2,
        micro_batches=2,
        optimizer=OptimizerSpec("sgd", lr, {"momentum": 0.9}),
        loss_fn=F.mse_loss,
        extrapolation=lam,
        progress=False,
    )


def _regression(steps: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 1, generator=g)
    xs = torch.randn(steps * 8, 4, generator=g)
    ys = xs @ w
    return [(xs[i : i + 8], ys[i : i + 8]) for i in range(0, len(xs), 8)]


@pytest.mark.parametrize("method", ["2bw+extrapolate", "xpipe+extrapolate"])
def test_on_a_one_step_delay_each_update_moves_lambda_eta_du_beyond_the_plain_step(
    method: str,
) -> None:
    """Through the Pipeline (2 stages, a one-step delay): after each plain step the stage's
    weights move by −λη(u_t − u_(t−1)), u read off the optimizer's own steps; the
    regression's loss falls and stays finite."""
    lam, lr = 0.5, 0.05
    pipe = _two_stage(method, lam, lr)
    stage = pipe.stages[0]
    assert stage.optimizer is not None
    weight = stage.module[0].weight
    before: list[Tensor] = []  # x_t
    plain: list[Tensor] = []  # x_t − η u_t

    stage.optimizer.register_step_pre_hook(lambda *_: before.append(weight.detach().clone()))
    stage.optimizer.register_step_post_hook(lambda *_: plain.append(weight.detach().clone()))
    result = pipe.fit(_regression(12), epochs=1)
    assert len(before) == 12
    us = [(x - p) / lr for x, p in zip(before, plain, strict=True)]
    tol = 64 * torch.finfo(weight.dtype).eps
    # x_(t+1) (the next step's start) = plain − λη(u_t − u_(t−1)); the first step plain
    torch.testing.assert_close(before[1], plain[0], rtol=0, atol=0)
    for t in range(1, 11):
        want = plain[t] - lam * lr * (us[t] - us[t - 1])
        torch.testing.assert_close(before[t + 1], want, rtol=tol, atol=tol)
    moved = max(float((before[t + 1] - plain[t]).abs().max()) for t in range(1, 11))
    assert moved > 1e-4  # the correction acted
    losses = result.losses
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3]), losses


def test_lambda_zero_is_the_base_method_bit_for_bit() -> None:
    data = _regression(6)
    base = _two_stage("2bw", None).fit(data, epochs=1).losses
    zero = _two_stage("2bw+extrapolate", 0.0).fit(data, epochs=1).losses
    assert zero == base


def test_the_methods_are_their_bases_with_the_correction_and_one_more_weight_copy() -> None:
    assert set(EXTRAPOLATING) <= CORRECTED
    for name in EXTRAPOLATING:
        method = get_method(name)
        base = get_method(method.schedule_family)
        assert method.correction == "extrapolate" and name == f"{base.name}+extrapolate"
        assert method.order(method.shape(4)) == base.order(base.shape(4))
        assert method.predictor == base.predictor and method.version_rule is base.version_rule
        mine, theirs = method_memory_factors(name, 4, 4), method_memory_factors(base.name, 4, 4)
        for k in range(4):
            assert mine(k, 4) == (theirs(k, 4)[0] + 1, theirs(k, 4)[1])
            assert method.stage_policy(k, 4).weight_copies == theirs(k, 4)[0] + 1
        assert "our reading" in method.description


def test_the_stage_counts_the_kept_update_as_optimizer_state() -> None:
    """The buffer is one weight-sized tensor per parameter: the stage's memory count adds
    exactly the stage's weight bytes to its optimizer state once it is kept."""
    sizes = {}
    for method in ("2bw", "2bw+extrapolate"):
        pipe = _two_stage(method, None if method == "2bw" else 0.5)
        pipe.fit(_regression(3), epochs=1)
        sizes[method] = pipe.stages[0].memory()
    extra = sizes["2bw+extrapolate"]["optimizer"] - sizes["2bw"]["optimizer"]
    assert extra == sizes["2bw"]["weights"] > 0


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf, True, "0.5"])
def test_lambda_must_be_a_finite_number_at_least_zero(bad: object) -> None:
    with pytest.raises(RuntimeConfigError, match=r"extrapolation must be a finite number >= 0"):
        _two_stage("2bw+extrapolate", bad)  # type: ignore[arg-type]


def test_lambda_given_to_a_method_that_does_not_extrapolate_is_refused() -> None:
    with pytest.raises(
        RuntimeConfigError, match=r"2bw does not extrapolate; use .*2bw\+extrapolate"
    ):
        _two_stage("2bw", 0.5)
    assert _two_stage("2bw+extrapolate", None).stages[0].updater.correction.strength == 0.5  # type: ignore[union-attr]


def test_the_train_command_words_the_refusals_with_its_flag() -> None:
    with pytest.raises(RuntimeConfigError, match=r"--extrapolation must be a finite number"):
        TrainConfig(Plan("2bw+extrapolate", 2, micro_batches=2), extrapolation=-1.0)
    with pytest.raises(RuntimeConfigError, match=r"--extrapolation 0.5 sets λ.*xpipe does not"):
        TrainConfig(Plan("xpipe", 2, micro_batches=2), extrapolation=0.5)
    tree = TrainConfig(Plan("xpipe+extrapolate", 2, micro_batches=2), extrapolation=0.25).options()
    assert tree.optim.extrapolation == 0.25
