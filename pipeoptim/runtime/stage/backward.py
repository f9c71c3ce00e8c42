"""A stage's backward: whole, or split into its input and weight halves, and its deferred end.

Why its own module: the backward is where a micro-batch's weight version is released and its
gradient counted toward the next update. It runs whole (B), or as the input half I and the
weight half W of zero-bubble schedules (:mod:`~pipeoptim.runtime.stage.split_backward`), and
where linear layers' weight gradients are added after the input's gradient is sent upstream
(:mod:`~pipeoptim.runtime.stage.accumulate_in_product`) it ends at the stage's next action
(:meth:`StageBackward.finish_backward`), which every other pass calls first.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from pipeoptim.errors import StageError
from pipeoptim.plan.versions import MicroBatchVersions
from pipeoptim.runtime.payload import (
    Gradients,
    Payload,
    input_gradients,
    output_roots,
    parts,
    payload_bytes,
)
from pipeoptim.runtime.stage.diagnose import out_of_memory, out_of_memory_message
from pipeoptim.runtime.stage.fields import StageFields
from pipeoptim.runtime.stage.split_backward import (
    Root,
    WeightHalf,
    input_half,
    split_refusal,
    weight_half,
)

__all__ = ["StageBackward"]


class StageBackward(StageFields):
    """The backward of a stage: B, or I then W, and the weight gradients a B deferred."""

    def backward(self, mb: int, grad: Gradients | None = None) -> Gradients | None:
        """Backward of micro-batch ``mb``; returns the gradient of its input (None on the
        first stage); for a tuple input a tuple, with a gradient per floating-point tensor
        (zeros where it took none) and None for the others. ``grad``: the output's, for a
        tuple output one per floating-point tensor. Gradients accumulate until
        :meth:`update`; where this stage defers its weight gradients, they are added at
        its next action (:meth:`finish_backward`)."""
        self.finish_backward()
        v = self.versions(mb)
        self.weights.check_backward(v, mb)
        x_in, out = self._saved.pop(mb)
        self._units_out.pop(mb, None)
        self.memory_count.release_activations(mb)
        self.memory_count.release_held(mb)
        if self.closure is not None:
            self.closure.backward(self.index, mb, self._params)
        self.weights.held.discard(mb)
        self.weights.on_buffer.pop(mb, None)
        with self.weights.adding_for(mb):
            if isinstance(out, Tensor):
                if out.requires_grad:
                    with self._backward_pass(x_in):
                        if self.is_last:
                            torch.autograd.backward(self.precision.scaled(out))
                        elif grad is not None:
                            assert isinstance(grad, Tensor)
                            torch.autograd.backward(out, self.precision.scaled(grad))
            else:
                roots, grads = output_roots(out, grad, self.precision.scaled, self.index)
                if roots:
                    with self._backward_pass(x_in):
                        torch.autograd.backward(roots, grads)
        if self._in_product is not None and self._in_product.queued:
            self._unfinished = (v, x_in)  # retired when its weight gradients are added
        else:
            self._retire(v)
        if isinstance(x_in, Tensor):
            return self.precision.true_gradient(x_in.grad if x_in.requires_grad else None)
        found = [t.grad if t.requires_grad else None for t in parts(x_in)]
        return self._input_gradients(x_in, found)

    @contextmanager
    def _backward_pass(self, x: Payload) -> Iterator[None]:
        """A backward (or half of one) of the micro-batch whose input is ``x``, under the
        stage's RNG stream; running out of memory there (a recomputation rebuilds its
        activations in the backward) is said as such, with what frees memory."""
        with self.random.stream():
            try:
                yield
            except Exception as err:
                if out_of_memory(err):
                    raise StageError(out_of_memory_message(self.index, x, err, "backward")) from err
                raise

    def finish_backward(self) -> None:
        """Add the weight gradients the latest backward deferred past its input gradient
        (``accumulate_in_product.py``), and count that backward done; nothing where none
        waits. Every pass, update and checkpoint of this stage calls it first; the executor
        before another reads this stage's gradients (tied weights)."""
        if self._unfinished is None:
            return
        (v, x_in), self._unfinished = self._unfinished, None
        assert self._in_product is not None  # only its backwards defer
        with self._backward_pass(x_in):
            self._in_product.finish()
        self._retire(v)

    def _retire(self, v: MicroBatchVersions) -> None:
        """A micro-batch's backward is complete (its B, or the W of a split one): release
        the weight version its forward held and count the gradients it accumulated."""
        self.weights.retire(v)
        self.memory_count.count_gradients(self._params)
        self._backwards_since_update += 1

    def backward_input(self, mb: int, grad: Gradients | None = None) -> Gradients | None:
        """The input half I of micro-batch ``mb``'s split backward: returns the gradient of
        its input (None on the first stage), as :meth:`backward` does, and keeps the graph
        and the gradient of each weighted unit's output for :meth:`backward_weight`; no
        weight gradient is computed. Synchronous (flush) methods only."""
        self._check_split("I", mb)
        if mb in self._weight_half:
            raise RuntimeError(f"stage {self.index}: a second I of micro-batch {mb}")
        v = self.versions(mb)
        if v.backward_version != self.weights.current:
            raise RuntimeError(
                f"stage {self.index}: I of micro-batch {mb} needs version {v.backward_version} "
                f"(live {self.weights.current})"
            )
        x_in, out = self._saved[mb]
        if self.closure is not None:
            self.closure.backward(self.index, mb, self._params)
        root: Root | None = None
        root_grad: Root | None = None
        if not isinstance(out, Tensor):
            roots, grads = output_roots(out, grad, self.precision.scaled, self.index)
            if roots:
                root, root_grad = roots, grads
        elif out.requires_grad:
            if self.is_last:
                root = self.precision.scaled(out)
            elif grad is not None:
                assert isinstance(grad, Tensor)
                root, root_grad = out, self.precision.scaled(grad)
        units = self._units_out.pop(mb, None)
        half: WeightHalf = []
        g_in: Gradients | None = None
        if root is not None:
            with self._backward_pass(x_in):
                g_in, half = input_half(root, root_grad, x_in, units, self._params)
        self._weight_half[mb] = half
        # held until W, with the activations
        self.memory_count.add_activations(mb, sum(payload_bytes(g) for *_, g in half))
        if isinstance(x_in, Tensor):
            assert g_in is None or isinstance(g_in, Tensor)
            return self.precision.true_gradient(g_in)
        found = g_in if isinstance(g_in, tuple) else (None,) * len(parts(x_in))
        return self._input_gradients(x_in, found)

    def backward_weight(self, mb: int) -> None:
        """The weight half W of micro-batch ``mb``'s split backward, after its I: the weight
        gradients accumulate into ``.grad`` (until :meth:`update`), then the micro-batch's
        graph and activations are released."""
        self._check_split("W", mb)
        half = self._weight_half.pop(mb, None)
        if half is None:
            raise RuntimeError(f"stage {self.index}: W of micro-batch {mb} before its I")
        v = self.versions(mb)
        with self._backward_pass(self._saved[mb][0]):
            weight_half(half)
        del half
        self._saved.pop(mb)
        self.memory_count.release_activations(mb)
        self.memory_count.release_held(mb)
        self.weights.held.discard(mb)
        self._retire(v)

    def _check_split(self, half: str, mb: int) -> None:
        if not self.policy.keeps_one_version:
            raise StageError(split_refusal(self.method.name, self.policy, half))
        if mb not in self._saved:
            raise RuntimeError(f"stage {self.index}: {half} of micro-batch {mb} before its F")

    def _input_gradients(
        self, x_in: tuple[Tensor, ...] | dict[str, Tensor | None], found: Sequence[Tensor | None]
    ) -> tuple[Tensor | None, ...] | None:
        """A tuple or dict input's gradients as sent upstream (None on the first stage)."""
        if self.index == 0:
            return None
        return input_gradients(x_in, found, self.precision.true_gradient)
