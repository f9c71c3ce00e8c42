"""The per-layer profiler on CPU (and on CUDA where there is one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.partition import optimal_partition
from pipeoptim.plan.profile import Profile
from pipeoptim.runtime.profiler import profile_model


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
    assert first.optimizer_state_bytes == 2 * first.param_bytes
    assert relu.optimizer_state_bytes == 0
    assert [layer.activation_bytes for layer in profile.layers] == [
        3 * 16 * 4,
        3 * 16 * 4,
        3 * 4 * 4,
    ]
    # profiling leaves no gradients behind
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(("optimizer", "factor"), [("sgd", 1), ("adamw", 2), ("rmsprop", 1)])
def test_optimizer_state_bytes(optimizer: str, factor: int) -> None:
    profile = profile_model(mlp(), torch.randn(2, 8), optimizer=optimizer, warmup=0, repeats=1)
    assert profile.total_optimizer_state_bytes == factor * profile.total_param_bytes


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
