"""Weight prediction for NAdam and Muon, and the Muon + AdamW optimizer a whole stage uses.

The references are the optimizers' updates written out by hand from torch's own code
(torch/optim/nadam.py, torch/optim/_muon.py); only Muon's Newton–Schulz orthogonalisation is
torch's function. Tolerances are a few float32 eps: the hand formulas round differently.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from support.prediction import distances
from torch import Tensor, nn
from torch.optim import Muon, NAdam, Optimizer
from torch.optim._muon import _zeropower_via_newtonschulz
from torch.optim.lr_scheduler import LambdaLR

from pipeoptim import Pipeline
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.runtime.optim.optimizers import MuonWithAdamW
from pipeoptim.runtime.optim.predict import (
    AdamPredictor,
    MuonPredictor,
    MuonWithAdamWPredictor,
    NAdamPredictor,
    WeightPredictor,
    predictor_for,
)
from pipeoptim.runtime.optim.update import OPTIMIZERS, StageUpdate, build_optimizer, make_optimizer

EPS = torch.finfo(torch.float32).eps
W0 = [[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]]
GRADS = [
    [[0.1, -0.2, 0.3], [0.05, 0.4, -0.1]],
    [[0.2, -0.1, 0.25], [-0.05, 0.3, -0.2]],
    [[0.15, -0.3, 0.2], [0.1, 0.35, -0.15]],
]


def ns(x: Tensor) -> Tensor:
    """Muon's orthogonalisation with torch.optim.Muon's default coefficients and steps."""
    return _zeropower_via_newtonschulz(x, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()


def steps(opt: Optimizer, p: Tensor, grads: list[list[list[float]]]) -> None:
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()


def close(a: Tensor, b: Tensor, k: float = 16) -> None:
    torch.testing.assert_close(a, b, rtol=k * EPS, atol=k * EPS)


# -- literal references -----------------------------------------------------------------


@pytest.mark.parametrize("decoupled", [False, True])
def test_nadam_prediction_is_the_next_update_with_g_equal_to_m(decoupled: bool) -> None:
    lr, b1, b2, eps, psi, wd = 0.01, 0.9, 0.999, 1e-8, 4e-3, 0.1
    p = nn.Parameter(torch.tensor(W0))
    opt = NAdam(
        [p], lr=lr, betas=(b1, b2), eps=eps, momentum_decay=psi, weight_decay=wd,
        decoupled_weight_decay=decoupled,
    )  # fmt: skip
    steps(opt, p, GRADS)

    def mu(k: int) -> float:
        return b1 * (1 - 0.5 * float(0.96 ** (k * psi)))

    # torch's update, by hand
    w, m, v, prod = torch.tensor(W0), torch.zeros(2, 3), torch.zeros(2, 3), 1.0
    for t, g_ in enumerate(GRADS, start=1):
        g = torch.tensor(g_)
        if decoupled:
            w = w * (1 - lr * wd)
        else:
            g = g + wd * w
        prod *= mu(t)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        den = (v / (1 - b2**t)).sqrt() + eps
        w = (
            w
            - lr * (1 - mu(t)) / (1 - prod) * g / den
            - lr * mu(t + 1) / (1 - prod * mu(t + 1)) * m / den
        )
    close(p.detach(), w)  # the hand update is torch's
    # prediction: step 4's coefficients with g = m, v̂ of step 3, one Δ for all s
    c = (1 - mu(4)) / (1 - prod * mu(4)) + mu(5) / (1 - prod * mu(4) * mu(5))
    delta = c * m / ((v / (1 - b2**3)).sqrt() + eps) + (wd * w if decoupled else 0.0)
    pred = predictor_for(opt, include_decoupled_decay=True)
    assert isinstance(pred, NAdamPredictor)
    for s in (1, 2, 3):
        close(pred.predicted(s)[0], w - s * lr * delta)
    d = pred.delta()[0][0]
    assert d is not None
    close(d, delta)
    # the fused path (no Δ tensor) and the Δ path agree
    if not decoupled:
        fused = NAdamPredictor(opt, auto_hooks=False).predicted(2)[0]
        close(fused, w - 2 * lr * delta)


@pytest.mark.parametrize("adjust", [None, "match_rms_adamw"])
def test_muon_prediction_is_the_next_update_with_g_equal_to_buf(adjust: str | None) -> None:
    lr, wd, mom = 0.02, 0.1, 0.95
    p = nn.Parameter(torch.tensor(W0))
    opt: Optimizer = Muon(
        [p], lr=lr, weight_decay=wd, momentum=mom, nesterov=True, adjust_lr_fn=adjust
    )
    steps(opt, p, GRADS)
    # torch's update, by hand (buf is a lerp: μ·buf + (1 − μ)·g)
    r = math.sqrt(max(1.0, 2 / 3)) if adjust is None else 0.2 * math.sqrt(3)
    w, buf = torch.tensor(W0), torch.zeros(2, 3)
    for g_ in GRADS:
        g = torch.tensor(g_)
        buf = mom * buf + (1 - mom) * g
        u = (1 - mom) * g + mom * buf
        w = w * (1 - lr * wd) - lr * r * ns(u)
    close(p.detach(), w)
    delta = r * ns(opt.state[p]["momentum_buffer"]) + wd * w
    pred = predictor_for(opt)
    assert isinstance(pred, MuonPredictor)
    for s in (1, 2, 3):
        close(pred.predicted(s)[0], w - s * lr * delta)
    # exact for one step when the next gradient is buf
    predicted = pred.predicted(1)[0]
    p.grad = opt.state[p]["momentum_buffer"].clone()
    opt.step()
    close(p.detach(), predicted)


def test_muon_delta_is_computed_once_per_update() -> None:
    p = nn.Parameter(torch.tensor(W0))
    opt = Muon([p], lr=0.02)
    pred = predictor_for(opt)
    steps(opt, p, GRADS[:1])
    first = [pred.predicted(s)[0] for s in (1, 2, 3)]
    assert pred.kept_computations == 1 and len(pred.held_tensors()) == 1
    steps(opt, p, GRADS[1:2])  # the step hook drops the kept Δ
    again = pred.predicted(1)[0]
    assert pred.kept_computations == 2
    fresh = MuonPredictor(opt, auto_hooks=False).predicted(1)[0]
    assert torch.equal(again, fresh) and not torch.equal(first[0], again)


# -- direction on a small regression ----------------------------------------------------


def test_nadam_prediction_lands_nearer_than_the_stale_weights() -> None:
    for s, (pred, stale, _) in enumerate(distances(lambda ps: NAdam(ps, lr=1e-2)), start=1):
        assert pred < 0.5 * stale, (s, pred, stale)


def test_muon_prediction_lands_nearer_than_stale_and_displacement() -> None:
    # noisy mini-batch gradients: buf averages the noise the last displacement carries
    def make(ps: list[Tensor]) -> Optimizer:
        return Muon(ps, lr=0.01, adjust_lr_fn="match_rms_adamw")

    for s, (pred, stale, disp) in enumerate(distances(make), start=1):
        assert pred < 0.2 * stale and pred < disp, (s, pred, stale, disp)


# -- the Muon + AdamW optimizer ---------------------------------------------------------


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3))


def train(net: nn.Module, opt: Optimizer, n: int, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        opt.step()


def test_composite_splits_matrices_from_the_rest() -> None:
    net = model()
    opt = MuonWithAdamW(list(net.parameters()), lr=1e-2)
    assert opt.muon is not None and opt.adamw is not None
    mats = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    assert mats == {id(net[0].weight), id(net[3].weight)}
    assert len({id(p) for g in opt.adamw.param_groups for p in g["params"]}) == 4
    assert all(
        a is b
        for a, b in zip(
            opt.param_groups, opt.muon.param_groups + opt.adamw.param_groups, strict=True
        )
    )
    emb = nn.Embedding(5, 4)
    own = MuonWithAdamW([{"params": [emb.weight], "use_muon": False}], lr=1e-3)
    assert own.muon is None and own.adamw is not None
    with pytest.raises(ValueError, match="more than one"):
        MuonWithAdamW([emb.weight, emb.weight])


def test_composite_checkpoint_round_trip_gives_the_same_next_step_bitwise() -> None:
    net = model()
    opt = MuonWithAdamW(list(net.parameters()), lr=1e-2)
    train(net, opt, 3)
    saved = copy.deepcopy(opt.state_dict())
    twin = copy.deepcopy(net)
    other = MuonWithAdamW(list(twin.parameters()), lr=1e-2)
    other.load_state_dict(copy.deepcopy(saved))
    assert len(other.state) == 6  # state mirrors the parts' per-parameter state
    train(net, opt, 1, seed=9)
    train(twin, other, 1, seed=9)
    for a, b in zip(net.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    bad = {**saved, "muon_groups": 0}
    with pytest.raises(ValueError, match="Muon's"):
        other.load_state_dict(bad)


def test_a_scheduler_drives_both_parts_also_after_a_load() -> None:
    net = model()
    opt = MuonWithAdamW(list(net.parameters()), lr=1e-2, adamw_lr=1e-3)
    sched = LambdaLR(opt, lambda k: 0.5**k)
    train(net, opt, 1)
    sched.step()
    assert opt.muon is not None and opt.adamw is not None
    assert opt.muon.param_groups[0]["lr"] == pytest.approx(5e-3)
    assert opt.adamw.param_groups[0]["lr"] == pytest.approx(5e-4)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new inner group dicts
    train(net, opt, 1)
    sched.step()
    assert opt.muon.param_groups[0]["lr"] == pytest.approx(2.5e-3)
    assert opt.adamw.param_groups[0]["lr"] == pytest.approx(2.5e-4)


def test_composite_builds_from_the_spec_and_passes_the_stage_checks() -> None:
    assert OPTIMIZERS["muon"] is MuonWithAdamW and OPTIMIZERS["nadam"] is NAdam
    net = model()
    params = list(net.parameters())
    opt = make_optimizer(OptimizerSpec("muon", 0.02, {}), params)
    assert isinstance(opt, MuonWithAdamW)
    assert isinstance(build_optimizer(OptimizerSpec("muon", 0.02, {}), params, 0), MuonWithAdamW)
    built = build_optimizer(lambda ps: MuonWithAdamW(ps, lr=0.02), params, 0)
    assert isinstance(make_optimizer(OptimizerSpec("nadam", 1e-3, {}), params), NAdam)
    update = StageUpdate(built, stage=0, scheduler=None, scaler=None, grad_clip=None, note=print)
    train(net, built, 2)
    state = copy.deepcopy(update.state_dict())
    assert state["optimizer_class"] == "MuonWithAdamW"
    update.check_state(state)
    update.check_state({k: v for k, v in state.items() if k != "optimizer_class"})  # tried
    assert update.load_state_dict(state) == []


def test_composite_step_runs_hooks_and_the_composed_predictor() -> None:
    net = model()
    opt = MuonWithAdamW(list(net.parameters()), lr=1e-2)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    pred, disp = predictor_for(opt), predictor_for(opt, "displacement")
    assert isinstance(pred, MuonWithAdamWPredictor)
    train(net, opt, 2)
    assert calls == ["pre", "post"] * 2
    # the displacement rule hooks the composite itself: Δ·lr is the last step's move
    flat = [p for g in opt.param_groups for p in g["params"]]  # prediction order
    before = [p.detach().clone() for p in flat]
    train(net, opt, 1)
    for b, p, d in zip(before, flat, disp.predicted(1), strict=True):
        close(d, p.detach() - (b - p.detach()))
    # the composite's prediction is the parts' predictions, Muon's first
    assert opt.muon is not None and opt.adamw is not None
    parts: list[WeightPredictor] = [
        MuonPredictor(opt.muon, auto_hooks=False),
        AdamPredictor(opt.adamw, auto_hooks=False),
    ]
    expected = [w for part in parts for w in part.predicted(2)]
    got = pred.predicted(2, [[1e-2, 1e-2]] * len(opt.param_groups))
    assert pred.kept_computations == 1
    for a, b in zip(got, expected, strict=True):
        close(a, b)
    assert len(pred.delta()) == len(opt.param_groups)
    pred.load_state_dict(pred.state_dict())


# -- end to end -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "predictor"),
    [
        (OptimizerSpec("muon", 0.02, {}), MuonWithAdamWPredictor),
        (OptimizerSpec("nadam", 1e-3, {}), NAdamPredictor),
    ],
)
def test_pipeoptim_trains_with_the_new_optimizers(
    spec: OptimizerSpec, predictor: type[WeightPredictor]
) -> None:
    torch.manual_seed(0)
    units: list[nn.Module] = [nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 12), nn.Linear(12, 3)]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(96, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    data = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 96, 16)]
    pipe = Pipeline(units, "pipeoptim", stages=2, optimizer=spec, device="cpu", transport="local")
    result = pipe.fit(data, epochs=2)
    assert len(result.losses) == 12 and all(math.isfinite(v) for v in result.losses)
    assert all(isinstance(s.predictor, predictor) for s in pipe.stages.values())
    pipe.close()


def test_param_groups_in_any_order_predict_each_parameters_own_weights() -> None:
    """A factory that groups the parameters out of module order (no-decay first, as LM
    scripts do; Muon's matrices first) predicts the same Ŵ per parameter as one in module
    order: the same run, bit for bit."""

    def grouped(reverse: bool) -> object:
        def factory(params: list[torch.Tensor]) -> torch.optim.Optimizer:
            decay = [p for p in params if p.dim() > 1]
            rest = [p for p in params if p.dim() <= 1]
            groups = [
                {"params": decay, "weight_decay": 0.1},
                {"params": rest, "weight_decay": 0.0},
            ]
            return torch.optim.AdamW(groups[::-1] if reverse else groups, lr=1e-2)

        return factory

    def run(reverse: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layers = [nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6)) for _ in range(3)]
        pipe = Pipeline(
            layers,
            method="pipeoptim",
            stages=3,
            optimizer=grouped(reverse),  # type: ignore[arg-type]
            loss_fn=F.mse_loss,
        )
        g = torch.Generator().manual_seed(2)
        data = [(torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)) for _ in range(9)]
        pipe.fit(data, epochs=1)
        return [p.detach().clone() for u in layers for p in u.parameters()]

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)
