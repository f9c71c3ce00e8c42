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

Nothing is left to chance memory (issue 33 item 1): every new tensor starts as NaN (an integer
one as a byte pattern), and one still holding it after ``init_weights`` is refused by name.
Non-persistent buffers (a rotary ``inv_freq``) are in no state dict, so an ``init_weights``
that loads one cannot fill them: before it runs, each is recomputed by its module's own
initialisation, a ``transformers`` rotary embedding's rope rule or the module's
``reset_parameters()`` (the torch convention for modules built on the meta device).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

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
    fresh = {id(real) for _, real in memo.values()}
    _poison(memo)
    devices = [device.index or 0] if device.type == "cuda" else []
    reset: set[int] = set()
    for i in reversed(wanted):
        with torch.random.fork_rng(devices=devices):
            # A stream of its own, so the weights init_weights draws do not depend on it.
            torch.manual_seed(unit_seed(seed, i) ^ 0x5EED)
            _reset_buffers(units[i], i, fresh, reset)
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(unit_seed(seed, i))
            with torch.no_grad():
                try:
                    returned = init_weights(i, units[i])
                except Exception as err:
                    raise RuntimeConfigError(
                        f"init_weights failed on unit {i} ({type(units[i]).__name__}): "
                        f"{type(err).__name__}: {err}; it is called as init_weights(index, "
                        f"unit) with the unit on {device}, to fill its tensors in place"
                    ) from err
        if isinstance(returned, nn.Module) and returned is not units[i]:
            raise RuntimeConfigError(
                f"init_weights returned a new {type(returned).__name__} for unit {i} "
                f"({type(units[i]).__name__}), which the pipeline ignores: it keeps the unit "
                f"it built and gave you; fill that unit's tensors in place instead, e.g. "
                f"unit.load_state_dict(new.state_dict()) or with torch.no_grad(): "
                f"p.copy_(...), and return nothing"
            )
        left = [n for n, t in units[i].state_dict(keep_vars=True).items() if t.is_meta]
        if left:
            raise RuntimeConfigError(
                f"after init_weights, unit {i} ({type(units[i]).__name__}) still holds meta "
                f"tensors {left[:4]}: init_weights must fill the unit's tensors in place, "
                f"not replace them with new meta ones"
            )
    for i in wanted:
        _check_initialised(units[i], i, fresh)


_INT_POISON = {
    torch.uint8: 0xA5,
    torch.int8: -91,
    torch.int16: -23131,
    torch.int32: -1515870811,
    torch.int64: -6510615555426900571,
}
"""What an integer tensor holds until it is initialised: a pattern no initialiser writes
by chance (0xA5 in every byte)."""


def _poison(memo: dict[int, tuple[Tensor, Tensor]]) -> None:
    """Fill every new tensor with a value no initialiser leaves by accident (NaN; a byte
    pattern for integers), so one that nothing writes is found (:func:`_check_initialised`)
    instead of training on whatever memory ``torch.empty`` returned."""
    with torch.no_grad():
        for _, real in memo.values():
            if real.is_floating_point() or real.is_complex():
                real.fill_(math.nan)
            elif real.dtype in _INT_POISON:
                real.fill_(_INT_POISON[real.dtype])


def _unset(t: Tensor) -> Tensor:
    """Whether ``t`` still holds the poison: anywhere (a float tensor: NaN), or everywhere
    (an integer one). A 0-d boolean tensor."""
    if t.is_floating_point() or t.is_complex():
        return torch.isnan(t).any()
    if t.dtype in _INT_POISON and t.numel() > 0:
        return (t == _INT_POISON[t.dtype]).all()
    return torch.zeros((), dtype=torch.bool, device=t.device)


def _tensors(unit: nn.Module, fresh: set[int]) -> list[tuple[str, Tensor, bool]]:
    """The unit's tensors this materialisation created: (name, tensor, non-persistent
    buffer), each once."""
    out: list[tuple[str, Tensor, bool]] = []
    seen: set[int] = set()
    for prefix, module in unit.named_modules(remove_duplicate=False):
        for table, buffers in ((module._parameters, False), (module._buffers, True)):
            for name, t in table.items():
                if t is None or id(t) not in fresh or id(t) in seen:
                    continue
                seen.add(id(t))
                transient = buffers and name in module._non_persistent_buffers_set
                out.append((f"{prefix}.{name}" if prefix else name, t, transient))
    return out


def _check_initialised(unit: nn.Module, index: int, fresh: set[int]) -> None:
    """Refuse a unit with a tensor nothing initialised (it still holds the poison), naming
    the tensors and how to fill them."""
    held = _tensors(unit, fresh)
    if not held:
        return
    flags = torch.stack([_unset(t.detach()) for _, t, _ in held]).tolist()  # one sync
    unset = [
        (name, transient) for (name, _, transient), bad in zip(held, flags, strict=True) if bad
    ]
    if not unset:
        return
    names = [name for name, _ in unset]
    shown = ", ".join(repr(n) for n in names[:6]) + (
        f" and {len(names) - 6} more" if len(names) > 6 else ""
    )
    transient = [name for name, is_buffer in unset if is_buffer]
    why = (
        f"{', '.join(repr(n) for n in transient[:4])} "
        f"{'is a non-persistent buffer' if len(transient) == 1 else 'are non-persistent buffers'}"
        f" (register_buffer(..., persistent=False)): in no state dict, so loading one does "
        f"not fill it, and the pipeline recomputes such a buffer only through its module's "
        f"reset_parameters() (the torch convention for modules built on the meta device) or a "
        f"Hugging Face rotary embedding's own rule; give the module a reset_parameters() "
        f"that computes it, or compute it in init_weights"
        if transient
        else "init_weights wrote no value into it (a state dict without it loaded with "
        "strict=False? an initialiser that skips this module type?); load or initialise "
        "every tensor of the unit in place"
    )
    raise RuntimeConfigError(
        f"unit {index} ({type(unit).__name__}) was built on the meta device and, after "
        f"init_weights, {shown} {'is' if len(names) == 1 else 'are'} still uninitialised "
        f"(its values would be whatever memory was free): {why}"
    )


def _reset_buffers(unit: nn.Module, index: int, fresh: set[int], done: set[int]) -> None:
    """Recompute the non-persistent buffers of the unit's modules by the module's own
    initialisation, before ``init_weights`` (which may overwrite them): a Hugging Face rotary
    embedding's rope function (as ``transformers``' own ``_init_weights`` does), else the
    module's ``reset_parameters()``. A module shared by several units is reset once."""
    for module in unit.modules():
        if id(module) in done:
            continue
        names = [
            n
            for n in module._non_persistent_buffers_set
            if module._buffers.get(n) is not None and id(module._buffers[n]) in fresh
        ]
        if not names:
            continue
        done.add(id(module))
        reset = _rotary_rule(module) or getattr(module, "reset_parameters", None)
        if not callable(reset):
            continue  # left to init_weights; refused after it if it writes nothing
        try:
            with torch.no_grad():
                reset()
        except Exception as err:
            raise RuntimeConfigError(
                f"unit {index} ({type(unit).__name__}): {type(module).__name__}"
                f".reset_parameters(), which recomputes its non-persistent buffers "
                f"{sorted(names)} after the meta device, failed: {type(err).__name__}: {err}; "
                f"make it work on a module whose tensors are real but uninitialised, or "
                f"compute the buffers in init_weights"
            ) from err


def _rotary_rule(module: nn.Module) -> Callable[[], None] | None:
    """The re-initialisation of a ``transformers`` rotary embedding's ``inv_freq`` (and
    ``original_inv_freq``), as ``PreTrainedModel._init_weights`` does it; None for another
    module. Looked up without importing ``transformers``."""
    if "RotaryEmbedding" not in type(module).__name__:
        return None
    if not all(hasattr(module, a) for a in ("inv_freq", "original_inv_freq", "rope_type")):
        return None
    rope = sys.modules.get("transformers.modeling_rope_utils")
    rules: dict[str, Any] = {
        "axial": getattr(module, "compute_axial_rope_parameters", None),
        "ntk_alpha": getattr(module, "compute_ntk_alpha_rope_parameters", None),
        "default": getattr(module, "compute_default_rope_parameters", None),
        **(getattr(rope, "ROPE_INIT_FUNCTIONS", None) or {}),
    }
    rule = rules.get(str(getattr(module, "rope_type", "")))
    if rule is None:
        return None
    hf: Any = module

    def apply() -> None:
        value, _ = rule(hf.config)
        hf.inv_freq.copy_(value)
        hf.original_inv_freq.copy_(value)

    return apply


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
