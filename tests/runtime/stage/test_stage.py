"""One stage on its own: which weights its forward and backward meet, copies, state.

The version tables are built by ``analyze_versions`` from small hand-written action lists,
the way the executor builds them from a real schedule, and the stage is driven by hand.
"""

from __future__ import annotations

import pytest
import torch
from support.versions import passes
from torch import Tensor, nn

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.methods import get_method
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.runtime.optim.update import make_optimizer
from pipeoptim.runtime.options import StageOptions
from pipeoptim.runtime.stage.stage import Stage


def make_stage(
    method: str,
    family: str = "sgd",
    m: int = 1,
    layers: nn.Module | None = None,
    amp: str | None = None,
    lr: float = 0.1,
) -> Stage:
    torch.manual_seed(0)
    return Stage(
        0,
        nn.Sequential(layers if layers is not None else nn.Linear(3, 2)),
        num_stages=2,
        method=get_method(method),
        options=StageOptions(OptimizerSpec(family, lr), amp=amp),
        micro_batches=m,
    )


def weights(stage: Stage) -> list[Tensor]:
    return [p.detach().clone() for p in stage.module.parameters()]


def warm_up(stage: Stage) -> None:
    """One update, so the optimizer has state to predict from."""
    stage.begin_segment(passes("pipeoptim", "0F0 0B0 0U0"))
    stage.forward(0, torch.randn(4, 3))
    stage.backward(0, torch.randn(4, 2))
    stage.update()


def test_predicted_forward_then_backward_on_current_weights() -> None:
    stage = make_stage("pipeoptim")
    warm_up(stage)
    stage.begin_segment(passes("pipeoptim", "0F0 0F1 0B0 0U0 0B1 0U1"))
    x0, x1, g0, g1 = torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 2), torch.randn(4, 2)
    stage.forward(0, x0)
    assert stage.distance(1) == 1  # one update (U0) between 0F1 and 0B1
    assert stage.predictor is not None
    w_hat, b_hat = stage.predictor.predicted(1)
    live = weights(stage)
    out1 = stage.forward(1, x1)
    assert torch.allclose(out1, x1 @ w_hat.T + b_hat, atol=1e-6)  # forward ran on Ŵ
    assert all(torch.equal(a, b) for a, b in zip(weights(stage), live, strict=True))
    stage.backward(0, g0)
    stage.update()  # an optimizer step between 0F1 and 0B1 is legal
    dx1 = stage.backward(1, g1)
    assert dx1 is None  # stage 0's input takes no gradient (next test: a middle stage)
    lin = stage.module[0]
    assert isinstance(lin, nn.Linear)
    assert lin.weight.grad is not None
    assert torch.allclose(lin.weight.grad, g1.T @ x1, atol=1e-6)  # from the forward's input
    assert stage.peak_weight_copies == 2


def test_backward_input_gradient_uses_weights_present_at_backward() -> None:
    stage = make_stage("pipeoptim")
    stage.index = 1  # a middle stage: its input takes a gradient
    warm_up(stage)
    stage.begin_segment(passes("pipeoptim", "0F0 0F1 0B0 0U0 0B1 0U1"))
    stage.forward(0, torch.randn(4, 3))
    stage.forward(1, torch.randn(4, 3))
    stage.backward(0, torch.randn(4, 2))
    stage.update()
    w_now = stage.module[0].weight.detach().clone()  # type: ignore[union-attr]
    g1 = torch.randn(4, 2)
    dx1 = stage.backward(1, g1)
    assert dx1 is not None and torch.allclose(dx1, g1 @ w_now, atol=1e-6)


def test_stash_backward_uses_the_forward_version() -> None:
    stage = make_stage("pipedream")
    stage.index = 1
    stage.begin_segment(passes("pipedream", "0F0 0F1 0B0 0U0 0B1 0U1"))
    w0 = stage.module[0].weight.detach().clone()  # type: ignore[union-attr]
    stage.forward(0, torch.randn(4, 3))
    stage.forward(1, torch.randn(4, 3))
    stage.backward(0, torch.randn(4, 2))
    stage.update()  # 0F1 is in flight: W^(0) is frozen, the live weights move on
    assert stage.weight_copies() == 2
    assert not torch.equal(stage.module[0].weight, w0)  # type: ignore[union-attr]
    g1 = torch.randn(4, 2)
    dx1 = stage.backward(1, g1)
    assert dx1 is not None and torch.allclose(dx1, g1 @ w0, atol=1e-6)
    assert stage.weight_copies() == 1  # the stash went with its last backward
    stage.update()
    assert stage.peak_weight_copies == 2


def test_double_buffer_runs_minibatch_t_on_the_previous_version() -> None:
    stage = make_stage("2bw", m=2)
    stage.index = 1
    stage.begin_segment(passes("2bw", "0F0 0F1 0B0 0B1 0U0 0F2 0F3 0B2 0B3 0U1", 2))
    w0 = [p.detach().clone() for p in stage.module.parameters()]
    for mb in (0, 1):
        stage.forward(mb, torch.randn(4, 3))
    for mb in (0, 1):
        stage.backward(mb, torch.randn(4, 2))
    stage.update()
    x2 = torch.randn(4, 3)
    out2 = stage.forward(2, x2)  # mini-batch 1 on W^(0) although W^(1) is live
    assert torch.allclose(out2, x2 @ w0[0].T + w0[1], atol=1e-6)
    g2 = torch.randn(4, 2)
    dx2 = stage.backward(2, g2)
    assert dx2 is not None and torch.allclose(dx2, g2 @ w0[0], atol=1e-6)
    assert stage.peak_weight_copies == 2


def bf16(t: Tensor) -> Tensor:
    return t.to(torch.bfloat16)


def assert_bf16_close(got: Tensor, want: Tensor) -> None:
    """A bf16 matmul against the formula written out: the stage's autocast F.linear and its
    autograd backward need not run the formula's kernel (torch >= 2.4 may sum the fp32
    products in another order), so the results may round to neighbouring bf16 values."""
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(got, want, rtol=2 * eps, atol=eps)


def test_bf16_predicted_forward_and_backward_on_the_current_weights_recast() -> None:
    """Under autocast the op saves the bf16 cast of the weights its forward used (Ŵ); the
    stage keeps docs/design.md's rule instead: the input gradient uses bf16(W) of the weights
    present at backward time, the weight gradient the forward's bf16 activations. Written
    out literally with bf16 matmuls."""
    stage = make_stage("pipeoptim", amp="bf16", lr=1.0)  # a large step: Ŵ far from W
    stage.index = 1
    warm_up(stage)
    stage.begin_segment(passes("pipeoptim", "0F0 0F1 0B0 0U0 0B1 0U1"))
    x0, x1, g0, g1 = torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 2), torch.randn(4, 2)
    stage.forward(0, x0)
    assert stage.predictor is not None
    w_hat, b_hat = stage.predictor.predicted(1)
    out1 = stage.forward(1, x1)
    assert out1.dtype == torch.bfloat16
    assert_bf16_close(out1, torch.addmm(bf16(b_hat), bf16(x1), bf16(w_hat).T))  # on Ŵ
    stage.backward(0, g0)
    stage.update()
    lin = stage.module[0]
    assert isinstance(lin, nn.Linear)
    w_now = lin.weight.detach().clone()
    dx1 = stage.backward(1, bf16(g1))
    assert dx1 is not None and dx1.dtype == torch.float32  # the input's dtype
    assert_bf16_close(dx1, (bf16(g1) @ bf16(w_now)).float())  # recast of the current W
    assert not torch.allclose(dx1, (bf16(g1) @ bf16(w_hat)).float(), atol=1e-2)
    assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.float32
    assert_bf16_close(lin.weight.grad, (bf16(g1).T @ bf16(x1)).float())


def test_bf16_stash_backward_recasts_the_stashed_version() -> None:
    stage = make_stage("pipedream", amp="bf16", lr=1.0)
    stage.index = 1
    stage.begin_segment(passes("pipedream", "0F0 0F1 0B0 0U0 0B1 0U1"))
    w0 = stage.module[0].weight.detach().clone()  # type: ignore[union-attr]
    stage.forward(0, torch.randn(4, 3))
    stage.forward(1, torch.randn(4, 3))
    stage.backward(0, torch.randn(4, 2))
    stage.update()
    g1 = bf16(torch.randn(4, 2))
    dx1 = stage.backward(1, g1)
    assert dx1 is not None
    assert_bf16_close(dx1, (g1 @ bf16(w0)).float())


def test_parametrized_weights_are_stated_as_a_deviation() -> None:
    layer = nn.utils.parametrizations.weight_norm(nn.Linear(3, 2))
    with pytest.warns(UserWarning, match="compute their weights in the forward"):
        stage = make_stage("pipeoptim", layers=layer)
    assert stage.notes and "not from the current ones" in stage.notes[0]
    assert not make_stage("pipedream", layers=layer).notes  # no prediction, no deviation


def test_stage_refuses_an_order_that_contradicts_the_analysis() -> None:
    stage = make_stage("pipedream")
    stage.begin_segment(passes("pipedream", "0F0 0B0 0U0 0F1 0B1 0U1"))
    stage.forward(0, torch.randn(4, 3))
    with pytest.raises(RuntimeError, match="after 0 updates, the schedule analysis says 1"):
        stage.forward(1, torch.randn(4, 3))


def test_parameter_free_stage() -> None:
    stage = make_stage("pipeoptim", layers=nn.ReLU())
    assert stage.optimizer is None and stage.predictor is None
    stage.index = 1
    stage.begin_segment(passes("pipeoptim", "0F0 0B0 0U0"))
    x = torch.randn(4, 3)
    assert torch.equal(stage.forward(0, x), torch.relu(x))
    dx = stage.backward(0, torch.ones(4, 3))
    assert dx is not None and torch.equal(dx, (x > 0).float())
    stage.update()


def test_memory_accounting_follows_the_pass() -> None:
    stage = make_stage("pipeoptim", layers=nn.Sequential(nn.Linear(3, 8), nn.Tanh()))
    stage.begin_segment(passes("pipeoptim", "0F0 0B0 0U0"))
    stage.forward(0, torch.randn(4, 3))
    assert stage.memory()["activations"] > 0
    assert stage.activation_bytes(0) == stage.memory()["activations"]
    stage.backward(0, torch.randn(4, 8))
    assert stage.memory()["activations"] == 0
    assert stage.memory()["gradients"] == stage.memory()["weights"]
    stage.update()
    assert stage.memory()["optimizer"] == stage.memory()["weights"]  # momentum buffers


def test_stage_rng_is_its_own() -> None:
    """Dropout masks come from the stage's stream, not from the process's."""
    a = make_stage("gpipe", layers=nn.Dropout(0.5))
    b = make_stage("gpipe", layers=nn.Dropout(0.5))
    a.begin_segment(passes("gpipe", "0F0 0B0 0U0"))
    b.begin_segment(passes("gpipe", "0F0 0B0 0U0"))
    x = torch.ones(8, 16)
    before = torch.get_rng_state()
    out_a = a.forward(0, x)
    assert torch.equal(torch.get_rng_state(), before)
    torch.rand(100)  # the process's stream moves, the stage's does not care
    assert torch.equal(b.forward(0, x), out_a)


def test_state_dict_round_trip_continues_identically() -> None:
    a = make_stage("pipeoptim", family="adam")
    warm_up(a)
    b = make_stage("pipeoptim", family="adam")
    b.load_state_dict(a.state_dict())
    x, g = torch.randn(4, 3), torch.randn(4, 2)
    for stage in (a, b):
        stage.begin_segment(passes("pipeoptim", "0F0 0B0 0U0"))
        stage.forward(0, x)
        stage.backward(0, g)
        stage.update()
    assert all(torch.equal(p, q) for p, q in zip(weights(a), weights(b), strict=True))


def test_make_optimizer_defaults_and_errors() -> None:
    params = [nn.Parameter(torch.zeros(2))]
    assert make_optimizer(OptimizerSpec("sgd", 0.1), params).param_groups[0]["momentum"] == 0.9
    opt = make_optimizer(OptimizerSpec("sgd", 0.1, {"momentum": 0.0}), params)
    assert opt.param_groups[0]["momentum"] == 0.0
    assert type(make_optimizer(OptimizerSpec("rmsprop", 0.1), params)).__name__ == "RMSprop"
    with pytest.raises(RuntimeConfigError, match="cannot build Adam"):
        make_optimizer(OptimizerSpec("adam", 0.1, {"bogus": 1.0}), params)
    spec = OptimizerSpec("sgd", 0.1)
    spec.family = "lamb"
    with pytest.raises(RuntimeConfigError, match="unknown optimizer 'lamb'"):
        make_optimizer(spec, params)


def test_resume_with_another_base_lr_rescales_the_scheduled_rate() -> None:
    """The schedule's progress is kept, its base moves: lr_t = new_base x factor(t)."""

    def stage(lr: float) -> Stage:
        torch.manual_seed(0)
        return Stage(
            0,
            nn.Sequential(nn.Linear(3, 2)),
            num_stages=2,
            method=get_method("pipeoptim"),
            options=StageOptions(
                OptimizerSpec("sgd", lr),
                scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10),
            ),
            micro_batches=1,
        )

    a = stage(0.1)
    for _ in range(3):
        warm_up(a)
    b = stage(0.05)
    changes = b.load_state_dict(a.state_dict())
    assert changes == ["stage 0 lr 0.1 -> 0.05"]
    assert b.optimizer is not None and a.optimizer is not None and b.scheduler is not None
    assert b.optimizer.param_groups[0]["lr"] == pytest.approx(a.optimizer.param_groups[0]["lr"] / 2)
    assert b.scheduler.base_lrs == [0.05] and b.scheduler.last_epoch == 3
    same = stage(0.1)
    assert same.load_state_dict(a.state_dict()) == []  # an unchanged lr changes nothing
    assert same.optimizer is not None
    assert same.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]


def test_predicted_backward_variant_takes_input_gradients_through_w_hat() -> None:
    """Beyond the paper: the backward of a predicted forward reads Ŵ (kept per mini-batch in
    flight), not the live weights; the weight gradient and the live weights are as without."""
    torch.manual_seed(0)
    stage = Stage(
        1,
        nn.Sequential(nn.Linear(3, 2)),
        num_stages=3,
        method=get_method("pipeoptim"),
        options=StageOptions(OptimizerSpec("sgd", 0.1), predicted_backward=True),
        micro_batches=1,
    )
    warm_up(stage)
    stage.begin_segment(passes("pipeoptim", "0F0 0F1 0B0 0U0 0B1 0U1"))
    stage.forward(0, torch.randn(4, 3))
    assert stage.predictor is not None
    w_hat = stage.predictor.predicted(1)[0]
    x1 = torch.randn(4, 3)
    stage.forward(1, x1)
    assert stage.weight_copies() == 2  # live + the Ŵ the graph of 0F1 holds
    stage.backward(0, torch.randn(4, 2))
    stage.update()
    w_now = stage.module[0].weight.detach().clone()  # type: ignore[union-attr]
    assert not torch.allclose(w_now, w_hat)
    g1 = torch.randn(4, 2)
    dx1 = stage.backward(1, g1)
    assert dx1 is not None and torch.allclose(dx1, g1 @ w_hat, atol=1e-6)
    assert torch.allclose(stage.module[0].weight.grad, g1.T @ x1, atol=1e-6)  # type: ignore[union-attr,arg-type]
    assert stage.weight_copies() == 1 and stage.peak_weight_copies == 2
    assert stage.memory()["stash"] == 0
