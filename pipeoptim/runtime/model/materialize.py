"""Units built on the meta device, materialised one stage at a time on the rank that trains it.

The point of a pipeline is a model no single device holds. The user builds the whole model on
``torch.device("meta")`` (shapes, no storage); each process materialises only the units of its
own stages on its device and initialises them with the user's ``init_weights(index, unit)``.

Why not ``Module.to_empty``: it converts each module's tensors separately, so a tensor that two
units share (a tied embedding) or a submodule two units share (a rotary-embedding table) comes
out as two tensors, or is emptied again after it was initialised. Here every tensor is converted
once (a memo by identity), so what was shared stays shared.

Each unit is initialised under its own random stream, seeded from the run's seed and the unit's
index, so the weights do not depend on which process holds which stage: the same model
materialised whole in one process gets the same values. Units are initialised from the last to
the first, so a tensor several units share ends with the value its first unit's initialiser
gives it (the same on every process; the tie exchange aligns stages on other processes to it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from pipeoptim.errors import RuntimeConfigError
from pipeoptim.runtime.model.units import InitWeights

__all__ = ["is_meta", "materialize_units", "meta_units"]


def is_meta(unit: nn.Module) -> bool:
    """Whether any of the unit's parameters or buffers is on the meta device."""
    return any(t.device.type == "meta" for t in (*unit.parameters(), *unit.buffers()))


def meta_units(units: Sequence[nn.Module]) -> list[int]:
    """Indices of the units with tensors on the meta device."""
    return [i for i, u in enumerate(units) if is_meta(u)]


def unit_seed(seed: int, index: int) -> int:
    """The random seed unit ``index``'s initialiser runs under."""
    return (seed * 1_000_003 + index * 7_919 + 12_345) % (2**63 - 1)


def materialize_units(
    units: Sequence[nn.Module],
    indices: Sequence[int],
    device: torch.device,
    init_weights: InitWeights | None,
    seed: int,
) -> None:
    """Give units ``indices`` real storage on ``device`` and initialise them, in place.

    Only meta tensors are touched; units that are already real are left as they are (a model
    partly built on meta). Refuses meta units without ``init_weights``: their storage would be
    uninitialised memory (as it stays wherever ``init_weights`` writes nothing)."""
    wanted = [i for i in indices if is_meta(units[i])]
    if not wanted:
        return
    if init_weights is None:
        raise RuntimeConfigError(
            f"units {wanted} are on the meta device (shapes, no values) and no init_weights "
            f"was given, so their weights would be uninitialised memory; pass "
            f"init_weights=lambda index, unit: ... (it runs after the unit is moved to its "
            f"device, e.g. unit.apply(model._init_weights) for a Hugging Face model, or "
            f"unit.load_state_dict(...) from a checkpoint), or build the model on a real device"
        )
    memo: dict[int, tuple[Tensor, Tensor]] = {}  # id -> (meta original, kept alive; real)
    for i in wanted:
        for module in units[i].modules():
            _convert(module, device, memo)
    for i in reversed(wanted):
        devices = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(unit_seed(seed, i))
            with torch.no_grad():
                try:
                    init_weights(i, units[i])
                except Exception as err:
                    raise RuntimeConfigError(
                        f"init_weights failed on unit {i} ({type(units[i]).__name__}): "
                        f"{type(err).__name__}: {err}; it is called as init_weights(index, "
                        f"unit) with the unit on {device}, to fill its tensors in place"
                    ) from err
        left = [n for n, t in units[i].state_dict(keep_vars=True).items() if t.is_meta]
        if left:
            raise RuntimeConfigError(
                f"after init_weights, unit {i} ({type(units[i]).__name__}) still holds meta "
                f"tensors {left[:4]}: init_weights must fill the unit's tensors in place, "
                f"not replace them with new meta ones"
            )


def _convert(
    module: nn.Module, device: torch.device, memo: dict[int, tuple[Tensor, Tensor]]
) -> None:
    """Move the module's own meta tensors to ``device`` (uninitialised), once per tensor."""
    for table in (module._parameters, module._buffers):
        for name, t in table.items():
            if t is None or not t.is_meta:
                continue
            if id(t) not in memo:
                empty = torch.empty_like(t, device=device)
                real = (
                    nn.Parameter(empty, requires_grad=t.requires_grad)
                    if isinstance(t, nn.Parameter)
                    else empty
                )
                memo[id(t)] = (t, real)
            table[name] = memo[id(t)][1]  # type: ignore[assignment]
