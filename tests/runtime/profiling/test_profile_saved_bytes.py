"""The profiler records what each unit's forward saves for its backward (``saved_bytes``), its
output aside, and the memory model books it; profiles without it load and book the output,
as before it was measured."""

from __future__ import annotations

import torch
from torch import nn

from pipeoptim.plan.kept_bytes import stage_kept_bytes
from pipeoptim.plan.profile import Profile
from pipeoptim.runtime.profiling.profiler import profile_model


def test_each_unit_records_what_its_backward_keeps_besides_its_output() -> None:
    x = torch.randn(4, 2, 8, 8)
    layers = [nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten()]
    profile = profile_model(layers, x, warmup=0, repeats=1, steps=False)
    conv, relu, pool, flat = profile.layers
    assert conv.saved_bytes == x.numel() * 4  # its input
    assert relu.saved_bytes == 0  # its output only: booked where it is kept
    conv_out = 4 * 3 * 8 * 8
    assert pool.saved_bytes == conv_out * 4 + (conv_out // 4) * 8  # input, int64 indices
    assert flat.saved_bytes == 0
    # a stage of all four keeps the saves and the output it sends
    assert stage_kept_bytes(profile.layers) == x.numel() * 4 + pool.saved_bytes + (
        flat.activation_bytes
    )


def test_the_field_round_trips_and_older_files_load_without_it() -> None:
    profile = profile_model([nn.Linear(8, 8), nn.ReLU()], torch.randn(2, 8), warmup=0, repeats=1)
    data = profile.to_dict()
    assert Profile.from_dict(data) == profile
    for layer in data["layers"]:
        del layer["saved_bytes"]
    old = Profile.from_dict(data)
    assert all(layer.saved_bytes is None for layer in old.layers)
    assert "saved_bytes" not in old.to_dict()["layers"][0]
    # the model of those files: each unit keeps its output
    assert stage_kept_bytes(old.layers) == sum(x.activation_bytes for x in old.layers)
