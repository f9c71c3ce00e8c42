"""The per-layer profiler on CPU (and on CUDA where there is one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.partition import optimal_partition
from pipeoptim.plan.profile import Profile
from pipeoptim.runtime.profiling.profiler import profile_model


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_profile_small_mlp_on_cpu() -> None:
    model = mlp()
    profile = profile_model(model, torch.randn(3, 8), optimizer="adam", warmup=1, repeats=3)
    assert [layer.name for layer in profile.layers] == ["0:Linear", "1:ReLU", "2:Linear"]
    assert profile.batch_size == 3
    assert profile.optimizer == "adam"
    assert profile.device == "cpu"
    assert profile.dtype_bytes == 4
    assert profile.meta["timer"] == "perf_counter"
    assert profile.meta["repeats"] == 3
    for layer in profile.layers:
        assert layer.forward_s > 0
        assert layer.backward_s > 0
    first, relu, last = profile.layers
    assert (first.param_count, first.param_bytes) == (8 * 16 + 16, 4 * (8 * 16 + 16))
    assert (relu.param_count, relu.param_bytes) == (0, 0)
    assert (last.param_count, last.param_bytes) == (16 * 4 + 4, 4 * (16 * 4 + 4))
    # measured after real steps: two moments and a float32 step count per parameter tensor
    assert first.optimizer_state_bytes == 2 * first.param_bytes + 2 * 4
    assert relu.optimizer_state_bytes == 0
    assert first.update_s > 0 and first.predict_s > 0
    assert relu.update_s == relu.predict_s == 0
    for layer in profile.layers:  # the fixed part of a time lies within the time
        assert 0 <= layer.forward_fixed_s <= layer.forward_s
        assert 0 <= layer.backward_fixed_s <= layer.backward_s
    assert profile.meta["batch_sizes"] == [3]  # half and a quarter of 3 are below 2
    assert profile.meta["threads"] == torch.get_num_threads()
    assert [layer.activation_bytes for layer in profile.layers] == [
        3 * 16 * 4,
        3 * 16 * 4,
        3 * 4 * 4,
    ]
    # profiling leaves no gradients behind, and the steps it timed changed no weight
    assert all(p.grad is None for p in model.parameters())
    fresh = mlp().parameters()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh, strict=True))


@pytest.mark.parametrize(
    ("optimizer", "factor", "step_bytes"), [("sgd", 1, 0), ("adamw", 2, 4), ("rmsprop", 1, 4)]
)
def test_optimizer_state_bytes(optimizer: str, factor: int, step_bytes: int) -> None:
    tensors = len(list(mlp().parameters()))
    profile = profile_model(mlp(), torch.randn(2, 8), optimizer=optimizer, warmup=0, repeats=1)
    measured = factor * profile.total_param_bytes + step_bytes * tensors
    assert profile.total_optimizer_state_bytes == measured
    estimated = profile_model(
        mlp(), torch.randn(2, 8), optimizer=optimizer, warmup=0, repeats=1, steps=False
    )
    assert estimated.total_optimizer_state_bytes == factor * profile.total_param_bytes
    assert all(layer.update_s == 0 for layer in estimated.layers)


def test_threads_are_set_for_the_profile_and_restored() -> None:
    before = torch.get_num_threads()
    profile = profile_model(mlp(), torch.randn(8, 8), warmup=0, repeats=1, threads=1)
    assert profile.meta["threads"] == 1
    assert profile.meta["batch_sizes"] == [8, 4, 2]  # at a half and a quarter (an eighth is 1)
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeConfigError, match="threads must be >= 1"):
        profile_model(mlp(), torch.randn(4, 8), threads=0)
    with pytest.raises(RuntimeConfigError, match="batch_sizes must be whole numbers from 1 to 3"):
        profile_model(mlp(), torch.randn(4, 8), batch_sizes=[4])


def test_fixed_part_is_the_intercept_of_the_times() -> None:
    from pipeoptim.runtime.profiling.layer_timing import _fixed_part

    # t = 2 + 0.5 b exactly: the fixed part is 2
    assert _fixed_part([8, 4, 2], [6.0, 4.0, 3.0]) == pytest.approx(2.0)
    # times that grow faster than the batch have no fixed part (clamped at 0)
    assert _fixed_part([8, 4], [8.0, 2.0]) == 0.0
    # one size: nothing to fit
    assert _fixed_part([8], [1.0]) == 0.0


def test_list_of_modules_buffers_restored_and_json(tmp_path: Path) -> None:
    norm = nn.BatchNorm1d(16)
    layers = [nn.Linear(8, 16), norm, nn.Linear(16, 2)]
    assert norm.running_mean is not None and norm.num_batches_tracked is not None
    mean_before = norm.running_mean.clone()
    profile = profile_model(layers, torch.randn(4, 8), warmup=1, repeats=2, progress=True)
    assert torch.equal(norm.running_mean, mean_before)
    assert int(norm.num_batches_tracked.item()) == 0
    assert [layer.name for layer in profile.layers] == ["0:Linear", "1:BatchNorm1d", "2:Linear"]
    path = tmp_path / "profile.json"
    profile.save(path)
    assert Profile.load(path) == profile
    assert optimal_partition(profile, 2).num_stages == 2


def test_integer_input_layer() -> None:
    model = nn.Sequential(nn.Embedding(10, 6), nn.Flatten(), nn.Linear(18, 3))
    profile = profile_model(model, torch.randint(0, 10, (5, 3)), warmup=0, repeats=2)
    assert profile.layers[0].activation_bytes == 5 * 3 * 6 * 4
    assert profile.layers[0].backward_s > 0
    assert profile.batch_size == 5


def test_profiler_errors() -> None:
    with pytest.raises(RuntimeConfigError, match="empty model"):
        profile_model(nn.Sequential(), torch.randn(2, 2))
    with pytest.raises(RuntimeConfigError, match="unknown optimizer 'lion'"):
        profile_model(mlp(), torch.randn(2, 8), optimizer="lion")
    with pytest.raises(RuntimeConfigError, match="repeats must be"):
        profile_model(mlp(), torch.randn(2, 8), repeats=0)

    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    with pytest.raises(RuntimeConfigError, match="returned a tuple"):
        profile_model([Pair()], torch.randn(2, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profile_on_cuda() -> None:
    model = mlp()
    profile = profile_model(model, torch.randn(3, 8), device="cuda", warmup=1, repeats=3)
    assert profile.device.startswith("cuda")
    assert profile.meta["timer"] == "cuda_event"
    assert "device_name" in profile.meta
    assert all(layer.forward_s > 0 and layer.backward_s > 0 for layer in profile.layers)
    assert profile.layers[0].param_bytes == 4 * (8 * 16 + 16)
