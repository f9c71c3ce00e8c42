"""``weights.alias``: a forward on a weight version reads the version's storage, sends its
gradient to the parameter, and survives updates in place before its backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeoptim.runtime.stage.weights import alias


def _pair() -> tuple[torch.Tensor, torch.Tensor]:
    param = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    source = torch.full((2, 3), 0.5)
    return param, source


def test_an_alias_reads_the_version_storage() -> None:
    param, source = _pair()
    a = alias(param, source)
    assert a.data_ptr() == source.data_ptr()
    assert a.shape == param.shape and a.dtype == param.dtype
    assert torch.equal(a, source)
    assert a.requires_grad and a.grad_fn is not None


def test_the_gradient_reaches_the_parameter_not_the_source() -> None:
    param, source = _pair()
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    (alias(param, source) * x).sum().backward()
    assert param.grad is not None and torch.equal(param.grad, x)
    assert source.grad is None


def test_updates_in_place_before_the_backward_do_not_invalidate_the_graph() -> None:
    """The runtime updates the parameter (and may turn the source into the live weights)
    between a forward and its backward; the backward then reads the source as it is."""
    param, source = _pair()
    x = torch.ones(4, 3, requires_grad=True)
    y = F.linear(x, alias(param, source))  # saves the alias for the input's gradient
    with torch.no_grad():
        param.add_(1.0)
        source.mul_(2.0)
    y.sum().backward()
    assert param.grad is not None and torch.equal(param.grad, torch.full((2, 3), 4.0))
    assert x.grad is not None and torch.equal(x.grad, torch.full((4, 3), 2.0))


def test_a_frozen_weight_gets_an_alias_without_a_graph() -> None:
    param = torch.zeros(3, requires_grad=False)
    source = torch.ones(3)
    a = alias(param, source)
    assert not a.requires_grad and torch.equal(a, source)
