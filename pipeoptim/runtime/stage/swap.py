"""Running a module on other tensors than its parameters, through slots resolved once.

Why not ``torch.func.functional_call``: a forward on a weight version other than the live
one (a stashed version, 2BW's previous buffer, a prediction Ŵ) runs the module on aliases
of that version's storage. ``functional_call`` resolves every name, unties shared weights
and walks the module tree on each call; on a stage of a small model that cost more than
the layers themselves (issue 34: XPipe at 16 stages ran at 1.8x GPipe's step). The slots
here are found once per module: each is the ``_parameters`` dict of the submodule that holds
a trainable weight, and the weight's name there. A call writes the given tensors into those
slots, runs the module and puts the parameters back, which is what ``functional_call`` does
(tied weights included: every name of a weight is a slot), without the lookups.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

__all__ = ["ParameterSlots"]


class ParameterSlots:
    """The places a module holds its trainable weights, by the stage's parameter index.

    ``params``: the stage's trainable parameters in its order; a weight of ``module`` not
    among them (a frozen one) keeps its own tensor."""

    def __init__(self, module: nn.Module, params: Sequence[Tensor]) -> None:
        index = {id(p): j for j, p in enumerate(params)}
        self._slots: list[tuple[dict[str, Any], str, int]] = []
        for name, p in module.named_parameters(remove_duplicate=False):
            j = index.get(id(p))
            if j is not None:
                owner, _, attr = name.rpartition(".")
                self._slots.append((module.get_submodule(owner)._parameters, attr, j))

    def call(
        self,
        fn: Callable[..., Any],
        tensors: Sequence[Tensor] | Mapping[int, Tensor],
        args: tuple[Any, ...],
    ) -> Any:
        """``fn(*args)`` with ``tensors[j]`` in every slot of parameter j, the parameters
        put back afterwards (also when ``fn`` raises)."""
        slots = self._slots
        kept = [held[attr] for held, attr, _ in slots]
        try:
            for held, attr, j in slots:
                held[attr] = tensors[j]
            return fn(*args)
        finally:
            for (held, attr, _), p in zip(slots, kept, strict=True):
                held[attr] = p
