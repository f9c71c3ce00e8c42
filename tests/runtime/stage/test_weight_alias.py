"""``weights.alias``: a forward on a weight version reads the version's storage, sends its
gradient to the parameter, and survives updates in place before its backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeoptim.plan.methods import WeightPolicy
from pipeoptim.runtime.stage.weights import WeightVersions, alias


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


# -- leaves: the running gradient sum is on the leaves for the length of a backward -------


def _stage_weights(leaves: bool) -> tuple[WeightVersions, list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(3))]
    store = WeightVersions(WeightPolicy.PREDICT, params, stage=0)
    store.leaf_grads = leaves
    buffers = [torch.randn_like(p) for p in params]
    return store, params, buffers


def _gradients(
    leaves: bool, order: str
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor | None]]:
    """Forwards then backwards of micro-batches in ``order`` ('b': on the buffer, 'p': on
    the parameters), with ragged values so that the order of the sum shows in the bits;
    returns the parameters' gradients after each backward, and the input gradients."""
    store, params, buffers = _stage_weights(leaves)
    g = torch.Generator().manual_seed(1)
    graphs = []
    for mb, route in enumerate(order):
        scale = 10 ** torch.randn(5, 4, generator=g)
        x = (torch.randn(5, 4, generator=g) * scale).requires_grad_()
        w, b = store.aliases(buffers, mb) if route == "b" else params
        graphs.append((x, F.linear(x, w, b)))
    after: list[list[torch.Tensor]] = []
    inputs = []
    for mb, (x, y) in enumerate(graphs):
        with store.adding_for(mb):
            y.backward(torch.randn(5, 3, generator=g) * 1e3)
        after.append([p.grad.clone() for p in params if p.grad is not None])
        inputs.append(x.grad)
    return after, inputs


def test_leaves_sum_the_gradients_of_the_alias_path_bit_for_bit() -> None:
    """Whatever the order of backwards on the buffer and on the parameters, each adds onto
    the running sum as through aliases, and ``.grad`` holds it after every backward."""
    for order in ("bbbp", "pbbb", "bpbp", "ppbbpb", "bbbb"):
        via_leaves, inputs_leaves = _gradients(True, order)
        via_aliases, inputs_aliases = _gradients(False, order)
        for got, want in zip(via_leaves, via_aliases, strict=True):
            assert len(got) == len(want) == 2, order
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b), order
        for a, b in zip(inputs_leaves, inputs_aliases, strict=True):
            assert a is not None and b is not None and torch.equal(a, b), order


def test_a_leaf_takes_the_gradient_for_the_length_of_the_backward() -> None:
    store, params, buffers = _stage_weights(True)
    w, b = store.aliases(buffers, 0)
    assert w.grad_fn is None and w.requires_grad and w.data_ptr() == buffers[0].data_ptr()
    y = F.linear(torch.ones(2, 4), w, b)
    buffers[0].add_(1.0)  # the buffer becomes the live weights and is updated in place
    params[0].grad = torch.ones(3, 4)
    with store.adding_for(0):
        assert params[0].grad is None and torch.equal(w.grad, torch.ones(3, 4))
        y.sum().backward()
    assert w.grad is None and torch.equal(params[0].grad, torch.full((3, 4), 3.0))


def test_a_failed_backward_leaves_the_gradient_on_the_parameter() -> None:
    store, params, buffers = _stage_weights(True)
    store.aliases(buffers, 0)
    params[0].grad = torch.ones(3, 4)
    try:
        with store.adding_for(0):
            raise RuntimeError("the backward failed")
    except RuntimeError:
        pass
    assert params[0].grad is not None and torch.equal(params[0].grad, torch.ones(3, 4))
