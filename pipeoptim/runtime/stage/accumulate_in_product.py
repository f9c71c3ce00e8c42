"""Weight gradients added inside their matrix product, across a step's micro-batches.

A stage that runs M > 1 micro-batches a step adds each one's weight gradients to the
previous ones: autograd computes a linear layer's gradient ``g^T x`` into a new tensor, then
adds it to ``weight.grad``, a second pass over the gradient for every micro-batch after the
first. Here the product writes into ``weight.grad`` itself (``addmm_``: ``grad += g^T x``
in one pass), as Megatron-LM's gradient-accumulation fusion does on GPUs. On the CPU
benchmark's stage (4 x Linear(1024), 4 micro-batches of 64) the forwards and backwards took
0.92-0.97x autograd's time; on small weights the fixed cost of doing it wins, so it is kept
to weights of :data:`MIN_WEIGHTS` elements or more.

:class:`AccumulateInProduct` is a torch function mode, so no module is changed: around a
forward, every ``F.linear`` (``nn.Linear`` and any module that calls it) whose weight is one
of the stage's own parameters of :data:`MIN_WEIGHTS` elements or more runs as
:class:`_LinearAddingIntoGrad`. Any other call, any
call under autocast or with inputs of another dtype, and any on a parameter with a gradient
hook (looked at on every call, so a hook added after the Pipeline was built counts) or
shared by two of the stage's modules (a tied weight) runs as it was. A module that calls one
layer twice in a forward gets both gradients added in turn, so its sum may round
differently from autograd's, by the dtype's rounding. The stage uses it
only where a forward runs on the parameters themselves, with no recomputation and no split
backward (those keep autograd's own graph: ``forward.py``).

With :attr:`AccumulateInProduct.defer` set, a backward computes only the input gradients
and queues each weight's product; :meth:`AccumulateInProduct.finish` runs the queue, in the
order the backward met the layers. A stage that sends its input's gradient upstream (every
stage but the first, synchronous or not; with one micro-batch a step too, where nothing
adds up) defers them past that send, to the start of its next action: the stage upstream,
which waits on that gradient, gets it a weight pass sooner, and
every ``.grad`` is the same sum, added in the same order, bit for bit. What it costs: each
linear layer's input and output gradient of that one micro-batch stay held until then.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["MIN_WEIGHTS", "AccumulateInProduct", "accumulates_in_product"]

WeightProduct = tuple[Tensor, Tensor | None, Tensor, Tensor]
"""A weight's gradient still to add: (weight, bias or None, the output gradient's rows, the
input's rows)."""

MIN_WEIGHTS = 2**19
"""The smallest weight (elements) whose gradient is added in its product. The saved pass is
over the weight, the cost a fixed one of Python (this function mode and the backward, about
25 us a call on one CPU thread): on 4 x Linear(w) + ReLU, 4 micro-batches of 64, the
forwards and backwards took 1.55x autograd's time at w = 64, 1.14x at 256, 1.00x at 512
(262,144 weights) and 0.92-0.97x at 1024 (``benchmarks/bench_accumulate_in_product.py``)."""


def accumulates_in_product(param: Tensor) -> bool:
    """Whether ``param``'s gradient may be added inside its product: a leaf that takes a
    gradient, with no hook that autograd's own accumulation would run."""
    return (
        param.requires_grad
        and param.is_leaf
        and not param._backward_hooks
        and not getattr(param, "_post_accumulate_grad_hooks", None)
    )


class _LinearAddingIntoGrad(torch.autograd.Function):
    """``F.linear`` whose backward adds the weight's (and bias's) gradient into their
    ``.grad`` itself, or queues it on the mode where the mode defers, and hands autograd
    none for them."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, mode: AccumulateInProduct
    ) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.params = (weight, bias)
        ctx.mode = mode
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        x, weight_saved = ctx.saved_tensors
        weight, bias = ctx.params
        product = (weight, bias, grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1]))
        if ctx.mode.defer:
            ctx.mode.queued.append(product)
        else:
            _add_into_grad(product)
        grad_x = grad.matmul(weight_saved) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


def _add_into_grad(product: WeightProduct) -> None:
    weight, bias, rows, inputs = product
    with torch.no_grad():
        if weight.grad is None:
            weight.grad = rows.t().mm(inputs)
        else:
            weight.grad.addmm_(rows.t(), inputs)
        if bias is not None:
            summed = rows.sum(0)
            if bias.grad is None:
                bias.grad = summed
            else:
                bias.grad.add_(summed)


class AccumulateInProduct(TorchFunctionMode):
    """Around a forward of ``module``: ``F.linear`` on its parameters adds their gradients in
    the product (module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        held = list(module.named_parameters(remove_duplicate=False))
        uses = Counter(id(p) for _, p in held)
        self._ids = {id(p) for _, p in held if uses[id(p)] == 1}
        """The module's parameters that one of its submodules holds: a weight two of them
        share gets two gradients a backward, whose sum autograd rounds its own way."""
        self._weights = {id(p) for _, p in held if id(p) in self._ids and p.numel() >= MIN_WEIGHTS}
        """Of them, those large enough to gain (:data:`MIN_WEIGHTS`)."""
        self.defer = False
        """Queue the weights' products in the backward, for :meth:`finish` (module
        docstring)."""
        self.queued: list[WeightProduct] = []
        """The products a deferring backward left, in the order it met them."""

    def finish(self) -> None:
        """Add the queued products into the gradients, in the order they were queued."""
        queued, self.queued = self.queued, []
        for product in queued:
            _add_into_grad(product)

    @property
    def active(self) -> bool:
        """Whether any weight of the module is one it takes over."""
        return bool(self._weights)

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs.get("input")
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (
                isinstance(x, Tensor)
                and isinstance(weight, Tensor)
                and id(weight) in self._weights
                and accumulates_in_product(weight)
                and (bias is None or (id(bias) in self._ids and accumulates_in_product(bias)))
                and x.dtype == weight.dtype
                and torch.is_grad_enabled()
                and not torch.is_autocast_enabled(x.device.type)
            ):
                return _LinearAddingIntoGrad.apply(x, weight, bias, self)  # type: ignore[no-untyped-call]
        return func(*args, **kwargs)
