"""A stage's units run as a chain in which a unit may hand the next one a tuple of tensors.

``nn.Sequential`` calls each unit with one argument; here a tuple a unit returns becomes the
next unit's positional arguments (``unit(*h)``), as torchgpipe does. It is a subclass of
``nn.Sequential`` with only ``forward`` changed, so a stage's ``state_dict`` keys
(``"0.weight"``...), its hooks and its modules are those of the ``nn.Sequential`` it was
built from (:func:`as_chain` changes the class in place, copying nothing).
"""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn

__all__ = ["UnitChain", "as_chain"]

M = TypeVar("M", bound=nn.Module)


class UnitChain(nn.Sequential):
    """``nn.Sequential`` whose units may return tuples: ``h = unit(*h)`` for a tuple ``h``.

    Called with one argument (a tensor, or a tuple to spread over the first unit's
    arguments) or with several (the first unit's arguments)."""

    def forward(self, *inputs: Any) -> Any:
        h = inputs[0] if len(inputs) == 1 else inputs
        for unit in self._modules.values():
            h = unit(*h) if isinstance(h, tuple) else unit(h)
        return h


def as_chain(module: M) -> M:
    """A plain ``nn.Sequential`` turned into a :class:`UnitChain` (the same object); any
    other module as it is (a container with its own forward keeps it)."""
    if type(module) is nn.Sequential:
        module.__class__ = UnitChain  # type: ignore[assignment]  # M is nn.Sequential here
    return module
