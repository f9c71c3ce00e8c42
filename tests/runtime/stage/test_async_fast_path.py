"""The fast path of micro-batched asynchronous forwards (issue 34) is the old path, bit for bit.

The old path ran every forward on a version other than the module's own through
``functional_call`` on fresh aliases, wrote Ŵ for every predicted micro-batch and re-pointed
what every predicted forward saved with a saved-tensor hook. The fast path fills the module's
parameter slots (``swap.py``), shares one alias per weight and version, writes Ŵ once per
distance between two updates, runs a forward that no update separates from its backward on the
module's own parameters, and, where every predicted forward meets one update before its
backward, makes the prediction buffer the live weights at that update instead of hooking.

``benchmarks/old_async_path.py`` puts the old path back (each part of the fast path undone),
so the two runs below differ only in the fast path; a difference in one weight bit fails.
Both runs predict XPipe's Ŵ from its kept Δ, as before: the fast path's one fused write per
update rounds another way by design, and ``test_hot_path.py`` holds it to Δ's Ŵ within a
few float32 eps.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from support import benchmark_scripts
from support.gpt import corpus, tiny_gpt, trained_pipeline
from torch import Tensor, nn

from pipeoptim.plan.actions import Action
from pipeoptim.plan.methods import WeightPolicy, get_method
from pipeoptim.plan.plan import OptimizerSpec
from pipeoptim.plan.versions import MicroBatchVersions, analyze_versions
from pipeoptim.runtime.optim.predict import XPipePredictor
from pipeoptim.runtime.options import StageOptions
from pipeoptim.runtime.pipeline import Pipeline
from pipeoptim.runtime.stage import saved, weights
from pipeoptim.runtime.stage.stage import Stage
from pipeoptim.workloads.gpt import lm_loss


def old_path() -> Any:
    """``old_async_path.old_path()``: the benchmarks folder is no package."""
    return benchmark_scripts.load("old_async_path").old_path()


@contextmanager
def kept_delta_arithmetic() -> Iterator[None]:
    """XPipe's Ŵ from its kept Δ on every write, the old path's arithmetic."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(XPipePredictor, "fuses_first_write", False)
        yield


def trained(method: str, steps: int = 4, **kw: Any) -> tuple[list[float], list[Tensor]]:
    pipe, losses = trained_pipeline(method, steps, **kw)
    params = [p.detach().clone() for s in pipe.stages.values() for p in s.module.parameters()]
    return losses, params


CASES = [
    ("xpipe", {}),
    ("xpipe", {"recompute": "full"}),
    ("xpipe", {"recompute": [1, 4]}),
    ("xpipe", {"amp": "bf16"}),
    ("xpipe", {"amp": "bf16", "recompute": "full"}),
    ("xpipe", {"micro_batches": 8}),
    ("xpipe", {"micro_batches": 2}),  # M < P: predictions two updates ahead, the hook's path
    ("xpipe", {"prediction_offset": 1}),
    ("xpipe", {"predicted_backward": True}),
    ("2bw", {}),
    ("2bw", {"recompute": "full"}),
    ("2bw", {"amp": "bf16", "recompute": [0, 2]}),
    ("pipeoptim", {}),
    ("pipeoptim", {"recompute": "full"}),
    ("pipedream", {"amp": "bf16"}),
    ("gpipe", {}),
]


@pytest.mark.parametrize(("method", "options"), CASES, ids=[f"{m}-{o}" for m, o in CASES])
def test_the_fast_path_trains_the_weights_of_the_old_path_bit_for_bit(
    method: str, options: dict[str, Any]
) -> None:
    with kept_delta_arithmetic():
        fast_losses, fast = trained(method, **options)
    with old_path():
        old_losses, old = trained(method, **options)
    assert fast_losses == old_losses
    assert len(fast) == len(old)
    for a, b in zip(fast, old, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


# -- one stage, by hand ----------------------------------------------------------------------
def stage_passes(method: str, order: str, m: int) -> dict[int, MicroBatchVersions]:
    actions = {0: [Action.parse(a) for a in order.split()]}
    report = analyze_versions(actions, get_method(method).weight_policy, m)
    return {mb: v for (_, mb), v in report.passes.items()}


def xpipe_stage() -> Stage:
    torch.manual_seed(0)
    return Stage(
        1,
        nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)),
        num_stages=3,
        method=get_method("xpipe"),
        options=StageOptions(OptimizerSpec("adam", 0.1)),
        micro_batches=2,
    )


# A middle stage under XPipe, M = 2: mini-batch 2's forwards (4, 5) predict one update ahead
# (s = 1) from the state of update 0, their backwards come after update 1.
ORDER = "0F0 0F1 0B0 0B1 0U0 0F2 0F3 0F4 0F5 0B2 0B3 0U1 0B4 0B5 0U2"
PREDICTED = (4, 5)
MICRO_BATCHES = range(6)


def run_order(stage: Stage, inputs: dict[int, Tensor], grads: dict[int, Tensor]) -> dict[int, Any]:
    """``ORDER`` on ``stage``: the input gradient of each backward, and what the live weights,
    Ŵ and the weight gradients were where the tests need them."""
    stage.begin_segment(stage_passes("xpipe", ORDER, 2))
    seen: dict[int, Any] = {}
    for a in ORDER.split():
        action = Action.parse(a)
        if action.kind.value == "F":
            stage.forward(action.mb, inputs[action.mb])
            if action.mb == PREDICTED[0]:
                seen["hat"] = [t.clone() for t in stage.weights.prediction_buffer()]
        elif action.kind.value == "B":
            if action.mb == PREDICTED[0]:
                seen["live"] = [p.detach().clone() for p in stage._params]
            seen[action.mb] = stage.backward(action.mb, grads[action.mb])
            if action.mb == PREDICTED[-1]:
                seen["grads"] = [p.grad.clone() for p in stage._params if p.grad is not None]
        else:
            stage.update()
    return seen


def test_a_predicted_micro_batch_gets_the_gradients_the_method_defines() -> None:
    """Weight gradients from the activations computed on Ŵ, input gradients through the live
    weights at the backward (docs/design.md, "Weight-version semantics"), on the path where
    the buffer becomes the live weights at the update between the forward and the backward.
    Ŵ differs from the weights the forward met and from those the backward meets, so a
    backward on either would fail."""
    stage = xpipe_stage()
    g = torch.Generator().manual_seed(5)
    inputs = {mb: torch.randn(5, 3, generator=g) for mb in MICRO_BATCHES}
    grads = {mb: torch.randn(5, 2, generator=g) for mb in MICRO_BATCHES}
    seen = run_order(stage, inputs, grads)
    assert stage._reads_buffer and stage.weights.leaf_grads  # the path this test is about
    assert [stage.versions(mb).distance for mb in PREDICTED] == [1, 1]
    w1, b1, _, _ = seen["hat"]
    live_w1, _, live_w2, _ = seen["live"]
    assert not torch.equal(w1, live_w1)
    expected_grads = [torch.zeros_like(t) for t in seen["hat"]]
    for mb in PREDICTED:
        x, gy = inputs[mb], grads[mb]
        h = torch.tanh(x @ w1.T + b1)  # the forward on Ŵ
        gh = (gy @ live_w2) * (1 - h * h)  # through the live weights, tanh's saved output
        expected_grads[0] += gh.T @ x
        expected_grads[1] += gh.sum(0)
        expected_grads[2] += gy.T @ h
        expected_grads[3] += gy.sum(0)
        torch.testing.assert_close(seen[mb], gh @ live_w1, rtol=1e-6, atol=1e-6)
    for got, want in zip(seen["grads"], expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_buffer_path_equals_the_hook_path_at_one_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same stage, the same passes: the buffer that becomes the live weights and the hook
    that re-points saved views of Ŵ give the same input gradients and weights, bit for bit."""
    g = torch.Generator().manual_seed(5)
    inputs = {mb: torch.randn(5, 3, generator=g) for mb in MICRO_BATCHES}
    grads = {mb: torch.randn(5, 2, generator=g) for mb in MICRO_BATCHES}
    fast = xpipe_stage()
    seen_fast = run_order(fast, inputs, grads)
    monkeypatch.setattr(Stage, "_buffer_becomes_live", lambda self, passes: False)
    hooked = xpipe_stage()
    seen_hooked = run_order(hooked, inputs, grads)
    assert fast._reads_buffer and not hooked._reads_buffer
    for mb in MICRO_BATCHES:
        assert torch.equal(seen_fast[mb], seen_hooked[mb])
    for a, b in zip(fast._params, hooked._params, strict=True):
        assert torch.equal(a, b)


def test_fast_xpipe_forwards_hook_nothing_and_predict_once_per_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Per update one write of Ŵ, no saved-tensor hook after the first forward (which counts
    the activation bytes), no functional_call; the forwards that predict nothing run on the
    module's own parameters."""
    hooks: list[int] = []
    original = torch.autograd.graph.saved_tensors_hooks

    def counting(pack: Any, unpack: Any) -> Any:
        hooks.append(1)
        return original(pack, unpack)

    monkeypatch.setattr(torch.autograd.graph, "saved_tensors_hooks", counting)
    repointed: list[int] = []
    repoint = saved.ForwardSaves.repoint
    monkeypatch.setattr(
        saved.ForwardSaves, "repoint", lambda s, *a: repointed.append(1) or repoint(s, *a)
    )
    stage = xpipe_stage()
    writes: list[int] = []
    assert stage.predictor is not None
    predict_into = stage.predictor.predict_into
    stage.predictor.predict_into = lambda *a: writes.append(1) or predict_into(*a)  # type: ignore[assignment,method-assign]
    on_parameters: list[bool] = []
    decide = Stage._on_parameters

    def deciding(self: Stage, v: MicroBatchVersions, s: int) -> bool:
        on_parameters.append(decide(self, v, s))
        return on_parameters[-1]

    monkeypatch.setattr(Stage, "_on_parameters", deciding)
    g = torch.Generator().manual_seed(5)
    run_order(
        stage,
        {mb: torch.randn(5, 3, generator=g) for mb in MICRO_BATCHES},
        {mb: torch.randn(5, 2, generator=g) for mb in MICRO_BATCHES},
    )
    assert len(writes) == 1  # micro-batches 4 and 5 share Ŵ
    assert repointed == [] and len(hooks) == 1
    assert on_parameters == [True] * 4 + [False] * 2  # 0 to 3 predict nothing


def test_two_bw_makes_one_leaf_per_weight_and_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """2BW in fp32 reads leaves on each version (``weights.leaf``), one per weight and
    version however many forwards read it, and no alias."""
    made: list[int] = []
    aliased: list[int] = []
    original_leaf, original_alias = weights.leaf, weights.alias
    monkeypatch.setattr(weights, "leaf", lambda s: made.append(1) or original_leaf(s))
    monkeypatch.setattr(weights, "alias", lambda p, s: aliased.append(1) or original_alias(p, s))
    torch.manual_seed(0)
    stage = Stage(
        1,
        nn.Sequential(nn.Linear(3, 2)),
        num_stages=3,
        method=get_method("2bw"),
        options=StageOptions(OptimizerSpec("sgd", 0.1)),
        micro_batches=3,
    )
    # mini-batch 0 on the live W^(0), no update before its backward: the parameters; 1 and 2
    # on W^(0) and W^(1), one behind, three forwards each
    order = " ".join(
        f"0F{3 * t} 0F{3 * t + 1} 0F{3 * t + 2} 0B{3 * t} 0B{3 * t + 1} 0B{3 * t + 2} 0U{t}"
        for t in range(3)
    )
    stage.begin_segment(stage_passes("2bw", order, 3))
    for a in order.split():
        action = Action.parse(a)
        if action.kind.value == "F":
            stage.forward(action.mb, torch.randn(4, 3))
        elif action.kind.value == "B":
            stage.backward(action.mb, torch.randn(4, 2))
        else:
            stage.update()
    assert stage.policy is WeightPolicy.DOUBLE_BUFFER
    assert len(made) == 2 * 2  # (weight, bias) per version read, not per forward (12)
    assert aliased == [] and stage.weights.leaf_grads


SIMULATED_CASES = [
    ("xpipe", 4),  # M = P: one Ŵ per mini-batch per stage
    ("xpipe", 8),
    ("xpipe", 2),  # M < P: two distances between updates
    ("pipeoptim", 1),  # one forward per update: each writes its own
    ("spectrain", 1),
]


@pytest.mark.parametrize(("method", "micro"), SIMULATED_CASES)
def test_the_simulator_charges_the_predictions_the_runtime_writes(method: str, micro: int) -> None:
    """Per stage the simulator's forwards that write Ŵ (and so cost the prediction) are as
    many as the runtime's writes of Ŵ in the same schedule, on CPU where each is timed."""
    from pipeoptim.sim import Program

    steps = 6
    spec = get_method(method)
    pipe = Pipeline(
        tiny_gpt(),
        method=method,
        stages=4,
        micro_batches=micro if spec.micro_batched else None,
        optimizer=OptimizerSpec("adamw", 3e-3),
        loss_fn=lm_loss,
        log_every=10**6,
    )
    pipe.fit(corpus(steps), max_steps=steps)
    runtime = [len(pipe.stages[k].prediction_seconds) for k in range(4)]
    shape = spec.shape(4, micro if spec.micro_batched else None, steps)
    program = Program(spec.order_arrays(shape), shape.micro_batches, spec.weight_policy)
    writes = program.prediction_writes()
    simulated = [int(writes[program.arrays.stage == k].sum()) for k in range(4)]
    assert simulated == runtime
    assert sum(runtime) > 0
    predicted = program.versions().actions.predicted
    if shape.micro_batches > 1:  # micro-batches share a Ŵ: fewer writes than predicted ones
        assert writes.sum() < predicted.sum()
    else:
        assert (writes == predicted).all()


@pytest.mark.parametrize(
    ("method", "micro", "buffered"),
    [("xpipe", 4, [True, True, False, False]), ("pipeoptim", 1, [False] * 4)],
)
def test_the_buffer_becomes_the_live_weights_only_where_forwards_share_an_update(
    method: str, micro: int, buffered: list[bool]
) -> None:
    """XPipe's micro-batches meet each update several at a time: on the stages where each
    predicted forward meets one update, the buffer becomes the live weights (one copy per
    update). PipeOptim's whole mini-batches meet one each (stage 2 predicts s = 1 for every
    forward): the hook re-points one forward's saved views, cheaper than a weight copy."""
    pipe = Pipeline(
        tiny_gpt(),
        method=method,
        stages=4,
        micro_batches=micro if get_method(method).micro_batched else None,
        optimizer=OptimizerSpec("adamw", 3e-3),
        loss_fn=lm_loss,
        log_every=10**6,
    )
    pipe.fit(corpus(6), max_steps=6)
    assert [pipe.stages[k]._reads_buffer for k in range(4)] == buffered
    stage = pipe.stages[2]
    moved = {stage.versions(mb).distance for mb in stage.weights.passes} - {0}
    assert method != "pipeoptim" or moved == {1}  # one update per predicted forward: hooked
