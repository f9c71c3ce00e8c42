"""Gradient clipping by the pipeline's norm (issue 63 item 4): under every synchronous method
of the registry, a clip that binds trains as ``clip_grad_norm_`` on the uncut model does
(a weight tied across stages counted once), local and dist; asynchronous methods clip per
stage by default and by the norm over one mini-batch's gradients on every stage when asked
(``clip_scope``), said in the run's notes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import padded_lm as lm
from support.launch import torchrun
from torch import nn

from pipeoptim import Pipeline
from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.methods.registry import FLUSHING
from pipeoptim.runtime import pipeline_clip
from pipeoptim.runtime.optim import global_clip
from pipeoptim.runtime.optim.update import StageUpdate

STEPS = 3
CLIP = 0.05
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize("method", FLUSHING)
def test_synchronous_methods_clip_as_one_device(method: str) -> None:
    batches = lm.padded_batches(STEPS)
    want, _, norms = lm.single_device(batches, CLIP)
    assert min(norms) > 2 * CLIP  # the clip binds at every step
    pipe = lm.pipeline(method, 4, grad_clip=CLIP)
    result = pipe.fit(batches, max_steps=STEPS)
    for got, expected in zip(lm.weights(pipe), want, strict=True):
        torch.testing.assert_close(got, expected, **TOLERANCE)
    assert any("clip_grad_norm_ on one device" in note for note in result.notes), result.notes


def test_per_stage_clipping_is_not_the_model_s() -> None:
    """What the pipeline's norm fixes: each stage clipping its own ends elsewhere."""
    batches = lm.padded_batches(STEPS)
    want, _, _ = lm.single_device(batches, CLIP)
    pipe = lm.pipeline("gpipe", 4, grad_clip=CLIP, clip_scope="stage")
    pipe.fit(batches, max_steps=STEPS)
    gap = max(float((g - w).abs().max()) for g, w in zip(lm.weights(pipe), want, strict=True))
    assert gap > 1e-3


def test_a_clip_that_does_not_bind_changes_nothing_bit_for_bit() -> None:
    batches = lm.padded_batches(STEPS)
    free = lm.pipeline("1f1b", 4)
    free.fit(batches, max_steps=STEPS)
    loose = lm.pipeline("1f1b", 4, grad_clip=1e6)
    loose.fit(batches, max_steps=STEPS)
    for a, b in zip(lm.weights(free), lm.weights(loose), strict=True):
        assert torch.equal(a, b)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def _async(scope: str | None, method: str = "pipedream") -> tuple[Pipeline, list[str]]:
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))] * 6
    pipe = Pipeline(
        _mlp(), method=method, stages=3, grad_clip=0.01, clip_scope=scope, progress=False
    )
    return pipe, pipe.fit(data, max_steps=6).notes


def test_asynchronous_methods_clip_per_stage_by_default_and_say_so() -> None:
    _, notes = _async(None)
    assert any("clip_scope='stage'" in n and "asynchronous default" in n for n in notes), notes


def test_asynchronous_pipeline_scope_clips_each_update_by_one_mini_batch_s_norm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every stage's t-th update takes the same factor: that of the norm over every stage's
    gradient of mini-batch t."""
    factors: dict[int, list[float]] = {}
    take = pipeline_clip.PipelineClip.factor

    def recorded(self: pipeline_clip.PipelineClip, step: int) -> torch.Tensor:
        out = take(self, step)
        factors.setdefault(step, []).append(float(out))
        return out

    monkeypatch.setattr(pipeline_clip.PipelineClip, "factor", recorded)
    pipe, notes = _async("pipeline")
    assert any("clip_scope='pipeline'" in n for n in notes), notes
    assert sorted(factors) == list(range(6))
    for step, seen in factors.items():
        assert len(seen) == 3 and len(set(seen)) == 1, (step, seen)
        assert seen[0] < 1.0  # it binds
    per_stage, _ = _async("stage")
    pairs = zip(
        pipe.stages[2].module.parameters(), per_stage.stages[2].module.parameters(), strict=True
    )
    assert any(not torch.equal(a, b) for a, b in pairs)


def test_pipeline_scope_is_refused_under_a_bounded_delay() -> None:
    with pytest.raises(RuntimeConfigError, match=r"bounded delay.*clip_scope='stage'"):
        Pipeline(_mlp(), method="pipedream+bounded", stages=3, grad_clip=1.0, clip_scope="pipeline")
    with pytest.raises(RuntimeConfigError, match="clip_scope must be one of"):
        Pipeline(_mlp(), method="gpipe", stages=3, grad_clip=1.0, clip_scope="model")


@pytest.mark.slow
def test_dist_clips_as_one_process_bit_for_bit(tmp_path: Path) -> None:
    """One all-reduce of the squared norms over the pipeline's ranks, on its own group."""
    args = ["--method", "zb-h1", "--micro-batches", "4", "--steps", str(STEPS)]
    ranks = torchrun(Path(lm.__file__), tmp_path, *args, "--clip", str(CLIP), nproc=2)
    local = lm.pipeline("zb-h1", 4, grad_clip=CLIP)
    result = local.fit(lm.padded_batches(STEPS), max_steps=STEPS)
    last = max(range(2), key=lambda r: bool(ranks[r]["losses"]))
    assert ranks[last]["losses"] == result.losses
    for rank in ranks:
        for k, state in rank["weights"].items():
            for name, tensor in state.items():
                assert torch.equal(tensor, local.stages[k].module.state_dict()[name]), (k, name)


def test_loss_scaling_is_undone_before_the_norm_is_read() -> None:
    """fp16's order: the gradient's norm is read unscaled (a scaled one would clip by the
    loss scale), and the step applies the unscaled, clipped gradient. On CPU with a
    GradScaler of its own (fp16 itself is CUDA's)."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    twin = nn.Linear(3, 2)
    twin.load_state_dict(layer.state_dict())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    update = StageUpdate(
        torch.optim.SGD(layer.parameters(), lr=0.1),
        stage=0,
        scheduler=None,
        scaler=scaler,
        grad_clip=0.1,
        note=print,
    )
    x = torch.randn(4, 3)
    scaler.scale(layer(x).square().sum()).backward()
    twin(x).square().sum().backward()
    params = list(layer.parameters())
    update.prepare(params)
    squared = update.clip_norm_squared(params, torch.device("cpu"))
    want = nn.utils.clip_grad_norm_(twin.parameters(), 0.1)
    assert float(want) > 0.2  # the clip binds
    torch.testing.assert_close(squared.sqrt(), want, rtol=1e-6, atol=0)
    update.step(params, 0, clip=global_clip.clip_factor(squared, 0.1))
    torch.optim.SGD(twin.parameters(), lr=0.1).step()
    for a, b in zip(layer.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
