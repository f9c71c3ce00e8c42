"""Models built on the meta device: each process materialises and initialises only its own
stages' units, and the run equals the same model materialised whole in one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support import tied_worker as tw
from support.launch import tied_torchrun as torchrun
from torch import Tensor, nn

from pipeoptim import Pipeline
from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.model.materialize import materialize_units


def small_units() -> list[nn.Module]:
    with torch.device("meta"):
        return [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)]


def init(index: int, unit: nn.Module) -> None:
    for m in unit.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.4)
            nn.init.uniform_(m.bias, -0.1, 0.1)


def data(steps: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)) for _ in range(steps)]


def test_each_stage_materialises_its_own_units_as_the_whole_model_would() -> None:
    steps = 4
    pipe = Pipeline(
        small_units(),
        method="gpipe",
        stages=2,
        micro_batches=2,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        loss_fn=F.mse_loss,
        device="cpu",
        init_weights=init,
    )
    whole = small_units()
    materialize_units(whole, range(4), torch.device("cpu"), init, seed=0)
    initial = [p.detach().clone() for u in whole for p in u.parameters()]
    held = [
        p.detach().clone() for k in sorted(pipe.stages) for p in pipe.stages[k].module.parameters()
    ]
    assert all(torch.equal(a, b) for a, b in zip(initial, held, strict=True))
    result = pipe.fit(data(steps), max_steps=steps)
    model = nn.Sequential(*whole)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in data(steps):
        total = 0.0
        for xs, ys in zip(x.tensor_split(2), y.tensor_split(2), strict=True):
            loss = F.mse_loss(model(xs), ys) / 2
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    assert result.losses == pytest.approx(losses, abs=1e-6)


def test_initial_weights_do_not_depend_on_the_layout() -> None:
    one, two = small_units(), small_units()
    materialize_units(one, range(4), torch.device("cpu"), init, seed=3)
    materialize_units(two, [2, 3], torch.device("cpu"), init, seed=3)
    materialize_units(two, [0, 1], torch.device("cpu"), init, seed=3)
    for a, b in zip(one, two, strict=True):
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.equal(p, q)


def test_a_shared_tensor_stays_shared_and_takes_its_first_units_value() -> None:
    with torch.device("meta"):
        units = tw.tied_units()
    calls: list[int] = []

    def fill(index: int, unit: nn.Module) -> None:
        calls.append(index)
        for p in unit.parameters():
            p.fill_(float(index))

    materialize_units(units, range(4), torch.device("cpu"), fill, seed=0)
    assert calls == [3, 2, 1, 0]  # last to first: the first unit's value is the one kept
    assert units[0].table.weight is units[3].weight
    assert torch.all(units[3].weight == 0.0)


def test_a_meta_model_without_an_initialiser_is_refused() -> None:
    with pytest.raises(
        RuntimeConfigError, match=r"units \[0, 1, 2, 3\] are on the meta device"
    ) as err:
        Pipeline(small_units(), method="gpipe", stages=2, device="cpu")
    assert "init_weights=lambda index, unit" in str(err.value)

    def replaces(index: int, unit: nn.Module) -> None:
        with torch.device("meta"):
            unit[0].weight = nn.Parameter(torch.empty(6, 6))

    with pytest.raises(RuntimeConfigError, match="still holds meta tensors"):
        Pipeline(small_units(), method="gpipe", stages=1, device="cpu", init_weights=replaces)


@pytest.mark.slow
def test_two_ranks_capped_below_the_whole_model_train_it_as_one_process_would(
    tmp_path: Path,
) -> None:
    steps = 3
    ranks = torchrun(
        tmp_path,
        2,
        "--mode",
        "meta",
        "--steps",
        str(steps),
        # glibc would keep freed large blocks in its heap (its mmap threshold grows after a
        # free), mapped and so counted against the cap: fix the threshold, and the arenas
        env={"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    full = ranks[0]["full_bytes"]
    for r in ranks:
        assert r["whole_fits"] is False  # the cap bites: the whole model cannot train here
        assert r["cap_over_baseline"] < full
    assert ranks[0]["unmaterialized"] == [4, 5, 6, 7]  # the other rank's units stay shapes
    assert ranks[1]["unmaterialized"] == [0, 1, 2, 3]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: the same computation, bit for bit
    local = Pipeline(
        tw.wide_units(),
        method="gpipe",
        stages=2,
        micro_batches=2,
        optimizer=tw.wide_adamw,
        loss_fn=F.mse_loss,
        device="cpu",
        init_weights=tw.init_wide,
    )
    try:
        result = local.fit(tw.wide_data(steps), max_steps=steps)
    finally:
        torch.set_num_threads(threads)
    assert ranks[1]["losses"] == result.losses
    for r in ranks:
        for k, weights in r["weights"].items():
            mine = local.stages[k].module.state_dict()
            assert all(torch.equal(weights[n], mine[n]) for n in weights)


def test_the_profiler_measures_meta_layers_one_at_a_time() -> None:
    held: list[int] = []
    original = nn.Linear.forward

    def counting(self: nn.Linear, x: Tensor) -> Tensor:
        held.append(sum(not p.is_meta for u in units for p in u.parameters()))
        return original(self, x)

    units = small_units()
    real = small_units()
    materialize_units(real, range(4), torch.device("cpu"), init, seed=0)
    from pipeoptim.runtime.profiling.profiler import profile_model

    nn.Linear.forward = counting  # type: ignore[method-assign]
    try:
        profile = profile_model(
            units, torch.randn(8, 6), warmup=0, repeats=1, init_weights=init, device="cpu"
        )
    finally:
        nn.Linear.forward = original  # type: ignore[method-assign]
    assert held and max(held) == 0  # the given layers stay on meta: copies were measured
    whole = profile_model(real, torch.randn(8, 6), warmup=0, repeats=1)
    assert [layer.name for layer in profile.layers] == [layer.name for layer in whole.layers]
    assert [layer.param_bytes for layer in profile.layers] == [
        layer.param_bytes for layer in whole.layers
    ]
    assert [layer.activation_bytes for layer in profile.layers] == [
        layer.activation_bytes for layer in whole.layers
    ]
    assert all(layer.forward_s > 0 for layer in profile.layers)
    assert profile.meta["materialised"] == "one layer at a time"
    with pytest.raises(RuntimeConfigError, match="pass init_weights"):
        profile_model(small_units(), torch.randn(8, 6))


def test_an_initialiser_that_fails_is_named_with_its_unit() -> None:
    def broken(index: int, unit: nn.Module) -> None:
        if index == 2:
            raise KeyError("oops")

    with pytest.raises(RuntimeConfigError, match=r"init_weights failed on unit 2 \(Sequential\)"):
        Pipeline(small_units(), method="gpipe", stages=2, device="cpu", init_weights=broken)
