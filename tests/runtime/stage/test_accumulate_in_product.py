"""Weight gradients added inside their products (``stage/accumulate_in_product.py``): the
same gradients as autograd's own accumulation, only where nothing else watches them, and
the stages that add up several backwards use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import benchmark_scripts
from torch import nn

from pipeoptim import Pipeline
from pipeoptim.runtime.stage import accumulate_in_product as fused_linear
from pipeoptim.runtime.stage.accumulate_in_product import AccumulateInProduct

MICRO = 4


@pytest.fixture(autouse=True)
def _small_weights_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests' layers are small: let every weight in (one test puts the threshold back)."""
    monkeypatch.setattr(fused_linear, "MIN_WEIGHTS", 1)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False), nn.Tanh())


def _grads(model: nn.Module, x: torch.Tensor, in_product: bool) -> list[torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    mode = AccumulateInProduct(model)
    for chunk in x.chunk(MICRO):
        if in_product:
            with mode:
                out = model(chunk)
        else:
            out = model(chunk)
        out.square().sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("shape", [(32, 16), (8, 4, 16)])  # rows, and a sequence's tokens
def test_the_gradients_are_autograds_to_the_dtypes_rounding(shape: tuple[int, ...]) -> None:
    model = _model()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    want, got = _grads(model, x, False), _grads(model, x, True)
    assert len(got) == len(want) == 3
    eps = torch.finfo(torch.float32).eps
    for a, b in zip(want, got, strict=True):
        # the same sums, maybe in another order: a few roundings of the largest term
        assert torch.allclose(a, b, rtol=0, atol=64 * eps * float(a.abs().max())), (
            (a - b).abs().max()
        )


def test_an_input_that_takes_a_gradient_gets_autograds() -> None:
    model = _model()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    plain, fused = x.clone().requires_grad_(), x.clone().requires_grad_()
    model(plain).sum().backward()
    with AccumulateInProduct(model):
        out = model(fused)
    out.sum().backward()
    assert plain.grad is not None and fused.grad is not None
    assert torch.allclose(plain.grad, fused.grad, rtol=1e-6, atol=1e-6)


def test_a_parameter_with_a_hook_keeps_autograds_accumulation() -> None:
    model = _model()
    mode = AccumulateInProduct(model)  # made before the hook, as a stage's is
    seen: list[int] = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(1))
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(3))
    for chunk in x.chunk(MICRO):
        with mode:
            out = model(chunk)
        out.sum().backward()
    assert len(seen) == MICRO  # autograd accumulated it, once per micro-batch


def test_under_autocast_the_call_runs_as_it_was() -> None:
    model = _model()
    x = torch.randn(8, 16)
    with AccumulateInProduct(model), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == torch.bfloat16
    assert "LinearAddingIntoGrad" not in type(out.grad_fn.next_functions[0][0]).__name__


def _units() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(12, 12), nn.ReLU()) for _ in range(4)]


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [
        (torch.randn(16, 12, generator=g), torch.randn(16, 12, generator=g)) for _ in range(steps)
    ]


def _pipeline(method: str, micro: int) -> Pipeline:
    """2 ranks; interleaved 1F1B puts two of the four units' stages on each."""
    virtual = {"virtual_stages": 2} if method == "interleaved-1f1b" else {}
    return Pipeline(
        _units(),
        method,
        stages=2,
        micro_batches=micro,
        loss_fn=F.mse_loss,
        device="cpu",
        **virtual,
    )


def _trained(
    method: str, micro: int, in_product: bool, defer: bool = True
) -> tuple[list[torch.Tensor], list[bool]]:
    pipe = _pipeline(method, micro)
    used = [s._in_product is not None for s in pipe.stages.values()]
    for s in pipe.stages.values():
        if not in_product:
            s._in_product = None
        elif not defer and s._in_product is not None:
            s._in_product.defer = False
    pipe.fit(_data(3), max_steps=3)
    weights = [p.detach().clone() for s in pipe.stages.values() for p in s.module.parameters()]
    pipe.close()
    return weights, used


@pytest.mark.parametrize("method", ["gpipe", "1f1b"])
def test_a_micro_batched_pipeline_trains_as_with_autograds_accumulation(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    apply = fused_linear._LinearAddingIntoGrad.apply

    def counted(*args: object) -> object:
        calls.append(1)
        return apply(*args)

    monkeypatch.setattr(fused_linear._LinearAddingIntoGrad, "apply", counted)
    want, _ = _trained(method, MICRO, False)
    assert calls == []
    got, used = _trained(method, MICRO, True)
    assert used == [True, True]
    assert len(calls) >= 2 * 2 * MICRO * 3  # 2 stages, 2 linear layers each, 3 steps
    for a, b in zip(want, got, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_stage_that_adds_up_nothing_and_sends_no_gradient_keeps_autograd_alone() -> None:
    """One micro-batch a step: stage 0 sums nothing and sends nothing, so it keeps
    autograd's linear; stage 1 takes the product over, to defer its weights."""
    _, used = _trained("gpipe", 1, True)
    assert used == [False, True]


def test_the_benchmark_times_both_ways() -> None:
    bench = benchmark_scripts.load("bench_accumulate_in_product")
    ms = bench.measure(micro_batches=2, rounds=1, steps=1, batch=8, width=8)
    assert set(ms) == {"autograd sums", "in the product"}
    assert all(v > 0 for v in ms.values())


def test_a_weight_two_modules_share_keeps_autograds_accumulation() -> None:
    shared = nn.Linear(6, 6)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(6, 6))
    mode = AccumulateInProduct(model)
    x = torch.randn(4, 6)
    with mode:
        out = model(x)
    kinds = []
    node = out.grad_fn
    while node is not None:  # down the chain of the graph, last layer first
        kinds.append(type(node).__name__)
        node = next(
            (
                n
                for n, _ in node.next_functions
                if n is not None and "Accumulate" not in type(n).__name__
            ),
            None,
        )
    assert kinds[0].startswith("_LinearAddingIntoGrad")  # the last layer, its own weight
    assert not any(k.startswith("_LinearAddingIntoGrad") for k in kinds[1:])


def test_a_split_backward_stage_leaves_its_weights_to_autograd() -> None:
    pipe = Pipeline(
        _units(), "zb-h1", stages=2, micro_batches=MICRO, loss_fn=F.mse_loss, device="cpu"
    )
    assert [s._in_product for s in pipe.stages.values()] == [None, None]
    pipe.close()


def test_a_stage_of_small_weights_keeps_autograd_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the threshold the function mode's fixed cost outweighs the pass it saves."""
    monkeypatch.setattr(fused_linear, "MIN_WEIGHTS", 2**19)
    _, used = _trained("gpipe", MICRO, True)
    assert used == [False, False]
    big = nn.Sequential(nn.Linear(1024, 512), nn.Linear(512, 4))  # 524,288 weights, and 2,048
    mode = AccumulateInProduct(big)
    assert mode.active
    with mode:
        out = big(torch.randn(2, 1024))
    assert type(out.grad_fn).__name__.startswith("Addmm")  # the small head: autograd's
    inner = out.grad_fn.next_functions[1][0]  # the head's input: the big layer's output
    assert type(inner).__name__.startswith("_LinearAddingIntoGrad")


def test_a_deferred_backward_leaves_the_weights_to_finish_which_adds_the_same_bits() -> None:
    """The input's gradient comes out of the backward; the weights' wait for ``finish``,
    which adds the same products in the same order: the same gradients bit for bit."""
    model = _model()
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(5))
    want = _grads(model, x, True)
    for p in model.parameters():
        p.grad = None
    mode = AccumulateInProduct(model)
    mode.defer = True
    for chunk in x.chunk(MICRO):
        before = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        inputs = chunk.clone().requires_grad_()
        with mode:
            out = model(inputs)
        out.square().sum().backward()
        assert inputs.grad is not None  # what goes upstream is there at once
        for p, b in zip(model.parameters(), before, strict=True):
            assert p.grad is None if b is None else p.grad is not None and torch.equal(p.grad, b)
        assert len(mode.queued) == 2  # both layers' products wait
        mode.finish()
        assert mode.queued == []
    got = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


@pytest.mark.parametrize(
    ("method", "micro"),
    [
        ("gpipe", MICRO),
        ("1f1b", MICRO),
        ("interleaved-1f1b", MICRO),
        ("gpipe", 1),
        ("pipedream", 1),
        ("pipeoptim", 1),
        ("xpipe", MICRO),
    ],
)
def test_stages_that_send_a_gradient_defer_their_weights_and_train_the_same_bits(
    method: str, micro: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stage 1 adds its weight gradients after its input's gradient, stage 0 (nothing to
    send) in its backward, under every weight policy and with one micro-batch a step too;
    the weights after three steps equal those of every weight gradient added in its
    backward, bit for bit."""
    deferred: list[int] = []
    finish = AccumulateInProduct.finish

    def counted(self: AccumulateInProduct) -> None:
        deferred.append(len(self.queued))
        finish(self)

    monkeypatch.setattr(AccumulateInProduct, "finish", counted)
    pipe = _pipeline(method, micro)
    stages = sorted(pipe.stages)
    modes = [pipe.stages[k]._in_product for k in stages]
    assert [m is not None and m.defer for m in modes] == [k > 0 for k in stages]
    pipe.close()
    want, _ = _trained(method, micro, True, defer=False)
    assert not any(deferred)
    got, _ = _trained(method, micro, True)
    # each backward of every stage but the first, 3 steps
    assert sum(1 for n in deferred if n) == (len(stages) - 1) * micro * 3
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
